"""The float64 copy that widens its largest Linear weights at each call (families/upcast.py):
the same figures bit for bit as a float64 copy of every weight, none of the module's own
weights copied or converted, and the analysis's estimate of the copy counting what it holds."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

import gatelens
from gatelens.families import upcast

sys.path.insert(0, str(Path(__file__).resolve().parent))
import official_models as om  # noqa: E402

#: the families that widen (the Mamba cells: their hand cell reads each Linear over many
#: rows a call), and some that do not (a token at a time: widening would cost more than it
#: saves, 4× on xLSTM-7B's block, so their copy holds every weight)
WIDENING = [om.hf_mamba, om.hf_mamba2, om.mambapy_stack]
HOLDING = [om.hf_rwkv, om.mingru_lm, om.xlstm_mlstm]


def _figures(build):
    """Every float64 figure of one family on one call: the one-step and free-running rows,
    the dynamics' first Jacobian-vector product, the anchored trace and verify's verdict."""
    fam, make = build(layers=2)
    call = make(5)
    ref = fam.reference(call)
    one = [(r.max_abs_diff_h, r.max_scaled_diff_h) for r in fam.one_step(call, ref)]
    free = [(r.max_abs_diff_h, r.max_scaled_diff_h) for r in fam.free_running(call, ref)]
    dyn = fam.dynamics(call, ref)[0]
    t = dyn.order[-1]  # the last step's Jacobian-vector product, the spectrum's operation
    prev = [p[:, t - 1].double() for p in dyn.trajectory]
    _, tangent = torch.func.jvp(lambda *s: tuple(dyn.step(dyn.inputs[:, t], list(s))),
                                tuple(prev), tuple(torch.ones_like(p) for p in prev))
    x = call.layout.get("ids", call.inputs)  # what the module itself takes
    anchored = gatelens.trace(fam.module, x, method="anchored")
    res = gatelens.verify(fam.module, x)
    kinds = {type(m).__name__ for m in fam.float64().modules()}
    return fam, kinds, (one, free, tangent, {k: v.clone() for k, v in anchored.items()},
                        res.passed, res.one_step_max_abs_diff_h)


@pytest.mark.filterwarnings("ignore:.*torch.jit.script.*deprecated:DeprecationWarning")
@pytest.mark.parametrize("build", WIDENING, ids=lambda b: b.__name__)
def test_widened_weights_give_the_float64_copys_figures_bit_for_bit(monkeypatch, build):
    monkeypatch.setattr(upcast, "UPCAST_NUMBERS", 10**12)  # no Linear widened
    _, kinds, whole = _figures(build)
    assert "UpcastLinear" not in kinds
    monkeypatch.setattr(upcast, "UPCAST_NUMBERS", 1)  # every Linear widened
    fam, kinds, widened = _figures(build)
    assert "UpcastLinear" in kinds and "Linear" not in kinds
    one, free, _, anchored, passed, worst = whole
    assert widened[0] == one and widened[1] == free and widened[4:] == (passed, worst)
    assert all(torch.equal(a, b) for a, b in zip(widened[2], whole[2], strict=True))
    assert widened[3].keys() == anchored.keys()
    for name, v in anchored.items():
        assert torch.equal(widened[3][name], v), name
    # the module's own weights: not converted, not copied, still its own parameters
    own = {id(p) for p in fam.module.parameters()}
    for m in fam.float64().modules():
        if isinstance(m, upcast.UpcastLinear):
            assert m.source.weight.dtype == torch.float32 and id(m.source.weight) in own
            assert m.weight.dtype == torch.float64 and not m.weight.requires_grad
            assert all(id(p) not in own for p in m.parameters())  # its bias is the copy's


@pytest.mark.parametrize("build", HOLDING, ids=lambda b: b.__name__)
def test_a_family_stepping_a_token_at_a_time_holds_every_weight(monkeypatch, build):
    monkeypatch.setattr(upcast, "UPCAST_NUMBERS", 1)
    fam, _ = build(layers=1)
    assert not any(isinstance(m, upcast.UpcastLinear) for m in fam.float64().modules())
    assert any(type(m) is torch.nn.Linear for m in fam.float64().modules())


def test_a_large_linear_is_widened_and_the_estimate_counts_what_the_copy_holds():
    fam, _ = om.hf_mamba(layers=2)
    linears = [m for m in fam.module.modules() if type(m) is torch.nn.Linear]
    full = fam.float64_bytes()
    old = upcast.UPCAST_NUMBERS
    try:
        upcast.UPCAST_NUMBERS = min(m.weight.numel() for m in linears)
        widened = sum(m.weight.numel() + (0 if m.bias is None else m.bias.numel())
                      for m in linears) * 8
        assert fam.float64_bytes() == full - widened
        m64 = type(fam)(fam.module).float64()  # a fresh family: a fresh copy
        held = sum(p.numel() * 8 for p in m64.parameters())
        assert not any(type(m) is torch.nn.Linear for m in m64.modules())
        table = m64.get_input_embeddings().weight.numel() * 8  # its one-row stand-in
        assert held == fam.float64_bytes() + table + sum(
            m.bias.numel() * 8 for m in linears if m.bias is not None)
    finally:
        upcast.UPCAST_NUMBERS = old


def test_the_copy_follows_the_modules_own_weights():
    """The widened weight is the module's own: a weight the user changes shows in the hand
    cell at once (and the copy is made again anyway: ``_weights_version``)."""
    lin = torch.nn.Linear(3, 2)
    wide = upcast.UpcastLinear(lin).double()
    x = torch.randn(4, 3, dtype=torch.float64)
    with torch.no_grad():
        lin.weight.mul_(2)
    assert torch.equal(wide(x), torch.nn.functional.linear(x, lin.weight.double(),
                                                           lin.bias.double()))
    assert lin.weight.dtype == torch.float32 and "widened" in repr(wide)
