"""nn.LSTMCell, nn.GRUCell and nn.RNNCell as families: a cell stepped by the caller.

A cell computes one step of the one-layer module: the same equations, the same gate order
(LSTM i, f, g, o; GRU r, z, n) and the same layout, its tensors named ``weight_ih`` ...
where the module's are ``weight_ih_l0`` .... So a cell is opened as a one-layer, batch-first
nn.LSTM / nn.GRU / nn.RNN whose parameters ARE the cell's tensors (shared, never copied;
``bias=False`` and nn.RNNCell's nonlinearity carried over), and everything but the call
and the reference is that module's family (lstm.py, gru.py, rnn.py): the trace names
are the one-layer module's (``layer0.i`` … ``layer0.h``), the read-out is anchored, the
dynamics are the same step.

The reference is always the cell's own outputs: the states its recorded calls returned
(``gatelens.readout.stitch``, a ``Recorded`` input), or, when ``trace(cell, x)`` is given a
sequence (B, T, F), the cell's own forward run one call a step on it, exactly as a loop
would (never the module's sequence kernel, which rounds differently).

>>> import torch
>>> from gatelens.families.registry import family_of
>>> cell = torch.nn.LSTMCell(3, 4)
>>> fam = family_of(cell); call = fam.check(torch.randn(2, 6, 3))  # the steps of a loop
>>> ref = fam.reference(call); ro = fam.read(call, ref)
>>> fam.name, list(ro.signals)[:3], fam.one_step(call, ref)[0].max_abs_diff_h < 1e-6
('lstm_cell', ['layer0.i', 'layer0.f', 'layer0.g'], True)
"""

from __future__ import annotations

from typing import Any, ClassVar

import torch
from torch import Tensor, nn

from gatelens.cells.numerics import quiet_onednn
from gatelens.families.base import Call, Dynamics, Family, LayerDiff, Readout, Reference
from gatelens.families.gru import GRUFamily
from gatelens.families.lstm import LSTMFamily
from gatelens.families.rnn import RNNFamily
from gatelens.families.spec import CellSpec
from gatelens.families.stepped import (
    Recorded,
    Step,
    recorded_call,
    recorded_output_diff,
    recorded_reference,
    stack_steps,
    torch_step,
)
from gatelens.families.torch_ops import weights_of

#: each cell class and the module whose one layer it is
MODULE_OF: dict[type, type] = {nn.LSTMCell: nn.LSTM, nn.GRUCell: nn.GRU, nn.RNNCell: nn.RNN}


def as_module(cell: nn.RNNCellBase) -> nn.RNNBase:
    """A one-layer, batch-first eval module of the cell's kind whose parameters are the
    cell's own tensors (``weight_ih`` is ``weight_ih_l0`` ...), built on the meta device so
    nothing is initialised or copied.

    >>> cell = torch.nn.RNNCell(2, 3, bias=False, nonlinearity="relu")
    >>> m = as_module(cell)
    >>> m.mode, m.bias, m.weight_hh_l0.data_ptr() == cell.weight_hh.data_ptr()
    ('RNN_RELU', False, True)
    """
    kind = MODULE_OF[next(c for c in MODULE_OF if isinstance(cell, c))]
    kw: dict[str, Any] = {"bias": cell.bias, "batch_first": True}
    if kind is nn.RNN:
        kw["nonlinearity"] = cell.nonlinearity
    with torch.device("meta"):
        module = kind(cell.input_size, cell.hidden_size, **kw)
    names = ["weight_ih", "weight_hh"] + (["bias_ih", "bias_hh"] if cell.bias else [])
    # the weights as the cell's forward reads them (a parametrization's or prune's value)
    module.load_state_dict({f"{n}_l0": w for n, w in weights_of(cell, names).items()},
                           assign=True)
    return module.eval()


