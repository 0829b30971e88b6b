"""``gatelens train --cell rwkv7``: RWKV-7 trained in PyTorch in the ``rwkv`` package's own
layout (families/rwkv7_train.py), analysed through the package's ``RWKV_x070``.

Checked here: the trainable module computes what the package computes (its logits against
the package's ``forward_seq`` on the package's model built from the same weights, with every
zero-initialised parameter moved so no path hides), and the package's model follows the
weights when they change; its weights are the package's checkpoint layout (names and shapes
of tests/rwkv7_models.py's checkpoint, which the family test loads through the package); a
few training steps lower the loss, and the run's safetensors are a checkpoint the package
itself loads to the same logits as ``load_run``'s model. Why the package's own model cannot
be trained is a test too: its whole-window time mix refuses a backward pass (if a later
rwkv allows it, training through the package becomes possible and this test says so).
test_official_train.py runs every official cell's checks on rwkv7 as well: reopening, the
parameter count, and ``analyze RUN`` verified against the package's own one-token step.
"""

from __future__ import annotations

import sys
import types
import warnings
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from gatelens.errors import GatelensError
from gatelens.families.official import scaled_diff
from gatelens.families.registry import family_of
from gatelens.families.rwkv7 import RWKV7LM, RWKV7Family
from gatelens.families.rwkv7_train import RWKV7Trainable, rwkv7_package
from gatelens.lens.run import load_run
from gatelens.training.config import TrainConfig
from gatelens.training.runs import read_history
from gatelens.training.train import train

sys.path.insert(0, str(Path(__file__).parent))  # the shared builder (importlib mode)
from rwkv7_models import C, N, V, pkg, weights  # noqa: E402

pytestmark = pytest.mark.filterwarnings("ignore:.*torch.jit.*:DeprecationWarning")
TEXT = "the cat sat on the mat; a dog ran far away!\n" * 60


@pytest.fixture(autouse=True)
def _single_thread(one_thread):
    pass


def _moved(seed: int = 0) -> RWKV7Trainable:
    """A model whose every parameter is off its initial value (the output projections and
    the LoRAs' first matrices start at 0, which would hide the paths behind them)."""
    torch.manual_seed(seed)
    m = RWKV7Trainable(V, C, 2, N)
    with torch.no_grad():
        for p in m.parameters():
            p.add_(0.2 * torch.randn_like(p))
    return m


