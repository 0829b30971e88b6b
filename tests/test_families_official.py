"""The official implementations' families against the modules' own computation.

Each family's anchored read-out, fed the module's own state at t − 1, lands on the module's
own state and output at t within the verification tolerance (1e-5, judged on the unit's
scale); the free-running re-run and the float64 dynamics are checked the same way; wiring
mistakes a reader could make (xlstm's swapped i/f slots) are caught by the check.
"""

from __future__ import annotations

import importlib
import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).parent))  # the shared tiny models (importlib mode)
from gatelens.errors import GatelensError
from gatelens.families.registry import gate_names
from official_models import (
    hf_mamba,
    hf_mamba2,
    hf_rwkv,
    mambapy_stack,
    mingru_lm,
    xlstm_mlstm,
    xlstm_slstm,
)

TOL = 1e-5
BUILDERS = {
    "mingru-gru": lambda L: mingru_lm(L),
    "mingru-lstm": lambda L: mingru_lm(L, lstm=True),
    "hf-mamba": hf_mamba,
    "hf-mamba2": hf_mamba2,
    "mambapy": mambapy_stack,
    "hf-rwkv": hf_rwkv,
    "xlstm-slstm": xlstm_slstm,
    "xlstm-mlstm": xlstm_mlstm,
}


@pytest.fixture(params=sorted(BUILDERS), scope="module")
def opened(request):
    fam, make = BUILDERS[request.param](2)
    call = make(0)
    return fam, call, fam.reference(call)


def test_one_step_on_the_modules_own_trajectory(opened):
    fam, call, ref = opened
    rows = fam.one_step(call, ref)
    assert [r.layer for r in rows] == list(range(fam.num_layers))
    assert max(r.max_scaled_diff_h for r in rows) < TOL
    assert all(r.max_scaled_diff_h > 0 or r.max_abs_diff_h == 0 for r in rows)


def test_read_names_shapes_and_keep_range(opened):
    fam, call, ref = opened
    out = fam.read(call, ref)
    assert list(out.signals) == gate_names(fam.cell, fam.num_layers) == fam.names()
    keep = out.signals[f"layer0.{fam.spec.keep_gate}"]
    assert keep.shape == (call.batch, call.length, fam.hidden_size)
    # κ = f n / n' is 0 at the first step of sLSTM (n = 0: nothing to keep)
    assert float(keep.min()) >= 0 and float(keep[:, 1:].min()) > 0 and float(keep.max()) < 1
    s = out.signals[f"layer0.{fam.spec.state}"]
    assert s.shape[-1] == fam.state_units(0).numel()
    assert int(fam.state_units(0).max()) == fam.hidden_size - 1


def test_free_running_rerun_stays_on_the_trajectory(opened):
    fam, call, ref = opened
    assert max(r.max_scaled_diff_h for r in fam.judge(fam.rerun(call), ref)) < 1e-4


# PyTorch's own forward-AD decompositions warn once, on first use, that torch.jit is deprecated.
@pytest.mark.filterwarnings("ignore:`torch.jit.script` is deprecated:DeprecationWarning")
def test_dynamics_step_reproduces_the_trajectory_and_has_jvps(opened):
    fam, call, ref = opened
    (dyn,) = fam.dynamics(call, ref)
    assert dyn.units.numel() == sum(p.shape[-1] for p in dyn.trajectory)
    assert int(dyn.units.max()) == fam.num_layers * fam.hidden_size - 1
    for j in (0, 7, call.length - 1):
        new = dyn.step(dyn.inputs[:, dyn.order[j]], dyn.previous(j))
        for a, b in zip(new, dyn.trajectory, strict=True):
            scale = b.abs().amax(dim=1).clamp(min=1.0)
            assert float(((a - b[:, dyn.order[j]]).abs() / scale).max()) < 1e-5
    prev = dyn.previous(5)
    tangent = [torch.randn_like(p) for p in prev]
    _, out = torch.func.jvp(lambda *s: tuple(dyn.step(dyn.inputs[:, 5], list(s))),
                            tuple(prev), tuple(tangent))
    assert all(bool(torch.isfinite(t).all()) for t in out)


def test_the_check_fails_when_the_hand_cell_is_wrong(opened):
    # a wrong weight in the float64 copy the hand cell reads: the one-step check must see it
    fam, call, ref = opened
    m = fam.float64()
    p = max((p for p in m.parameters() if p.ndim == 2), key=lambda p: p.numel())
    with torch.no_grad():
        p.mul_(1.05)
    try:
        assert max(r.max_scaled_diff_h for r in fam.one_step(call, ref)) > 1e-4
    finally:
        with torch.no_grad():
            p.div_(1.05)


