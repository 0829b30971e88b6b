"""The xLSTM family (families/hf_xlstm.py) inside a whole transformers xLSTMForCausalLM.

A small random xLSTMForCausalLM of two mLSTM blocks is opened by ``Lens``: each block, read
against an independent float64 recurrence written here from the block's weights (the
paper's stabilised form: m, C, n and h̃ with its max(|q̄ᵀn|, e^{−m}) denominator, F.rms_norm,
F.layer_norm per head), against the package's own decode path (the block, and the whole
model with its xLSTMCache, one token at a time: the step kernel) and its prompt path (the
chunkwise kernel over the whole window, padded to chunk_size). The native kernels, the
config's defaults, are the ones that run on the CPU.
"""

from __future__ import annotations

import copy
import math
import types
import warnings

import jsonschema
import pytest
import torch
import torch.nn.functional as F
import transformers

import gatelens
from gatelens.analysis.common import pooled
from gatelens.errors import GatelensError
from gatelens.families import hf_xlstm
from gatelens.families.base import Readout
from gatelens.families.hf_xlstm import HFXLSTMFamily
from gatelens.families.official import scaled_diff
from gatelens.families.registry import family_of
from gatelens.readout.hooks import open_cells
from gatelens.report.json_report import check_report, schema

V, D, NH, B, T = 11, 64, 4, 2, 20
DQK, DV = 16, 32  # qk_dim_factor 1, v_dim_factor 2 (xLSTM-7B: d_v = 2 d_qk too)
CHUNK = 16  # the prompt path: T = 20 padded to two chunks
VOCAB = list("abcdefghij ")
TEXT = "abc def ghij jig fed cba " * 40
LW, PW = 20, 6  # the windows Lens analyses and the perturbed position
SIGNALS = ("i", "f", "o", "m", "s", "h", "y")
S = NH * (DQK * DV + DQK)
#: the head of each entry of s: C̄ (d_qk × d_v) head by head, then n̄ (d_qk) head by head
UNITS = torch.cat([torch.arange(NH).repeat_interleave(DQK * DV),
                   torch.arange(NH).repeat_interleave(DQK)])


@pytest.fixture(autouse=True)
def _single_thread(one_thread):
    transformers.utils.logging.set_verbosity_error()
    warnings.filterwarnings("ignore", message=".*fall.*back.*")


def _config(blocks: int, **kw) -> transformers.xLSTMConfig:
    return transformers.xLSTMConfig(
        vocab_size=V, hidden_size=D, num_hidden_layers=blocks, num_heads=NH,
        qk_dim_factor=1.0, v_dim_factor=2.0, chunk_size=CHUNK, ffn_proj_factor=1.0,
        ffn_round_up_to_multiple_of=16, **kw)


def _spread(model: torch.nn.Module) -> torch.nn.Module:
    """Gates that read their input (the package initialises the gate weights at zero and
    ĩ's bias at −10: a memory that never writes), norms and biases off their 1 and 0."""
    g = torch.Generator().manual_seed(1)
    f_bias = torch.linspace(3.0, 6.0, NH)  # the package's f̃ biases
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "gate_preact" in name and name.endswith("weight"):
                p.normal_(0.0, 0.3, generator=g)
            elif "gate_preact" in name:  # ĩ around 0, f̃ around 3 … 6
                want = {"igate": torch.zeros(NH), "fgate": f_bias,
                        "ifgate": torch.cat([torch.zeros(NH), f_bias])}[name.split(".")[-2][:-7]]
                p.copy_(want + torch.randn(p.shape, generator=g))
            elif "norm" in name or name.endswith("bias"):
                p.add_(0.3 * torch.randn(p.shape, generator=g))
    return model.eval()


def xlstm(blocks: int = 2, **kw) -> torch.nn.Module:
    """A random xLSTMForCausalLM (weight_mode "single": the package's own initialisation
    fails for "fused", its fused ifgate bias being 2·NH long)."""
    torch.manual_seed(0)
    return _spread(transformers.xLSTMForCausalLM(_config(blocks, **kw)))


