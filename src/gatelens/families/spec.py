"""One table of per-cell facts: every module that needs to know a cell reads it here.

A cell family is described once, by a ``CellSpec``: its trace letters, which of them are
gates, the chunk order of its stacked weights, the keep gate and the carried state of
docs/methods.md, the value ranges the page colours by, and the names a reader sees.
Adding a cell family means its own kernel file and one entry in ``CELLS``.

>>> spec = CELLS["lstm"]
>>> spec.signals, spec.keep_gate, spec.state, spec.chunk("f")
(('i', 'f', 'g', 'o', 'c', 'h'), 'f', 'c', 1)
>>> cell_of_mode("GRU"), CELLS["gru"].display["z"]
('gru', 'update (keep)')
"""

from __future__ import annotations

from dataclasses import dataclass, field

from gatelens.cells.names import layer_name, layer_names  # noqa: F401 - re-exported

SIGMOID = (0.0, 1.0)
TANH = (-1.0, 1.0)


@dataclass(frozen=True)
class CellSpec:
    """The facts of one cell, as the trace names it.

    Attributes:
        name: the trace's cell name (``lstm``, ``gru``, ``rnn_tanh``, ``rnn_relu``).
        family: the ``--cell`` name that builds it (``lstm``, ``gru``, ``rnn``).
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
        modern: one of gatelens's own cells (modern.py), not a PyTorch module.
        bounds: value range of each bounded signal (sigmoid [0, 1], tanh [−1, 1]).
        display: a reader's name for each gate letter.
    """

    name: str
    family: str
    mode: str | None
    chunks: tuple[str, ...]
    signals: tuple[str, ...]
    gates: tuple[str, ...]
    keep_gate: str | None
    input_gate: str | None
    state: str
    candidate: str | None = None
    modern: bool = False
    bounds: dict[str, tuple[float, float]] = field(default_factory=dict)
    display: dict[str, str] = field(default_factory=dict)

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


_LSTM_NAMES = {"i": "input", "f": "forget", "g": "candidate", "o": "output"}
_GRU_NAMES = {"r": "reset", "z": "update (keep)", "n": "new"}

CELLS: dict[str, CellSpec] = {
    "lstm": CellSpec(
        name="lstm", family="lstm", mode="LSTM", chunks=("i", "f", "g", "o"),
        signals=("i", "f", "g", "o", "c", "h"), gates=("i", "f", "g", "o"),
        keep_gate="f", input_gate="i", state="c",
        bounds={"i": SIGMOID, "f": SIGMOID, "o": SIGMOID, "g": TANH}, display=_LSTM_NAMES),
    "gru": CellSpec(
        name="gru", family="gru", mode="GRU", chunks=("r", "z", "n"),
        signals=("r", "z", "n", "h"), gates=("r", "z", "n"), keep_gate="z", input_gate=None,
        state="h", candidate="n", bounds={"r": SIGMOID, "z": SIGMOID, "n": TANH},
        display=_GRU_NAMES),
    "rnn_tanh": CellSpec(
        name="rnn_tanh", family="rnn", mode="RNN_TANH", chunks=("pre",),
        signals=("pre", "h"), gates=(), keep_gate=None, input_gate=None, state="h",
        bounds={"h": TANH}),
    "rnn_relu": CellSpec(
        name="rnn_relu", family="rnn", mode="RNN_RELU", chunks=("pre",),
        signals=("pre", "h"), gates=(), keep_gate=None, input_gate=None, state="h"),
    # gatelens's own cells (modern.py); y is the block's output, the next layer's input.
    "mingru": CellSpec(
        name="mingru", family="mingru", mode=None, chunks=("z", "cand"),
        signals=("z", "cand", "keep", "h", "y"), gates=("z", "keep"), keep_gate="keep",
        input_gate=None, state="h", candidate="cand", modern=True,
        bounds={"z": SIGMOID, "keep": SIGMOID},
        display={"keep": "keep (the state's retention)", "cand": "candidate h̃"}),
    "minlstm": CellSpec(
        name="minlstm", family="minlstm", mode=None, chunks=("f", "i", "cand"),
        signals=("f", "i", "cand", "keep", "h", "y"), gates=("f", "i", "keep"),
        keep_gate="keep", input_gate="i", state="h", candidate="cand", modern=True,
        bounds={"f": SIGMOID, "i": SIGMOID, "keep": SIGMOID}, display={"cand": "candidate h̃"}),
    "slstm": CellSpec(
        name="slstm", family="slstm", mode=None, chunks=("z", "i", "f", "o"),
        signals=("z", "i", "f", "o", "c", "n", "m", "kappa", "s", "h", "y"),
        gates=("z", "i", "f", "o", "kappa"), keep_gate="kappa", input_gate="i", state="s",
        candidate="z", modern=True,
        bounds={"z": TANH, "i": SIGMOID, "f": SIGMOID, "o": SIGMOID, "kappa": SIGMOID,
                "s": TANH, "h": TANH},
        display={"kappa": "keep κ = f n / n'", "s": "state c/n"}),
    # ONNX / Keras cells PyTorch has no module for (cells/variants.py): the LSTM's and the
    # GRU's letters; their gate ranges depend on the activations, so no bounds are fixed.
    "lstm_variant": CellSpec(
        name="lstm_variant", family="lstm", mode=None, chunks=("i", "f", "g", "o"),
        signals=("i", "f", "g", "o", "c", "h"), gates=("i", "f", "g", "o"),
        keep_gate="f", input_gate="i", state="c", display=_LSTM_NAMES),
    "gru_variant": CellSpec(
        name="gru_variant", family="gru", mode=None, chunks=("r", "z", "n"),
        signals=("r", "z", "n", "h"), gates=("r", "z", "n"), keep_gate="z", input_gate=None,
        state="h", candidate="n", display=_GRU_NAMES),
}