def test_xlstm_slstm_reads_fgate_into_the_i_slot():
    fam, make = xlstm_slstm(1)
    call = make(0)
    ref = fam.reference(call)
    assert max(r.max_scaled_diff_h for r in fam.one_step(call, ref)) < TOL
    layer = fam.float64().blocks[0].xlstm
    with torch.no_grad():  # read igate into i, as the names suggest: the check must fail
        layer.fgate.weight, layer.igate.weight = layer.igate.weight, layer.fgate.weight
    try:
        assert max(r.max_scaled_diff_h for r in fam.one_step(call, ref)) > 1e-3
    finally:
        with torch.no_grad():
            layer.fgate.weight, layer.igate.weight = layer.igate.weight, layer.fgate.weight


def test_xlstm_cuda_backend_cells_are_converted_exactly():
    importlib.import_module("xlstm")
    import copy

    from xlstm.blocks.slstm.cell import sLSTMCell_cuda

    from gatelens.families.xlstm_slstm import XLSTMSLSTMFamily, tiny_slstm_stack, to_vanilla

    stack = tiny_slstm_stack(dim=8, blocks=2, heads=2)
    x = torch.randn(2, 7, 8)
    with torch.no_grad():
        want = stack(x)
    cuda = copy.deepcopy(stack)
    for block in cuda.blocks:  # CUDA-backend cells holding the same weights, their layout
        old = block.xlstm.slstm_cell
        cfg = copy.deepcopy(old.config)
        cfg.backend = "cuda"
        new = sLSTMCell_cuda(cfg, skip_backend_init=True)
        with torch.no_grad():
            R = old._recurrent_kernel_int2ext(old._recurrent_kernel_)
            new._recurrent_kernel_.copy_(new._recurrent_kernel_ext2int(R))
            new._bias_.copy_(new._bias_ext2int(old._bias_int2ext(old._bias_)))
        assert not torch.equal(new._bias_.reshape(-1), old._bias_.reshape(-1))  # layouts differ
        block.xlstm.slstm_cell = new
    with pytest.raises(GatelensError, match="to_vanilla"):
        XLSTMSLSTMFamily(cuda)
    with torch.no_grad():
        got = to_vanilla(cuda)(x)
    assert torch.equal(got, want)


def test_xlstm_mixed_stack_is_refused():
    xlstm = importlib.import_module("xlstm")
    from gatelens.families.xlstm_slstm import XLSTMSLSTMFamily

    cfg = xlstm.xLSTMBlockStackConfig(
        mlstm_block=xlstm.mLSTMBlockConfig(), slstm_block=xlstm.sLSTMBlockConfig(
            slstm=xlstm.sLSTMLayerConfig(backend="vanilla", num_heads=2)),
        context_length=8, num_blocks=2, embedding_dim=8, slstm_at=[1])
    stack = xlstm.xLSTMBlockStack(cfg)
    assert XLSTMSLSTMFamily.opens(stack)
    with pytest.raises(GatelensError, match="mixing"):
        XLSTMSLSTMFamily(stack)


def test_opens_by_module_path_not_class_name():
    importlib.import_module("transformers")
    importlib.import_module("mambapy")
    from mambapy.mamba import Mamba, MambaConfig
    from transformers import MambaConfig as HFConfig
    from transformers import MambaModel

    from gatelens.families.hf_mamba import HFMambaFamily
    from gatelens.families.mambapy import MambapyFamily

    mp = Mamba(MambaConfig(d_model=8, n_layers=1, d_state=2))
    hf = MambaModel(HFConfig(vocab_size=5, hidden_size=8, state_size=2, num_hidden_layers=1))
    assert type(mp.layers[0].mixer).__name__ == "MambaBlock" == type(hf.layers[0]).__name__
    assert MambapyFamily.opens(mp) and not MambapyFamily.opens(hf)
    assert HFMambaFamily.opens(hf) and not HFMambaFamily.opens(mp)
    assert not any(F.opens(m) for F in (HFMambaFamily, MambapyFamily)
                   for m in (mp.layers[0].mixer, hf.layers[0]))


