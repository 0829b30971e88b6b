"""The Jamba family (families/hf_jamba.py): the Mamba-1 mixers inside a whole hybrid model.

A small random JambaForCausalLM (a Mamba layer, an attention layer, a Mamba layer whose
feed-forward is a mixture of experts) is opened by ``Lens``: only its two
``JambaMambaMixer`` modules, each read against an independent float64 recurrence written
here (the conv as F.conv1d, Jamba's weighted RMS norms on δ, B and C written out, the scan
as a loop), against the package's own decode path (one token at a time through its cache)
and against its whole-sequence scan and the final state that scan leaves in a cache. One
layer has no return path once the convolution's window has passed; a carried Zero edit is
the package's own cached decode from a zeroed state.
"""

from __future__ import annotations

import copy
import math
import warnings

import jsonschema
import pytest
import torch
import torch.nn.functional as F
import transformers

import gatelens
from gatelens.analysis.common import pooled
from gatelens.errors import GatelensError
from gatelens.families.hf_jamba import HFJambaFamily
from gatelens.families.hf_mamba import MambaCell
from gatelens.families.official import scaled_diff
from gatelens.families.registry import family_of
from gatelens.readout.hooks import open_cells
from gatelens.report.json_report import check_report, schema

V, D, N, K, R, B, T = 11, 16, 4, 3, 4, 2, 16
DIN = 2 * D
VOCAB = list("abcdefghij ")
TEXT = "abc def ghij jig fed cba " * 40
LW, PW = 24, 6  # the windows Lens analyses and the perturbed position
SIGNALS = ("delta", "a", "s", "y")
PATHS = ["model.layers.0.mamba", "model.layers.2.mamba"]


@pytest.fixture(autouse=True)
def _single_thread(one_thread):
    transformers.utils.logging.set_verbosity_error()
    warnings.filterwarnings("ignore", message=".*fall.*back.*")


def jamba(attn_at: int = 1) -> torch.nn.Module:
    """Layers: mamba, attention, mamba with a 2-expert MoE (``attn_at`` 0: attention, mamba).
    Weights (the three norms' too) spread beyond the package's start; Δ's bias set as Mamba
    sets it (softplus⁻¹ of 0.01-0.1; Jamba's class leaves nn.Linear's), so the keeps are
    of 0.6-0.99, memories worth measuring."""
    cfg = transformers.JambaConfig(
        vocab_size=V, hidden_size=D, intermediate_size=2 * D, num_hidden_layers=3 - (attn_at == 0),
        num_attention_heads=2, num_key_value_heads=1, num_experts=2, num_experts_per_tok=1,
        expert_layer_period=3, expert_layer_offset=2, attn_layer_period=3 - (attn_at == 0),
        attn_layer_offset=attn_at, mamba_d_state=N, mamba_d_conv=K, mamba_dt_rank=R,
        use_cache=False)
    torch.manual_seed(0)
    model = transformers.JambaForCausalLM(cfg)
    g = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("dt_proj.bias"):
                p.copy_(torch.expm1(torch.empty(p.shape).uniform_(0.01, 0.1, generator=g)).log())
            elif not name.endswith("A_log"):
                p.add_(0.3 * torch.randn(p.shape, generator=g))
    return model.eval()


def _mixers(model) -> list[torch.nn.Module]:
    return [m for m in model.modules() if type(m).__name__ == "JambaMambaMixer"]


def _x(seed: int = 1, length: int = T) -> torch.Tensor:
    return torch.randn(B, length, D, generator=torch.Generator().manual_seed(seed))


