"""The Mamba-2 mixers of the hybrids (families/hf_mamba2_mixers.py) inside whole models.

Small random Bamba, Zamba2 (a shared transformer block in its hybrid layer), FalconH1 (μP
multipliers in and around its mixer), GraniteMoeHybrid (MoE) and NemotronH (attention and
MoE layers) are opened by ``Lens``: only their Mamba-2 mixers, named by their index in the
whole stack. Each mixer's trace is checked against the whole model run one token at a time
with its own cache (the package's decode path: the states it leaves in the cache after
every token), against an independent float64 recurrence written here (the conv as F.conv1d,
the state update per head as an explicit loop, the gated RMSNorm by hand), and against the
mixer's chunked whole-sequence path. One mixer has no return path once the conv's window
has passed; ``analyze`` runs end to end on Bamba.
"""

from __future__ import annotations

import copy
import math
import sys
import warnings
from pathlib import Path

import jsonschema
import pytest
import torch
import torch.nn.functional as F
import transformers

import gatelens
from gatelens.errors import GatelensError
from gatelens.families.hf_mamba2_mixers import HFMamba2MixerFamily
from gatelens.families.official import scaled_diff
from gatelens.readout.hooks import open_cells
from gatelens.report.json_report import check_report, schema

sys.path.insert(0, str(Path(__file__).parent))  # the shared tiny models (importlib mode)
from official_models import spread_decays  # noqa: E402

V, D, B, T, P = 11, 16, 2, 12, 4  # T: three of the chunked path's 4-token chunks
VOCAB = list("abcdefghij ")
TEXT = "abc def ghij jig fed cba " * 40
MAMBA = dict(mamba_n_heads=4, mamba_d_head=8, mamba_n_groups=2, mamba_d_state=4,
             mamba_d_conv=3, mamba_expand=2, mamba_chunk_size=4)
ATTN = dict(num_attention_heads=2, num_key_value_heads=1)


@pytest.fixture(autouse=True)
def _single_thread(one_thread):
    transformers.utils.logging.set_verbosity_error()
    warnings.filterwarnings("ignore", message=".*deprecated.*")


def _bamba():
    return transformers.BambaForCausalLM(transformers.BambaConfig(
        vocab_size=V, hidden_size=D, intermediate_size=2 * D, num_hidden_layers=3,
        attn_layer_indices=[1], **ATTN, **MAMBA))


def _zamba2():
    return transformers.Zamba2ForCausalLM(transformers.Zamba2Config(
        vocab_size=V, hidden_size=D, intermediate_size=2 * D, num_hidden_layers=3,
        layers_block_type=["mamba", "hybrid", "hybrid"], mamba_d_state=4, mamba_d_conv=3,
        mamba_expand=2, mamba_ngroups=2, n_mamba_heads=4, chunk_size=4, num_mem_blocks=1,
        num_attention_heads=2))


def _falcon_h1(**kw):
    settings = {"mamba_rms_norm": True, "ssm_multipliers": [0.5, 1.5, 0.8, 1.2, 0.7],
                "ssm_in_multiplier": 1.3, "ssm_out_multiplier": 0.9, **kw}
    return transformers.FalconH1ForCausalLM(transformers.FalconH1Config(
        vocab_size=V, hidden_size=D, intermediate_size=2 * D, num_hidden_layers=2,
        mamba_d_ssm=2 * D, **ATTN, **MAMBA, **settings))


def _granite():
    return transformers.GraniteMoeHybridForCausalLM(transformers.GraniteMoeHybridConfig(
        vocab_size=V, hidden_size=D, intermediate_size=2 * D, num_hidden_layers=2,
        num_local_experts=2, num_experts_per_tok=1, shared_intermediate_size=2 * D,
        layer_types=["linear_attention", "full_attention"], **ATTN, **MAMBA))


def _nemotron_h():
    return transformers.NemotronHForCausalLM(transformers.NemotronHConfig(
        vocab_size=V, hidden_size=D, layers_block_type=["linear_attention", "full_attention",
                                                        "moe"],
        **ATTN, head_dim=8, intermediate_size=2 * D, ssm_state_size=4, mamba_num_heads=4,
        mamba_head_dim=8, n_groups=2, conv_kernel=3, chunk_size=4, n_routed_experts=2,
        num_experts_per_tok=1, moe_intermediate_size=D, moe_shared_expert_intermediate_size=D))


