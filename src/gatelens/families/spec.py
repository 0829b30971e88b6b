"""The facts of one cell, as a trace names them: a ``CellSpec``.

Each family declares the specs of the cells it opens in its own file (its ``specs`` class
attribute); ``gatelens.families.registry.cell_spec`` finds one by its trace name. A spec
holds the trace letters, which of them are gates, the chunk order of the stacked weights,
the keep gate and the carried state of docs/methods.md, which output signal the
perturbation reads, the value ranges the page colours by, and the names a reader sees.

>>> spec = CellSpec(name="toy", kind="toy", chunks=("f", "g"), signals=("f", "g", "h"),
...                 gates=("f", "g"), keep_gate="f", input_gate=None, state="h")
>>> spec.keep_gate, spec.chunk_of_keep, names_of(spec, 2)[-1]
('f', 0, 'layer1.h')
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from gatelens.cells.names import layer_name, layer_names  # noqa: F401 - re-exported

if TYPE_CHECKING:
    from torch import Tensor

SIGMOID = (0.0, 1.0)
TANH = (-1.0, 1.0)


@dataclass(frozen=True)
class CellSpec:
    """The facts of one cell, as the trace names it.

    Attributes:
        name: the trace's cell name (``lstm``, ``gru``, ``rnn_tanh``, ``rnn_relu``).
        kind: the kind of cell in report.json's model "cell" (``lstm``, ``gru``, ``rnn``,
            ``mamba`` ...): what a reader calls it, whichever family opened it.
        mode: ATen's ``module.mode`` string of the PyTorch module, or None.
        chunks: the letters of the stacked weight rows in PyTorch's chunk order
            (LSTM i, f, g, o; GRU r, z, n; RNN one block, the pre-activation).
        signals: the trace letters of one layer and direction, in storage order.
        gates: the letters that are gates proper (a nonlinearity of a pre-activation).
        keep_gate: the gate that scales the carried state (f, z), None without one.
        input_gate: the gate chrono initialisation sets to −b_f (LSTM i), else None.
        state: the carried state s of the perturbation measurement (c or h).
        candidate: the letter ĉ of a convex-mix cell, s' = keep ⊙ s + (1 − keep) ⊙ ĉ (GRU n,
            minGRU/minLSTM cand, sLSTM z); None for the LSTM and RNN.
        output: the layer's output signal, what the perturbation's h curve reads (``h``;
            ``y`` where the cell's output is not its hidden state: Mamba, RWKV).
        bounds: value range of each bounded signal (sigmoid [0, 1], tanh [−1, 1]).
        display: a reader's name for each gate letter.
        keep_operator: for a cell whose keep is an operator on the state, not a factor per
            coordinate (the delta rule's α S (I − β k kᵀ)): ``keep_operator(signals, s)``
            -> A_t(s), ``signals`` one layer's letters at one step (N, ·) and ``s`` (N, S)
            that layer's state; the perturbation split's forget path applies it. None: the
            keep gate scales each coordinate of s.
        return_path: the letters a perturbation re-enters the carried state through, every
            gate and write quantity of one step (LSTM i, f, g, o): what the return path cut
            patches to its clean value (docs/interventions.md); () where it cannot be cut.
        carried: the parts of the carried state one step hands the next (LSTM h, c): what
            the state ablation replaces; () where it cannot be ablated.
    """

    name: str
    kind: str
    chunks: tuple[str, ...]
    signals: tuple[str, ...]
    gates: tuple[str, ...]
    keep_gate: str | None
    input_gate: str | None
    state: str
    candidate: str | None = None
    mode: str | None = None
    output: str = "h"
    bounds: dict[str, tuple[float, float]] = field(default_factory=dict)
    display: dict[str, str] = field(default_factory=dict)
    keep_operator: Callable[[dict[str, Tensor], Tensor], Tensor] | None = None
    return_path: tuple[str, ...] = ()
    carried: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        for what, letters in (("gates", self.gates), ("state", (self.state,)),
                              ("output", (self.output,)), ("return_path", self.return_path),
                              ("carried", self.carried),
                              ("keep_gate", (self.keep_gate,) if self.keep_gate else ())):
            missing = [x for x in letters if x not in self.signals]
            if missing:
                raise ValueError(f"CellSpec {self.name!r}: {what} {missing} not among its "
                                 f"signals {self.signals}")

    def chunk(self, letter: str) -> int:
        """Index of ``letter``'s block in the stacked weights (``weight_ih.view(-1, H)``)."""
        return self.chunks.index(letter)

    @property
    def chunk_of_keep(self) -> int:
        """Index of the keep gate's block (the one ``--forget-bias`` sets)."""
        if self.keep_gate is None:
            raise ValueError(f"{self.name} has no keep gate")
        return self.chunk(self.keep_gate)

    @property
    def n_chunks(self) -> int:
        """Blocks of H rows in ``weight_ih``: 4 (LSTM), 3 (GRU), 1 (RNN)."""
        return len(self.chunks)


#: The extra signal of a projected LSTM (``proj_size > 0``): m = o ⊙ tanh(c), the output
#: before the projection h = W_hr m; it stands just before ``h``.
PROJ_SIGNAL = "m"


def letters_of(spec: CellSpec, proj: bool = False) -> tuple[str, ...]:
    """Signal letters of one layer and direction, with ``m`` before ``h`` when projected."""
    letters = spec.signals
    if not proj:
        return letters
    if spec.name != "lstm":
        raise ValueError(f"proj=True applies to the lstm only, not {spec.name!r}")
    return letters[:-1] + (PROJ_SIGNAL, letters[-1])


def names_of(spec: CellSpec, num_layers: int, bidirectional: bool = False,
             proj: bool = False) -> list[str]:
    """The exact list of names a Trace of this cell and shape holds, in order."""
    letters = letters_of(spec, proj)
    return [f"{name}.{s}" for name in layer_names(num_layers, bidirectional) for s in letters]
