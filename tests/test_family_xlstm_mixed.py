"""The mixed xLSTM family (families/xlstm_mixed.py): an xlstm xLSTMBlockStack of mLSTM blocks
with an sLSTM block at ``slstm_at`` (the xLSTM paper's [7:1] pattern, scaled down), read
block by block. Each block's trace is checked against the one-kind family on a one-block
stack holding that block's weights, fed the block's input from the mixed stack's own run.
"""

from __future__ import annotations

import importlib
import math
import warnings

import jsonschema
import pytest
import torch

import gatelens
from gatelens.analysis.common import pooled
from gatelens.families.registry import family_of
from gatelens.readout.hooks import open_cells
from gatelens.report.html_data import page_data
from gatelens.report.json_report import check_report, schema

xlstm = importlib.import_module("xlstm")

from gatelens.families.xlstm_mixed import XLSTMMixedFamily, spread_gates, tiny_mixed_stack  # noqa: E402
from gatelens.families.xlstm_mlstm import XLSTMMLSTMFamily, tiny_mlstm_stack  # noqa: E402
from gatelens.families.xlstm_slstm import XLSTMSLSTMFamily, tiny_slstm_stack  # noqa: E402

D, B, T, HEADS = 16, 2, 10, 2
MLSTM = ("i", "f", "kappa", "s", "h", "y")
SLSTM = ("z", "i", "f", "o", "kappa", "s", "h", "y")
V, VOCAB = 11, list("abcdefghij ")
TEXT = "abc def ghij jig fed cba " * 40


@pytest.fixture(autouse=True)
def _single_thread(one_thread):
    warnings.filterwarnings("ignore", category=UserWarning)


def _stack(blocks: int = 3) -> torch.nn.Module:
    torch.manual_seed(0)
    return tiny_mixed_stack(dim=D, blocks=blocks, slstm_at=(1,), heads=HEADS)


def _x() -> torch.Tensor:
    return torch.randn(B, T, D, generator=torch.Generator().manual_seed(1))


def test_the_mixed_stack_opens_with_each_blocks_names():
    stack = _stack()
    fam = family_of(stack)
    assert isinstance(fam, XLSTMMixedFamily) and fam.cell == "xlstm_mixed"
    assert fam.kinds == ["mLSTMLayer", "sLSTMLayer", "mLSTMLayer"]
    assert fam.names() == ([f"layer0.{n}" for n in MLSTM] + [f"layer1.{n}" for n in SLSTM]
                           + [f"layer2.{n}" for n in MLSTM])
    assert [fam.unit_count(k) for k in range(3)] == [HEADS, D, HEADS]
    assert fam.describe()["hidden_per_block"] == [HEADS, D, HEADS]
    tr = gatelens.trace(stack, _x())
    assert list(tr) == fam.names() and tr.keep_gate == "kappa"
    assert tr["layer1.kappa"].shape == (B, T, D) and tr["layer0.kappa"].shape == (B, T, HEADS)
    assert torch.equal(tr["layer0.kappa"], tr["layer0.f"])  # an mLSTM block's keep is its f
    assert not torch.equal(tr["layer1.kappa"], tr["layer1.f"])  # an sLSTM block's is κ
    with torch.no_grad():
        want = stack(_x())
        with open_cells(stack) as cache:
            got = stack(_x())
    assert torch.equal(got, want)
    assert torch.equal(cache["layer1.s"], tr["layer1.s"])


def test_one_step_passes_and_one_weight_of_one_block_off_by_a_tenth_of_a_percent_fails():
    fam = XLSTMMixedFamily(_stack())
    call = fam.check(_x())
    ref = fam.reference(call)
    rows = fam.one_step(call, ref)
    assert len(rows) == 3 and max(r.max_scaled_diff_h for r in rows) < 1e-5
    assert gatelens.verify(fam.module, _x()).passed
    for k, wrong in ((1, "xlstm.zgate.weight"), (0, "xlstm.v_proj.weight"),
                     (2, "xlstm.proj_down.weight")):
        fresh = XLSTMMixedFamily(fam.module)
        with torch.no_grad():  # one weight of one block's float64 copy off by 1e-3 relative
            fresh.float64().blocks[k].get_parameter(wrong).mul_(1.001)
        rows = fresh.one_step(call, ref)
        assert rows[k].max_scaled_diff_h > 1e-5, (k, wrong)
        assert all(r.max_scaled_diff_h < 1e-5 for r in rows[:k]), (k, wrong)


def _alone(stack: torch.nn.Module, k: int):
    """A one-block stack of block k's kind holding block k's weights, and its family."""
    kind = type(stack.blocks[k].xlstm).__name__
    if kind == "sLSTMLayer":
        one, cls = tiny_slstm_stack(dim=D, blocks=1, heads=HEADS, conv=2), XLSTMSLSTMFamily
    else:
        one, cls = tiny_mlstm_stack(dim=D, blocks=1, heads=HEADS, conv=2), XLSTMMLSTMFamily
    one.blocks[0].load_state_dict(stack.blocks[k].state_dict(), strict=True)
    return one, cls(one)