def test_the_trainable_module_computes_what_the_package_computes():
    m = _moved()
    ids = torch.randint(0, V, (2, 24), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        ours, theirs = m(ids), RWKV7LM(m.rwkv)(ids)
        assert scaled_diff(ours, theirs)[1] < 1e-5
        assert float(theirs.abs().max()) > 1  # logits that are not flat
        first = m.rwkv
        assert m.rwkv is first  # built once while the weights stand still
        m.blocks[1].att.w0.add_(0.5)  # a decay changed: the package's model follows
        assert m.rwkv is not first
        moved = RWKV7LM(m.rwkv)(ids)
        assert scaled_diff(m(ids), moved)[1] < 1e-5 and (moved - theirs).abs().max() > 1e-3
    fam = family_of(m)  # the family opens the trainable module through the package's model
    assert isinstance(fam, RWKV7Family) and fam.model is m.rwkv
    assert fam.describe()["implementation"] == "rwkv.model.RWKV_x070"


def test_its_weights_are_the_package_checkpoint_layout():
    ours = {n: tuple(t.shape) for n, t in RWKV7Trainable(V, C, 2, N).state_dict().items()}
    theirs = {n: tuple(t.shape) for n, t in weights(2).items()}
    assert set(ours) == set(theirs)
    # the widths of the LoRAs and of the channel mix are choices: RWKV-LM's here
    free = (".w1", ".w2", ".a1", ".a2", ".v1", ".v2", ".g1", ".g2", "ffn.key.weight",
            "ffn.value.weight")
    assert {n: s for n, s in ours.items() if not n.endswith(free)} == {
        n: s for n, s in theirs.items() if not n.endswith(free)}
    assert ours["blocks.1.ffn.key.weight"] == (4 * C, C) and ours["blocks.1.att.g1"] == (C, 32)


@torch.no_grad()
def test_the_initialisation_is_rwkv_lm_s():
    torch.manual_seed(0)
    m = RWKV7Trainable(V, C, 2, N)  # C = 32, heads of N = 16
    att0, att1 = m.blocks[0].att, m.blocks[1].att
    # worked by hand from RWKV-LM's formulas: channel 0 and C − 1 of the bottom layer
    # (zig-zag −1 and +1 at a head's ends; the decay ramp −6 ... 0; the slope −0.5 ... 0.5)
    assert att0.w0.view(-1)[[0, C - 1]].tolist() == pytest.approx([-8.0, 3.0])
    assert att0.a0.view(-1)[[0, C - 1]].tolist() == pytest.approx([-0.69, 0.31])
    assert att0.x_r.view(-1)[0] == 1.0 and att1.x_r.view(-1)[16] == pytest.approx(
        1 - 0.5 ** 0.1)  # 1 − (c/C)^(0.2 (1 − k/L)) at layer 1
    assert att1.v0.view(-1)[0] == pytest.approx(0.93) and not hasattr(att0, "v0")
    assert float(att0.r_k.mean()) == pytest.approx(-0.04) and att0.k_a.eq(1.02).all()
    assert att0.output.weight.eq(0).all() and m.blocks[0].ffn.value.weight.eq(0).all()
    assert att0.w1.eq(0).all() and att0.g1.eq(0).all()  # LoRAs start closed
    sv = torch.linalg.svdvals  # orthogonal × gain: every singular value the gain
    assert sv(att0.w2).tolist() == pytest.approx([0.1] * 32, abs=1e-6)
    assert sv(m.blocks[1].ffn.key.weight).tolist() == pytest.approx([2.0] * C, abs=1e-5)
    lim = 0.05 / C ** 0.5
    assert float(att0.key.weight.abs().max()) <= lim and m.head.bias is None


def test_the_package_whole_window_path_refuses_a_backward_pass():
    z = {n: t.squeeze() if t.dim() == 3 else t for n, t in weights(1).items()}
    a = "blocks.0.att."
    names = ("x_r", "x_w", "x_k", "x_v", "x_a", "x_g", "w0", "w1", "w2", "a0", "a1", "a2")
    args = [z[a + n].clone().requires_grad_() for n in names]
    rest = [z[a + n].clone().requires_grad_() for n in ("g1", "g2", "k_k", "k_a")]
    proj = [z[f"{a}{n}.weight"].t().contiguous().requires_grad_()
            for n in ("receptance", "key", "value", "output")]
    H = C // N
    out = pkg.RWKV_x070_TMix_seq(
        0, H, N, torch.randn(6, C), torch.zeros(C), torch.empty(0), torch.zeros(H, N, N),
        *args, torch.empty(0), torch.empty(0), torch.empty(0), *rest,
        z[a + "r_k"].flatten().requires_grad_(), *proj, z[a + "ln_x.weight"],
        z[a + "ln_x.bias"])[0]
    with pytest.raises(RuntimeError, match="inplace operation"):
        out.sum().backward()


def test_a_few_steps_lower_the_loss_and_the_package_loads_the_checkpoint(tmp_path):
    corpus = tmp_path / "c.txt"
    corpus.write_text(TEXT, encoding="utf-8")
    cfg = TrainConfig(corpus=str(corpus), cell="rwkv7", hidden=16, layers=2, steps=16,
                      seq=32, batch=8, eval_every=8, val_windows=4, lr=5e-3)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        train(cfg, tmp_path / "r", progress=False)
    val = read_history(tmp_path / "r")["val_loss"]
    assert len(val) == 3 and val[-1] < val[0] - 1.0, val  # ln 20 ≈ 3.0 at the start
    # the run's weights, under rnn., are a checkpoint the package loads itself
    tensors = {n.removeprefix("rnn."): t for n, t in
               load_file(str(tmp_path / "r" / "model.safetensors")).items()}
    assert set(tensors) == set(weights(2))
    torch.save(tensors, tmp_path / "own.pth")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        theirs = pkg.RWKV_x070(str(tmp_path / "own"), "cpu fp32")
    run = load_run(tmp_path / "r")
    ids = torch.randint(0, theirs.z["emb.weight"].shape[0], (2, 20))
    with torch.no_grad():
        assert scaled_diff(run.model(ids)[0], RWKV7LM(theirs)(ids))[1] < 1e-5


def test_bad_settings_are_one_line_errors(monkeypatch):
    with pytest.raises(GatelensError, match="multiple of 16"):
        TrainConfig(cell="rwkv7", hidden=40).validate()
    with pytest.raises(GatelensError, match="does not apply|applies to"):
        TrainConfig(cell="rwkv7", hidden=32, embed=8).validate()
    # rwkv.model imported before RWKV_V7_ON=1: no RWKV_x070 in it
    monkeypatch.setitem(sys.modules, "rwkv.model", types.ModuleType("rwkv.model"))
    with pytest.raises(GatelensError, match="without RWKV_V7_ON=1"):
        rwkv7_package()
