"""The RG-LRU family (families/hf_rglru.py) inside a whole RecurrentGemma model.

A small random RecurrentGemmaForCausalLM (a recurrent block, then a local-attention block)
is opened by ``Lens``: only its recurrent decoder layer, read against an independent float64
recurrence written here from the block's weights (the paper's a_t = σ(Λ)^(c·r_t) with
Λ = −recurrent_param, the block-diagonal gates as full matrices, the conv as F.conv1d),
against the package's own decode path (one token at a time through its cache) and its
whole-sequence forward. Position 0 is the package's reset: s_0 = i_0 ⊙ x̂_0, with neither the
keep nor the √(1 − a²) normalisation, and the dynamics start after it.
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
from gatelens.families import hf_rglru
from gatelens.families.hf_rglru import HFRGLRUFamily
from gatelens.families.official import scaled_diff
from gatelens.families.registry import family_of
from gatelens.readout.hooks import open_cells
from gatelens.report.json_report import check_report, schema

V, D, B, T, K = 11, 32, 2, 16, 3
VOCAB = list("abcdefghij ")
TEXT = "abc def ghij jig fed cba " * 40
LW, PW = 24, 6  # the windows Lens analyses and the perturbed position
SIGNALS = ("r", "i", "a", "write", "x", "s", "y")


@pytest.fixture(autouse=True)
def _single_thread(one_thread):
    transformers.utils.logging.set_verbosity_error()
    warnings.filterwarnings("ignore", message=".*fall.*back.*")


def _spread(model: torch.nn.Module, seed: int = 0) -> torch.nn.Module:
    """Biases and norm weights away from the package's zeros (the conv's bias, the gates'
    biases and Gemma's 1 + w all enter), weights a little beyond its initialisation."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("recurrent_param"):
                continue  # the package's a^c in [0.9, 0.999]: memories worth measuring
            p.add_((0.3 if "bias" in name or "norm" in name else 0.1)
                   * torch.randn(p.shape, generator=g))
    return model.eval()


def gemma(lru_width: int | None = None, types=("recurrent", "attention")) -> torch.nn.Module:
    cfg = transformers.RecurrentGemmaConfig(
        vocab_size=V, hidden_size=D, intermediate_size=2 * D, num_attention_heads=2,
        num_hidden_layers=len(types), block_types=list(types), attention_window_size=8,
        conv1d_width=K, lru_width=lru_width, use_cache=False)
    torch.manual_seed(0)
    return _spread(transformers.RecurrentGemmaForCausalLM(cfg))


def _layer(lru_width: int | None = None) -> torch.nn.Module:
    return gemma(lru_width).model.layers[0]


def _x(seed: int = 1, length: int = T) -> torch.Tensor:
    return torch.randn(B, length, D, generator=torch.Generator().manual_seed(seed))


def _norm(norm: torch.nn.Module, v: torch.Tensor) -> torch.Tensor:
    return v / torch.sqrt(v.pow(2).mean(-1, keepdim=True) + norm.eps) * (1 + norm.weight)