def test_hf_mamba_hooks_on_dt_proj_and_conv1d_never_fire():
    # the reason the family recomputes Δ and the convolution from the weights
    fam, make = hf_mamba(1)
    fired = []
    mixer = fam.module.layers[0].mixer
    handles = [mod.register_forward_hook(lambda *a: fired.append(1))
               for mod in (mixer.dt_proj, mixer.conv1d)]
    fam.reference(make(0))
    for h in handles:
        h.remove()
    assert fired == []


def test_bad_calls_are_one_line_errors():
    fam, _ = mingru_lm(1)
    with pytest.raises(GatelensError, match="token ids"):
        fam.check(torch.randn(2, 3, 4))
    with pytest.raises(GatelensError, match="prev_hiddens"):
        fam.check(torch.zeros(2, 3, dtype=torch.long), state=[torch.zeros(1)])
    fam, _ = mambapy_stack(1)
    with pytest.raises(GatelensError, match=r"\(B, T, F\)"):
        fam.check(torch.randn(2, 3))


def test_mingru_step_path_parts_from_the_scan_by_rounding_only():
    # the reference is the package's own sequential path; its log-space scan is reported
    fam, make = mingru_lm(2)
    ref = fam.reference(make(0))
    abs_, scaled = ref.extra["step_vs_forward"]
    assert 0 < scaled < 1e-5


def _inside(model: torch.nn.Module, run) -> tuple:
    """The one module a family opens inside ``model``, and what it received when ``run``
    ran the whole model (as Lens records it with a forward hook)."""
    from gatelens.families.hf_mamba import HFMambaFamily
    from gatelens.families.hf_rwkv import HFRwkvFamily
    from gatelens.families.mambapy import MambapyFamily
    from gatelens.families.xlstm_slstm import XLSTMSLSTMFamily

    found = [(n, cls) for n, mod in model.named_modules()
             for cls in (HFMambaFamily, HFRwkvFamily, MambapyFamily, XLSTMSLSTMFamily)
             if cls.opens(mod)]
    assert len(found) == 1, found
    path, cls = found[0]
    fam = cls(model.get_submodule(path))
    seen = {}
    handle = fam.module.register_forward_hook(
        lambda m, a, k, o: seen.update(call=fam.split_call(a, k)), with_kwargs=True)
    with torch.no_grad():
        out = run()
    handle.remove()
    return fam, fam.check(*seen["call"]), out


@pytest.mark.parametrize("which", ["hf-mamba", "hf-rwkv", "mambapy", "xlstm"])
def test_opened_inside_their_language_models(which):
    from gatelens.lens.lens import output_logits

    ids = torch.randint(0, 11, (2, 10))
    if which == "xlstm":
        xlstm = importlib.import_module("xlstm")
        cfg = xlstm.xLSTMLMModelConfig(
            vocab_size=11, slstm_block=xlstm.sLSTMBlockConfig(slstm=xlstm.sLSTMLayerConfig(
                backend="vanilla", num_heads=2)), context_length=16, num_blocks=1,
            embedding_dim=8, slstm_at="all")
        lm = xlstm.xLSTMLMModel(cfg).eval()
    elif which == "mambapy":
        importlib.import_module("mambapy")
        from mambapy.mamba import Mamba, MambaConfig
        # mambapy 1.2.0's own MambaLM (mambapy.lm) imports mamba_ssm, a CUDA-only package,
        # at import time: on the CPU the stack is wrapped by hand
        lm = torch.nn.Sequential(torch.nn.Embedding(11, 8), Mamba(MambaConfig(
            d_model=8, n_layers=1, d_state=2)), torch.nn.Linear(8, 11)).eval()
    else:
        transformers = importlib.import_module("transformers")
        if which == "hf-mamba":
            lm = transformers.MambaForCausalLM(transformers.MambaConfig(
                vocab_size=11, hidden_size=8, state_size=2, num_hidden_layers=1)).eval()
        else:
            lm = transformers.RwkvForCausalLM(transformers.RwkvConfig(
                vocab_size=11, hidden_size=8, num_hidden_layers=2, context_length=16,
                attention_hidden_size=8, intermediate_size=16)).eval()
    fam, call, out = _inside(lm, lambda: lm(ids))
    assert call.inputs.shape[:2] == (2, 10)
    assert max(r.max_scaled_diff_h for r in fam.one_step(call, fam.reference(call))) < TOL
    assert output_logits(out).shape == (2, 10, 11)  # HF: the ModelOutput's .logits
