"""nn.GRU as a family: gates r, z, n from the layer's input and PyTorch's own h_{t−1}
(h itself is PyTorch's); the one-step check through equations.py's GRU step.

>>> import torch
>>> from gatelens.families.registry import family_of
>>> fam = family_of(torch.nn.GRU(3, 4, batch_first=True))
>>> call = fam.check(torch.randn(2, 5, 3)); ref = fam.reference(call)
>>> list(fam.read(call, ref).signals), fam.one_step(call, ref)[0].max_abs_diff_h < 1e-6
(['layer0.r', 'layer0.z', 'layer0.n', 'layer0.h'], True)
"""

from __future__ import annotations

import abc

import torch
from torch import Tensor, nn

from gatelens.cells.equations import cell_weights, step
from gatelens.cells.names import layer_name
from gatelens.families.base import Call, LayerDiff, Readout, Reference
from gatelens.families.lstm import input_projection, one_hot_ids
from gatelens.families.spec import SIGMOID, TANH, CellSpec
from gatelens.families.torch_rnn import TorchRNNFamily, max_diff, previous
from gatelens.families.torch_train import torch_recipe

#: a reader's names of the GRU's gates
GRU_NAMES = {"r": "reset", "z": "update (keep)", "n": "new"}
GRU = CellSpec(
    name="gru", kind="gru", mode="GRU", chunks=("r", "z", "n"),
    signals=("r", "z", "n", "h"), gates=("r", "z", "n"), keep_gate="z", input_gate=None,
    state="h", candidate="n", bounds={"r": SIGMOID, "z": SIGMOID, "n": TANH},
    display=GRU_NAMES, return_path=("r", "z", "n"), carried=("h",))


def recurrent_projection(h: Tensor, h0: Tensor, w_hh: Tensor, b_hh: Tensor | None,
                         reverse: bool) -> Tensor:
    """W_hh h_{t−1} + b_hh at every step, time-major (T, B, G), h_{t−1} the module's own."""
    prev = previous(h, h0, reverse).transpose(0, 1)  # (T, B, H)
    out = torch.matmul(prev, w_hh.t())  # (T, B, G)
    return out if b_hh is None else out.add_(b_hh)


class TorchFamilyNoCell(TorchRNNFamily):
    """GRU and RNN: h is PyTorch's own; the one-step check is equations.py's step."""

    def read(self, call: Call, ref: Reference) -> Readout:
        out: dict[str, Tensor] = {}
        h_n = []
        with torch.no_grad():
            for k, reverse, name, _ in self.directions_of():
                w = cell_weights(self.module, k, reverse)
                X = ref.inputs[layer_name(k)]  # (B, T, F_k)
                h = ref.states[name + ".h"]  # (B, T, H)
                xw = input_projection(w.w_ih, X, one_hot_ids(X) if k == 0 else None)
                if w.b_ih is not None:
                    xw += w.b_ih
                hw = recurrent_projection(h, ref.initial[name][0], w.w_hh, w.b_hh, reverse)
                sig = {s: t.transpose(0, 1) for s, t in self.gates(xw, hw).items()}  # (B, T, ·)
                sig["h"] = h
                out.update({f"{name}.{s}": t for s, t in sig.items()})
                h_n.append(h[:, 0 if reverse else -1])
        return Readout({n: out[n] for n in self.names()}, torch.stack(h_n), None,
                       {"method": "anchored"})

    @abc.abstractmethod
    def gates(self, xw: Tensor, hw: Tensor) -> dict[str, Tensor]:
        """The cell's signals but h from W x + b_ih and W h + b_hh, (T, B, ·) each."""

    def one_step(self, call: Call, ref: Reference) -> list[LayerDiff]:
        rows = []
        with torch.no_grad():
            for k, reverse, name, _ in self.directions_of():
                h = ref.states[name + ".h"]
                sig = step(cell_weights(self.module, k, reverse), ref.inputs[layer_name(k)],
                           previous(h, ref.initial[name][0], reverse))
                rows.append(LayerDiff(k, reverse, max_diff(sig["h"], h), None))
        return rows


class GRUFamily(TorchFamilyNoCell):
    """nn.GRU, any layers, directions, bias."""

    name = "gru"
    opens_what = "nn.GRU"
    module_class = nn.GRU
    specs = (GRU,)
    recipe = torch_recipe("gru", nn.GRU, specs, "GRU z", "PyTorch's nn.GRU")

    def gates(self, xw: Tensor, hw: Tensor) -> dict[str, Tensor]:
        xr, xz, xn = xw.chunk(3, dim=-1)  # (T, B, H) each
        hr, hz, hn = hw.chunk(3, dim=-1)
        r = torch.sigmoid(xr + hr)
        return {"r": r, "z": torch.sigmoid(xz + hz), "n": torch.tanh(xn + r * hn)}