#: each model, its mixers' paths (index in the whole stack) and class
MODELS = {
    "bamba": (_bamba, ["model.layers.0.mamba", "model.layers.2.mamba"], "BambaMixer"),
    # its two hybrid layers call one shared transformer block (one set of weights)
    "zamba2": (_zamba2, ["model.layers.0.mamba", "model.layers.1.mamba_decoder.mamba",
                         "model.layers.2.mamba_decoder.mamba"], "Zamba2MambaMixer"),
    "falcon_h1": (_falcon_h1, ["model.layers.0.mamba", "model.layers.1.mamba"],
                  "FalconH1Mixer"),
    "granitemoehybrid": (_granite, ["model.layers.0.mamba"], "GraniteMoeHybridMambaLayer"),
    "nemotron_h": (_nemotron_h, ["model.layers.0.mixer"], "NemotronHMamba2Mixer"),
}


def build(kind: str, **kw) -> torch.nn.Module:
    torch.manual_seed(0)
    return spread_decays(MODELS[kind][0](**kw))


def _ids(seed: int = 1, length: int = T) -> torch.Tensor:
    return torch.randint(0, V, (B, length), generator=torch.Generator().manual_seed(seed))


def mixers(model) -> dict[str, torch.nn.Module]:
    return {n: m for n, m in model.named_modules() if HFMamba2MixerFamily.opens(m)}


@torch.no_grad()
def decode(model, ids: torch.Tensor) -> dict[str, dict[str, torch.Tensor]]:
    """The whole model one token at a time with its own cache (the package's decode path):
    per mixer its input u and output y at every token, and the state s the cache holds
    after every token, (B, T, ·) each."""
    mods = mixers(model)
    seen = {n: {"u": [], "y": [], "s": []} for n in mods}

    def keep(name: str):
        def hook(mod, args, kwargs, out) -> None:
            seen[name]["u"].append(args[0] if args else kwargs["hidden_states"])
            seen[name]["y"].append(out)
        return hook

    hooks = [m.register_forward_hook(keep(n), with_kwargs=True) for n, m in mods.items()]
    cache = None
    try:
        for t in range(ids.shape[1]):
            out = model(ids[:, t : t + 1], past_key_values=cache, use_cache=True,
                        position_ids=torch.full((ids.shape[0], 1), t))
            cache = out.past_key_values
            for n, m in mods.items():
                s = cache.layers[m.layer_idx].recurrent_states[0]
                seen[n]["s"].append(s.reshape(s.shape[0], 1, -1).clone())
    finally:
        for h in hooks:
            h.remove()
    return {n: {k: torch.cat(v, dim=1) for k, v in d.items()} for n, d in seen.items()}


def _rms(v: torch.Tensor, groups: int, eps: float) -> torch.Tensor:
    w = v.unflatten(-1, (groups, -1))
    return (w / torch.sqrt(w.pow(2).mean(-1, keepdim=True) + eps)).flatten(-2)


@torch.no_grad()
def independent(mix: torch.nn.Module, u: torch.Tensor) -> dict[str, torch.Tensor]:
    """The mixer in float64, whole sequence, written from its weights: FalconH1's
    multipliers, the conv as F.conv1d over a left-padded sequence, the state of each head
    as an explicit loop over tokens, the gated RMSNorm over its groups by hand. exp(A_log)
    is taken in float32, as the packages take it."""
    m, u = copy.deepcopy(mix).double(), u.double()
    NH, Pd, N, G = m.num_heads, m.head_dim, m.ssm_state_size, m.n_groups
    inner, cd, K = m.intermediate_size, m.conv_dim, m.conv_kernel_size
    falcon = hasattr(m, "mup_vector")
    assert m.activation == "silu"
    if falcon:
        u = u * m.ssm_in_multiplier
    zx = F.linear(u, m.in_proj.weight, m.in_proj.bias)
    if falcon:
        zx = zx * m.mup_vector[0, 0]
    g, xbc, dt = zx.split([inner, cd, NH], dim=-1)
    xbc = F.silu(F.conv1d(F.pad(xbc.transpose(1, 2), (K - 1, 0)), m.conv1d.weight,
                          m.conv1d.bias, groups=cd).transpose(1, 2))
    x, Bm, Cm = xbc.split([inner, G * N, G * N], dim=-1)
    delta = F.softplus(dt + m.dt_bias)  # (B, T, NH)
    a = torch.exp(delta * -torch.exp(mix.A_log.float()).double())
    group = torch.arange(NH) // (NH // G)  # each head's group of B and C
    x, Bm, Cm = x.unflatten(-1, (NH, Pd)), Bm.unflatten(-1, (G, N))[:, :, group], \
        Cm.unflatten(-1, (G, N))[:, :, group]
    s = torch.zeros(u.shape[0], NH, Pd, N, dtype=torch.float64)
    states, ys = [], []
    for t in range(u.shape[1]):
        s = a[:, t, :, None, None] * s + delta[:, t, :, None, None] * x[:, t, :, :, None] \
            * Bm[:, t, :, None, :]
        states.append(s.flatten(1))
        ys.append(((s * Cm[:, t, :, None, :]).sum(-1) + m.D[:, None] * x[:, t]).flatten(1))
    y, w = torch.stack(ys, dim=1), m.norm.weight if hasattr(m.norm, "weight") else None
    eps = getattr(m.norm, "variance_epsilon", 0.0)
    if w is None:  # FalconH1 without its gated norm
        y = y * F.silu(g)
    elif falcon and m.norm.norm_before_gate:
        y = w * _rms(y, G, eps) * F.silu(g)
    else:
        y = w * _rms(y * F.silu(g), G, eps)
    return {"s": torch.stack(states, dim=1), "a": a, "delta": delta,
            "y": F.linear(y, m.out_proj.weight, m.out_proj.bias)}


