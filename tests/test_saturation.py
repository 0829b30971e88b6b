"""Gate saturation: a 2-layer LSTM with its forget gates forced shut and open, the gates each
cell has, strict thresholds, and chunks equal to one shot."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch
from torch import nn

from gatelens.analysis.saturation import SaturationAccumulator, gate_saturation
from gatelens.cells.modern import SLSTM, MinGRU, MinLSTM
from gatelens.readout.trace import trace
from gatelens.readout.trace_types import Trace

pytestmark = pytest.mark.usefixtures("one_thread")


def test_forced_forget_gates_through_the_real_trace() -> None:
    torch.manual_seed(0)
    H = 6
    m = nn.LSTM(4, H, num_layers=2, batch_first=True)
    with torch.no_grad():  # f = σ(b) with |z| ≤ ~1 otherwise: layer 0 shut, layer 1 open
        for k, b in ((0, -12.0), (1, 12.0)):
            getattr(m, f"bias_ih_l{k}")[H : 2 * H] = b
    x = torch.randn(3, 20, 4)
    tr = trace(m, x)
    s = gate_saturation(tr)
    assert s.gates == ["i", "f", "o"] and s.positions == 60
    assert np.array_equal(s.left["f"], [1.0] * H + [0.0] * H)
    assert np.array_equal(s.right["f"], [0.0] * H + [1.0] * H)
    assert s.keep_right_majority == H and s.describe().startswith(f"{H} of {2 * H} units")
    # i and o against a recount of PyTorch's own states' gates, by numpy
    for g in ("i", "o"):
        v = np.concatenate([tr[f"layer{k}.{g}"].numpy() for k in range(2)], -1)  # (B, T, 2H)
        assert np.array_equal(s.left[g], (v < 0.1).mean((0, 1)))
        assert np.array_equal(s.right[g], (v > 0.9).mean((0, 1)))
    d = s.to_dict()
    assert list(d) == ["i", "f", "o", "keep_right_majority"] and list(d["f"]) == ["left", "right"]
    assert json.loads(json.dumps(d)) == d and len(d["i"]["left"]) == 2 * H


def test_every_cell_has_its_gates_and_chunks_add_up() -> None:
    torch.manual_seed(1)
    x = torch.randn(4, 12, 3)
    cases = {nn.GRU(3, 5, batch_first=True): ["r", "z"], MinGRU(3, 5): ["z", "keep"],
             MinLSTM(3, 5): ["f", "i", "keep"], SLSTM(3, 5): ["i", "f", "o", "kappa"]}
    for m, gates in cases.items():
        tr = trace(m, x)
        one = gate_saturation(tr)
        assert one.gates == gates
        acc = SaturationAccumulator()
        for a, b in ((0, 1), (1, 4)):
            acc.update(Trace(tr.cell, tr.num_layers, False,
                             {n: t[a:b] for n, t in tr.items()}))
        two = acc.result()
        for g in gates:
            assert np.array_equal(one.left[g], two.left[g])
            assert np.array_equal(one.right[g], two.right[g])
    rnn = gate_saturation(trace(nn.RNN(3, 5, batch_first=True), x))
    assert rnn.gates == [] and rnn.to_dict() == {"keep_right_majority": None}


def test_thresholds_are_strict() -> None:
    z = torch.tensor([0.1, 0.9, 0.0999, 0.9001], dtype=torch.float64).view(1, 4, 1)
    s = gate_saturation(Trace("gru", 1, False, {"layer0.r": z, "layer0.z": z}))
    assert s.left["z"].tolist() == [0.25] and s.right["z"].tolist() == [0.25]
    assert s.keep_right_majority == 0
