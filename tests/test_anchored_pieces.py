"""The anchored read of an official family a piece of steps at a time
(``families.official_layers.anchored_layer``): each step reads nothing but the module's own
state before it, so the pieces give the window's values, and the one-step check at depth
holds one piece's float64 work, not a layer's (24 Mamba-2 layers of mamba2-130m's width:
0.75 GB a window)."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

import gatelens
from gatelens.families import official_layers
from gatelens.families.official import OfficialFamily
from gatelens.families.registry import family_classes, open_family

sys.path.insert(0, str(Path(__file__).parent))  # the shared builders (importlib mode)
from test_open_cells_families import VOCAB, whole_model  # noqa: E402

pytestmark = [pytest.mark.usefixtures("one_thread"),
              pytest.mark.filterwarnings("ignore:.*torch.jit.*:DeprecationWarning")]

OFFICIAL = [c.name for c in family_classes() if issubclass(c, OfficialFamily)]


def test_every_official_family_is_read_here():
    assert len(OFFICIAL) >= 10 and set(OFFICIAL) <= set(gatelens.families())


@pytest.mark.parametrize("name", OFFICIAL)
def test_the_anchored_read_in_pieces_is_the_windows(name, monkeypatch):
    model, path, reads = whole_model(name)
    fam = open_family(model.get_submodule(path))
    ids = torch.randint(0, VOCAB, (2, 9), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        call = fam.check(reads(ids))
        ref = fam.reference(call)
        whole = fam.read(call, ref).signals
        steps: list[int] = []
        step_cell = fam.step_cell
        monkeypatch.setattr(fam, "step_cell", lambda k, m, u, *a, **kw: (
            steps.append(u.shape[0]) or step_cell(k, m, u, *a, **kw)))
        monkeypatch.setattr(official_layers, "PIECE_BYTES", 1)  # one step a piece
        pieces = fam.read(call, ref).signals
    assert set(steps) == {2} and len(steps) == 9 * fam.num_layers  # B rows a call
    assert list(pieces) == list(whole)
    for n, v in whole.items():
        assert pieces[n].dtype == v.dtype and pieces[n].shape == v.shape, n
        assert torch.allclose(pieces[n], v, rtol=1e-6, atol=1e-7), (
            n, float((pieces[n] - v).abs().max()))
    # and the checks read from it: the one-step rows the same to float rounding
    rows = fam.one_step(call, ref)
    assert all(r.max_abs_diff_h < 1e-4 for r in rows), [r.max_abs_diff_h for r in rows]