# ---- opened inside the whole model ----------------------------------------------------
@pytest.mark.parametrize("kind", sorted(MODELS))
def test_lens_opens_only_the_mamba2_mixers_by_their_index(kind):
    model = build(kind)
    _, paths, cls = MODELS[kind]
    lens = gatelens.Lens(model, vocab=VOCAB)
    assert list(lens.families) == paths
    for path, fam in lens.families.items():
        assert isinstance(fam, HFMamba2MixerFamily) and type(fam.module).__name__ == cls
        info = fam.describe()
        assert info["layer_index"] == int(path.split(".")[2])  # its index in the whole stack
        assert (info["hidden"], info["units"], info["heads"], info["groups"]) == \
            (4, "head", 4, 2)
        assert "not recurrences" in info["left_alone"]
        assert fam.names() == ["layer0.delta", "layer0.a", "layer0.s", "layer0.y"]
    if kind == "zamba2":  # the shared block is one module, called from both hybrid layers
        blocks = [layer.shared_transformer for layer in model.model.layers[1:]]
        assert blocks[0].self_attn.q_proj.weight is blocks[1].self_attn.q_proj.weight
    ids = _ids()
    with torch.no_grad():
        expected = model(ids, use_cache=False).logits
        with open_cells(model) as cache:
            got = model(ids, use_cache=False).logits
    assert torch.equal(got, expected)
    assert sorted(cache) == sorted(f"{p}.layer0.{n}" for p in paths
                                   for n in ("delta", "a", "s", "y"))
    assert cache[f"{paths[0]}.layer0.s"].shape == (B, T, 4 * 8 * 4)
    assert cache[f"{paths[0]}.layer0.a"].shape == (B, T, 4)


@pytest.mark.parametrize("kind", sorted(MODELS))
def test_the_trace_is_the_models_decode_path_and_the_float64_recurrence(kind):
    model = build(kind)
    steps = decode(model, _ids())
    for path, mix in mixers(model).items():
        run = steps[path]
        tr = gatelens.trace(mix, run["u"])
        exact = independent(mix, run["u"])
        # the states the whole model's own decode left in its cache, token by token
        assert scaled_diff(tr["layer0.s"], run["s"])[1] < 1e-5, path
        assert scaled_diff(tr["layer0.y"], run["y"])[1] < 1e-5, path
        for name in ("s", "a", "delta", "y"):
            assert scaled_diff(tr[f"layer0.{name}"], exact[name])[1] < 1e-5, (path, name)
        assert float(exact["s"].abs().max()) > 0.1  # the state is not negligible
        # the hand cell run free in float64: s, a, Δ to float64's rounding (y goes through
        # the package's gated norm, which rounds to float32 inside)
        fam64 = HFMamba2MixerFamily(copy.deepcopy(mix).double())
        free = fam64.rerun(fam64.check(run["u"].double())).signals
        for name in ("s", "a", "delta"):
            assert free[f"layer0.{name}"].dtype == torch.float64
            assert scaled_diff(free[f"layer0.{name}"], exact[name])[1] < 1e-12, (path, name)
        assert scaled_diff(free["layer0.y"], exact["y"])[1] < 1e-5


def _check(fam: HFMamba2MixerFamily, seed: int = 2):
    call = fam.check(torch.randn(B, T, D, generator=torch.Generator().manual_seed(seed)))
    return call, fam.reference(call)