def _block(weight_mode: str = "single", use_bias: bool = False) -> torch.nn.Module:
    """One block: of a whole model, or (fused) built on its own, as the model would hold it."""
    if weight_mode == "single" and not use_bias:
        return xlstm(1).backbone.blocks[0]
    torch.manual_seed(0)
    cfg = _config(1, weight_mode=weight_mode, use_bias=use_bias)
    return _spread(transformers.models.xlstm.modeling_xlstm.xLSTMBlock(cfg))


def _x(seed: int = 2, length: int = T) -> torch.Tensor:
    return torch.randn(B, length, D, generator=torch.Generator().manual_seed(seed))


def _rms(norm: torch.nn.Module, v: torch.Tensor) -> torch.Tensor:
    out = F.rms_norm(v, (v.shape[-1],), norm.weight, norm.eps)
    return out if norm.bias is None else out + norm.bias


@torch.no_grad()
def independent(block: torch.nn.Module, x: torch.Tensor) -> dict[str, torch.Tensor]:
    """The block in float64, written from its weights: the fused projections sliced by
    rows, the soft cap 15·tanh(·/15), and the mLSTM in the paper's stabilised form (m, C, n
    as the package stores them; the trace's C̄ = e^m C, n̄ = e^m n from them)."""
    b, x = copy.deepcopy(block).double(), x.double()
    L, cap = b.mlstm_layer, 15.0
    assert L.config.gate_soft_cap == cap
    u = _rms(b.norm_mlstm, x)
    if L.config.weight_mode == "fused":
        W, bias = L.qkv_opreact.weight, L.qkv_opreact.bias
        cut = [0, NH * DQK, 2 * NH * DQK, 2 * NH * DQK + NH * DV, 2 * NH * DQK + 2 * NH * DV]
        q, k, v, o = (F.linear(u, W[a:z], None if bias is None else bias[a:z])
                      for a, z in zip(cut, cut[1:], strict=False))
        g = F.linear(u, L.ifgate_preact.weight, L.ifgate_preact.bias)
        pi, pf = g[..., :NH], g[..., NH:]
    else:
        q, k, v, o = L.q(u), L.k(u), L.v(u), L.ogate_preact(u)
        pi, pf = L.igate_preact(u), L.fgate_preact(u)
    pi, pf = cap * torch.tanh(pi / cap), cap * torch.tanh(pf / cap)
    q, k, v = (z.view(B, -1, NH, z.shape[-1] // NH) for z in (q, k, v))
    C = torch.zeros(B, NH, DQK, DV, dtype=torch.float64)
    n = torch.zeros(B, NH, DQK, dtype=torch.float64)
    m = torch.zeros(B, NH, dtype=torch.float64)
    out: dict[str, list] = {n_: [] for n_ in ("i", "f", "m", "s", "htil")}
    for t in range(x.shape[1]):
        logf = F.logsigmoid(pf[:, t])
        m_new = torch.maximum(logf + m, pi[:, t])
        fa, ia = torch.exp(logf + m - m_new), torch.exp(pi[:, t] - m_new)
        C = fa[..., None, None] * C + ia[..., None, None] * torch.einsum(
            "bhi,bhj->bhij", k[:, t], v[:, t])
        n = fa[..., None] * n + ia[..., None] * k[:, t]
        m = m_new
        qs = q[:, t] / math.sqrt(DQK)
        den = torch.maximum(torch.einsum("bhi,bhi->bh", qs, n).abs(), torch.exp(-m)) + 1e-6
        out["htil"].append(torch.einsum("bhi,bhij->bhj", qs, C) / den[..., None])
        scale = torch.exp(m)
        out["s"].append(torch.cat([(C * scale[..., None, None]).reshape(B, -1),
                                   (n * scale[..., None]).reshape(B, -1)], dim=-1))
        out["i"].append(ia)
        out["f"].append(torch.exp(logf))
        out["m"].append(m)
    res = {k_: torch.stack(v_, dim=1) for k_, v_ in out.items()}
    norm = L.multihead_norm
    h = F.layer_norm(res.pop("htil"), (DV,), eps=norm.eps).reshape(B, -1, NH * DV)
    h = h * norm.weight + (0.0 if norm.bias is None else norm.bias)
    y = L.out_proj(torch.sigmoid(o) * h)
    r = x + y
    z = _rms(b.norm_ffn, r)
    ffn = b.ffn
    if hasattr(ffn, "proj_up_gate_z"):
        gate, up = ffn.proj_up_gate_z(z).chunk(2, dim=-1)
    else:
        gate, up = ffn.proj_up_gate(z), ffn.proj_up(z)
    return {**res, "o": torch.sigmoid(o), "h": h, "y": y,
            "out": r + ffn.proj_down(F.silu(gate) * up)}


def _raw(state) -> torch.Tensor:
    """A package state (C, n, m) in the trace's raw scale, (B, S)."""
    C, n, m = (z.double() for z in state)
    e = torch.exp(m)  # (B, NH, 1)
    return torch.cat([(C * e[..., None]).flatten(1), (n * e).flatten(1)], dim=-1)


def _head_scaled(got: torch.Tensor, want: torch.Tensor, scale: torch.Tensor) -> float:
    """max |got − want| over each head's largest |value| of ``scale`` (B, T, S), ≥ 1."""
    top = torch.stack([scale[..., UNITS == h].abs().amax(dim=(1, 2)) for h in range(NH)], -1)
    return float(((got - want).double().abs() / top[:, None, UNITS].clamp(min=1)).max())


# ---- opened inside the whole model ----------------------------------------------------
def test_lens_opens_each_block_and_the_registry_lists_it():
    model = xlstm()
    lens = gatelens.Lens(model, vocab=VOCAB)
    assert list(lens.families) == ["backbone.blocks.0", "backbone.blocks.1"]
    fam = lens.families["backbone.blocks.1"]
    assert isinstance(fam, HFXLSTMFamily) and fam.cell == "hf_xlstm"
    assert "hf-xlstm" in gatelens.families()
    blk = model.backbone.blocks[0]
    assert family_of(blk.mlstm_layer) is None and family_of(model.backbone) is None
    assert fam.names() == [f"layer0.{n}" for n in SIGNALS]
    info = fam.describe()
    assert (info["family"], info["hidden"], info["units"], info["heads"], info["qk_head_dim"],
            info["v_head_dim"]) == ("hf-xlstm", NH, "head", NH, DQK, DV)
    assert (info["step_kernel"], info["chunkwise_kernel"], info["mode"]) == (
        "native", "chunkwise--native_autograd", "inference")
    assert torch.equal(fam.state_units(0), UNITS) and fam.input_window() == 1
    ids = torch.randint(0, V, (B, T), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        expected = model(ids).logits  # use_cache (the default): a zero cache to each block
        with open_cells(model) as cache:
            got = model(ids).logits
    assert torch.equal(got, expected)
    assert list(cache.traces) == ["backbone.blocks.0", "backbone.blocks.1"]
    assert cache["backbone.blocks.1.layer0.s"].shape == (B, T, S)
    assert cache["backbone.blocks.0.layer0.o"].shape == (B, T, NH * DV)
    assert cache["backbone.blocks.0.layer0.m"].shape == (B, T, NH)


@pytest.mark.parametrize("mode,bias", [("single", False), ("fused", True)])
def test_the_trace_is_the_float64_recurrence_and_the_package_paths(mode, bias):
    block = _block(weight_mode=mode, use_bias=bias)
    fam = HFXLSTMFamily(block)
    call = fam.check(_x())
    ref = fam.reference(call)
    exact = independent(block, call.inputs)
    tr = gatelens.trace(block, call.inputs, method="anchored")  # the hand cell, one step
    own = gatelens.trace(block, call.inputs)  # the package's own float32 values
    assert own.meta["method"] == "own"
    for name in SIGNALS:
        assert scaled_diff(own[f"layer0.{name}"], exact[name])[1] < 1e-5, name
    fam64 = HFXLSTMFamily(copy.deepcopy(block).double())
    free = fam64.rerun(fam64.check(call.inputs.double())).signals  # float64, from zeros
    for name in SIGNALS:
        want = exact[name]
        assert free[f"layer0.{name}"].dtype == torch.float64
        # m is the package's stabiliser, which it keeps in float32 whatever the model's
        # dtype (inference_state_dtype allows no float64); i = e^{ĩ − m} reads it
        tol = 1e-6 if name in ("i", "m") else 1e-10
        assert scaled_diff(free[f"layer0.{name}"], want)[1] < tol, name
        assert scaled_diff(tr[f"layer0.{name}"], want)[1] < 1e-5, name
    # the anchored memory adds no error of its own on the head's scale: fed the module's
    # float32 state at t − 1 (within 1.5e-06 of the float64 recurrence here, the package's
    # own accumulated rounding), the float64 step is no farther from that recurrence
    # (linear in the state, |f| ≤ 1) beyond the rounding of its float32 input u
    anchor = _head_scaled(ref.states["layer0.s"], exact["s"], exact["s"])
    assert _head_scaled(tr["layer0.s"], exact["s"], exact["s"]) <= anchor + 2e-7
    # the package's decode path (the trajectory) and its prompt path (the forward)
    assert scaled_diff(ref.states["layer0.s"], exact["s"])[1] < 1e-5
    assert scaled_diff(ref.output, exact["out"])[1] < 1e-5
    assert scaled_diff(ref.extra["aux"][0], exact["m"])[0] < 1e-5  # m, the package's own
    # a memory worth reading: writes that matter, keeps from forgetful to long, m moving
    assert float(exact["s"].abs().max()) > 10 and float(exact["m"].max()) > 1
    assert float(exact["f"].min()) < 0.3 and float(exact["f"].max()) > 0.99
    assert float(exact["i"].min()) < 1e-2 and float(exact["i"].max()) == pytest.approx(1.0)


def test_the_prompt_path_and_the_step_path_part_by_float32_rounding_only():
    fam = HFXLSTMFamily(_block())
    call = fam.check(_x(length=40))  # three chunks, the last one padded
    ref = fam.reference(call)
    out_abs, out_scaled = ref.extra["step_vs_forward"]
    assert 0 < out_scaled < 1e-5 and out_abs < 1e-4
    # the final state the prompt path returns (the chunkwise kernel, its own stabiliser)
    # against the step path's, in the raw scale where the two stabilisers do not enter
    steps = ref.states["layer0.s"]
    assert _head_scaled(ref.final[:, None], steps[:, -1:], steps) < 1e-6
    # a float64 model still steps in float32 (the step kernel keeps C, n, m in the
    # backend's inference_state_dtype, float32 at most): the two paths part as much
    fam64 = HFXLSTMFamily(copy.deepcopy(fam.module).double())
    ref64 = fam64.reference(fam64.check(call.inputs.double()))
    assert ref64.extra["parts"][0][0].dtype == torch.float64
    assert 1e-9 < ref64.extra["step_vs_forward"][1] < 1e-5


def test_the_whole_model_stepped_with_its_cache_is_the_trace_and_the_prompt_its_final():
    """The model's own decode path (xLSTMForCausalLM, one token at a time, its xLSTMCache)
    holds at each token the state the trace holds; after the prompt, the model's cache
    holds the trace's last state; the logits of the two paths part by rounding."""
    model = xlstm()
    ids = torch.randint(0, V, (B, T), generator=torch.Generator().manual_seed(4))
    with torch.no_grad(), open_cells(model) as tr:
        prompt = model(ids, use_cache=True)
    cache = transformers.models.xlstm.modeling_xlstm.xLSTMCache(
        model.config, B, dtype=torch.float32)
    states: list[list[torch.Tensor]] = [[], []]
    logits = []
    with torch.no_grad():
        for t in range(T):
            logits.append(model(ids[:, t : t + 1], cache_params=cache, use_cache=True).logits)
            for k in range(2):
                states[k].append(_raw(cache.rnn_state[k]))
    for k in range(2):
        s = tr[f"backbone.blocks.{k}.layer0.s"]
        stepped = torch.stack(states[k], dim=1)
        # block 1 reads block 0's output from the prompt path in the trace and from the
        # step path here: the two paths' float32 disagreement, carried up one block
        assert scaled_diff(s, stepped)[1] < (1e-5 if k == 0 else 1e-4), k
        assert _head_scaled(s, stepped, s) < 1e-5, k
        final = _raw(prompt.cache_params.rnn_state[k])[:, None]
        assert _head_scaled(final, s[:, -1:], s) < 1e-5, k
    stepped_logits = torch.cat(logits, dim=1)
    assert 0 < float((stepped_logits - prompt.logits).abs().max()) < 1e-4


# ---- the check against the module's own decode path ------------------------------------
@pytest.mark.parametrize("wrong", ["igate_preact.bias", "fgate_preact.weight", "k.weight",
                                   "v.weight", "ogate_preact.weight", "multihead_norm.weight",
                                   "out_proj.weight"])
def test_one_step_passes_and_a_parameter_off_by_a_tenth_of_a_percent_fails(wrong):
    fam = HFXLSTMFamily(_block())
    call = fam.check(_x())
    ref = fam.reference(call)
    (row,) = fam.one_step(call, ref)
    assert row.max_scaled_diff_h < 1e-5
    with torch.no_grad():  # one parameter of the family's float64 copy off by 1e-3 relative
        fam.float64().mlstm_layer.get_parameter(wrong).mul_(1.001)
    assert fam.one_step(call, ref)[0].max_scaled_diff_h > 1e-5


def test_the_memory_is_judged_on_its_heads_scale():
    fam = HFXLSTMFamily(_block())
    call = fam.check(_x())
    ref = fam.reference(call)
    s = ref.states["layer0.s"].double()
    units = fam.state_units(0)
    head = int(units[0])
    top = float(s[0, :, units == head].abs().max())
    assert top > 10
    small = int((s[0].abs().amax(0) + (units != head) * 1e9).argmin())  # head 0's least
    signals = {"layer0.s": s.clone(), "layer0.y": ref.states["layer0.y"]}
    signals["layer0.s"][0, 3, small] += 1e-5 * top / 2  # half the tolerance on the head's scale
    (row,) = fam.judge(Readout(signals=signals), ref)
    assert row.max_scaled_diff_h == pytest.approx(0.5e-5, rel=1e-3)
    assert scaled_diff(signals["layer0.s"], s)[1] > 1e-5  # entry by entry it would fail
    signals["layer0.s"][0, 3, small] += 2e-5 * top
    assert fam.judge(Readout(signals=signals), ref)[0].max_scaled_diff_h > 1e-5
    assert ref.extra["final_vs_step"][1] < 1e-6  # the prompt path's final, on the same scale


def test_the_soft_cap_is_the_packages_and_eps_is_normed_away():
    fam = HFXLSTMFamily(_block())
    call = fam.check(_x())
    ref = fam.reference(call)
    layer = fam.float64().mlstm_layer
    layer.config.gate_soft_cap = 15.0 * 1.001
    assert fam.one_step(call, ref)[0].max_scaled_diff_h > 1e-5
    layer.config.gate_soft_cap = 15.0
    assert fam.one_step(call, ref)[0].max_scaled_diff_h < 1e-5
    assert fam.module.mlstm_layer.config.gate_soft_cap == 15.0  # the copy's, not the model's
    # ε e^{m} (up to ~1e-3 of the denominator here) scales a head's h̃ as a whole, which its
    # LayerNorm takes out again: what reaches h and y hardly reads ε, nor therefore m
    assert float(ref.extra["aux"][0].max()) > 5
    layer.mlstm_backend.config.eps = 0.0
    assert fam.one_step(call, ref)[0].max_scaled_diff_h < 1e-5


def test_verify_through_the_public_entry_point(monkeypatch):
    block = _block()
    result = gatelens.verify(block, _x())
    assert result.passed and result.one_step_max_scaled_diff_h < 1e-5
    monkeypatch.setattr(hf_xlstm, "soft_cap", lambda x, cap: x)  # no soft cap
    assert not gatelens.verify(block, _x()).passed


# ---- memory: one block has no return path ----------------------------------------------
def _keep_gap(blocks: int, start_lag: int) -> float:
    """max over t > PW + start_lag of |δs_t − f_t δs_{t−1}| (each head's f on its entries),
    relative to |δs| where the roll starts: the package's own states (its decode path) of
    the top block, the input of the model's embedding changed at PW."""
    model = xlstm(blocks)
    g = torch.Generator().manual_seed(5)
    with torch.no_grad():
        x = model.backbone.embeddings(torch.randint(0, V, (B, LW), generator=g))
        xp = x.clone()
        xp[:, PW] += torch.randn(B, D, generator=g)
        for blk in model.backbone.blocks[:-1]:
            x, xp = blk(x, None)[0], blk(xp, None)[0]
        fam = HFXLSTMFamily(model.backbone.blocks[-1])
        clean, pert = fam.check(x), fam.check(xp)
        ref_c, ref_p = fam.reference(clean), fam.reference(pert)
    keep = fam.read(clean, ref_c).signals["layer0.f"].double()[..., fam.state_units(0)]
    ds = (ref_p.states["layer0.s"] - ref_c.states["layer0.s"]).double()
    rolled = ds[:, PW + start_lag]
    norm = rolled.abs().amax(dim=-1)
    assert float(norm.min()) > 0
    worst = 0.0
    for t in range(PW + start_lag + 1, LW):
        rolled = keep[:, t] * rolled
        worst = max(worst, float(((ds[:, t] - rolled).abs().amax(-1) / norm).max()))
    return worst


def test_one_block_has_no_return_path_and_the_second_has_one():
    assert _keep_gap(1, 0) < 1e-5  # the package's float32 steps: rounding
    assert _keep_gap(2, 0) > 1e-3  # the upper block reads a changed input at every lag


# ---- measured by Lens ------------------------------------------------------------------
def test_analyze_measures_each_block_and_the_split_is_the_keep_gate():
    result = gatelens.Lens(xlstm(), vocab=VOCAB).analyze(
        TEXT, windows=2, length=LW, perturb_pos=PW, exponents=1)
    assert list(result.analyses) == ["backbone.blocks.0", "backbone.blocks.1"]
    for path, a in result.analyses.items():
        rep = a.report
        check_report(rep)
        jsonschema.validate(rep, schema())
        assert rep["model"]["family"] == "hf-xlstm" and rep["model"]["path"] == path
        assert rep["verification"]["passed"] is True
        assert rep["units"]["gate"] == "f" and rep["units"]["n_units"] == NH
        assert all(0 < rep["gates"]["f"][q] < 1 for q in ("p5", "p50", "p95"))
        assert all(math.isfinite(v) and v > 0 for v in rep["units"]["half_life"].values())
        assert rep["lyapunov"] is not None and rep["lyapunov"]["size"] == S
        pert = rep["perturbation"]
        assert pert["n"] == 2 and pert["lags"] == [1, 2, 4, 8]
        # the forget path by hand: δs_p carried by the clean run's f of each entry's head
        tr, tr2 = a.trace, a.trace_perturbed
        ds = (pooled(tr2, "s") - pooled(tr, "s")).double()
        keep = tr["layer0.f"].double()[..., UNITS]
        rolled, by_hand = ds[:, PW], {}
        for lag in range(1, LW - PW):
            rolled = keep[:, PW + lag] * rolled
            by_hand[lag] = (rolled.norm(dim=-1) / ds[:, PW].norm(dim=-1)).mean()
        assert pert["forget_only"] == pytest.approx([float(by_hand[k]) for k in pert["lags"]],
                                                    rel=1e-6, abs=1e-14)
        dec = a.decomposition
        scale = max(float(dec["measured"].abs().max()), 1.0)
        assert float((dec["measured"] - dec["forget_path"] - dec["return_path"]).abs().max()) \
            < 1e-9 * scale
        back = max(pert["return_path"]) / max(pert["measured"])
        assert back < 1e-5 if path.endswith("0") else back > 1e-2  # one block: none


def test_a_checkpoint_naming_triton_kernels_opens_with_the_native_ones(tmp_path):
    import json

    model = xlstm(1)
    model.save_pretrained(tmp_path)
    cfg = json.loads((tmp_path / "config.json").read_text())
    cfg.update(chunkwise_kernel="chunkwise--triton_xl_chunk", step_kernel="triton",
               sequence_kernel="native_sequence__triton")  # as xLSTM-7B's config.json
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    hf = gatelens.load_hf(tmp_path)
    (note,) = hf.notes
    assert "native ones" in note and "'triton'" in note
    backend = hf.model.backbone.blocks[0].mlstm_layer.mlstm_backend.config
    assert (backend.chunkwise_kernel, backend.step_kernel) == ("chunkwise--native_autograd",
                                                               "native")
    ids = torch.randint(0, V, (B, T))
    with torch.no_grad():
        assert torch.equal(hf.model(ids).logits, model(ids).logits)
    assert HFXLSTMFamily.hf_config_overrides({"model_type": "xlstm"}) is None  # defaults
    assert HFXLSTMFamily.hf_config_overrides({"model_type": "mamba"}) is None


# ---- refusals ------------------------------------------------------------------------
def test_a_cache_after_earlier_tokens_and_a_train_mode_backend_are_refused_in_one_line():
    model = xlstm()
    ids = torch.randint(0, V, (B, 4))
    cache = transformers.models.xlstm.modeling_xlstm.xLSTMCache(model.config, B,
                                                                 dtype=torch.float32)
    with torch.no_grad():
        model(ids, cache_params=cache, use_cache=True)  # the cache now holds 4 tokens
        with pytest.raises(GatelensError, match="hf-xlstm: a state .* other than zeros"), \
                open_cells(model):
            model(ids, cache_params=cache, use_cache=True)
    fam = HFXLSTMFamily(model.backbone.blocks[0])
    x = _x()
    zeros = fam._zeros(B, x)
    assert fam.split_call((x, zeros), {}) == (x, None)  # a fresh cache is the zero state
    assert fam.split_call((), {"x": x, "state": None}) == (x, None)
    with pytest.raises(GatelensError, match="inputs must be a float tensor"):
        fam.check(torch.zeros(B, T, dtype=torch.long))
    train = HFXLSTMFamily(xlstm(1, mode="train", return_last_states=True).backbone.blocks[0])
    with pytest.raises(GatelensError, match="mode='train'; its decode path"):
        train.check(x)


# ---- transformers' own copy of the block (no xlstm package) ---------------------------
def _own_copy(monkeypatch) -> types.ModuleType:
    """modeling_xlstm as transformers runs it where the xlstm package is missing: its own
    block and native kernels (a fresh module object; the imported one is left alone)."""
    import importlib
    import importlib.util

    name = "transformers.models.xlstm.modeling_xlstm"
    importlib.import_module(name)  # transformers resolves annotations through sys.modules
    spec = importlib.util.find_spec(name)
    source = spec.loader.get_source(name)
    monkeypatch.setattr(transformers.utils, "is_xlstm_available", lambda: False)
    mod = types.ModuleType(name)
    mod.__package__ = name.rsplit(".", 1)[0]
    exec(compile(source, spec.origin, "exec"), mod.__dict__)
    return mod


def test_transformers_own_copy_of_the_block_is_read_the_same(monkeypatch):
    """Without the xlstm package transformers defines the block and its native kernels
    itself (unpadded: chunks, then its sequence kernel for the rest); the family reads it."""
    mod = _own_copy(monkeypatch)
    assert not mod.external_xlstm
    torch.manual_seed(0)
    block = _spread(mod.xLSTMBlock(_config(1)))
    assert type(block.mlstm_layer.mlstm_backend) is mod.xLSTMBackend
    assert family_of(block).__class__ is HFXLSTMFamily
    fam = HFXLSTMFamily(block)
    call = fam.check(_x(length=40))  # two chunks of 16, then 8 steps of its sequence kernel
    ref = fam.reference(call)
    assert fam.one_step(call, ref)[0].max_scaled_diff_h < 1e-5
    assert 0 < ref.extra["step_vs_forward"][1] < 1e-5 and ref.extra["final_vs_step"][1] < 1e-5
    exact = independent(block, call.inputs)
    sig = fam.read(call, ref).signals
    for name in SIGNALS:
        assert scaled_diff(sig[f"layer0.{name}"], exact[name])[1] < 1e-5, name
