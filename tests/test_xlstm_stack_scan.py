"""xlstm's block stacks read from their own whole-sequence forward (families/
xlstm_stack_scan.py): every state agrees with the package's own step path of the whole
stack (the independent per-token reference) to float32 rounding, the reference's output is
the module's own forward, the module runs once, and a replay that is off shows."""

from __future__ import annotations

import importlib
import warnings

import pytest
import torch

import gatelens
from gatelens.families.official import scaled_diff

xlstm = importlib.import_module("xlstm")

from gatelens.families.xlstm_mixed import XLSTMMixedFamily, tiny_mixed_stack  # noqa: E402
from gatelens.families.xlstm_mlstm import XLSTMMLSTMFamily, tiny_mlstm_stack  # noqa: E402
from gatelens.families.xlstm_slstm import XLSTMSLSTMFamily, tiny_slstm_stack  # noqa: E402

B, T, D = 2, 14, 16


@pytest.fixture(autouse=True)
def _quiet(one_thread):
    warnings.filterwarnings("ignore", category=UserWarning)


def _family(kind: str):
    torch.manual_seed(0)
    if kind == "mlstm":
        return XLSTMMLSTMFamily(tiny_mlstm_stack(dim=D, blocks=2, heads=2).eval())
    if kind == "slstm":
        return XLSTMSLSTMFamily(tiny_slstm_stack(dim=D, blocks=2, heads=2).eval())
    return XLSTMMixedFamily(tiny_mixed_stack(dim=D, blocks=3, slstm_at=(1,), heads=2).eval())


def _call(fam):
    return fam.check(torch.randn(B, T, D, generator=torch.Generator().manual_seed(1)))


@pytest.mark.parametrize("kind", ["mlstm", "slstm", "mixed"])
def test_the_forward_read_is_the_step_path_to_rounding(kind):
    fam = _family(kind)
    call = _call(fam)
    with torch.no_grad():
        read, step = fam._forward_trajectory(call), fam._trajectory(call)
        own = fam.module(call.inputs)
    assert len(read["parts"]) == fam.num_layers
    for k in range(fam.num_layers):
        for got, ref in zip(read["parts"][k], step["parts"][k], strict=True):
            assert got.dtype == torch.float64 and got.shape == ref.shape
            assert scaled_diff(got, ref)[1] < 1e-5
        assert scaled_diff(read["aux"][k], step["aux"][k])[1] < 1e-5
        for key in ("x", "u", "y", "xo"):
            assert scaled_diff(read[key][k], step[key][k])[1] < 1e-5
    assert torch.equal(read["output"], own)  # the module's own forward, not a re-run
    gap = read["step_vs_forward"]  # the mLSTM blocks' h (an sLSTM cell's is its own loop)
    assert gap is None if kind == "slstm" else 0 <= gap[1] < 1e-5
    ref = fam.reference(call)
    assert max(d.max_scaled_diff_h for d in fam.one_step(call, ref)) < 1e-5


@pytest.mark.parametrize("kind", ["mlstm", "slstm", "mixed"])
def test_the_stack_runs_once_and_no_block_is_stepped(kind):
    """The reference is one forward of the stack: no layer's ``step`` runs."""
    fam = _family(kind)
    calls = {"forward": 0, "step": 0}
    stack = fam.module
    stack.register_forward_hook(lambda *a: calls.__setitem__("forward", calls["forward"] + 1))
    for block in stack.blocks:
        step = block.xlstm.step

        def counted(*a, _step=step, **k):
            calls["step"] += 1
            return _step(*a, **k)
        block.xlstm.step = counted
    fam.reference(_call(fam))
    assert calls == {"forward": 1, "step": 0}


def test_a_replay_that_is_off_fails_the_one_step_check():
    """Block 0's replayed memory with its input gate shifted is no longer what the hand
    cell computes from the block's own input: the check says so."""
    fam = _family("mixed")
    call = _call(fam)
    cell = fam.module.blocks[0].xlstm.mlstm_cell
    own = cell.backend_fn_step

    def shifted(**kw):
        kw["igate_preact"] = kw["igate_preact"] + 0.5
        return own(**kw)
    cell.backend_fn_step = shifted
    ref = fam.reference(call)
    rows = fam.one_step(call, ref)
    assert rows[0].max_scaled_diff_h > 1e-3 and max(r.max_scaled_diff_h for r in rows[1:]) < 1e-5


def test_open_cells_reads_the_users_own_forward():
    """``open_cells`` on a mixed stack: the module runs once (its own forward, recorded),
    and the trace is ``trace``'s."""
    fam = _family("mixed")
    stack, x = fam.module, _call(fam).inputs
    want = gatelens.trace(stack, x)
    runs = []
    stack.register_forward_hook(lambda *a: runs.append(1))
    with torch.no_grad(), gatelens.open_cells(stack) as cache:
        stack(x)
    assert len(runs) == 1
    for k in range(fam.num_layers):
        assert torch.equal(cache[f"layer{k}.s"], want[f"layer{k}.s"])


@pytest.mark.parametrize("kind", ["mlstm", "mixed"])
def test_mlstm_blocks_are_traced_with_the_packages_own_signals(kind):
    """Every mLSTM block's signals as the package computed them (``read_own``), within
    float32 rounding of the float64 hand cell's; an sLSTM block's by the hand cell (its gates
    stay inside its cell's step), named in the trace, and refused by ``method="own"``."""
    fam = _family(kind)
    x = _call(fam).inputs
    own, hand = gatelens.trace(fam.module, x), gatelens.trace(fam.module, x, method="anchored")
    assert own.meta["method"] == "own" and hand.meta["method"] == "anchored"
    assert own.meta.get("hand_cell_layers") == (None if kind == "mlstm" else [1])
    assert list(own) == list(hand)
    for n in own:
        assert scaled_diff(own[n], hand[n])[1] < 1e-5, n
        if kind == "mixed" and n.startswith("layer1."):  # the sLSTM block: the hand cell's
            assert torch.equal(own[n], hand[n])
    if kind == "mixed":
        with pytest.raises(ValueError, match=r"for layers \[1\]"):
            gatelens.trace(fam.module, x, method="own")
    else:
        assert gatelens.trace(fam.module, x, method="own").meta["method"] == "own"


@pytest.mark.parametrize("width", [(2, 8), (4, 24)])
def test_the_scanned_replay_is_the_step_function_bit_for_bit(width) -> None:
    """The package's ``recurrent_step_stabilized_simple`` replayed as a scan (the stabiliser
    a step at a time, C and n as linear recurrences: ``xlstm_scan.scanned``) gives the states
    the step function itself gives called a token at a time, bit for bit; h to float32
    rounding (a check figure, formed for every step in one product)."""
    from gatelens.families.xlstm_stack_scan import _replay

    fam = _family("mlstm")
    step = fam.module.blocks[0].xlstm.mlstm_cell.backend_fn_step
    assert step.__name__ == "recurrent_step_stabilized_simple"
    NH, d = width
    gen = torch.Generator().manual_seed(5)
    q, k, v = (torch.randn(3, 40, NH * d, generator=gen) for _ in range(3))
    i, f = (3 * torch.randn(3, 40, NH, generator=gen) for _ in range(2))
    scanned = _replay(step, NH, q, k, v, i, f)
    called = _replay(lambda **kw: step(**kw), NH, q, k, v, i, f)  # not known: a call a token
    for a, b in zip(scanned[1:], called[1:], strict=True):  # C, n, m
        assert torch.equal(a, b)
    assert scaled_diff(scanned[0], called[0])[1] < 1e-6
