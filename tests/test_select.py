"""layers= and names=: reading some of a deep model's recurrent modules and trace names
(readout/select.py), through open_cells and Lens.analyze."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import gatelens
from gatelens.errors import GatelensError
from gatelens.readout.select import keeps_name, select_paths


class Stack(nn.Module):
    """Embedding, then four recurrent modules one after another, then a head."""

    def __init__(self, vocab: int = 6, hidden: int = 5) -> None:
        super().__init__()
        self.emb = nn.Embedding(vocab, hidden)
        self.blocks = nn.ModuleList([nn.LSTM(hidden, hidden, batch_first=True),
                                     nn.GRU(hidden, hidden, batch_first=True),
                                     nn.LSTM(hidden, hidden, batch_first=True),
                                     nn.GRU(hidden, hidden, batch_first=True)])
        self.head = nn.Linear(hidden, vocab)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        x = self.emb(ids)
        for block in self.blocks:
            x = block(x)[0]
        return self.head(x)


@pytest.fixture()
def stack():
    torch.manual_seed(0)
    return Stack().eval()


def test_open_cells_reads_only_the_selected_modules_and_names(stack):
    ids = torch.randint(0, 6, (2, 9))
    with gatelens.open_cells(stack) as full:
        out = stack(ids)
    with gatelens.open_cells(stack, layers=[1, "blocks.3"], names=["h"]) as some:
        assert torch.equal(stack(ids), out)  # the model's output untouched
    assert sorted(some) == ["blocks.1.layer0.h", "blocks.3.layer0.h"]
    for key in some:  # what is kept is exactly what the full read gives
        assert torch.equal(some[key], full[key])
    with gatelens.open_cells(stack, layers="blocks.[02]", names=["c", "f"]) as lstms:
        stack(ids)
    assert sorted(lstms) == ["blocks.0.layer0.c", "blocks.0.layer0.f", "blocks.2.layer0.c",
                             "blocks.2.layer0.f"]


@pytest.mark.parametrize("layers, names, says", [
    ([4], None, "layers: 4 is not one of the 4 recurrent modules (0..3, or -4..-1)"),
    (["dec.*"], None, "layers: 'dec.*' names no recurrent module; they are 'blocks.0'"),
    ([], None, "layers: an empty selection"),
    ([1.5], None, "layers: 1.5 is neither a position nor a module path"),
    ([1], ["c"], "names: 'c' is no trace name of the modules read (they have layer0.r"),
])
def test_a_selection_that_names_nothing_is_one_line(stack, layers, names, says):
    with pytest.raises(GatelensError) as e:
        with gatelens.open_cells(stack, layers=layers, names=names):
            pass
    assert str(e.value).startswith(says)


def test_lens_analyze_measures_only_the_selected_layers(stack, tmp_path):
    lens = gatelens.Lens(stack, list("abcdef"))
    ids = torch.randint(0, 6, (3, 24))
    res = lens.analyze(ids, layers=[-1, 0], perturb_pos=6, exponents=0, out=tmp_path)
    assert list(res.analyses) == ["blocks.0", "blocks.3"]  # the model's order
    assert sorted(p.name for p in tmp_path.iterdir() if p.is_dir()) == ["blocks.0", "blocks.3"]
    whole = lens.analyze(ids, perturb_pos=6, exponents=0)
    for path, a in res.analyses.items():  # the same figures as when every layer is measured
        assert a.report["gates"] == whole.analyses[path].report["gates"]
    with pytest.raises(GatelensError, match="layers: 'head' names no recurrent module"):
        lens.analyze(ids, layers="head", perturb_pos=6)


def test_the_rules():
    assert select_paths(["a", "b"], None) == ["a", "b"]
    assert select_paths(["x.1", "x.10", "y"], "x.1*") == ["x.1", "x.10"]
    assert select_paths(["a", "b", "c"], [-1, "a", 2]) == ["a", "c"]
    assert keeps_name("layer0.f", ["layer0.f"]) and not keeps_name("layer0.ff", ["f"])