@torch.no_grad()
def independent(mod: torch.nn.Module, x: torch.Tensor) -> dict[str, torch.Tensor]:
    """The mixer in float64, whole sequence, written from its weights: the causal depthwise
    conv as F.conv1d, δ, B, C each w ⊙ v / √(mean(v²) + ε), Δ = softplus(W δ + b), the scan
    s_t = exp(Δ A) s_{t−1} + Δ B x̂ as a loop; A taken in float32 as the package takes it."""
    m, x = copy.deepcopy(mod).double(), x.double()
    assert m.activation == "silu"
    xi, z = m.in_proj(x).chunk(2, dim=-1)
    xc = F.silu(F.conv1d(F.pad(xi.transpose(1, 2), (K - 1, 0)), m.conv1d.weight,
                         m.conv1d.bias, groups=DIN).transpose(1, 2))  # (B, T, DIN)
    dt, Bm, Cm = m.x_proj(xc).split([R, N, N], dim=-1)

    def norm(v, ln):
        return ln.weight * v / torch.sqrt(v.pow(2).mean(-1, keepdim=True) + ln.variance_epsilon)

    dt, Bm, Cm = norm(dt, m.dt_layernorm), norm(Bm, m.b_layernorm), norm(Cm, m.c_layernorm)
    delta = F.softplus(dt @ m.dt_proj.weight.T + m.dt_proj.bias)
    a = torch.exp(delta[..., None] * -torch.exp(mod.A_log.float()).double())  # (B, T, DIN, N)
    s = torch.zeros(x.shape[0], DIN, N, dtype=torch.float64)
    states = []
    for t in range(x.shape[1]):
        s = a[:, t] * s + delta[:, t, :, None] * Bm[:, t, None, :] * xc[:, t, :, None]
        states.append(s.flatten(1))
    S = torch.stack(states, dim=1)
    y = m.out_proj(((S.view(*S.shape[:2], DIN, N) * Cm[:, :, None, :]).sum(-1) + m.D * xc)
                   * F.silu(z))
    return {"delta": delta, "a": a.flatten(2), "s": S, "y": y}