@pytest.mark.parametrize("kind", sorted(MODELS))
def test_one_step_passes_and_a_parameter_off_by_a_tenth_of_a_percent_fails(kind):
    for mix in mixers(build(kind)).values():
        fam = HFMamba2MixerFamily(mix)
        call, ref = _check(fam)
        (row,) = fam.one_step(call, ref)
        assert row.max_scaled_diff_h < 1e-5
        # the chunked whole-sequence path against the decode path, and its final state
        assert ref.extra["step_vs_forward"][1] < 1e-5
        assert ref.extra["final_vs_step"][1] < 1e-5
        assert ref.final.shape == (B, 4 * 8 * 4)
        with torch.no_grad():
            fam.float64().dt_bias[1] *= 1.001  # one head's step off by 0.1 %
        assert fam.one_step(call, ref)[0].max_scaled_diff_h > 1e-5


@pytest.mark.parametrize("settings", [dict(mamba_rms_norm=False),
                                      dict(mamba_norm_before_gate=False)])
def test_falcon_h1_variants_and_its_multipliers_matter(settings):
    mix = build("falcon_h1", **settings).model.layers[0].mamba
    fam = HFMamba2MixerFamily(mix)
    call, ref = _check(fam)
    assert fam.one_step(call, ref)[0].max_scaled_diff_h < 1e-5
    exact = independent(mix, call.inputs)
    assert scaled_diff(ref.output, exact["y"])[1] < 1e-5
    assert fam.describe()["multipliers"]["gated_norm"] is settings.get("mamba_rms_norm", True)
    fam.float64().ssm_in_multiplier = 1.0  # the multiplier before in_proj left out
    assert fam.one_step(call, ref)[0].max_scaled_diff_h > 1e-3
    with torch.no_grad():
        fam.float64().ssm_in_multiplier = mix.ssm_in_multiplier
        assert fam.one_step(call, ref)[0].max_scaled_diff_h < 1e-5
        fam.float64().mup_vector[..., -4:] *= 1.001  # δ's μP multiplier off by 0.1 %
    assert fam.one_step(call, ref)[0].max_scaled_diff_h > 1e-5


# ---- memory: no return path in one mixer, analyze end to end --------------------------
def _rolled_gap(fam, start_lag: int, sqrt: bool = False) -> float:
    """max over t of |δs_t − a_t ⊙ δs_{t−1}| rolled from lag ``start_lag`` after P,
    relative to |δs| there: the mixer's own decode states, the clean read-out's keep."""
    x = torch.randn(B, T, D, generator=torch.Generator().manual_seed(4))
    xp = x.clone()
    xp[:, P] += torch.randn(B, D, generator=torch.Generator().manual_seed(5))
    clean, pert = fam.check(x), fam.check(xp)
    ref_c, ref_p = fam.reference(clean), fam.reference(pert)
    keep = fam.read(clean, ref_c).signals["layer0.a"][..., fam.state_units(0)].double()
    keep = keep.sqrt() if sqrt else keep
    ds = (ref_p.states["layer0.s"] - ref_c.states["layer0.s"]).double()
    rolled = ds[:, P + start_lag]
    norm = rolled.abs().amax(dim=-1)
    assert float(norm.min()) > 0
    worst = 0.0
    for t in range(P + start_lag + 1, T):
        rolled = keep[:, t] * rolled
        worst = max(worst, float(((ds[:, t] - rolled).abs().amax(-1) / norm).max()))
    return worst


def test_one_mixer_has_no_return_path_once_the_window_has_passed():
    fam = HFMamba2MixerFamily(build("bamba").model.layers[0].mamba)
    K = fam.input_window()
    assert K == 3
    assert _rolled_gap(fam, K - 1) < 2e-5  # the package's float32 steps
    assert _rolled_gap(fam, 0) > 1e-3  # the conv still reads the changed input
    assert _rolled_gap(fam, K - 1, sqrt=True) > 1e-2  # a wrong decay


def test_analyze_measures_each_bamba_mixer():
    result = gatelens.Lens(build("bamba"), vocab=VOCAB).analyze(
        TEXT, windows=2, length=24, perturb_pos=6, exponents=1)
    assert list(result.analyses) == ["model.layers.0.mamba", "model.layers.2.mamba"]
    for path, a in result.analyses.items():
        rep = a.report
        check_report(rep)
        jsonschema.validate(rep, schema())
        assert rep["model"]["family"] == "hf-mamba2-mixer" and rep["model"]["path"] == path
        assert rep["verification"]["passed"] is True
        assert rep["units"]["gate"] == "a" and rep["units"]["n_units"] == 4
        assert all(0 < rep["gates"]["a"][q] < 1 for q in ("p5", "p50", "p95"))
        assert all(math.isfinite(v) for v in rep["units"]["half_life"].values())
        assert rep["lyapunov"] is not None and rep["perturbation"]["n"] == 2


