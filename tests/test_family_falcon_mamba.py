"""The FalconMamba family (families/hf_falcon_mamba.py): transformers' FalconMambaModel inside
a small random FalconMambaForCausalLM, opened as one stack (``backbone``) like hf-mamba.

The trace is checked against an independent float64 recurrence written here from the
weights (the conv as F.conv1d, the weightless RMS norms on δ, B and C written out, the scan
as a loop), against the package's own decode path (the model run one token at a time with
its cache) and its whole-sequence forward; the one-step check fails when one weight is off
by 0.1 % or when the norms are left out; one layer has no return path once the conv's
window has passed; a carried Zero edit is the package's own cached decode from a zeroed
state.
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
from gatelens.families.hf_falcon_mamba import HFFalconMambaFamily
from gatelens.families.hf_mamba import MambaCell
from gatelens.families.official import scaled_diff
from gatelens.families.registry import family_of
from gatelens.report.json_report import check_report, schema

V, D, N, K, B, T = 11, 16, 4, 3, 2, 16
DIN = 2 * D
VOCAB = list("abcdefghij ")
TEXT = "abc def ghij jig fed cba " * 40
LW, PW = 24, 6  # the windows Lens analyses and the perturbed position
SIGNALS = ("delta", "a", "s", "y")


@pytest.fixture(autouse=True)
def _single_thread(one_thread):
    transformers.utils.logging.set_verbosity_error()
    warnings.filterwarnings("ignore", message=".*fall.*back.*")


def falcon(layers: int = 2) -> torch.nn.Module:
    """A small FalconMambaForCausalLM, its weights spread beyond the package's start (A and
    the dt bias kept: keeps of 0.5-0.99 worth measuring)."""
    cfg = transformers.FalconMambaConfig(
        vocab_size=V, hidden_size=D, state_size=N, num_hidden_layers=layers, expand=2,
        conv_kernel=K, time_step_rank=4, use_cache=False)
    torch.manual_seed(0)
    model = transformers.FalconMambaForCausalLM(cfg)
    g = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if not name.endswith(("A_log", "dt_proj.bias")):
                p.add_(0.3 * torch.randn(p.shape, generator=g))
    return model.eval()


def _ids(seed: int = 2, length: int = T) -> torch.Tensor:
    return torch.randint(0, V, (B, length), generator=torch.Generator().manual_seed(seed))


@torch.no_grad()
def independent(backbone: torch.nn.Module, ids: torch.Tensor) -> dict[str, torch.Tensor]:
    """The backbone in float64, whole sequence, written from its weights: RMSNorm blocks,
    the depthwise causal conv as F.conv1d, δ, B, C each divided by √(mean² + ε) (no
    weight), Δ = softplus(W δ + b), s_t = exp(Δ A) s_{t−1} + Δ B x̂ as a loop; A taken in
    float32 as the package takes it."""
    m = copy.deepcopy(backbone).double()
    x = m.embeddings(ids)

    def norm(v, eps, w=None):
        v = v / torch.sqrt(v.pow(2).mean(-1, keepdim=True) + eps)
        return v if w is None else w * v

    out: dict[str, torch.Tensor] = {}
    for k, block in enumerate(m.layers):
        mix = block.mixer
        assert mix.activation == "silu"
        u = norm(x, block.norm.variance_epsilon, block.norm.weight)
        xi, z = mix.in_proj(u).chunk(2, dim=-1)
        xc = F.silu(F.conv1d(F.pad(xi.transpose(1, 2), (K - 1, 0)), mix.conv1d.weight,
                             mix.conv1d.bias, groups=DIN).transpose(1, 2))  # (B, T, DIN)
        r = mix.time_step_rank
        dt, Bm, Cm = mix.x_proj(xc).split([r, N, N], dim=-1)
        eps = mix.rms_eps
        dt, Bm, Cm = norm(dt, eps), norm(Bm, eps), norm(Cm, eps)
        delta = F.softplus(dt @ mix.dt_proj.weight.T + mix.dt_proj.bias)  # (B, T, DIN)
        A = -torch.exp(backbone.layers[k].mixer.A_log.float()).double()  # (DIN, N)
        a = torch.exp(delta[..., None] * A)  # (B, T, DIN, N)
        s = torch.zeros(ids.shape[0], DIN, N, dtype=torch.float64)
        states = []
        for t in range(ids.shape[1]):
            s = a[:, t] * s + delta[:, t, :, None] * Bm[:, t, None, :] * xc[:, t, :, None]
            states.append(s.flatten(1))
        S = torch.stack(states, dim=1)  # (B, T, DIN·N)
        yin = (S.view(*S.shape[:2], DIN, N) * Cm[:, :, None, :]).sum(-1) + mix.D * xc
        y = mix.out_proj(yin * F.silu(z))
        out.update({f"layer{k}.delta": delta, f"layer{k}.a": a.flatten(2),
                    f"layer{k}.s": S, f"layer{k}.y": y})
        x = x + y
    out["out"] = norm(x, m.norm_f.variance_epsilon, m.norm_f.weight)
    return out


# ---- opened inside the whole model ----------------------------------------------------
def test_lens_opens_the_backbone_and_the_registry_lists_it():
    model = falcon()
    lens = gatelens.Lens(model, vocab=VOCAB)
    assert list(lens.families) == ["backbone"]
    fam = lens.families["backbone"]
    assert isinstance(fam, HFFalconMambaFamily) and fam.cell == "mamba"
    assert "hf-falcon-mamba" in gatelens.families()
    assert family_of(model.backbone.layers[0].mixer) is None  # the stack, not its parts
    assert family_of(transformers.MambaModel(transformers.MambaConfig(
        vocab_size=V, hidden_size=8, num_hidden_layers=1))).name == "hf-mamba"
    assert fam.names() == [f"layer{k}.{n}" for k in range(2) for n in SIGNALS]
    assert (fam.hidden_size, fam.input_window(), fam.recipe) == (DIN * N, K, None)


def test_the_trace_is_the_float64_recurrence_and_the_package_paths():
    model = falcon()
    fam = HFFalconMambaFamily(model.backbone)
    ids = _ids()
    call = fam.check(ids)
    ref = fam.reference(call)
    exact = independent(model.backbone, ids)
    tr = gatelens.trace(model.backbone, ids)
    fam64 = HFFalconMambaFamily(copy.deepcopy(model.backbone).double())
    free = fam64.rerun(fam64.check(ids)).signals
    for name in fam.names():
        assert free[name].dtype == torch.float64
        assert scaled_diff(free[name], exact[name])[1] < 1e-12, name
        assert scaled_diff(tr[name], exact[name])[1] < 1e-5, name
    # the package's decode path (the trajectory) and its whole-sequence forward
    for k in range(2):
        assert scaled_diff(ref.states[f"layer{k}.s"], exact[f"layer{k}.s"])[1] < 1e-5
    assert scaled_diff(ref.output, exact["out"])[1] < 1e-5
    assert ref.extra["step_vs_forward"][1] < 1e-5 and ref.extra["final_vs_step"][1] < 1e-5
    last = torch.cat([exact[f"layer{k}.s"][:, -1] for k in range(2)], dim=-1)
    assert scaled_diff(ref.final[:, None], last[:, None])[1] < 1e-5
    assert float(exact["layer1.s"].abs().max()) > 0.1  # the state is not negligible
    a = exact["layer0.a"]
    assert 0.05 < float(a.min()) and float(a.max()) < 1


@pytest.mark.parametrize("wrong", ["x_proj.weight", "dt_proj.bias", "A_log", "conv1d.weight",
                                   "D", "in_proj.weight"])
def test_one_step_passes_and_a_weight_off_by_a_thousandth_fails_it(wrong):
    fam = HFFalconMambaFamily(falcon().backbone)
    call = fam.check(_ids())
    ref = fam.reference(call)
    assert max(r.max_scaled_diff_h for r in fam.one_step(call, ref)) < 1e-5
    p = fam.float64().layers[1].mixer.get_parameter(wrong)
    with torch.no_grad():
        # x_proj: B's first row alone (B's rows all scaled together are invisible: the
        # norm after it; test_the_norms_make_x_proj_scale_free)
        (p[-2 * N] if wrong == "x_proj.weight" else p).mul_(1.001)
    assert fam.one_step(call, ref)[1].max_scaled_diff_h > 1e-5


def test_the_norms_make_x_proj_scale_free():
    fam = HFFalconMambaFamily(falcon().backbone)
    call = fam.check(_ids())
    ref = fam.reference(call)
    with torch.no_grad():
        fam.float64().layers[1].mixer.x_proj.weight.mul_(1.5)  # δ, B and C each rescaled
    assert fam.one_step(call, ref)[1].max_scaled_diff_h < 1e-5


def test_the_norms_on_delta_b_and_c_are_needed_for_the_check(monkeypatch):
    fam = HFFalconMambaFamily(falcon().backbone)
    call = fam.check(_ids())
    ref = fam.reference(call)
    assert fam.one_step(call, ref)[0].max_scaled_diff_h < 1e-5
    monkeypatch.setattr(HFFalconMambaFamily, "_bcdt", MambaCell._bcdt)  # plain Mamba-1
    assert fam.one_step(call, ref)[0].max_scaled_diff_h > 1e-3


# ---- the no-return-path invariant (one linear layer) ----------------------------------
def _keep_gap(layers: int, layer: int, start_lag: int, how: str = "a") -> float:
    """max over t of |δs_t − a_t ⊙ δs_{t−1}| rolled from lag ``start_lag`` after PW, relative
    to |δs| there: the package's own states (its decode path), the clean read-out's keep
    (``how`` "sqrt": a wrong keep √a)."""
    fam = HFFalconMambaFamily(falcon(layers).backbone)
    ids = _ids(4, LW)
    idp = ids.clone()
    idp[:, PW] = (ids[:, PW] + 3) % V
    clean, pert = fam.check(ids), fam.check(idp)
    ref_c, ref_p = fam.reference(clean), fam.reference(pert)
    keep = fam.read(clean, ref_c).signals[f"layer{layer}.a"].double()
    keep = keep.sqrt() if how == "sqrt" else keep
    name = f"layer{layer}.s"
    ds = (ref_p.states[name] - ref_c.states[name]).double()
    rolled = ds[:, PW + start_lag]
    norm = rolled.abs().amax(dim=-1)
    assert float(norm.min()) > 0
    worst = 0.0
    for t in range(PW + start_lag + 1, LW):
        rolled = keep[:, t] * rolled
        worst = max(worst, float(((ds[:, t] - rolled).abs().amax(-1) / norm).max()))
    return worst


def test_one_layer_has_no_return_path_once_the_window_has_passed():
    assert _keep_gap(1, 0, K - 1) < 2e-5  # the package's float32 steps
    assert _keep_gap(1, 0, 0) > 1e-3  # the conv still reads the change at lag 1, 2
    assert _keep_gap(1, 0, K - 1, "sqrt") > 1e-2
    assert _keep_gap(2, 1, K - 1) > 1e-3  # the upper layer reads a changed input


# ---- measured by Lens ------------------------------------------------------------------
def test_analyze_measures_the_stack_and_the_split_is_the_keep_gate():
    result = gatelens.Lens(falcon(), vocab=VOCAB).analyze(
        TEXT, windows=2, length=LW, perturb_pos=PW, exponents=1)
    ((path, a),) = result.analyses.items()
    rep = a.report
    check_report(rep)
    jsonschema.validate(rep, schema())
    assert path == "backbone" and rep["model"]["family"] == "hf-falcon-mamba"
    assert rep["verification"]["passed"] is True
    assert rep["units"]["gate"] == "a" and rep["units"]["n_units"] == 2 * DIN * N
    assert all(0 < rep["gates"]["a"][q] < 1 for q in ("p5", "p50", "p95"))
    assert all(math.isfinite(v) and v > 0 for v in rep["units"]["half_life"].values())
    pert = rep["perturbation"]
    assert pert["n"] == 2 and pert["lags"] == [1, 2, 4, 8, 16]
    tr, tr2 = a.trace, a.trace_perturbed  # the forget path by hand: the clean run's keeps
    ds = (pooled(tr2, "s") - pooled(tr, "s")).double()
    keep = torch.cat([tr[f"layer{k}.a"] for k in range(2)], dim=-1).double()
    rolled, by_hand = ds[:, PW], {}
    for lag in range(1, LW - PW):
        rolled = keep[:, PW + lag] * rolled
        by_hand[lag] = (rolled.norm(dim=-1) / ds[:, PW].norm(dim=-1)).mean()
    assert pert["forget_only"] == pytest.approx([float(by_hand[k]) for k in pert["lags"]],
                                                rel=1e-5, abs=1e-12)
    dec = a.decomposition
    scale = max(float(dec["measured"].abs().max()), 1.0)
    assert float((dec["measured"] - dec["forget_path"] - dec["return_path"]).abs().max()) \
        < 1e-5 * scale
    assert max(rep["decomposition"]["return_path"]) > 1e-6  # two layers: a return path


# ---- an edit: the package's own decode from the edited state ---------------------------
def test_a_zeroed_state_is_the_packages_own_decode_from_a_zeroed_cache():
    m, t = falcon(1), 5
    lens, ids = gatelens.Lens(m, vocab=V), _ids(3, 12)
    with torch.no_grad():
        own = m(ids).logits
    res = lens.run(ids, edits=[gatelens.Zero("backbone.layer0.s", at=t)])
    cache, got = transformers.DynamicCache(config=m.config), []
    with torch.no_grad():
        for j in range(ids.shape[1]):
            got.append(m(ids[:, j:j + 1], cache_params=cache, use_cache=True).logits)
            if j == t:
                cache.get_recurrent_state(0).zero_()
    ref = torch.cat(got, dim=1)
    assert torch.equal(res.output.logits[:, :t], own[:, :t])
    later = (res.output.logits[:, t + 1:] - ref[:, t + 1:]).abs().max()
    moved = (own[:, t + 1:] - ref[:, t + 1:]).abs().max()
    assert later < 1e-5 < moved, (later, moved)
    assert not res.trace["backbone.layer0.s"][:, t].any()