class TorchCellFamily(Family):
    """A PyTorch cell stepped in a loop, opened as the one-layer module of its tensors."""

    cell_class: ClassVar[type] = nn.RNNCellBase
    module_family: ClassVar[type] = LSTMFamily
    stepped = True  # every call is one step: a forward's calls are stitched

    def __init__(self, module: nn.Module) -> None:
        super().__init__(module)
        #: the one-layer module's family, bound to a module sharing the cell's tensors
        self.inner = self.module_family(as_module(module))

    @classmethod
    def opens(cls, module: nn.Module) -> bool:
        # a subclass that computes something else is not this cell
        return isinstance(module, cls.cell_class) and \
            type(module).forward is cls.cell_class.forward

    # ---- facts: the one-layer module's ---------------------------------------------------
    @property
    def spec(self) -> CellSpec:
        return self.inner.spec

    @property
    def num_layers(self) -> int:
        return 1

    @property
    def hidden_size(self) -> int:
        return self.module.hidden_size

    @property
    def two_states(self) -> bool:
        return self.inner.two_states

    @property
    def state_parts(self) -> tuple[str, ...]:
        """The parts of the carried state, in order (LSTM: h then c)."""
        return self.inner.state_parts

    def names(self) -> list[str]:
        return self.inner.names()

    def describe(self) -> dict:
        return {**self.inner.describe(), "family": self.name,
                "module": f"nn.{self.cell_class.__name__}"}

    # ---- a call ----------------------------------------------------------------------
    def step_of(self, inputs: Tensor, state: Any, output: Any) -> Step:
        return torch_step(inputs, state, output, cell=True)

    def check(self, inputs: Any, state: Any = None) -> Call:
        """A ``Recorded`` trajectory (the cell's calls, stitched), or what a loop would
        step through: inputs (B, T, F), one step (B, F) or an unbatched step (F,), and the
        cell's own state (LSTM (h, c), else h; (B, H) each, (H,) unbatched, None: zeros)."""
        if isinstance(inputs, Recorded):
            return recorded_call(self.inner, inputs)
        cell, w = self.module, self.module.weight_ih
        if not isinstance(inputs, Tensor):
            raise TypeError(f"inputs must be a Tensor; got {type(inputs).__name__}")
        if not inputs.is_floating_point() or inputs.dtype != w.dtype:
            raise TypeError(f"inputs must have the cell's dtype {w.dtype}; got {inputs.dtype}")
        if inputs.device != w.device:
            raise ValueError(f"inputs must be on the cell's device {w.device}; got "
                             f"{inputs.device}")
        if inputs.ndim not in (1, 2, 3) or inputs.shape[-1] != cell.input_size:
            raise ValueError(f"a {type(cell).__name__}'s inputs are steps (B, T, F), one step "
                             f"(B, F) or (F,) with F = {cell.input_size}; got shape "
                             f"{tuple(inputs.shape)}")
        unbatched = inputs.ndim == 1
        x = inputs.reshape(1, 1, -1) if unbatched else (
            inputs.unsqueeze(1) if inputs.ndim == 2 else inputs)  # (B, T, F)
        if 0 in x.shape[:2]:
            raise ValueError(f"inputs must hold at least one step of one sequence; got "
                             f"{tuple(inputs.shape)}")
        layout = {"batch_first": True, "unbatched": unbatched, "packed": None,
                  "lengths": None, "recorded": None}
        return Call(x, self._check_state(state, x.shape[0], unbatched), layout)

    def _check_state(self, state: Any, B: int, unbatched: bool) -> tuple[Tensor, ...]:
        """The cell's state as the one-layer module's parts, (1, B, H) each."""
        H, w = self.hidden_size, self.module.weight_ih
        if state is None:
            return tuple(w.new_zeros(1, B, H) for _ in range(2 if self.two_states else 1))
        if self.two_states and not (isinstance(state, tuple) and len(state) == 2):
            raise TypeError(f"an LSTMCell's state is a tuple (h, c); got {type(state).__name__}")
        parts = state if self.two_states else (state,)
        want = (H,) if unbatched else (B, H)
        out = []
        for name, t in zip(("h", "c"), parts, strict=False):
            if not isinstance(t, Tensor) or t.dtype != w.dtype or t.device != w.device:
                raise TypeError(f"the state's {name} must be a {w.dtype} Tensor on {w.device}; "
                                f"got {getattr(t, 'dtype', type(t).__name__)}")
            if tuple(t.shape) != want:
                raise ValueError(f"the state's {name} must have shape {want}; got "
                                 f"{tuple(t.shape)}")
            out.append(t.reshape(1, B, H))
        return tuple(out)

    # ---- the cell's own trajectory ------------------------------------------------------
    def reference(self, call: Call) -> Reference:
        """What the cell itself returned: its recorded calls, or its own forward run one
        call a step on the call's inputs (cached in the call)."""
        if call.layout.get("recorded") is None:
            call.layout["recorded"] = self.run_steps(call)
        return recorded_reference(self.inner, call)

    def run_steps(self, call: Call) -> Recorded:
        """The cell's own forward, one call a step, the state it returns handed back."""
        state = tuple(s[0] for s in call.state)  # (B, H) each
        steps = []
        with torch.no_grad(), quiet_onednn():
            for t in range(call.length):
                out = self.module(call.inputs[:, t], state if self.two_states else state[0])
                state = out if self.two_states else (out,)
                steps.append(tuple(s.unsqueeze(0) for s in state))  # (1, B, H) each
        return Recorded(call.inputs, call.state, stack_steps(steps), calls=call.length,
                        unbatched=bool(call.layout.get("unbatched")))

    # ---- the one-layer module's read-out, checks and dynamics -----------------------------
    def read(self, call: Call, ref: Reference) -> Readout:
        return self.inner.read(call, ref)

    def rerun(self, call: Call) -> Readout:
        return self.inner.rerun(call)

    def one_step(self, call: Call, ref: Reference) -> list[LayerDiff]:
        return self.inner.one_step(call, ref)

    def judge(self, readout: Readout, ref: Reference) -> list[LayerDiff]:
        return self.inner.judge(readout, ref)

    def dynamics(self, call: Call, ref: Reference) -> list[Dynamics]:
        return self.inner.dynamics(call, ref)

    def intervene(self, call: Call, plan: Any, output: Any, offset: int = 0
                  ) -> tuple[Any, dict[str, Tensor]]:
        """Edits inside the cell's step (families/torch_edit.py), returned as the cell
        returns its state. Its one return value is both what the step puts out and the
        state the caller hands back, so an edit here always carries."""
        from gatelens.errors import GatelensError
        from gatelens.families.torch_edit import intervene

        if any(not c.carry for c in plan.changes):
            raise GatelensError(f"carry=False cannot apply to a {type(self.module).__name__} "
                                "stepped in a loop: its one return value is both the read-out "
                                "and the state the caller hands back")
        unbatched = bool(call.layout.get("unbatched"))
        inner = Call(call.inputs, call.state, {**call.layout, "unbatched": False})
        (_, parts), sig = intervene(self.inner, inner, plan, None, offset)
        parts = parts if isinstance(parts, tuple) else (parts,)  # (1, B, H) each
        state = tuple(p[0, 0] if unbatched else p[0] for p in parts)
        return (state if self.two_states else state[0]), sig

    def output_diff(self, readout: Readout, output: Any) -> float | None:
        """``output`` is the Call whose recorded steps the read-out is compared with."""
        if isinstance(output, Call) and output.layout.get("recorded") is not None:
            return recorded_output_diff(self, readout, output)
        return None


class LSTMCellFamily(TorchCellFamily):
    """nn.LSTMCell, bias or not."""

    name = "lstm_cell"
    opens_what = "nn.LSTMCell"
    cell_class = nn.LSTMCell
    module_family = LSTMFamily
    specs = LSTMFamily.specs


class GRUCellFamily(TorchCellFamily):
    """nn.GRUCell, bias or not."""

    name = "gru_cell"
    opens_what = "nn.GRUCell"
    cell_class = nn.GRUCell
    module_family = GRUFamily
    specs = GRUFamily.specs


class RNNCellFamily(TorchCellFamily):
    """nn.RNNCell, tanh or relu, bias or not."""

    name = "rnn_cell"
    opens_what = "nn.RNNCell (tanh or relu)"
    cell_class = nn.RNNCell
    module_family = RNNFamily
    specs = RNNFamily.specs