def test_each_blocks_trace_is_its_own_kinds_family_run_alone():
    stack = _stack()
    fam = XLSTMMixedFamily(stack)
    call = fam.check(_x())
    ref = fam.reference(call)
    mixed = fam.read(call, ref).signals
    for k in range(3):
        one, single = _alone(stack, k)
        x_k = ref.extra["x"][k]  # block k's input on the mixed stack's own run
        alone = single.read(single.check(x_k), single.reference(single.check(x_k))).signals
        own = [n for n in (SLSTM if k == 1 else MLSTM) if n != "kappa" or k == 1]
        assert sorted(alone) == sorted(f"layer0.{n}" for n in own)
        for n in own:  # s: float64 in a mixed stack (its mLSTM memory's raw scale)
            assert torch.allclose(mixed[f"layer{k}.{n}"].double(), alone[f"layer0.{n}"].double(),
                                  rtol=1e-6, atol=1e-7), (k, n)
        assert mixed[f"layer{k}.s"].dtype == torch.float64
        # and the block's output the stack handed on is the one-block stack's own
        with torch.no_grad():
            y, _ = one.blocks[0].xlstm.step(one.blocks[0].xlstm_norm(x_k[:, :1]))
        assert torch.allclose(y, ref.states[f"layer{k}.y"][:, :1], atol=1e-6)


def _lm() -> torch.nn.Module:
    torch.manual_seed(0)
    cfg = xlstm.xLSTMLMModelConfig(
        vocab_size=V, context_length=32, num_blocks=2, embedding_dim=D, slstm_at=[1],
        mlstm_block=xlstm.mLSTMBlockConfig(mlstm=xlstm.mLSTMLayerConfig(
            num_heads=HEADS, qkv_proj_blocksize=2)),
        slstm_block=xlstm.sLSTMBlockConfig(slstm=xlstm.sLSTMLayerConfig(
            backend="vanilla", num_heads=HEADS)))
    lm = xlstm.xLSTMLMModel(cfg)
    spread_gates(lm.xlstm_block_stack)
    return lm.eval()


def test_lens_analyzes_a_mixed_lm_end_to_end(tmp_path):
    lens = gatelens.Lens(_lm(), vocab=VOCAB)
    ((path, fam),) = lens.families.items()
    assert fam.name == "xlstm-mixed" and path == "xlstm_block_stack"
    result = lens.analyze(TEXT, windows=2, length=16, perturb_pos=6, out=tmp_path,
                          exponents=1)
    assert (tmp_path / "xlstm_block_stack" / "report.json").exists()
    a = result.analyses[path]
    rep = a.report
    check_report(rep)
    jsonschema.validate(rep, schema())
    assert rep["model"]["family"] == "xlstm-mixed" and rep["verification"]["passed"] is True
    assert rep["units"]["gate"] == "kappa" and rep["units"]["n_units"] == HEADS + D
    # the page's unit tables: the mLSTM block's heads, then the sLSTM block's units
    units = page_data(a)["units"]
    assert [len(units[n]["mean"]) for n in ("layer0", "layer1")] == [HEADS, D]
    assert units["layer0"]["mean"] == [pytest.approx(v, abs=1e-3) for v in
                                       a.units.forget_means[:HEADS]]
    assert all(math.isfinite(v) for v in rep["units"]["half_life"].values())
    keep = rep["gates"]["kappa"]
    assert all(0 <= keep[q] <= 1 for q in ("p5", "p50", "p95"))
    # the split, coordinate by coordinate, each block's keep on its own state
    dec, tr, tr2 = a.decomposition, a.trace, a.trace_perturbed
    scale = float(dec["measured"].abs().max())
    assert scale > 0
    assert float((dec["measured"] - dec["forget_path"] - dec["return_path"]).abs().max()) \
        < 1e-5 * max(scale, 1.0)
    ds = (pooled(tr2, "s") - pooled(tr, "s")).double()
    keep_s = torch.cat([tr[f"layer{k}.kappa"][..., fam.state_units(k)] for k in range(2)],
                       dim=-1).double()
    assert torch.allclose(dec["forget_path"][:, 7], keep_s[:, 7] * ds[:, 6], atol=1e-6)
    assert rep["perturbation"]["half_life_forget_only"] is not None


def test_the_recipe_builds_one_slstm_block_among_mlstm_blocks_and_refuses_one_kind():
    from gatelens.errors import GatelensError
    from gatelens.families.xlstm_mixed import MIXED_RECIPE

    s = MIXED_RECIPE.settings
    stack = MIXED_RECIPE.build(D, 8, 3, heads=HEADS, settings=s)
    assert XLSTMMixedFamily(stack).kinds == ["mLSTMLayer", "sLSTMLayer", "mLSTMLayer"]
    assert MIXED_RECIPE.check(8, 1, HEADS) is not None and MIXED_RECIPE.check(8, 2, 2) is None
    with pytest.raises(GatelensError, match="leaves no sLSTM or no mLSTM block"):
        MIXED_RECIPE.build(D, 8, 2, heads=HEADS, settings={**s, "slstm_at": [5]})


def test_the_dynamics_replay_the_stack_and_pool_each_blocks_own_units():
    fam = XLSTMMixedFamily(_stack())
    call = fam.check(_x())
    ref = fam.reference(call)
    (dyn,) = fam.dynamics(call, ref)
    parts = list(dyn.initial)
    for t in dyn.order:  # the float64 step from zeros along the module's own run
        parts = dyn.step(dyn.inputs[:, t], parts)
        for got, want in zip(parts, dyn.trajectory, strict=True):
            assert torch.allclose(got, want[:, t], rtol=1e-4, atol=1e-5), t
        parts = [p[:, t] for p in dyn.trajectory]  # anchored: the next step from the module's
    # units 0 … 1: block 0's heads, 2 … 17: block 1's channels, 18 … 19: block 2's heads
    owned = dyn.units[dyn.units >= 0]
    assert sorted(set(owned.tolist())) == list(range(HEADS + D + HEADS))
    widths = [sum(p.shape[-1] for p in fam.initial_parts(k, 1)) for k in range(3)]
    per = torch.split(dyn.units, widths)
    assert set(per[1][per[1] >= 0].tolist()) == set(range(HEADS, HEADS + D))