#: The official implementations' cells (families/mingru_pytorch.py, xlstm_*.py, hf_*.py,
#: mambapy.py); y is the layer's (cell module's) output. Their keep gate multiplies the
#: carried state s coordinate by coordinate through ``Family.state_units`` (a head's f
#: scales its whole matrix memory; Mamba's exp(Δ·A) is per (channel, state) pair).
OFFICIAL: dict[str, CellSpec] = {
    "mingru_pt_gru": CellSpec(
        name="mingru_pt_gru", family="mingru-pytorch", mode=None, chunks=("cand", "z"),
        signals=("z", "cand", "keep", "h", "y"), gates=("z", "keep"), keep_gate="keep",
        input_gate=None, state="h", candidate="cand", bounds={"z": SIGMOID, "keep": SIGMOID},
        display={"keep": "keep 1 − z", "cand": "candidate g(h̃)"}),
    "mingru_pt_lstm": CellSpec(
        name="mingru_pt_lstm", family="mingru-pytorch", mode=None, chunks=("cand", "f", "i"),
        signals=("f", "i", "cand", "keep", "h", "y"), gates=("f", "i", "keep"),
        keep_gate="keep", input_gate="i", state="h", candidate="cand",
        bounds={"f": SIGMOID, "i": SIGMOID, "keep": SIGMOID},
        display={"keep": "keep f′ = f/(f + i)", "cand": "candidate g(h̃)"}),
    "xlstm_slstm": CellSpec(
        name="xlstm_slstm", family="xlstm", mode=None, chunks=("i", "f", "z", "o"),
        signals=("z", "i", "f", "o", "kappa", "s", "h", "y"),
        gates=("z", "i", "f", "o", "kappa"), keep_gate="kappa", input_gate="i", state="s",
        candidate="z",
        bounds={"z": TANH, "i": SIGMOID, "f": SIGMOID, "o": SIGMOID, "kappa": SIGMOID,
                "s": TANH, "h": TANH},
        display={"kappa": "keep κ = f n / n'", "s": "state c/n", "f": "forget σ(f̃)",
                 "i": "input exp(ĩ − m')"}),
    "xlstm_mlstm": CellSpec(
        name="xlstm_mlstm", family="xlstm", mode=None, chunks=("i", "f"),
        signals=("i", "f", "s", "h", "y"), gates=("i", "f"), keep_gate="f", input_gate="i",
        state="s", bounds={"i": SIGMOID, "f": SIGMOID},
        display={"f": "forget σ(f̃) per head", "i": "input exp(ĩ − m') per head",
                 "s": "memory (C, n)·e^m per head"}),
    "mamba": CellSpec(
        name="mamba", family="mamba", mode=None, chunks=("delta", "B", "C"),
        signals=("delta", "a", "s", "y"), gates=("a",), keep_gate="a", input_gate=None,
        state="s", bounds={"a": SIGMOID},
        display={"a": "keep exp(Δ·A) per (channel, state)", "delta": "step Δ"}),
    "mamba2": CellSpec(
        name="mamba2", family="mamba2", mode=None, chunks=("delta", "B", "C"),
        signals=("delta", "a", "s", "y"), gates=("a",), keep_gate="a", input_gate=None,
        state="s", bounds={"a": SIGMOID},
        display={"a": "keep exp(Δ·A) per head", "delta": "step Δ per head"}),
    "rwkv4": CellSpec(
        name="rwkv4", family="rwkv", mode=None, chunks=("k", "v", "r"),
        signals=("r", "k", "v", "keep", "s", "wkv", "y"), gates=("r", "keep"),
        keep_gate="keep", input_gate=None, state="s", bounds={"r": SIGMOID, "keep": SIGMOID},
        display={"keep": "keep e^{−w} per channel", "s": "state (num, den)",
                 "wkv": "num/den read-out"}),
}
CELLS.update(OFFICIAL)

