"""Families of the ONNX / Keras cells PyTorch has no module for (cells/variants.py).

``VariantLSTMFamily`` opens a ``VariantLSTM`` (peepholes, any recurrent activation and
activation) and ``VariantGRUFamily`` a ``VariantGRU`` (reset before or after, any
activations). One layer, the directions the module has; the trace names are the LSTM's
``layer0.i f g o c h`` and the GRU's ``layer0.r z n h`` (``layer0.reverse.*`` for a
reverse direction; a reverse-only module has only those).

- ``reference``: the module's own forward (``module.run``), every h and c it produced.
- ``read`` (anchored): every gate from the layer's input and the module's own h_{t−1}
  (and c_{t−1}: a peephole reads it), the LSTM's c by the contraction
  c_t = f_t ⊙ c_{t−1} + i_t ⊙ g_t from the initial state, h = o ⊙ α(c); the GRU's h is
  the module's own.
- ``one_step``/``judge``: h judged by |Δh| / max(1, |h|) (absolute wherever |h| ≤ 1, as
  with sigmoid/tanh; a relu or linear activation makes h unbounded), c by
  |Δc| / max(1, |c|); absolute figures beside them (docs/methods.md "Verification").
- ``dynamics``: per direction, s = (h, c) or (h), float64, the step of the equations.

>>> import torch
>>> from gatelens.cells.variants import VariantGRU
>>> fam = VariantGRUFamily(VariantGRU(3, 4, reset_after=False))
>>> call = fam.check(torch.randn(2, 6, 3))
>>> ref = fam.reference(call)
>>> list(fam.read(call, ref).signals), fam.one_step(call, ref)[0].max_abs_diff_h < 1e-6
(['layer0.r', 'layer0.z', 'layer0.n', 'layer0.h'], True)
"""

from __future__ import annotations

import abc
from typing import Any, ClassVar

import torch
from torch import Tensor, nn

from gatelens.cells.equations import StepEdit
from gatelens.cells.variants import (
    VariantGRU,
    VariantLSTM,
    VariantWeights,
    activation,
    gru_variant_step,
    lstm_variant_step,
)
from gatelens.families.base import Call, Dynamics, Family, LayerDiff, Readout, Reference
from gatelens.families.gru import GRU_NAMES
from gatelens.families.lstm import LSTM_NAMES
from gatelens.families.spec import CellSpec, layer_name

# the LSTM's and the GRU's letters; their gate ranges depend on the activations, so no
# bounds are fixed
LSTM_VARIANT = CellSpec(
    name="lstm_variant", kind="lstm", chunks=("i", "f", "g", "o"),
    signals=("i", "f", "g", "o", "c", "h"), gates=("i", "f", "g", "o"),
    keep_gate="f", input_gate="i", state="c", display=LSTM_NAMES,
    return_path=("i", "f", "g", "o"), carried=("h", "c"))
GRU_VARIANT = CellSpec(
    name="gru_variant", kind="gru", chunks=("r", "z", "n"),
    signals=("r", "z", "n", "h"), gates=("r", "z", "n"), keep_gate="z", input_gate=None,
    state="h", candidate="n", display=GRU_NAMES, return_path=("r", "z", "n"),
    carried=("h",))

#: Activations with values in [−1, 1], and in [0, 1]: h of an LSTM is o ⊙ α(c), of a GRU a
#: mix of h and n with weights z, 1 − z, so these bound h as tanh and sigmoid do.
BOUNDED = ("tanh", "softsign", "hard_tanh", "sigmoid", "hard_sigmoid", "hard_sigmoid_v2",
           "sparse_sigmoid")
UNIT = ("sigmoid", "hard_sigmoid", "hard_sigmoid_v2", "sparse_sigmoid")


