"""The Gated DeltaNet family (families/hf_gated_deltanet.py) inside a whole hybrid model.

A small random Qwen3NextForCausalLM (linear attention, full attention, linear attention) is
opened by ``Lens``: only its two Gated DeltaNet layers, each read against an independent
float64 recurrence written here (S_t = α_t S_{t−1} (I − β_t k_t k_tᵀ) + β_t v_t k_tᵀ as
explicit matrices), against the package's own decode path (one token at a time through its
cache) and against its chunked whole-sequence path. The perturbation split's forget path is
the clean run's operators applied as matrices, recomputed here by hand; one layer has no
return path once the convolution's window has passed. Qwen3.5's and OLMo Hybrid's layers
(β up to 2 there) pass the one-step check too.
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
from gatelens.analysis.common import pooled
from gatelens.analysis.perturbation import keep_at
from gatelens.errors import GatelensError
from gatelens.families.hf_gated_deltanet import HFGatedDeltaNetFamily, delta_keep
from gatelens.families.official import scaled_diff
from gatelens.report.json_report import check_report, schema

sys.path.insert(0, str(Path(__file__).parent))  # the shared tiny models (importlib mode)
from official_models import spread_decays  # noqa: E402

V, D, B, T, P = 11, 32, 2, 24, 6
VOCAB = list("abcdefghij ")
TEXT = "abc def ghij jig fed cba " * 40
LINEAR = dict(linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=8,
              linear_value_head_dim=8, linear_conv_kernel_dim=3)
TYPES = ["linear_attention", "full_attention", "linear_attention"]
LW, PW = 24, 6  # the windows Lens analyses and the perturbed position


@pytest.fixture(autouse=True)
def _single_thread(one_thread):
    transformers.utils.logging.set_verbosity_error()
    warnings.filterwarnings("ignore", message=".*fall.*back.*")


def qwen3_next(types=TYPES) -> torch.nn.Module:
    cfg = transformers.Qwen3NextConfig(
        vocab_size=V, hidden_size=D, intermediate_size=2 * D, num_hidden_layers=len(types),
        num_attention_heads=2, num_key_value_heads=1, head_dim=16, num_experts=0,
        layer_types=list(types), **LINEAR)
    torch.manual_seed(0)
    return spread_decays(transformers.Qwen3NextForCausalLM(cfg))


def _x(seed: int = 1, length: int = T) -> torch.Tensor:
    return torch.randn(B, length, D, generator=torch.Generator().manual_seed(seed))


@torch.no_grad()
def independent(mod: torch.nn.Module, x: torch.Tensor) -> dict[str, torch.Tensor]:
    """The Qwen3-Next layer in float64, whole sequence, written out: the conv as F.conv1d,
    the state update as explicit matrices α S (I − β k kᵀ) + β v kᵀ. exp(A_log) is taken in
    float32, as the package takes it."""
    m, x = copy.deepcopy(mod).double(), x.double()
    Hk, Hv, dk, dv, K = m.num_k_heads, m.num_v_heads, m.head_k_dim, m.head_v_dim, \
        m.conv_kernel_size
    q, k, v, z, b, a = m.fix_query_key_value_ordering(m.in_proj_qkvz(x), m.in_proj_ba(x))
    qkv = torch.cat([t.flatten(2) for t in (q, k, v)], dim=-1).transpose(1, 2)  # (B, C, T)
    qkv = F.silu(F.conv1d(qkv, m.conv1d.weight, padding=K - 1, groups=m.conv_dim)
                 [..., : x.shape[1]]).transpose(1, 2)
    q, k, v = qkv.split([Hk * dk, Hk * dk, Hv * dv], dim=-1)
    rep = Hv // Hk
    unit = lambda t: t / torch.sqrt((t * t).sum(-1, keepdim=True) + 1e-6)  # noqa: E731
    q = unit(q.unflatten(-1, (Hk, dk)).repeat_interleave(rep, 2)) / math.sqrt(dk)
    k = unit(k.unflatten(-1, (Hk, dk)).repeat_interleave(rep, 2))  # (B, T, Hv, dk)
    v = v.unflatten(-1, (Hv, dv))
    beta = torch.sigmoid(b)  # (B, T, Hv)
    alpha = torch.exp(-torch.exp(mod.A_log.float()).double() * F.softplus(a + m.dt_bias))
    S = torch.zeros(x.shape[0], Hv, dv, dk, dtype=torch.float64)
    eye = torch.eye(dk, dtype=torch.float64)
    states, outs = [], []
    for t in range(x.shape[1]):
        kt, bt = k[:, t], beta[:, t, :, None, None]
        S = alpha[:, t, :, None, None] * S @ (eye - bt * kt[..., :, None] * kt[..., None, :]) \
            + bt * v[:, t, :, :, None] * kt[..., None, :]
        states.append(S.flatten(1))
        outs.append((S @ q[:, t, :, :, None])[..., 0])  # (B, Hv, dv)
    o = torch.stack(outs, dim=1)  # (B, T, Hv, dv)
    o = o * torch.rsqrt(o.pow(2).mean(-1, keepdim=True) + m.norm.variance_epsilon)
    o = m.norm.weight * o * F.silu(z)
    return {"s": torch.stack(states, dim=1), "alpha": alpha, "beta": beta,
            "k": k.flatten(2), "v": v.flatten(2), "y": m.out_proj(o.flatten(2))}


def _gdn(model):
    return [m for m in model.modules() if type(m).__name__.endswith("GatedDeltaNet")]


# ---- opened inside the whole model ----------------------------------------------------
def test_lens_opens_only_the_gated_deltanet_layers():
    lens = gatelens.Lens(qwen3_next(), vocab=VOCAB)
    assert list(lens.families) == ["model.layers.0.linear_attn", "model.layers.2.linear_attn"]
    fam = lens.families["model.layers.2.linear_attn"]
    assert isinstance(fam, HFGatedDeltaNetFamily) and fam.cell == "gated_deltanet"
    assert fam.names() == ["layer0.alpha", "layer0.beta", "layer0.k", "layer0.v",
                           "layer0.s", "layer0.y"]
    info = fam.describe()
    assert (info["layer_index"], info["hidden"], info["units"]) == (2, 4, "head")
    assert info["left_alone"].startswith("the model's attention")
    assert fam.state_units(0).tolist() == [h for h in range(4) for _ in range(64)]


def test_the_trace_is_the_float64_recurrence_and_the_package_paths():
    mod = _gdn(qwen3_next())[0]
    fam = HFGatedDeltaNetFamily(mod)
    call = fam.check(_x())
    ref = fam.reference(call)
    exact = independent(mod, call.inputs)
    tr = gatelens.trace(mod, call.inputs)
    # the hand cell run free in float64 (the module's weights as they are, in float64)
    fam64 = HFGatedDeltaNetFamily(copy.deepcopy(mod).double())
    free = fam64.rerun(fam64.check(call.inputs.double())).signals
    for name in ("s", "alpha", "beta", "k", "v", "y"):
        assert free[f"layer0.{name}"].dtype == torch.float64
        assert scaled_diff(free[f"layer0.{name}"], exact[name])[1] < 1e-12, name
        assert scaled_diff(tr[f"layer0.{name}"], exact[name])[1] < 1e-5, name
    # the package's decode path (the trajectory) and its chunked forward, against float64
    assert scaled_diff(ref.states["layer0.s"], exact["s"])[1] < 1e-5
    assert scaled_diff(ref.output, exact["y"])[1] < 1e-5
    assert ref.extra["step_vs_forward"][1] < 1e-5 and ref.extra["final_vs_step"][1] < 1e-5
    assert scaled_diff(ref.final[:, None], exact["s"][:, -1:])[1] < 1e-5
    assert float(exact["s"].abs().max()) > 0.1  # the state is not negligible


def test_chunked_and_recurrent_paths_agree_over_several_chunks():
    mod = _gdn(qwen3_next())[0]
    fam = HFGatedDeltaNetFamily(mod)
    call = fam.check(_x(2, length=70))  # past the package's 64-token chunk
    ref = fam.reference(call)
    exact = independent(mod, call.inputs)
    assert ref.extra["step_vs_forward"][1] < 1e-5
    assert scaled_diff(ref.output[:, 64:], exact["y"][:, 64:])[1] < 1e-5
    assert scaled_diff(ref.states["layer0.s"], exact["s"])[1] < 1e-5


def test_one_step_passes_and_a_wrong_weight_fails_it():
    for mod in _gdn(qwen3_next()):
        fam = HFGatedDeltaNetFamily(mod)
        call = fam.check(_x())
        ref = fam.reference(call)
        (row,) = fam.one_step(call, ref)
        assert row.max_scaled_diff_h < 1e-5
        with torch.no_grad():
            fam.float64().dt_bias[1] += 1e-3  # one head's decay off
        assert fam.one_step(call, ref)[0].max_scaled_diff_h > 1e-5


def test_the_dynamics_step_reproduces_the_trajectory():
    fam = HFGatedDeltaNetFamily(_gdn(qwen3_next())[0])
    call = fam.check(_x())
    ref = fam.reference(call)
    (dyn,) = fam.dynamics(call, ref)
    parts = list(dyn.initial)
    for t in range(T):
        parts = dyn.step(dyn.inputs[:, t], parts)
        for got, want in zip(parts, dyn.trajectory, strict=True):
            assert scaled_diff(got[:, None], want[:, t : t + 1])[1] < 1e-5
    assert dyn.size == 2 * 64 + 4 * 64  # (d_conv − 1) × conv channels, then S


# ---- the keep operator and the split ----------------------------------------------------
def test_the_keep_operator_is_the_matrix_product():
    g = torch.Generator().manual_seed(3)
    H, dv, dk = 2, 3, 4
    k = F.normalize(torch.randn(5, H, dk, generator=g, dtype=torch.float64), dim=-1)
    alpha, beta = torch.rand(5, H, generator=g).double(), torch.rand(5, H, generator=g).double()
    S = torch.randn(5, H, dv, dk, generator=g, dtype=torch.float64)
    eye = torch.eye(dk, dtype=torch.float64)
    kkT = k[..., :, None] * k[..., None, :]
    want = alpha[..., None, None] * S @ (eye - beta[..., None, None] * kkT)
    got = delta_keep({"alpha": alpha, "beta": beta, "k": k.flatten(1)}, S.flatten(1))
    assert torch.allclose(got, want.flatten(1), rtol=0, atol=1e-14)


def _keep_gap(mod, start_lag: int, how: str = "operator") -> float:
    """max over t of |δS_t − A_t(δS_{t−1})| rolled from lag ``start_lag`` after P, relative
    to |δS| there, the module's own states (its decode path) and the clean read-out's α,
    β, k (``how``: "operator", "sqrt" (a wrong decay) or "elementwise" (α alone))."""
    fam = HFGatedDeltaNetFamily(mod)
    x = _x(4)
    xp = x.clone()
    xp[:, P] += torch.randn(B, D, generator=torch.Generator().manual_seed(5))
    clean, pert = fam.check(x), fam.check(xp)
    ref_c, ref_p = fam.reference(clean), fam.reference(pert)
    sig = fam.read(clean, ref_c).signals
    ds = (ref_p.states["layer0.s"] - ref_c.states["layer0.s"]).double()
    rolled = ds[:, P + start_lag]
    norm = rolled.abs().amax(dim=-1)
    assert float(norm.min()) > 0
    worst = 0.0
    for t in range(P + start_lag + 1, T):
        step = {n: sig[f"layer0.{n}"][:, t].double() for n in ("alpha", "beta", "k")}
        if how == "sqrt":
            step["alpha"] = step["alpha"].sqrt()
        if how == "elementwise":
            rolled = step["alpha"].repeat_interleave(64, dim=-1) * rolled
        else:
            rolled = delta_keep(step, rolled)
        worst = max(worst, float(((ds[:, t] - rolled).abs().amax(-1) / norm).max()))
    return worst


def test_one_layer_has_no_return_path_once_the_window_has_passed():
    mod = _gdn(qwen3_next())[0]
    K = mod.conv_kernel_size
    assert HFGatedDeltaNetFamily(mod).input_window() == K == 3
    assert _keep_gap(mod, K - 1) < 2e-5  # the package's float32 steps
    assert _keep_gap(mod, 0) > 1e-3  # the conv still reads the changed input at lag 1, 2
    assert _keep_gap(mod, K - 1, "sqrt") > 1e-2
    assert _keep_gap(mod, K - 1, "elementwise") > 1e-2  # the k kᵀ term matters


def test_analyze_measures_each_layer_and_the_split_is_the_operators():
    # (writing the page is the report's own business: tests/test_official_lens.py)
    result = gatelens.Lens(qwen3_next(), vocab=VOCAB).analyze(
        TEXT, windows=2, length=LW, perturb_pos=PW, exponents=1)
    assert list(result.analyses) == ["model.layers.0.linear_attn", "model.layers.2.linear_attn"]
    returns = {}
    for path, a in result.analyses.items():
        rep = a.report
        assert rep["lyapunov"] is not None and a.lyapunov is not None
        check_report(rep)
        jsonschema.validate(rep, schema())
        assert rep["model"]["family"] == "hf-gated-deltanet" and rep["model"]["path"] == path
        assert rep["verification"]["passed"] is True
        assert rep["units"]["gate"] == "alpha" and rep["units"]["n_units"] == 4
        assert all(0 < rep["gates"]["alpha"][q] < 1 for q in ("p5", "p50", "p95"))
        assert all(math.isfinite(v) for v in rep["units"]["half_life"].values())
        pert = rep["perturbation"]
        assert pert["n"] == 2 and pert["lags"] == [1, 2, 4, 8, 16]
        # the forget path by hand: the clean run's operators as explicit matrices
        tr, tr2 = a.trace, a.trace_perturbed
        ds = (pooled(tr2, "s") - pooled(tr, "s")).double()
        eye = torch.eye(8, dtype=torch.float64)
        rolled, by_hand = ds[:, PW].reshape(2, 4, 8, 8), {}
        for lag in range(1, LW - PW):
            t = PW + lag
            al, be = tr["layer0.alpha"][:, t].double(), tr["layer0.beta"][:, t].double()
            kk = tr["layer0.k"][:, t].double().reshape(2, 4, 8)
            rolled = al[..., None, None] * rolled @ (
                eye - be[..., None, None] * kk[..., :, None] * kk[..., None, :])
            by_hand[lag] = (rolled.flatten(1).norm(dim=-1) / ds[:, PW].norm(dim=-1)).mean()
        assert pert["forget_only"] == pytest.approx([float(by_hand[k]) for k in pert["lags"]],
                                                    rel=1e-6, abs=1e-14)
        dec = a.decomposition
        scale = max(float(dec["measured"].abs().max()), 1.0)
        assert float((dec["measured"] - dec["forget_path"] - dec["return_path"]).abs().max()) \
            < 1e-9 * scale
        # what enters the return path at each step past the conv's window (lag ≥ 3):
        # u_t = r_t − A_t(r_{t−1}), relative to |δs_p|
        r, base = dec["return_path"], float(ds[:, PW].abs().max())
        returns[path] = max(float((r[:, t] - keep_at(tr, t)(r[:, t - 1])).abs().max()) / base
                            for t in range(PW + 3, LW))
    # the bottom layer's input is the same again after the conv's window (its return path
    # is then carried by the operators alone); the top layer's differs at every lag (the
    # attention layer between reads the changed token)
    assert returns["model.layers.0.linear_attn"] < 1e-5
    assert returns["model.layers.2.linear_attn"] > 1e-3


# ---- the trainable stack (--cell hf-gated-deltanet) --------------------------------------
def test_the_stack_is_one_family_of_its_layers_and_passes_the_one_step_check():
    from gatelens.families.hf_gated_deltanet import GDN_RECIPE, GatedDeltaNetStack

    torch.manual_seed(0)
    stack = spread_decays(GDN_RECIPE.build(D, D, 2, settings=GDN_RECIPE.settings))
    assert isinstance(stack, GatedDeltaNetStack)
    model = torch.nn.Sequential(torch.nn.Embedding(V, D), stack, torch.nn.Linear(D, V))
    lens = gatelens.Lens(model, vocab=VOCAB)
    ((path, fam),) = lens.families.items()  # its layers are part of it, not opened again
    assert path == "1" and fam.num_layers == 2 and fam.hidden_size == 2  # heads of 16
    assert fam.names()[-6:] == ["layer1.alpha", "layer1.beta", "layer1.k", "layer1.v",
                                "layer1.s", "layer1.y"]
    call = fam.check(_x())
    ref = fam.reference(call)
    rows = fam.one_step(call, ref)  # the norms, residuals and final norm are links too
    assert len(rows) == 2 and max(r.max_scaled_diff_h for r in rows) < 1e-5
    assert ref.extra["step_vs_forward"][1] < 1e-5 and ref.extra["final_vs_step"][1] < 1e-5
    with torch.no_grad():
        fam.float64().norms[1].weight.mul_(1.001)  # the top block's norm off
    assert fam.one_step(call, ref)[1].max_scaled_diff_h > 1e-5


# ---- refusals ------------------------------------------------------------------------------
def test_a_cache_or_a_padding_mask_is_refused_in_one_line():
    mod = _gdn(qwen3_next())[0]
    fam = HFGatedDeltaNetFamily(mod)
    x = _x()
    mask = torch.ones(B, T, dtype=torch.long)
    assert fam.split_call((), {"hidden_states": x, "attention_mask": mask}) == (x, None)
    mask[0, :3] = 0
    inputs, state = fam.split_call((), {"hidden_states": x, "attention_mask": mask})
    with pytest.raises(GatelensError, match="padding mask passed to Qwen3NextGatedDeltaNet"):
        fam.check(inputs, state)
    with pytest.raises(GatelensError, match="inputs must be a float tensor"):
        fam.check(torch.zeros(B, T, dtype=torch.long))


# ---- the same layer in Qwen3.5 and OLMo Hybrid ----------------------------------------
def _qwen3_5():
    cfg = transformers.Qwen3_5TextConfig(
        vocab_size=V, hidden_size=D, intermediate_size=2 * D, num_hidden_layers=2,
        num_attention_heads=2, num_key_value_heads=1, head_dim=16,
        layer_types=["linear_attention", "full_attention"], **LINEAR)
    return transformers.Qwen3_5ForCausalLM(cfg)


def _qwen3_5_moe():
    cfg = transformers.Qwen3_5MoeTextConfig(
        vocab_size=V, hidden_size=D, num_hidden_layers=2, num_attention_heads=2,
        num_key_value_heads=1, head_dim=16, num_experts=2, num_experts_per_tok=1,
        moe_intermediate_size=D, shared_expert_intermediate_size=D,
        layer_types=["linear_attention", "full_attention"], **LINEAR)
    return transformers.Qwen3_5MoeForCausalLM(cfg)


def _olmo_hybrid():
    cfg = transformers.OlmoHybridConfig(
        vocab_size=V, hidden_size=D, intermediate_size=2 * D, num_hidden_layers=2,
        num_attention_heads=2, num_key_value_heads=1, pad_token_id=0,
        layer_types=["linear_attention", "full_attention"], **LINEAR)
    return transformers.OlmoHybridForCausalLM(cfg)


@pytest.mark.parametrize("build,cell", [(_qwen3_5, "gated_deltanet"),
                                        (_qwen3_5_moe, "gated_deltanet"),
                                        (_olmo_hybrid, "gated_deltanet_neg")])
def test_qwen3_5_and_olmo_hybrid_layers_pass_the_one_step_check(build, cell):
    # Qwen3.5-MoE's layer is Qwen3.5's; the MoE blocks around it are left alone
    torch.manual_seed(0)
    model = spread_decays(build())
    lens = gatelens.Lens(model, vocab=VOCAB)
    ((path, fam),) = lens.families.items()
    assert path == "model.layers.0.linear_attn" and fam.cell == cell
    call = fam.check(_x())
    ref = fam.reference(call)
    assert fam.one_step(call, ref)[0].max_scaled_diff_h < 1e-5
    assert ref.extra["step_vs_forward"][1] < 1e-5
    beta = fam.read(call, ref).signals["layer0.beta"]
    assert float(beta.max()) > (1.0 if cell.endswith("neg") else 0.5)  # 2σ(·) in OLMo's


def test_the_recipe_refuses_a_width_its_heads_do_not_fill():
    from gatelens.training.config import TrainConfig

    with pytest.raises(GatelensError, match="--hidden 24 must be a multiple of 16"):
        TrainConfig(cell="hf-gated-deltanet", hidden=24).validate()
    TrainConfig(cell="hf-gated-deltanet", hidden=32, layers=2).validate()


# ---- edits (Lens.run) ---------------------------------------------------------------------
EDIT_KEY = "model.layers.1.linear_attn.layer0"  # the Gated DeltaNet layer on top


def _edit_model(types=("full_attention", "linear_attention")) -> torch.nn.Module:
    """Attention, then a Gated DeltaNet layer on top: the cache's state edit after token t
    is then the whole edit (a layer above would read position t's edited output)."""
    return qwen3_next(list(types))


def _ids(length: int = 12) -> torch.Tensor:
    return torch.randint(0, V, (B, length), generator=torch.Generator().manual_seed(3))


def test_an_edit_before_is_bitwise_and_a_state_set_to_itself_changes_nothing():
    model, ids, t = _edit_model(), _ids(), 5
    lens = gatelens.Lens(model, vocab=VOCAB)
    with torch.no_grad():
        own = model(ids, use_cache=False).logits
    s = lens.run(ids).trace[f"{EDIT_KEY}.s"]
    res = lens.run(ids, edits=[gatelens.Set(f"{EDIT_KEY}.s", s[:, t], at=t)])
    assert torch.equal(res.output.logits[:, :t], own[:, :t])
    assert (res.output.logits - own).abs().max() < 1e-5
    for name, edit in (("alpha", gatelens.Set(f"{EDIT_KEY}.alpha", 1.0, at=t, units=[0])),
                       ("beta", gatelens.Zero(f"{EDIT_KEY}.beta", at=t)),
                       ("y", gatelens.Scale(f"{EDIT_KEY}.y", 2.0, at=t))):
        moved = lens.run(ids, edits=[edit])
        assert torch.equal(moved.output.logits[:, :t], own[:, :t]), name
        assert (moved.output.logits[:, t:] - own[:, t:]).abs().max() > 1e-3, name
    cut = lens.run(ids, edits=[gatelens.Zero(f"{EDIT_KEY}.beta", at=t)]).trace
    assert torch.equal(cut[f"{EDIT_KEY}.beta"][:, t], torch.zeros(B, 4))


def test_a_state_edit_is_the_models_own_decode_from_the_edited_state():
    """Zero the layer's state after token t: the whole model's own cached decode, its
    cache's state zeroed after token t, gives the same later logits."""
    model, ids, t = _edit_model(), _ids(), 5
    res = gatelens.Lens(model, vocab=VOCAB).run(
        ids, edits=[gatelens.Zero(f"{EDIT_KEY}.s", at=t)])
    cache, got = None, []
    with torch.no_grad():
        for j in range(ids.shape[1]):
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
    print(f"gdn zero-state vs cached decode {later:.2e}, moved {moved:.2e}")
    assert later < 1e-5 and moved > 1e-2, (later, moved)


def test_an_edit_carries_forward_and_this_position_only_does_not():
    model, ids, t = _edit_model(["linear_attention"]), _ids(), 4
    lens, key = gatelens.Lens(model, vocab=VOCAB), "model.layers.0.linear_attn.layer0.s"
    with torch.no_grad():
        own = model(ids, use_cache=False).logits
    carried = lens.run(ids, edits=[gatelens.Scale(key, 3.0, at=t)]).output.logits
    here = lens.run(ids, edits=[gatelens.Scale(key, 3.0, at=t, carry=False)]).output.logits
    assert (carried[:, t + 1:] - own[:, t + 1:]).abs().max() > 1e-3
    assert (here[:, t] - own[:, t]).abs().max() > 1e-3
    assert (here[:, t + 1:] - own[:, t + 1:]).abs().max() < 1e-5
    assert torch.allclose(here[:, t], carried[:, t])


@pytest.mark.parametrize("gate", ["alpha", "beta"])
def test_at_real_width_a_gate_off_by_a_tenth_of_a_percent_fails(gate, monkeypatch):
    """Qwen3.5-0.8B's Gated DeltaNet layer shape (width 1024, 16 heads of 128 keys and 128
    values): the read-out passes, and with its decay α or its write strength β off by 1e-3
    relative it fails, although the one-step figure is judged against max(1, the unit's
    largest |value|) and the layer's outputs here are small (docs/methods.md)."""
    torch.manual_seed(0)
    cfg = transformers.Qwen3_5TextConfig(
        vocab_size=8, hidden_size=1024, num_hidden_layers=1, linear_num_key_heads=16,
        linear_num_value_heads=16, linear_key_head_dim=128, linear_value_head_dim=128,
        linear_conv_kernel_dim=4, layer_types=["linear_attention"])
    layer = transformers.models.qwen3_5.modeling_qwen3_5.Qwen3_5GatedDeltaNet(cfg, 0).eval()
    fam = HFGatedDeltaNetFamily(layer)
    call = fam.check(torch.randn(2, 64, 1024, generator=torch.Generator().manual_seed(1)))
    ref = fam.reference(call)
    assert fam.one_step(call, ref)[0].max_scaled_diff_h < 1e-6  # measured 2.8e-7
    right = HFGatedDeltaNetFamily._inputs

    def wrong(self, m, u, xc):
        signals = right(self, m, u, xc)
        return {**signals, gate: signals[gate] * 1.001}

    monkeypatch.setattr(HFGatedDeltaNetFamily, "_inputs", wrong)
    assert fam.one_step(call, ref)[0].max_scaled_diff_h > 1e-4  # α 1.6e-4, β 4.5e-4