#: The extra signal of a projected LSTM (``proj_size > 0``): m = o ⊙ tanh(c), the output
#: before the projection h = W_hr m; it stands just before ``h``.
PROJ_SIGNAL = "m"

#: ``--cell`` names, in the order the command line lists them.
FAMILIES: tuple[str, ...] = ("lstm", "gru", "rnn", "mingru", "minlstm", "slstm")


def cell_spec(cell: str) -> CellSpec:
    """The spec of a trace cell name; a clear error for an unknown one.

    >>> cell_spec("rnn_relu").family
    'rnn'
    """
    try:
        return CELLS[cell]
    except KeyError:
        raise ValueError(f"unknown cell {cell!r}; expected one of {sorted(CELLS)}") from None


def cell_of_mode(mode: str) -> str | None:
    """The trace cell name of a PyTorch module's ``mode`` (None: not a module we open)."""
    return next((s.name for s in CELLS.values() if s.mode == mode), None)


def family_spec(family: str, nonlinearity: str = "tanh") -> CellSpec:
    """The spec a ``--cell`` family builds (``rnn`` with its nonlinearity).

    >>> family_spec("rnn", "relu").name, family_spec("gru").keep_gate
    ('rnn_relu', 'z')
    """
    return cell_spec(f"rnn_{nonlinearity}" if family == "rnn" else family)


def signals(cell: str, proj: bool = False) -> tuple[str, ...]:
    """Signal letters of one layer and direction, with ``m`` before ``h`` when projected.

    >>> signals("lstm", proj=True)
    ('i', 'f', 'g', 'o', 'c', 'm', 'h')
    """
    letters = cell_spec(cell).signals
    if not proj:
        return letters
    if cell != "lstm":
        raise ValueError(f"proj=True applies to the lstm only, not {cell!r}")
    return letters[:-1] + (PROJ_SIGNAL, letters[-1])


def gate_names(
    cell: str, num_layers: int, bidirectional: bool = False, proj: bool = False
) -> list[str]:
    """The exact list of names a Trace of this configuration holds, in order.

    ``proj=True`` (an LSTM with ``proj_size > 0``) adds ``m`` before each ``h``.

    >>> gate_names("gru", 2)
    ['layer0.r', 'layer0.z', 'layer0.n', 'layer0.h', 'layer1.r', 'layer1.z', 'layer1.n', 'layer1.h']
    >>> gate_names("rnn_tanh", 1, bidirectional=True)
    ['layer0.pre', 'layer0.h', 'layer0.reverse.pre', 'layer0.reverse.h']
    >>> gate_names("lstm", 1, proj=True)[-2:]
    ['layer0.m', 'layer0.h']
    """
    letters = signals(cell, proj)
    return [f"{name}.{s}" for name in layer_names(num_layers, bidirectional) for s in letters]
