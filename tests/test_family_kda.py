"""The KDA family (families/hf_kda.py) inside a whole Kimi-Linear model.

A small random KimiLinearForCausalLM (KDA, MLA attention, KDA; MoE blocks after the upper
two) is opened by ``Lens``: only its two KDA layers, each read against an independent
float64 recurrence written here (S_t = S_{t−1} Diag(α_t) (I − β_t k_t k_tᵀ) + β_t v_t k_tᵀ
as explicit matrices, α one per key channel), against the package's own decode path (one
token at a time through its cache), against its chunked whole-sequence path and against
the state that path leaves in the cache (Sᵀ there). The perturbation split's forget path
is the clean run's operators applied as matrices, recomputed here by hand; one layer has no
return path once the convolution's window has passed.
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
from gatelens.families.hf_gated_deltanet import delta_keep
from gatelens.families.hf_kda import HFKDAFamily, kda_keep
from gatelens.families.official import scaled_diff
from gatelens.report.json_report import check_report, schema
from gatelens.report.markdown import render_markdown

sys.path.insert(0, str(Path(__file__).parent))  # the shared tiny models (importlib mode)
from official_models import spread_decays  # noqa: E402

V, D, B, T, P = 11, 32, 2, 24, 6
H, DH, K = 2, 8, 3  # KDA heads, head size (keys and values), conv taps
VOCAB = list("abcdefghij ")
TEXT = "abc def ghij jig fed cba " * 40
TYPES = ["linear_attention", "full_attention", "linear_attention"]
LW, PW = 24, 6  # the windows Lens analyses and the perturbed position


@pytest.fixture(autouse=True)
def _single_thread(one_thread):
    transformers.utils.logging.set_verbosity_error()
    warnings.filterwarnings("ignore", message=".*fall.*back.*")


def kimi(types=TYPES) -> torch.nn.Module:
    cfg = transformers.KimiLinearConfig(
        vocab_size=V, hidden_size=D, intermediate_size=2 * D, moe_intermediate_size=16,
        num_hidden_layers=len(types), num_attention_heads=2, num_key_value_heads=2,
        kv_lora_rank=8, qk_rope_head_dim=4, qk_nope_head_dim=8, v_head_dim=8,
        num_experts=4, num_experts_per_tok=2, linear_num_heads=H, linear_head_dim=DH,
        linear_conv_kernel_dim=K, layer_types=list(types),
        mlp_layer_types=["dense"] + ["sparse"] * (len(types) - 1), pad_token_id=0)
    torch.manual_seed(0)
    return spread_decays(transformers.KimiLinearForCausalLM(cfg))


def _x(seed: int = 1, length: int = T) -> torch.Tensor:
    return torch.randn(B, length, D, generator=torch.Generator().manual_seed(seed))


@torch.no_grad()
def independent(mod: torch.nn.Module, x: torch.Tensor) -> dict[str, torch.Tensor]:
    """The KDA layer in float64, whole sequence, written out: the conv as F.conv1d, the
    state update as explicit matrices S Diag(α) (I − β k kᵀ) + β v kᵀ. exp(A_log) is taken
    in float32, as the package takes it."""
    m, x = copy.deepcopy(mod).double(), x.double()
    qkv = torch.cat([m.q_proj(x), m.k_proj(x), m.v_proj(x)], dim=-1).transpose(1, 2)
    qkv = F.silu(F.conv1d(qkv, m.conv1d.weight, padding=K - 1, groups=3 * H * DH)
                 [..., : x.shape[1]]).transpose(1, 2)
    q, k, v = (t.unflatten(-1, (H, DH)) for t in qkv.split(H * DH, dim=-1))  # (B, T, H, d)
    unit = lambda t: t / torch.sqrt((t * t).sum(-1, keepdim=True) + 1e-6)  # noqa: E731
    q, k = unit(q) / math.sqrt(DH), unit(k)
    beta = torch.sigmoid(m.b_proj(x))  # (B, T, H)
    fg = m.forget_gate
    rate = torch.exp(mod.forget_gate.A_log.float()).double().reshape(H, 1)
    g = -rate * F.softplus((fg.f_b_proj(fg.f_a_proj(x)) + fg.dt_bias).unflatten(-1, (H, DH)))
    alpha = torch.exp(g)  # (B, T, H, d_k)
    S = torch.zeros(x.shape[0], H, DH, DH, dtype=torch.float64)  # (d_v × d_k) per head
    eye = torch.eye(DH, dtype=torch.float64)
    states, outs = [], []
    for t in range(x.shape[1]):
        kt, bt = k[:, t], beta[:, t, :, None, None]
        S = S @ torch.diag_embed(alpha[:, t]) @ (eye - bt * kt[..., :, None] * kt[..., None, :]) \
            + bt * v[:, t, :, :, None] * kt[..., None, :]
        states.append(S.flatten(1))
        outs.append((S @ q[:, t, :, :, None])[..., 0])  # (B, H, d_v)
    o = torch.stack(outs, dim=1)  # (B, T, H, d_v)
    o = o * torch.rsqrt(o.pow(2).mean(-1, keepdim=True) + m.o_norm.variance_epsilon)
    o = m.o_norm.weight * o * torch.sigmoid(m.g_b_proj(m.g_a_proj(x)).unflatten(-1, (H, DH)))
    return {"s": torch.stack(states, dim=1), "alpha": alpha.flatten(2), "beta": beta,
            "k": k.flatten(2), "v": v.flatten(2), "y": m.o_proj(o.flatten(2))}


def _kda(model):
    return [m for m in model.modules() if type(m).__name__ == "KimiLinearDeltaAttention"]


# ---- opened inside the whole model ----------------------------------------------------
def test_lens_opens_only_the_kda_layers():
    model = kimi()
    lens = gatelens.Lens(model, vocab=VOCAB)
    assert list(lens.families) == ["model.layers.0.self_attn", "model.layers.2.self_attn"]
    assert type(model.model.layers[2].mlp).__name__ == "KimiLinearMoE"  # left alone
    fam = lens.families["model.layers.2.self_attn"]
    assert isinstance(fam, HFKDAFamily) and fam.cell == "kda" and fam.name == "hf-kda"
    assert fam.names() == ["layer0.alpha", "layer0.beta", "layer0.k", "layer0.v",
                           "layer0.s", "layer0.y"]
    info = fam.describe()
    assert (info["layer_index"], info["hidden"], info["units"]) == (2, H * DH, "channel")
    assert info["left_alone"].startswith("the model's MLA attention")
    # coordinate (h, i, j) of S belongs to key channel h·d + j
    units = fam.state_units(0).view(H, DH, DH)
    assert units[1, 5].tolist() == list(range(DH, 2 * DH)) and units[0, :, 3].eq(3).all()


def test_the_trace_is_the_float64_recurrence_and_the_package_paths():
    mod = _kda(kimi())[0]
    fam = HFKDAFamily(mod)
    call = fam.check(_x())
    ref = fam.reference(call)
    exact = independent(mod, call.inputs)
    tr = gatelens.trace(mod, call.inputs)
    # the hand cell run free in float64 (the module's weights as they are, in float64)
    fam64 = HFKDAFamily(copy.deepcopy(mod).double())
    free = fam64.rerun(fam64.check(call.inputs.double())).signals
    for name in ("s", "alpha", "beta", "k", "v", "y"):
        assert free[f"layer0.{name}"].dtype == torch.float64
        assert scaled_diff(free[f"layer0.{name}"], exact[name])[1] < 1e-12, name
        assert scaled_diff(tr[f"layer0.{name}"], exact[name])[1] < 1e-5, name
    # the package's decode path (the trajectory) and its chunked forward, against float64
    assert scaled_diff(ref.states["layer0.s"], exact["s"])[1] < 1e-5
    assert scaled_diff(tr["layer0.s"], ref.states["layer0.s"])[1] < 1e-5
    assert scaled_diff(ref.output, exact["y"])[1] < 1e-5
    assert ref.extra["step_vs_forward"][1] < 1e-5 and ref.extra["final_vs_step"][1] < 1e-5
    assert scaled_diff(ref.final[:, None], exact["s"][:, -1:])[1] < 1e-5
    assert float(exact["s"].abs().max()) > 0.1  # the state is not negligible
    # the decay is one per key channel: it differs within each head
    alpha = tr["layer0.alpha"].view(B, T, H, DH)
    assert float(alpha.std(dim=-1).min()) > 1e-3


def test_the_final_state_is_the_cache_s_transposed():
    from transformers.cache_utils import Cache, LinearAttentionLayer

    mod = _kda(kimi())[1]
    x = _x(3)
    cache = Cache(layers=[LinearAttentionLayer() for _ in range(3)])
    with torch.no_grad():
        mod(hidden_states=x, cache_params=cache)  # the chunked prefill
    held = cache.layers[2].recurrent_states[0]  # (B, H, d_k, d_v): Sᵀ
    assert held.shape == (B, H, DH, DH) and held.dtype == torch.float32
    exact = independent(mod, x)["s"][:, -1].view(B, H, DH, DH)
    assert scaled_diff(held.transpose(-1, -2).flatten(1)[:, None], exact.flatten(1)[:, None]
                       )[1] < 1e-5
    assert scaled_diff(held.flatten(1)[:, None], exact.flatten(1)[:, None])[1] > 1e-2


def test_a_float64_model_still_steps_in_float32():
    # the package casts g, the delta rule and the gated norm to float32: a float64 model's
    # own paths are judged at float32's rounding; the hand cell is float64 throughout
    mod = copy.deepcopy(_kda(kimi())[0]).double()
    fam = HFKDAFamily(mod)
    call = fam.check(_x().double())
    ref = fam.reference(call)
    exact = independent(mod, call.inputs)
    gap = scaled_diff(ref.states["layer0.s"], exact["s"])[1]
    assert 1e-10 < gap < 1e-5
    assert fam.one_step(call, ref)[0].max_scaled_diff_h < 1e-5


def test_chunked_and_recurrent_paths_agree_over_several_chunks():
    mod = _kda(kimi())[0]
    fam = HFKDAFamily(mod)
    call = fam.check(_x(2, length=70))  # past the package's 64-token chunk
    ref = fam.reference(call)
    exact = independent(mod, call.inputs)
    assert ref.extra["step_vs_forward"][1] < 1e-5 and ref.extra["final_vs_step"][1] < 1e-5
    assert scaled_diff(ref.output[:, 64:], exact["y"][:, 64:])[1] < 1e-5
    assert scaled_diff(ref.states["layer0.s"], exact["s"])[1] < 1e-5


@pytest.mark.parametrize("param,where", [
    ("forget_gate.dt_bias", 3),  # one key channel's decay
    ("forget_gate.A_log", None), ("b_proj.weight", None), ("conv1d.weight", None),
    ("q_proj.weight", None), ("g_b_proj.weight", None), ("o_norm.weight", None)])
def test_one_step_passes_and_a_parameter_off_by_a_tenth_of_a_percent_fails_it(param, where):
    mod = _kda(kimi())[1]
    fam = HFKDAFamily(mod)
    call = fam.check(_x())
    ref = fam.reference(call)
    assert fam.one_step(call, ref)[0].max_scaled_diff_h < 1e-5
    with torch.no_grad():
        p = fam.float64().get_parameter(param)
        (p if where is None else p[where : where + 1]).mul_(1.001)
    assert fam.one_step(call, ref)[0].max_scaled_diff_h > 1e-5


def test_the_dynamics_step_reproduces_the_trajectory():
    fam = HFKDAFamily(_kda(kimi())[0])
    call = fam.check(_x())
    ref = fam.reference(call)
    (dyn,) = fam.dynamics(call, ref)
    parts = list(dyn.initial)
    for t in range(T):
        parts = dyn.step(dyn.inputs[:, t], parts)
        for got, want in zip(parts, dyn.trajectory, strict=True):
            assert scaled_diff(got[:, None], want[:, t : t + 1])[1] < 1e-5
    assert dyn.size == (K - 1) * 3 * H * DH + H * DH * DH  # the conv window, then S


# ---- the keep operator and the split ----------------------------------------------------
def test_the_keep_operator_is_the_matrix_product():
    g = torch.Generator().manual_seed(3)
    n, dv, dk = 5, 3, 4
    k = F.normalize(torch.randn(n, H, dk, generator=g, dtype=torch.float64), dim=-1)
    alpha = torch.rand(n, H, dk, generator=g).double()
    beta = torch.rand(n, H, generator=g).double()
    S = torch.randn(n, H, dv, dk, generator=g, dtype=torch.float64)
    eye = torch.eye(dk, dtype=torch.float64)
    kkT = k[..., :, None] * k[..., None, :]
    want = S @ torch.diag_embed(alpha) @ (eye - beta[..., None, None] * kkT)
    sig = {"alpha": alpha.flatten(1), "beta": beta, "k": k.flatten(1)}
    got = kda_keep(sig, S.flatten(1))
    assert torch.allclose(got, want.flatten(1), rtol=0, atol=1e-14)
    # not the erasure before the decay, Diag(α) (I − β k kᵀ) in the other order
    other = S @ (eye - beta[..., None, None] * kkT) @ torch.diag_embed(alpha)
    assert float((got - other.flatten(1)).abs().max()) > 1e-2
    # with one α in every channel of a head it is Gated DeltaNet's operator
    same = {**sig, "alpha": alpha[..., :1].expand(n, H, dk).flatten(1)}
    gdn = delta_keep({**sig, "alpha": alpha[..., 0]}, S.flatten(1))
    assert torch.allclose(kda_keep(same, S.flatten(1)), gdn, rtol=0, atol=1e-14)


def _keep_gap(mod, start_lag: int, how: str = "operator") -> float:
    """max over t of |δS_t − A_t(δS_{t−1})| rolled from lag ``start_lag`` after P, relative
    to |δS| there, the module's own states (its decode path) and the clean read-out's α,
    β, k (``how``: "operator", "sqrt" (a wrong decay), "head" (each head's mean α: Gated
    DeltaNet's per-head decay) or "elementwise" (α alone, no erasure))."""
    fam = HFKDAFamily(mod)
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
    units = fam.state_units(0)
    worst = 0.0
    for t in range(P + start_lag + 1, T):
        step = {n: sig[f"layer0.{n}"][:, t].double() for n in ("alpha", "beta", "k")}
        if how == "sqrt":
            step["alpha"] = step["alpha"].sqrt()
        if how == "head":
            step["alpha"] = step["alpha"].view(B, H, DH).mean(-1, keepdim=True).expand(
                B, H, DH).flatten(1)
        if how == "elementwise":
            rolled = step["alpha"][:, units] * rolled
        else:
            rolled = kda_keep(step, rolled)
        worst = max(worst, float(((ds[:, t] - rolled).abs().amax(-1) / norm).max()))
    return worst


def test_one_layer_has_no_return_path_once_the_window_has_passed():
    mod = _kda(kimi())[0]
    assert HFKDAFamily(mod).input_window() == K
    assert _keep_gap(mod, K - 1) < 2e-5  # the package's float32 steps
    assert _keep_gap(mod, 0) > 1e-3  # the conv still reads the changed input at lag 1, 2
    assert _keep_gap(mod, K - 1, "sqrt") > 1e-2
    assert _keep_gap(mod, K - 1, "head") > 1e-2  # the decay is per channel, not per head
    assert _keep_gap(mod, K - 1, "elementwise") > 1e-2  # the k kᵀ term matters


def test_analyze_measures_each_layer_and_the_split_is_the_operators():
    result = gatelens.Lens(kimi(), vocab=VOCAB).analyze(
        TEXT, windows=2, length=LW, perturb_pos=PW, exponents=1)
    assert list(result.analyses) == ["model.layers.0.self_attn", "model.layers.2.self_attn"]
    returns = {}
    for path, a in result.analyses.items():
        rep = a.report
        assert rep["lyapunov"] is not None and a.lyapunov is not None
        check_report(rep)
        jsonschema.validate(rep, schema())
        assert rep["model"]["family"] == "hf-kda" and rep["model"]["path"] == path
        assert rep["model"]["layer_index"] == int(path.split(".")[2])
        assert "MoE" in rep["model"]["left_alone"] and rep["model"]["heads"] == H
        # and the pages say so, report.md for each layer and index.html once
        assert f"\nLeft alone: {rep['model']['left_alone']}.\n" in render_markdown(rep)
        assert result.index_html.count("<p>Left alone: the model's MLA attention") == 1
        assert rep["verification"]["passed"] is True
        assert rep["units"]["gate"] == "alpha" and rep["units"]["n_units"] == H * DH
        assert all(0 < rep["gates"]["alpha"][q] < 1 for q in ("p5", "p50", "p95"))
        assert all(math.isfinite(v) for v in rep["units"]["half_life"].values())
        pert = rep["perturbation"]
        assert pert["n"] == 2 and pert["lags"] == [1, 2, 4, 8, 16]
        # the forget path by hand: the clean run's operators as explicit matrices
        tr, tr2 = a.trace, a.trace_perturbed
        ds = (pooled(tr2, "s") - pooled(tr, "s")).double()
        eye = torch.eye(DH, dtype=torch.float64)
        rolled, by_hand = ds[:, PW].reshape(2, H, DH, DH), {}
        for lag in range(1, LW - PW):
            t = PW + lag
            al = tr["layer0.alpha"][:, t].double().reshape(2, H, DH)
            be = tr["layer0.beta"][:, t].double()
            kk = tr["layer0.k"][:, t].double().reshape(2, H, DH)
            rolled = rolled @ torch.diag_embed(al) @ (
                eye - be[..., None, None] * kk[..., :, None] * kk[..., None, :])
            by_hand[lag] = (rolled.flatten(1).norm(dim=-1) / ds[:, PW].norm(dim=-1)).mean()
        assert pert["forget_only"] == pytest.approx([float(by_hand[k]) for k in pert["lags"]],
                                                    rel=1e-6, abs=1e-14)
        dec = a.decomposition
        scale = max(float(dec["measured"].abs().max()), 1.0)
        assert float((dec["measured"] - dec["forget_path"] - dec["return_path"]).abs().max()) \
            < 1e-9 * scale
        # what enters the return path at each step past the conv's window (lag ≥ 3)
        r, base = dec["return_path"], float(ds[:, PW].abs().max())
        returns[path] = max(float((r[:, t] - keep_at(tr, t)(r[:, t - 1])).abs().max()) / base
                            for t in range(PW + 3, LW))
    # the bottom layer's input is the same again after the conv's window; the top layer's
    # differs at every lag (the MLA attention layer between reads the changed token)
    assert returns["model.layers.0.self_attn"] < 1e-5
    assert returns["model.layers.2.self_attn"] > 1e-3


def test_a_cache_or_a_padding_mask_is_refused_in_one_line():
    from gatelens.errors import GatelensError

    fam = HFKDAFamily(_kda(kimi())[0])
    x = _x()
    mask = torch.ones(B, T, dtype=torch.long)
    mask[0, :3] = 0
    inputs, state = fam.split_call((), {"hidden_states": x, "attention_mask": mask})
    with pytest.raises(GatelensError, match="padding mask passed to KimiLinearDeltaAttention"):
        fam.check(inputs, state)


# ---- edits (Lens.run) ---------------------------------------------------------------------
EDIT_KEY = "model.layers.1.self_attn.layer0"  # the KDA layer on top


def _ids(length: int = 12) -> torch.Tensor:
    return torch.randint(0, V, (B, length), generator=torch.Generator().manual_seed(3))


def _own(model, ids) -> torch.Tensor:
    with torch.no_grad():
        return model(ids, use_cache=False).logits


def test_an_edit_before_is_bitwise_and_a_state_set_to_itself_changes_nothing():
    model, ids, t = kimi(["full_attention", "linear_attention"]), _ids(), 5
    lens, own = gatelens.Lens(model, vocab=VOCAB), _own(model, ids)
    s = lens.run(ids).trace[f"{EDIT_KEY}.s"]
    res = lens.run(ids, edits=[gatelens.Set(f"{EDIT_KEY}.s", s[:, t], at=t)])
    assert torch.equal(res.output.logits[:, :t], own[:, :t])
    assert (res.output.logits - own).abs().max() < 1e-5
    for edit in (gatelens.Set(f"{EDIT_KEY}.alpha", 1.0, at=t, units=[0, 1]),
                 gatelens.Zero(f"{EDIT_KEY}.beta", at=t),
                 gatelens.Scale(f"{EDIT_KEY}.y", 2.0, at=t)):
        moved = lens.run(ids, edits=[edit]).output.logits
        assert torch.equal(moved[:, :t], own[:, :t]), edit
        assert (moved[:, t:] - own[:, t:]).abs().max() > 1e-3, edit


def test_a_state_edit_is_the_models_own_decode_from_the_edited_state():
    """Zero the KDA layer's state after token t: the whole model's own cached decode, its
    cache's state zeroed after token t, gives the same later logits."""
    model, ids, t = kimi(["full_attention", "linear_attention"]), _ids(), 5
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
    ref, own = torch.cat(got, dim=1), _own(model, ids)
    assert torch.equal(res.output.logits[:, :t], own[:, :t])
    later = (res.output.logits[:, t + 1:] - ref[:, t + 1:]).abs().max()
    moved = (own[:, t + 1:] - ref[:, t + 1:]).abs().max()
    print(f"kda zero-state vs cached decode {later:.2e}, moved {moved:.2e}")
    assert later < 1e-5 and moved > 1e-2, (later, moved)


def test_an_edit_carries_forward_and_this_position_only_does_not():
    model, ids, t = kimi(["linear_attention"]), _ids(), 4
    lens, key, own = gatelens.Lens(model, vocab=VOCAB), "model.layers.0.self_attn.layer0.s", \
        _own(model, ids)
    carried = lens.run(ids, edits=[gatelens.Scale(key, 3.0, at=t)]).output.logits
    here = lens.run(ids, edits=[gatelens.Scale(key, 3.0, at=t, carry=False)]).output.logits
    assert (carried[:, t + 1:] - own[:, t + 1:]).abs().max() > 1e-3
    assert (here[:, t] - own[:, t]).abs().max() > 1e-3
    assert (here[:, t + 1:] - own[:, t + 1:]).abs().max() < 1e-5
    assert torch.allclose(here[:, t], carried[:, t])