# ---- edits (Lens.run) ---------------------------------------------------------------------
def _bamba_mixer_on_top() -> torch.nn.Module:
    """An attention layer, then one Mamba-2 layer (transformers 5.23's Bamba cannot decode
    with a cache that holds no attention layer)."""
    torch.manual_seed(0)
    return spread_decays(transformers.BambaForCausalLM(transformers.BambaConfig(
        vocab_size=V, hidden_size=D, intermediate_size=2 * D, num_hidden_layers=2,
        attn_layer_indices=[0], **ATTN, **MAMBA)))


def test_an_edit_before_is_bitwise_and_a_state_set_to_itself_changes_nothing():
    model, ids = build("bamba"), _ids()
    lens, key = gatelens.Lens(model, vocab=VOCAB), "model.layers.2.mamba.layer0.s"
    with torch.no_grad():
        own = model(ids, use_cache=False).logits
    s = lens.run(ids).trace[key]
    res = lens.run(ids, edits=[gatelens.Set(key, s[:, 5], at=5)])
    assert torch.equal(res.output.logits[:, :5], own[:, :5])
    assert (res.output.logits - own).abs().max() < 1e-5
    moved = lens.run(ids, edits=[gatelens.Scale(key, 2.0, at=5)]).output.logits
    assert (moved[:, 6:] - own[:, 6:]).abs().max() > 1e-4


def test_a_state_edit_is_the_models_own_decode_from_the_edited_state():
    """Zero the mixer's state after token t: the whole model's own cached decode, its
    cache's state zeroed after token t, gives the same later logits (the mixer in the top
    layer: a layer above would read position t's edited output, which the cache's edit
    cannot give)."""
    model, ids, t = _bamba_mixer_on_top(), _ids(), 5
    res = gatelens.Lens(model, vocab=VOCAB).run(
        ids, edits=[gatelens.Zero("model.layers.1.mamba.layer0.s", at=t)])
    cache, got = None, []
    with torch.no_grad():
        for j in range(T):
            out = model(ids[:, j : j + 1], past_key_values=cache, use_cache=True,
                        position_ids=torch.full((B, 1), j))
            cache = out.past_key_values
            got.append(out.logits)
            if j == t:
                cache.layers[1].recurrent_states[0].zero_()
        own = model(ids, use_cache=False).logits
    ref = torch.cat(got, dim=1)
    assert torch.equal(res.output.logits[:, :t], own[:, :t])
    later = (res.output.logits[:, t + 1:] - ref[:, t + 1:]).abs().max()
    moved = (own[:, t + 1:] - ref[:, t + 1:]).abs().max()
    assert later < 1e-5 < moved, (later, moved)


# ---- refusals ------------------------------------------------------------------------------
def test_a_cache_or_a_padding_mask_is_refused_in_one_line_naming_the_layer():
    mix = build("bamba").model.layers[2].mamba
    fam = HFMamba2MixerFamily(mix)
    x = torch.randn(B, T, D)
    mask = torch.ones(B, T, dtype=torch.long)
    assert fam.split_call((), {"hidden_states": x, "attention_mask": mask}) == (x, None)
    mask[0, :3] = 0
    inputs, state = fam.split_call((x, None, mask), {})
    with pytest.raises(GatelensError, match=r"layer 2 \(BambaMixer\) was called with a cache "
                                            "or a padding mask"):
        fam.check(inputs, state)
    with pytest.raises(GatelensError, match="inputs must be a float tensor"):
        fam.check(torch.zeros(B, T, dtype=torch.long))


@pytest.mark.parametrize("settings", [{}, {"mamba_rms_norm": False}])
def test_the_free_running_rerun_by_layer_is_the_step_by_step_one(settings):
    """``scan_layer`` (the hand cell over a whole window, as the free-running re-run runs it)
    against ``step_cell`` token by token, with FalconH1's μP multipliers, gated norm or not."""
    model = build("falcon_h1", **settings)
    fam = HFMamba2MixerFamily(model.model.layers[0].mamba)
    call = fam.check(torch.randn(B, T, D, generator=torch.Generator().manual_seed(3)))
    with torch.no_grad():
        by_layer, by_step = fam._rerun_by_layer(call), fam._rerun_by_step(call)
    for name, v in by_step.signals.items():
        assert (by_layer.signals[name] - v).abs().max() <= 1e-6 * v.abs().max().clamp(min=1)