def _previous(seq: Tensor, init: Tensor, reverse: bool) -> Tensor:
    """The state each step reads, (B, T, H): init, then the step before in processing order."""
    init = init.unsqueeze(1)  # (B, 1, H)
    return torch.cat([seq[:, 1:], init], 1) if reverse else torch.cat([init, seq[:, :-1]], 1)


def _contract(f: Tensor, u: Tensor, c0: Tensor, reverse: bool) -> Tensor:
    """c_t = f_t ⊙ c_{t−1} + u_t in processing order from c0 (B, H); (B, T, H)."""
    T, prev, out = f.shape[1], c0, [None] * f.shape[1]
    for t in range(T - 1, -1, -1) if reverse else range(T):
        prev = f[:, t] * prev + u[:, t]  # (B, H)
        out[t] = prev
    return torch.stack(out, dim=1)


def _diff(a: Tensor, b: Tensor) -> tuple[float, float]:
    """max |a − b| and max |a − b| / max(1, |b|), in float64 (0 for empty tensors)."""
    if not a.numel():
        return 0.0, 0.0
    d = (a.double() - b.double()).abs()
    return float(d.max()), float((d / b.double().abs().clamp(min=1.0)).max())


class _VariantFamily(Family):
    """What the two variant families share; subclasses give the module class and step."""

    edit_reads_whole = True  # its edited run reads every stretch (families/base.py)

    module_class: ClassVar[type] = nn.Module
    cell_name: ClassVar[str] = ""

    @classmethod
    def opens(cls, module: nn.Module) -> bool:
        return isinstance(module, cls.module_class)

    @property
    def spec(self) -> CellSpec:
        return self.specs[0]

    @property
    def num_layers(self) -> int:
        return 1

    @property
    def bidirectional(self) -> bool:
        return self.module.bidirectional

    @property
    def hidden_size(self) -> int:
        return self.module.hidden_size

    @property
    def n_parts(self) -> int:
        return 2 if self.spec.state == "c" else 1

    @property
    def bounded_h(self) -> bool:
        """Whether h stays in [−1, 1] (an activation of that range: judged absolutely)."""
        return self.module.activation in BOUNDED and (
            self.n_parts == 2 or self.module.recurrent_activation in UNIT)

    def layers(self) -> list[tuple[int, bool, str]]:
        """(direction index, reverse, layer name) of each direction the module has."""
        return [(d, name == "reverse", layer_name(0, name == "reverse"))
                for d, name in enumerate(self.module.directions)]

    def names(self) -> list[str]:
        return [f"{n}.{s}" for _, _, n in self.layers() for s in self.spec.signals]

    def describe(self) -> dict:
        m = self.module
        out = {**super().describe(), "recurrent_activation": m.recurrent_activation,
               "activation": m.activation}
        if m.bidirectional:  # the same note as nn.RNNBase's (index.html shows it)
            out["directions"] = ("forward direction measured; the reverse direction's gates "
                                 "are in the trace")
        if isinstance(m, VariantLSTM):
            out["peepholes"] = m.peephole is not None
        else:
            out["reset_after"] = m.reset_after
        return out

    def check(self, inputs: Any, state: Any = None) -> Call:
        if not isinstance(inputs, Tensor):
            raise TypeError(f"inputs must be a Tensor (B, T, F); got {type(inputs).__name__}")
        w = self.module.weight_ih
        if inputs.ndim != 3 or inputs.shape[-1] != self.module.input_size or 0 in inputs.shape:
            raise ValueError(f"inputs must be batch-first (B, T, F) with F = "
                             f"{self.module.input_size}; got shape {tuple(inputs.shape)}")
        if inputs.dtype != w.dtype or inputs.device != w.device:
            raise TypeError(f"inputs must have the module's dtype {w.dtype} and device "
                            f"{w.device}; got {inputs.dtype} on {inputs.device}")
        parts = self.module.initial(inputs, state)  # (D, B, H) each, checked
        return Call(inputs, tuple(parts), {"batch_first": True})

    # ---- the module's own trajectory -----------------------------------------------------
    def reference(self, call: Call) -> Reference:
        with torch.no_grad():
            seqs, finals = self.module.run(call.inputs, call.state)
        letters = ("h", "c")[: self.n_parts]
        states, initial = {}, {}
        for d, _, name in self.layers():
            states.update({f"{name}.{s}": seqs[d][j] for j, s in enumerate(letters)})
            initial[name] = tuple(p[d] for p in call.state)
        out = torch.cat([s[0] for s in seqs], dim=-1)  # (B, T, D·H)
        final = tuple(finals) if self.n_parts == 2 else finals[0]
        return Reference(states, {"layer0": call.inputs}, initial, out, final)

    @abc.abstractmethod
    def _step(self, w: VariantWeights, x: Tensor, parts: list[Tensor],
              edit: StepEdit | None = None) -> dict[str, Tensor]:
        """One step of the cell from the state parts at t − 1: every signal by letter
        (``edit``: an intervention's edit inside the step)."""

    def intervene(self, call: Call, plan: Any, output: Any, offset: int = 0
                  ) -> tuple[Any, dict[str, Tensor]]:
        """Edits inside the variant's steps (families/variants_edit.py)."""
        from gatelens.families.variants_edit import intervene

        return intervene(self, call, plan, output, offset)

    def _fed(self, call: Call, ref: Reference, d: int, reverse: bool, name: str,
             dtype: torch.dtype | None = None) -> dict[str, Tensor]:
        """The step of direction d fed the module's own state at t − 1, at every t."""
        prev = [_previous(ref.states[f"{name}.{s}"], ref.initial[name][j], reverse)
                for j, s in enumerate(("h", "c")[: self.n_parts])]  # (B, T, H) each
        x = call.inputs if dtype is None else call.inputs.to(dtype)
        return self._step(self.module.weights(d, dtype), x,
                          prev if dtype is None else [p.to(dtype) for p in prev])

    def read(self, call: Call, ref: Reference) -> Readout:
        out: dict[str, Tensor] = {}
        h_n, c_n = [], []
        act = self.module.activation
        with torch.no_grad():
            for d, reverse, name in self.layers():
                sig = self._fed(call, ref, d, reverse, name)
                if self.n_parts == 2:  # the contraction keeps c on the module's trajectory
                    sig["c"] = _contract(sig["f"], sig["i"] * sig["g"], ref.initial[name][1],
                                         reverse)
                    sig["h"] = sig["o"] * activation(act)(sig["c"])
                else:
                    sig["h"] = ref.states[f"{name}.h"]
                out.update({f"{name}.{s}": sig[s] for s in self.spec.signals})
                last = 0 if reverse else -1  # a reverse direction ends at t = 0
                h_n.append(sig["h"][:, last])
                if self.n_parts == 2:
                    c_n.append(sig["c"][:, last])
        return Readout({n: out[n] for n in self.names()}, torch.stack(h_n),
                       torch.stack(c_n) if c_n else None, {"method": "anchored"})

    def rerun(self, call: Call) -> Readout:
        out: dict[str, Tensor] = {}
        h_n, c_n = [], []
        T = call.length
        with torch.no_grad():
            for d, reverse, name in self.layers():
                w = self.module.weights(d)
                parts = [p[d] for p in call.state]
                rows: list[dict[str, Tensor]] = [{}] * T
                for t in range(T - 1, -1, -1) if reverse else range(T):
                    rows[t] = self._step(w, call.inputs[:, t], parts)
                    parts = [rows[t][s] for s in ("h", "c")[: self.n_parts]]
                out.update({f"{name}.{s}": torch.stack([r[s] for r in rows], 1)
                            for s in self.spec.signals})  # (B, T, H)
                h_n.append(parts[0])
                if self.n_parts == 2:
                    c_n.append(parts[1])
        return Readout({n: out[n] for n in self.names()}, torch.stack(h_n),
                       torch.stack(c_n) if c_n else None, {"method": "step"})

    # ---- checks ------------------------------------------------------------------------
    def _layer_diff(self, reverse: bool, got: dict[str, Tensor], want: dict[str, Tensor]
                    ) -> LayerDiff:
        dh, sh = _diff(got["h"], want["h"])
        dc = sc = None
        if self.n_parts == 2:
            dc, sc = _diff(got["c"], want["c"])
        # h bounded by its activations is judged absolutely, as nn.LSTM's; else on its scale
        return LayerDiff(0, reverse, dh, dc, sc, None if self.bounded_h else sh)

    def one_step(self, call: Call, ref: Reference) -> list[LayerDiff]:
        rows = []
        with torch.no_grad():
            for d, reverse, name in self.layers():
                sig = self._fed(call, ref, d, reverse, name)
                want = {s: ref.states[f"{name}.{s}"] for s in ("h", "c")[: self.n_parts]}
                rows.append(self._layer_diff(reverse, sig, want))
        return rows

    def judge(self, readout: Readout, ref: Reference) -> list[LayerDiff]:
        rows = []
        for _, reverse, name in self.layers():
            got = {s: readout.signals[f"{name}.{s}"] for s in ("h", "c")[: self.n_parts]}
            want = {s: ref.states[f"{name}.{s}"] for s in ("h", "c")[: self.n_parts]}
            rows.append(self._layer_diff(reverse, got, want))
        return rows

    def output_diff(self, readout: Readout, output: Any) -> float:
        """max |read-out − module| over its output and final states (open_cells)."""
        out, final = output
        mine = torch.cat([readout.signals[f"{n}.h"] for _, _, n in self.layers()], dim=-1)
        parts = [(mine, out), (readout.h_n, final[0] if isinstance(final, tuple) else final)]
        if self.n_parts == 2:
            parts.append((readout.c_n, final[1]))
        return max(_diff(a, b.detach())[0] for a, b in parts)

    def dynamics(self, call: Call, ref: Reference) -> list[Dynamics]:
        out = []
        H, T = self.hidden_size, call.length
        units = torch.arange(H).repeat(self.n_parts)  # h and c of unit u are unit u
        x64 = call.inputs.detach().double()  # (B, T, F)
        for d, reverse, name in self.layers():
            w = self.module.weights(d, torch.float64)

            def step(x: Tensor, s: list[Tensor], w: VariantWeights = w) -> list[Tensor]:
                sig = self._step(w, x, list(s))
                return [sig[k] for k in ("h", "c")[: self.n_parts]]

            letters = ("h", "c")[: self.n_parts]
            out.append(Dynamics(
                step=step, inputs=x64,
                trajectory=[ref.states[f"{name}.{s}"].detach().double() for s in letters],
                initial=[p.detach().double() for p in ref.initial[name]],
                order=list(range(T - 1, -1, -1)) if reverse else list(range(T)),
                units=units, name="reverse" if reverse else "forward"))
        return out


class VariantLSTMFamily(_VariantFamily):
    """ONNX LSTM with peepholes, Keras LSTM with a non-sigmoid/tanh activation."""

    name = "variant_lstm"
    opens_what = "gatelens's VariantLSTM"
    module_class = VariantLSTM
    cell_name = "lstm_variant"
    specs = (LSTM_VARIANT,)

    def _step(self, w, x, parts, edit=None):
        return lstm_variant_step(w, x, parts[0], parts[1], edit)


class VariantGRUFamily(_VariantFamily):
    """ONNX GRU with linear_before_reset = 0, Keras GRU with reset_after = False or other
    activations."""

    name = "variant_gru"
    opens_what = "gatelens's VariantGRU"
    module_class = VariantGRU
    cell_name = "gru_variant"
    specs = (GRU_VARIANT,)

    def _step(self, w, x, parts, edit=None):
        return gru_variant_step(w, x, parts[0], edit)