# ---- opened inside the whole model ----------------------------------------------------
def test_lens_opens_only_the_mamba_mixers():
    model = jamba()
    layers = model.model.layers
    assert [type(m.feed_forward).__name__ for m in layers] == ["JambaMLP", "JambaMLP",
                                                               "JambaSparseMoeBlock"]
    lens = gatelens.Lens(model, vocab=VOCAB)
    assert list(lens.families) == PATHS
    assert "hf-jamba" in gatelens.families()
    for left in (layers[1], layers[1].self_attn, layers[2].feed_forward, layers[0]):
        assert family_of(left) is None  # attention, MoE, the decoder layer around a mixer
    fam = lens.families["model.layers.2.mamba"]
    assert isinstance(fam, HFJambaFamily) and fam.cell == "mamba"
    assert fam.names() == [f"layer0.{n}" for n in SIGNALS]
    info = fam.describe()
    assert (info["layer_index"], info["hidden"], info["units"], info["conv_kernel"]) == \
        (2, DIN * N, "(channel, state) pair", K)
    assert info["left_alone"].startswith("the model's attention, MLP and MoE")
    assert fam.input_window() == K and fam.recipe is None
    ids = torch.randint(0, V, (B, T), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        expected = model(ids).logits
        with open_cells(model) as cache:
            got = model(ids).logits
    assert torch.equal(got, expected)
    assert list(cache.traces) == PATHS
    assert sorted(cache) == sorted(f"{p}.layer0.{n}" for p in PATHS for n in SIGNALS)
    assert cache["model.layers.0.mamba.layer0.a"].shape == (B, T, DIN * N)


def test_the_trace_is_the_float64_recurrence_and_the_package_paths():
    mod = _mixers(jamba())[1]
    fam = HFJambaFamily(mod)
    call = fam.check(_x())
    ref = fam.reference(call)
    exact = independent(mod, call.inputs)
    tr = gatelens.trace(mod, call.inputs)
    fam64 = HFJambaFamily(copy.deepcopy(mod).double())
    free = fam64.rerun(fam64.check(call.inputs.double())).signals
    for name in SIGNALS:
        assert free[f"layer0.{name}"].dtype == torch.float64
        assert scaled_diff(free[f"layer0.{name}"], exact[name])[1] < 1e-12, name
        assert scaled_diff(tr[f"layer0.{name}"], exact[name])[1] < 1e-5, name
    # the package's decode path (the trajectory), its scan and the state the scan leaves
    assert scaled_diff(ref.states["layer0.s"], exact["s"])[1] < 1e-5
    assert scaled_diff(ref.output, exact["y"])[1] < 1e-5
    assert ref.extra["step_vs_forward"][1] < 1e-5 and ref.extra["final_vs_step"][1] < 1e-5
    assert scaled_diff(ref.final[:, None], exact["s"][:, -1:])[1] < 1e-5
    assert float(exact["s"].abs().max()) > 0.1  # the state is not negligible
    assert 0.1 < float(exact["a"].min()) and float(exact["a"].max()) < 1


@pytest.mark.parametrize("wrong", ["dt_layernorm.weight", "b_layernorm.weight",
                                   "c_layernorm.weight", "x_proj.weight", "A_log",
                                   "conv1d.weight", "dt_proj.bias"])
def test_one_step_passes_and_a_weight_off_by_a_thousandth_fails_it(wrong):
    for mod in _mixers(jamba()):
        fam = HFJambaFamily(mod)
        call = fam.check(_x())
        ref = fam.reference(call)
        assert fam.one_step(call, ref)[0].max_scaled_diff_h < 1e-5
        p = fam.float64().get_parameter(wrong)
        with torch.no_grad():  # x_proj: B's first row (the whole of it is normalised away)
            (p[R] if wrong == "x_proj.weight" else p).mul_(1.001)
        assert fam.one_step(call, ref)[0].max_scaled_diff_h > 1e-5


def test_the_norms_are_needed_and_make_x_proj_scale_free(monkeypatch):
    fam = HFJambaFamily(_mixers(jamba())[0])
    call = fam.check(_x())
    ref = fam.reference(call)
    with torch.no_grad():
        fam.float64().x_proj.weight.mul_(1.5)  # δ, B and C each rescaled: normalised away
    assert fam.one_step(call, ref)[0].max_scaled_diff_h < 1e-5
    monkeypatch.setattr(HFJambaFamily, "_bcdt", MambaCell._bcdt)  # plain Mamba-1
    assert fam.one_step(call, ref)[0].max_scaled_diff_h > 1e-3


def test_the_dynamics_step_reproduces_the_trajectory():
    fam = HFJambaFamily(_mixers(jamba())[0])
    call = fam.check(_x())
    ref = fam.reference(call)
    (dyn,) = fam.dynamics(call, ref)
    assert dyn.size == (K - 1) * DIN + DIN * N  # the conv's window, then s
    parts = list(dyn.initial)
    for t in range(T):
        parts = dyn.step(dyn.inputs[:, t], parts)
        for got, want in zip(parts, dyn.trajectory, strict=True):
            assert scaled_diff(got[:, None], want[:, t : t + 1])[1] < 1e-5


# ---- the no-return-path invariant (one linear layer) ----------------------------------
def _keep_gap(start_lag: int, how: str = "a") -> float:
    """max over t of |δs_t − a_t ⊙ δs_{t−1}| rolled from lag ``start_lag`` after PW, relative
    to |δs| there: the package's own states (its decode path), the clean read-out's keep
    (``how`` "sqrt": a wrong keep √a)."""
    fam = HFJambaFamily(_mixers(jamba())[0])
    x = _x(4, LW)
    xp = x.clone()
    xp[:, PW] += torch.randn(B, D, generator=torch.Generator().manual_seed(5))
    clean, pert = fam.check(x), fam.check(xp)
    ref_c, ref_p = fam.reference(clean), fam.reference(pert)
    keep = fam.read(clean, ref_c).signals["layer0.a"].double()
    keep = keep.sqrt() if how == "sqrt" else keep
    ds = (ref_p.states["layer0.s"] - ref_c.states["layer0.s"]).double()
    rolled = ds[:, PW + start_lag]
    norm = rolled.abs().amax(dim=-1)
    assert float(norm.min()) > 0
    worst = 0.0
    for t in range(PW + start_lag + 1, LW):
        rolled = keep[:, t] * rolled
        worst = max(worst, float(((ds[:, t] - rolled).abs().amax(-1) / norm).max()))
    return worst


def test_one_layer_has_no_return_path_once_the_window_has_passed():
    assert _keep_gap(K - 1) < 2e-5  # the package's float32 steps
    assert _keep_gap(0) > 1e-3  # the conv still reads the changed input at lag 1, 2
    assert _keep_gap(K - 1, "sqrt") > 1e-2


# ---- measured by Lens ------------------------------------------------------------------
def test_analyze_measures_each_mamba_layer_and_the_split_is_the_keep_gate():
    result = gatelens.Lens(jamba(), vocab=VOCAB).analyze(
        TEXT, windows=2, length=LW, perturb_pos=PW, exponents=1)
    assert list(result.analyses) == PATHS
    entering = {}
    for path, a in result.analyses.items():
        rep = a.report
        check_report(rep)
        jsonschema.validate(rep, schema())
        assert rep["model"]["family"] == "hf-jamba" and rep["model"]["path"] == path
        assert rep["verification"]["passed"] is True
        assert rep["units"]["gate"] == "a" and rep["units"]["n_units"] == DIN * N
        assert all(0 < rep["gates"]["a"][q] < 1 for q in ("p5", "p50", "p95"))
        assert all(math.isfinite(v) and v > 0 for v in rep["units"]["half_life"].values())
        assert rep["lyapunov"] is not None
        pert = rep["perturbation"]
        assert pert["n"] == 2 and pert["lags"] == [1, 2, 4, 8, 16]
        tr, tr2 = a.trace, a.trace_perturbed  # the forget path by hand: the clean keeps
        ds = (pooled(tr2, "s") - pooled(tr, "s")).double()
        keep = tr["layer0.a"].double()
        rolled, by_hand = ds[:, PW], {}
        for lag in range(1, LW - PW):
            rolled = keep[:, PW + lag] * rolled
            by_hand[lag] = (rolled.norm(dim=-1) / ds[:, PW].norm(dim=-1)).mean()
        assert pert["forget_only"] == pytest.approx(
            [float(by_hand[k]) for k in pert["lags"]], rel=1e-5, abs=1e-12)
        dec = a.decomposition
        scale = max(float(dec["measured"].abs().max()), 1.0)
        assert float((dec["measured"] - dec["forget_path"] - dec["return_path"]).abs().max()) \
            < 1e-9 * scale
        # what enters the return path at each step past the conv's window, u_t = r_t −
        # a_t r_{t−1}, relative to |δs_p|
        r, base = dec["return_path"], float(ds[:, PW].abs().max())
        entering[path] = max(float((r[:, t] - keep[:, t] * r[:, t - 1]).abs().max()) / base
                             for t in range(PW + K, LW))
    # the bottom Mamba layer's input is the same again after the conv's window; the top
    # one's differs at every lag (the attention layer between reads the changed token)
    assert entering[PATHS[0]] < 1e-5
    assert entering[PATHS[1]] > 1e-3


# ---- an edit: the package's own decode from the edited state ---------------------------
def test_a_zeroed_state_is_the_packages_own_decode_from_a_zeroed_cache():
    m, t = jamba(attn_at=0), 5  # the top layer's later outputs read its state, not y_t
    lens, key = gatelens.Lens(m, vocab=V), "model.layers.1.mamba.layer0.s"
    ids = torch.randint(0, V, (B, 12), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        own = m(ids).logits
    res = lens.run(ids, edits=[gatelens.Zero(key, at=t)])
    cache, got = transformers.DynamicCache(config=m.config), []
    with torch.no_grad():
        for j in range(ids.shape[1]):
            got.append(m(ids[:, j:j + 1], past_key_values=cache, use_cache=True).logits)
            if j == t:
                cache.get_recurrent_state(1).zero_()
    ref = torch.cat(got, dim=1)
    assert torch.equal(res.output.logits[:, :t], own[:, :t])
    later = (res.output.logits[:, t + 1:] - ref[:, t + 1:]).abs().max()
    moved = (own[:, t + 1:] - ref[:, t + 1:]).abs().max()
    assert later < 1e-5 < moved, (later, moved)
    assert not res.trace[key][:, t].any()


# ---- refusals ------------------------------------------------------------------------------
def test_a_cache_or_a_padding_mask_is_refused_in_one_line():
    fam = HFJambaFamily(_mixers(jamba())[0])
    x = _x()
    mask = torch.ones(B, T, dtype=torch.long)
    assert fam.split_call((), {"hidden_states": x, "attention_mask": mask}) == (x, None)
    mask[0, :3] = 0
    inputs, state = fam.split_call((), {"hidden_states": x, "attention_mask": mask})
    with pytest.raises(GatelensError, match="padding mask passed to JambaMambaMixer"):
        fam.check(inputs, state)
    cache = transformers.DynamicCache(config=fam.module.config)
    with pytest.raises(GatelensError, match=r"hf-jamba: a cache .*\(got DynamicCache\)"):
        fam.check(*fam.split_call((x,), {"cache_params": cache}))
    with pytest.raises(GatelensError, match="inputs must be a float tensor"):
        fam.check(torch.zeros(B, T, dtype=torch.long))