@torch.no_grad()
def independent(layer: torch.nn.Module, x: torch.Tensor) -> dict[str, torch.Tensor]:
    """The decoder layer in float64, whole sequence, written from its weights: the conv as
    F.conv1d over a left-padded sequence, each gate's block-diagonal weight as one full
    matrix, a = σ(Λ)^(c·r) with Λ = −recurrent_param (the package keeps −Λ), and the reset
    at position 0 (h_0 = i_0 ⊙ x̂_0) as the package's ``position_ids == 0`` applies it."""
    m, x = copy.deepcopy(layer).double(), x.double()
    blk = m.temporal_block
    lru, W = blk.rg_lru, blk.lru_width
    assert blk.act_fn.__class__.__name__ == "GELUTanh"
    u = _norm(m.temporal_pre_norm, x)
    xb = blk.linear_x(u).transpose(1, 2)  # (B, W, T)
    xc = F.conv1d(F.pad(xb, (K - 1, 0)), blk.conv_1d.weight, blk.conv_1d.bias,
                  groups=W).transpose(1, 2)  # (B, T, W)
    Wi, Wr = torch.block_diag(*lru.input_gate_weight), torch.block_diag(*lru.recurrent_gate_weight)
    i = torch.sigmoid(xc @ Wi + lru.input_gate_bias.flatten())
    r = torch.sigmoid(xc @ Wr + lru.recurrent_gate_bias.flatten())
    a = torch.sigmoid(-lru.recurrent_param) ** (8.0 * r)
    h = torch.zeros(x.shape[0], W, dtype=torch.float64)
    hs, writes = [], []
    for t in range(x.shape[1]):
        w = i[:, t] if t == 0 else torch.sqrt(1 - a[:, t] ** 2) * i[:, t]
        h = (0.0 if t == 0 else a[:, t]) * h + w * xc[:, t]
        hs.append(h)
        writes.append(w)
    s = torch.stack(hs, dim=1)
    y = blk.linear_out(s * F.gelu(blk.linear_y(u), approximate="tanh"))
    res = x + y
    z, mlp = _norm(m.channel_pre_norm, res), m.mlp_block
    out = res + mlp.down_proj(F.gelu(mlp.gate_proj(z), approximate="tanh") * mlp.up_proj(z))
    return {"r": r, "i": i, "a": a, "write": torch.stack(writes, dim=1), "x": xc, "s": s,
            "y": y, "out": out}


