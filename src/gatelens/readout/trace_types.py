"""The Trace container: every gate of a recurrent module, by stable name.

A Trace is a read-only mapping from names such as ``layer0.f`` to tensors shaped
``(B, T, H)``, batch first whatever the module's ``batch_first``. The names are public
API (see ``gate_names``); docs/methods.md gives the equations they come from.

>>> import torch
>>> f = torch.full((2, 3, 4), 0.5)
>>> tr = Trace(cell="lstm", num_layers=1, bidirectional=False, tensors={"layer0.f": f})
>>> tr["layer0.f"].shape
torch.Size([2, 3, 4])
>>> tr.keep_gate, tr.state_name
('f', 'c')
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field

from torch import Tensor

from gatelens.families.registry import cell_spec, gate_names
from gatelens.families.spec import CellSpec, layer_name

__all__ = ["Trace", "gate_names"]


@dataclass(frozen=True)
class Trace(Mapping[str, Tensor]):
    """Opened cells of one recurrent module on one input.

    Attributes:
        cell: "lstm", "gru", "rnn_tanh" or "rnn_relu".
        num_layers: stacked layers of the module.
        bidirectional: whether ``layerK.reverse.*`` names are present.
        tensors: name -> (B, T, H) tensor (``h`` is (B, T, proj_size) for a projected LSTM).
        lengths: (B,) valid lengths for PackedSequence input, else None; positions at or
            past a sequence's length hold zeros.
        h_n: final hidden state as the module returns it, (layers * directions, B, H_out).
        c_n: final cell state (LSTM only), (layers * directions, B, H).
        meta: free-form facts about the run (gatelens.trace records method, dtype, device,
            batch_first, unbatched, chunk).
        proj_size: the LSTM's proj_size (0 when not projected); when > 0 each layer and
            direction also holds ``m`` = o ⊙ tanh(c), (B, T, H), and ``h`` is (B, T, P).
    """

    cell: str
    num_layers: int
    bidirectional: bool
    tensors: dict[str, Tensor]
    lengths: Tensor | None = None
    h_n: Tensor | None = None
    c_n: Tensor | None = None
    meta: dict = field(default_factory=dict)
    proj_size: int = 0

    def __getitem__(self, name: str) -> Tensor:
        try:
            return self.tensors[name]
        except KeyError:
            raise KeyError(f"{name!r} is not in this trace; it holds {list(self.tensors)}"
                           ) from None

    def __iter__(self) -> Iterator[str]:
        return iter(self.tensors)

    def __len__(self) -> int:
        return len(self.tensors)

    @property
    def spec(self) -> CellSpec:
        """The cell's facts (``gatelens.families.spec``)."""
        return cell_spec(self.cell)

    @property
    def keep_gate(self) -> str | None:
        """The gate that scales the carried state: f (LSTM), z (GRU), None (RNN)."""
        return self.spec.keep_gate

    @property
    def state_name(self) -> str:
        """The carried state s (docs/methods.md): c for the LSTM, h for GRU and RNN."""
        return self.spec.state

    @property
    def gates(self) -> tuple[str, ...]:
        """The gate letters of this cell (i, f, g, o / r, z, n / none)."""
        return self.spec.gates

    def layer(self, k: int, reverse: bool = False) -> dict[str, Tensor]:
        """Signals of one layer and direction, keyed by the bare letter (``f``, ``h``...)."""
        prefix = layer_name(k, reverse) + "."
        return {n[len(prefix):]: self.tensors[n] for n in self.tensors if n.startswith(prefix)
                and "." not in n[len(prefix):]}  # only its names read (a lazy mapping's too)