# ---- opened inside the whole model ----------------------------------------------------
def test_lens_opens_only_the_recurrent_block_and_the_registry_lists_it():
    model = gemma()
    lens = gatelens.Lens(model, vocab=VOCAB)
    assert list(lens.families) == ["model.layers.0"]
    fam = lens.families["model.layers.0"]
    assert isinstance(fam, HFRGLRUFamily) and fam.cell == "rglru"
    assert "hf-rglru" in gatelens.families()
    assert family_of(model.model.layers[1]) is None  # the local-attention block
    assert family_of(model.model.layers[0].temporal_block) is None  # the layer, not its parts
    assert fam.names() == [f"layer0.{n}" for n in SIGNALS]
    info = fam.describe()
    assert (info["family"], info["hidden"], info["units"], info["heads"], info["conv_width"]) \
        == ("hf-rglru", D, "channel", 2, K)
    assert fam.state_units(0).tolist() == list(range(D)) and fam.input_window() == K
    # open_cells keys the trace as every family's: module path, then layerK.name
    ids = torch.randint(0, V, (B, T), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        expected = model(ids).logits
        with open_cells(model) as cache:
            got = model(ids).logits
    assert torch.equal(got, expected)
    assert list(cache.traces) == ["model.layers.0"]
    assert sorted(cache) == sorted(f"model.layers.0.layer0.{n}" for n in SIGNALS)
    assert cache["model.layers.0.layer0.a"].shape == (B, T, D)


@pytest.mark.parametrize("lru_width", [None, 48])  # 48: the LRU wider than the model
def test_the_trace_is_the_float64_recurrence_and_the_package_paths(lru_width):
    layer = _layer(lru_width)
    W = lru_width or D
    fam = HFRGLRUFamily(layer)
    call = fam.check(_x())
    ref = fam.reference(call)
    exact = independent(layer, call.inputs)
    tr = gatelens.trace(layer, call.inputs)
    fam64 = HFRGLRUFamily(copy.deepcopy(layer).double())
    free = fam64.rerun(fam64.check(call.inputs.double())).signals
    for name in SIGNALS:
        assert exact[name].shape == (B, T, D if name == "y" else W)
        assert free[f"layer0.{name}"].dtype == torch.float64
        assert scaled_diff(free[f"layer0.{name}"], exact[name])[1] < 1e-12, name
        assert scaled_diff(tr[f"layer0.{name}"], exact[name])[1] < 1e-5, name
    # the package's decode path (the trajectory) and its whole-sequence forward
    assert scaled_diff(ref.states["layer0.s"], exact["s"])[1] < 1e-5
    assert scaled_diff(ref.states["layer0.y"], exact["y"])[1] < 1e-5
    assert scaled_diff(ref.output, exact["out"])[1] < 1e-5
    assert ref.extra["step_vs_forward"][1] < 1e-5
    assert float(exact["s"].abs().max()) > 0.1  # the state is not negligible
    assert 0.3 < float(exact["a"].min()) and float(exact["a"].max()) < 1  # keeps that keep


def test_position_0_is_the_packages_reset():
    layer = _layer()
    fam = HFRGLRUFamily(layer)
    call = fam.check(_x())
    ref = fam.reference(call)
    exact = independent(layer, call.inputs)
    sig = fam.read(call, ref).signals
    i0, x0, a0 = (exact[n][:, 0] for n in ("i", "x", "a"))
    # the package's own state at 0 is the gated input, neither kept nor normalised ...
    s0 = ref.states["layer0.s"][:, 0].double()
    assert scaled_diff(s0, i0 * x0)[1] < 1e-6
    assert scaled_diff(s0, torch.sqrt(1 - a0 ** 2) * i0 * x0)[1] > 0.1  # (it would matter)
    # ... and from position 1 on the normalised recurrence from that state
    s1 = ref.states["layer0.s"][:, 1].double()
    a1, i1, x1 = (exact[n][:, 1] for n in ("a", "i", "x"))
    assert scaled_diff(s1, a1 * s0 + torch.sqrt(1 - a1 ** 2) * i1 * x1)[1] < 1e-6
    # the trace's a_0 is the gate's value there (what the keep would be), its write i_0
    assert torch.allclose(sig["layer0.a"][:, 0].double(), a0, rtol=1e-5, atol=0)
    assert torch.allclose(sig["layer0.write"][:, 0].double(), i0, rtol=1e-5, atol=0)
    assert ref.extra["aux"][0][:, :, 0].tolist() == [[1.0] + [0.0] * (T - 1)] * B
    # the same sequence started at position 1 (no reset) is refused, not misread
    inputs, state = fam.split_call((call.inputs, torch.arange(1, T + 1)[None]), {})
    with pytest.raises(GatelensError, match="positions other than 0 … T − 1"):
        fam.check(inputs, state)
    # positions 0 … T − 1, as a tensor or as RecurrentGemmaModel passes them, are accepted
    assert fam.split_call((call.inputs, torch.arange(T)[None]), {}) == (call.inputs, None)


def test_the_reset_is_needed_for_the_check_to_pass(monkeypatch):
    fam = HFRGLRUFamily(_layer())
    call = fam.check(_x())
    ref = fam.reference(call)
    assert fam.one_step(call, ref)[0].max_scaled_diff_h < 1e-5
    plain = HFRGLRUFamily.step_cell
    monkeypatch.setattr(HFRGLRUFamily, "step_cell",
                        lambda self, k, m, u, parts, aux: plain(self, k, m, u, parts, None))
    assert fam.one_step(call, ref)[0].max_scaled_diff_h > 1e-3


def test_the_dynamics_start_after_the_reset_and_reproduce_the_trajectory():
    fam = HFRGLRUFamily(_layer())
    call = fam.check(_x())
    ref = fam.reference(call)
    (dyn,) = fam.dynamics(call, ref)
    assert dyn.offset == 1 and dyn.order == list(range(1, T))
    assert dyn.size == (K - 1) * D + D  # the conv's window, then s
    parts = list(dyn.initial)
    for got, want in zip(parts, dyn.trajectory, strict=True):
        assert torch.equal(got, want[:, 0])
    for t in range(1, T):
        parts = dyn.step(dyn.inputs[:, t], parts)
        for got, want in zip(parts, dyn.trajectory, strict=True):
            assert scaled_diff(got[:, None], want[:, t : t + 1])[1] < 1e-5


# ---- the check against the module's own decode path ------------------------------------
@pytest.mark.parametrize("wrong", ["input_gate_weight", "recurrent_gate_bias",
                                   "recurrent_param", "conv"])
def test_one_step_passes_and_a_wrong_weight_fails_it(wrong):
    fam = HFRGLRUFamily(_layer())
    call = fam.check(_x())
    ref = fam.reference(call)
    (row,) = fam.one_step(call, ref)
    assert row.max_scaled_diff_h < 1e-5
    blk = fam.float64().temporal_block
    with torch.no_grad():  # a whole gate weight of the family's float64 copy off by 1e-3 relative
        p = blk.conv_1d.weight if wrong == "conv" else getattr(blk.rg_lru, wrong)
        p.mul_(1.001)
    assert fam.one_step(call, ref)[0].max_scaled_diff_h > 1e-5


def test_a_wrong_exponent_fails_the_check(monkeypatch):
    fam = HFRGLRUFamily(_layer())
    call = fam.check(_x())
    ref = fam.reference(call)
    monkeypatch.setattr(hf_rglru, "C_LRU", 8.0 * 1.001)
    assert fam.one_step(call, ref)[0].max_scaled_diff_h > 1e-5


def test_verify_through_the_public_entry_point(monkeypatch):
    layer = _layer()
    result = gatelens.verify(layer, _x())
    assert result.passed and result.one_step_max_scaled_diff_h < 1e-5
    monkeypatch.setattr(hf_rglru, "C_LRU", 8.0 * 1.001)
    assert not gatelens.verify(layer, _x()).passed


def test_the_reference_leaves_the_blocks_cache_as_it_was():
    layer = _layer()
    blk = layer.temporal_block
    conv, state = torch.ones(B, D, K - 1), torch.ones(B, D)
    blk.conv1d_state, blk.rg_lru.recurrent_states = conv, state
    fam = HFRGLRUFamily(layer)
    fam.reference(fam.check(_x()))
    assert blk.conv1d_state is conv and blk.rg_lru.recurrent_states is state


# ---- measured by Lens ------------------------------------------------------------------
def test_analyze_measures_the_block_and_the_split_is_the_keep_gate():
    result = gatelens.Lens(gemma(), vocab=VOCAB).analyze(
        TEXT, windows=2, length=LW, perturb_pos=PW, exponents=1)
    ((path, a),) = result.analyses.items()
    rep = a.report
    check_report(rep)
    jsonschema.validate(rep, schema())
    assert path == "model.layers.0" and rep["model"]["family"] == "hf-rglru"
    assert rep["model"]["path"] == path and rep["verification"]["passed"] is True
    assert rep["units"]["gate"] == "a" and rep["units"]["n_units"] == D
    assert all(0 < rep["gates"]["a"][q] < 1 for q in ("p5", "p50", "p95"))
    assert all(math.isfinite(v) and v > 0 for v in rep["units"]["half_life"].values())
    assert rep["lyapunov"] is not None and a.lyapunov is not None
    pert = rep["perturbation"]
    assert pert["n"] == 2 and pert["lags"] == [1, 2, 4, 8, 16]
    # the forget path by hand: δs_p carried by the clean run's a_t alone
    tr, tr2 = a.trace, a.trace_perturbed
    ds = (pooled(tr2, "s") - pooled(tr, "s")).double()
    rolled, by_hand = ds[:, PW], {}
    for lag in range(1, LW - PW):
        rolled = tr["layer0.a"][:, PW + lag].double() * rolled
        by_hand[lag] = (rolled.norm(dim=-1) / ds[:, PW].norm(dim=-1)).mean()
    assert pert["forget_only"] == pytest.approx([float(by_hand[k]) for k in pert["lags"]],
                                                rel=1e-6, abs=1e-14)
    dec = a.decomposition
    scale = max(float(dec["measured"].abs().max()), 1.0)
    assert float((dec["measured"] - dec["forget_path"] - dec["return_path"]).abs().max()) \
        < 1e-9 * scale
    # the bottom layer's input is the same again once the conv's window has passed: what
    # enters its return path then is nothing new (u_t = r_t − a_t r_{t−1})
    r, base = dec["return_path"], float(ds[:, PW].abs().max())
    keep = tr["layer0.a"].double()
    entering = [float((r[:, t] - keep[:, t] * r[:, t - 1]).abs().max()) / base
                for t in range(PW + K, LW)]
    assert max(entering) < 1e-5
    assert float((r[:, PW + 1] - keep[:, PW + 1] * r[:, PW]).abs().max()) / base > 1e-3


def _keep_gap(start_lag: int, types=("recurrent", "attention"), how: str = "a") -> float:
    """max over t of |δs_t − a_t δs_{t−1}| rolled from lag ``start_lag`` after PW, relative
    to |δs| there: the package's own states (its decode path) of the top recurrent layer,
    the clean read-out's a (``how`` "sqrt": a wrong keep √a)."""
    model = gemma(types=types)
    g = torch.Generator().manual_seed(5)
    layers = model.model.layers
    with torch.no_grad():
        x = model.model.embed_tokens(torch.randint(0, V, (B, LW), generator=g)) * D ** 0.5
        xp = x.clone()
        xp[:, PW] += torch.randn(B, D, generator=g)
        pos = torch.arange(LW)[None]
        for layer in layers[:-1]:  # up to the top layer, run as the model runs them
            x, xp = layer(x, pos, None, False), layer(xp, pos, None, False)
        fam = HFRGLRUFamily(layers[-1])
        clean, pert = fam.check(x), fam.check(xp)
        ref_c, ref_p = fam.reference(clean), fam.reference(pert)
    keep = fam.read(clean, ref_c).signals["layer0.a"].double()
    if how == "sqrt":
        keep = keep.sqrt()
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
    assert _keep_gap(K - 1, ("recurrent",)) < 1e-5  # the package's float32 steps
    assert _keep_gap(0, ("recurrent",)) > 1e-3  # the conv still reads the change at lag 1, 2
    assert _keep_gap(K - 1, ("recurrent",), "sqrt") > 1e-2
    # the upper of two recurrent layers reads a changed input at every lag
    assert _keep_gap(K - 1, ("recurrent", "recurrent")) > 1e-3


def test_a_cache_is_refused_in_one_line():
    model = gemma()
    model.config.use_cache = True  # the model then hands its layers a DynamicCache
    with pytest.raises(GatelensError, match="got DynamicCache"), torch.no_grad(), \
            open_cells(model):
        model(torch.zeros(B, T, dtype=torch.long))
    fam = HFRGLRUFamily(model.model.layers[0])
    x = _x()
    inputs, state = fam.split_call((x, torch.arange(T)[None], None, True, object()), {})
    assert inputs is x
    with pytest.raises(GatelensError, match="hf-rglru: a call with a cache"):
        fam.check(inputs, state)
    with pytest.raises(GatelensError, match="inputs must be a float tensor"):
        fam.check(torch.zeros(B, T, dtype=torch.long))


# ---- the trainable stack (--cell hf-rglru) ----------------------------------------------
def _stack():
    from gatelens.families.hf_rglru import RGLRU_RECIPE

    torch.manual_seed(0)
    return RGLRU_RECIPE.build(D, 32, 2, settings=RGLRU_RECIPE.settings)


def test_the_stack_is_the_packages_own_model_without_its_embedding():
    stack = _stack()
    model = transformers.RecurrentGemmaModel(transformers.RecurrentGemmaConfig(
        vocab_size=V, hidden_size=32, num_hidden_layers=2, num_attention_heads=2,
        intermediate_size=96, conv1d_width=4, block_types=("recurrent",), use_cache=False))
    model.layers, model.final_norm = stack.layers, stack.final_norm
    x = torch.randn(B, 10, 32)
    with torch.no_grad():  # the package's model, fed x as its scaled embedding (√d · e)
        want = model(inputs_embeds=x / model.normalizer.to(x.dtype)).last_hidden_state
        assert torch.allclose(stack(x), want, atol=1e-6)
    for layer in stack.layers:  # the package's own init: exp(−2 softplus(Λ')) ~ U(0.81, 0.998)
        u = torch.exp(-2 * F.softplus(layer.temporal_block.rg_lru.recurrent_param.detach()))
        assert float(u.min()) >= 0.81 and float(u.max()) <= 0.999


def test_the_stack_is_one_family_of_its_blocks_and_passes_the_one_step_check():
    stack = _stack()
    model = torch.nn.Sequential(torch.nn.Embedding(V, 32), stack, torch.nn.Linear(32, V))
    lens = gatelens.Lens(model, vocab=VOCAB)
    ((path, fam),) = lens.families.items()  # its blocks are part of it, not opened again
    assert path == "1" and fam.num_layers == 2 and fam.hidden_size == 32
    call = fam.check(torch.randn(B, 12, 32))
    ref = fam.reference(call)
    rows = fam.one_step(call, ref)  # the norms, residuals, MLPs and final norm are links
    assert len(rows) == 2 and max(r.max_scaled_diff_h for r in rows) < 1e-5
    assert ref.extra["step_vs_forward"][1] < 1e-5
    # the free-running float64 stack stays on the package's own decode path
    free = fam.rerun(call).signals["layer1.s"]
    assert float((free - ref.states["layer1.s"]).abs().max()) < 1e-5
    with torch.no_grad():
        fam.float64().final_norm.weight.add_(1e-3)  # the final norm off ((1 + w), w = 0)
    assert fam.one_step(call, ref)[1].max_scaled_diff_h > 1e-5
    with torch.no_grad():
        fam.float64().final_norm.weight.sub_(1e-3)
        fam.float64().layers[1].mlp_block.down_proj.weight.mul_(1.001)  # the top MLP off
    assert fam.one_step(call, ref)[1].max_scaled_diff_h > 1e-5


def test_the_recipe_refuses_a_width_its_heads_do_not_fill():
    from gatelens.training.config import TrainConfig

    with pytest.raises(GatelensError, match="--hidden 24 must be a multiple of 16"):
        TrainConfig(cell="hf-rglru", hidden=24).validate()
    TrainConfig(cell="hf-rglru", hidden=32, layers=2).validate()


# ---- edits (Lens.run) ---------------------------------------------------------------------
def _ids(length: int = 12) -> torch.Tensor:
    return torch.randint(0, V, (B, length), generator=torch.Generator().manual_seed(3))


def _own(model, ids) -> torch.Tensor:
    with torch.no_grad():
        return model(ids, use_cache=False).logits


def test_an_edit_before_is_bitwise_and_a_state_set_to_itself_changes_nothing():
    model, ids, t = gemma(types=("attention", "recurrent")), _ids(), 5
    lens, key, own = gatelens.Lens(model, vocab=VOCAB), "model.layers.1.layer0", \
        _own(model, ids)
    s = lens.run(ids).trace[f"{key}.s"]
    res = lens.run(ids, edits=[gatelens.Set(f"{key}.s", s[:, t], at=t)])
    assert torch.equal(res.output.logits[:, :t], own[:, :t])
    assert (res.output.logits - own).abs().max() < 1e-5
    for edit in (gatelens.Set(f"{key}.a", 1.0, at=t, units=[0, 1]),
                 gatelens.Zero(f"{key}.write", at=t), gatelens.Zero(f"{key}.i", at=t),
                 gatelens.Scale(f"{key}.y", 2.0, at=t)):
        moved = lens.run(ids, edits=[edit])
        assert torch.equal(moved.output.logits[:, :t], own[:, :t]), edit
        assert (moved.output.logits[:, t:] - own[:, t:]).abs().max() > 1e-3, edit
    kept = lens.run(ids, edits=[gatelens.Set(f"{key}.a", 1.0, at=slice(t, None), units=[3])])
    s_kept = kept.trace[f"{key}.s"][:, t - 1:, 3]  # a := 1: no write, the state held
    assert torch.equal(s_kept[:, 1:], s_kept[:, 1:2].expand_as(s_kept[:, 1:]))
    assert (s_kept[:, 1] - s_kept[:, 0]).abs().max() < 1e-6


def test_an_edit_carries_forward_and_this_position_only_does_not():
    t, ids, model = 4, _ids(), gemma(types=("recurrent",))
    lens, key, own = gatelens.Lens(model, vocab=VOCAB), "model.layers.0.layer0.s", \
        _own(model, ids)
    carried = lens.run(ids, edits=[gatelens.Scale(key, 3.0, at=t)]).output.logits
    here = lens.run(ids, edits=[gatelens.Scale(key, 3.0, at=t, carry=False)]).output.logits
    assert (carried[:, t + 1:] - own[:, t + 1:]).abs().max() > 1e-3
    assert (here[:, t] - own[:, t]).abs().max() > 1e-3
    assert (here[:, t + 1:] - own[:, t + 1:]).abs().max() < 1e-5
    assert torch.allclose(here[:, t], carried[:, t])
