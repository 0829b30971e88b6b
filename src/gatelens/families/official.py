"""The shared machinery of the official implementations' families (xlstm, mingru-pytorch,
transformers' Mamba / Mamba-2 / RWKV, mambapy): a stack of blocks, each around one
recurrent cell, read from the module's own weights on the module's own trajectory.

A family here describes its module by a few pieces, each in the module's own terms:

- ``_trajectory(call)``: the module's own computation, step by step where its
  whole-sequence forward hides the states (the package's own ``step`` / cache path, as
  METHODS takes the LSTM's c from PyTorch run one step at a time): per layer the block's
  input ``x``, the cell's input ``u`` and output ``y``, the block's output ``xo``, and the
  carried state after every step in the *dynamic form* (``parts``: a scale invariant under
  any stabiliser, e.g. RWKV's (num, den) brought back from the max-shifted form) and any
  ``aux`` a step reads from the trajectory (a stabiliser that only enters through an eps);
- ``step_cell(k, m, u, parts, aux)``: the hand cell of layer k in float64 on the weights of
  ``m`` (a float64 copy of the module): its signals, the new parts and the cell's output;
- ``pre``/``post``/``final``: the block around the cell (norms, residuals, feed-forward);
- ``state_of(k, parts)``: the carried state s of METHODS "Modern families".

From these the base gives every method of ``Family``: the anchored read-out (each step fed
the trajectory's state at t − 1, all steps at once), the one-step check (state, output and
every link between layers against the module's own values, judged on the unit's scale as
``verify_modern``), the free-running re-run and the float64 dynamics of the whole stack.
How the module's own run is recorded and judged: families/records.py.
"""

from __future__ import annotations

import abc
import copy
from collections.abc import Iterator, Mapping, Sequence
from typing import Any

import torch
from torch import Tensor, nn

from gatelens.cells.names import layer_name
from gatelens.errors import GatelensError
from gatelens.families.base import Call, Dynamics, Family, LayerDiff, Readout, Reference
from gatelens.families.official_layers import anchored_layer
from gatelens.families.records import (
    AsDtypes,
    Recorder,
    buffer_units,
    conv_buffer,
    scaled_diff,
    window_diff,
    worst_of,
    worst_of_windows,
)

__all__ = ["OfficialFamily", "Recorder", "buffer_units", "conv_buffer", "scaled_diff"]


class OfficialFamily(Family, abc.ABC):
    """A stack of blocks around one recurrent cell each (see the module docstring)."""

    #: the trace cell name, one of ``specs``' names
    cell_name: str = ""
    #: whether a step reads ``aux`` from the module's trajectory (xlstm's stabiliser m)
    uses_aux: bool = False
    #: the dtype s is read and traced in; None: the module's (xlstm's mLSTM: float64)
    state_dtype: torch.dtype | None = None

    # ---- facts ---------------------------------------------------------------------
    spec = property(lambda self: next(s for s in self.specs if s.name == self.cell_name))

    def dtype_of(self, letter: str, dtype: torch.dtype) -> torch.dtype:
        """The dtype a trace holds ``letter`` in: ``dtype`` (the module's), or ``state_dtype``."""
        return self.state_dtype if letter == self.spec.state and self.state_dtype else dtype

    def carried_parts(self, k: int, parts: list[Tensor], dtype: torch.dtype) -> list[Tensor]:
        """Layer k's parts as an edited run carries them from step to step: in ``dtype``."""
        return [p.to(dtype) for p in parts]

    def names(self) -> list[str]:
        return [f"{layer_name(k)}.{s}" for k in range(self.num_layers) for s in self.letters(k)]

    def letters(self, k: int) -> tuple[str, ...]:
        """The trace letters of layer k (the spec's signals; a mixed stack's own per layer)."""
        return self.spec.signals

    def unit_count(self, k: int) -> int:
        """Units of layer k's keep gate (``hidden_size``; a mixed stack's own per layer)."""
        return self.hidden_size

    def describe(self) -> dict:
        return {**super().describe(), "implementation": type(self.module).__module__ + "."
                + type(self.module).__qualname__, "units": self.units_name}

    #: what one unit is, in words (a channel, a (channel, state) pair, a head)
    units_name: str = "channel"
    layers_apart: bool = False  # trajectory_recorded: each layer's layer_recorded(rec, k)

    @abc.abstractmethod
    def state_units(self, k: int) -> Tensor:
        """(S,) int64: the unit (0 … H − 1) of layer k each carried-state coordinate
        belongs to, so the keep gate (B, T, H) is ``keep[..., state_units]`` on s."""

    #: positions the layer's input enters the carried state through (METHODS "Window of
    #: the input path": 1 for minGRU/minLSTM, 2 for RWKV's token shift, d_conv for Mamba)
    def input_window(self) -> int:
        return 1

    # ---- the pieces a family gives -------------------------------------------------
    @abc.abstractmethod
    def _forward(self, call: Call) -> Tensor:
        """The module's own whole-sequence forward on the call, its output tensor."""

    def _forward_trajectory(self, call: Call) -> dict | None:
        """``_trajectory``'s dict read from ONE whole-sequence forward (forward_scan.py), with
        "step_vs_forward" (the scan's output against the replay); None without scan_modules."""
        if (mods := self.scan_modules()) is None:
            return None
        with Recorder(mods, self.scan_steps()) as rec:
            output = self._forward(call)
        return self.trajectory_recorded(rec, output)

    def scan_modules(self) -> dict[str, nn.Module] | None:
        """The submodules whose first argument and output in one whole-sequence forward give
        the whole trajectory (``trajectory_recorded``: ``_forward_trajectory``'s dict from
        that forward); None: read from the decode path."""
        return None

    def trajectory_recorded(self, rec: Recorder, output: Tensor) -> dict:
        raise GatelensError(f"{self.name}: its states are read from the decode path")

    def _output_of(self, returned: Any) -> Tensor:
        """The tensor ``_forward`` gives, from what the module returned."""
        return returned[0] if isinstance(returned, (tuple, list)) else returned

    @abc.abstractmethod
    def _trajectory(self, call: Call) -> dict:
        """The module's own run: {"x", "u", "y", "xo", "parts", "aux", "output"} (module
        docstring), lists per layer of (B, T, ·) tensors; ``parts`` a list per layer."""

    @abc.abstractmethod
    def initial_parts(self, k: int, batch: int) -> list[Tensor]:
        """The dynamic parts of layer k before the first step (the zero state), float64."""

    @abc.abstractmethod
    def step_cell(self, k: int, m: nn.Module, u: Tensor, parts: list[Tensor],
             aux: Tensor | None) -> tuple[dict[str, Tensor], list[Tensor], Tensor]:
        """One step of layer k's hand cell, batched over N rows: (signals, parts', y)."""

    @abc.abstractmethod
    def state_of(self, k: int, parts: list[Tensor]) -> Tensor:
        """The carried state s (…, S) of layer k from its dynamic parts (…, n_i): some of them
        side by side along the last dimension, whatever the leading ones."""

    def part_units(self, k: int) -> list[Tensor]:
        """Per dynamic part, the unit of each coordinate (−1: a buffer, no unit); by
        default every part is the state s itself."""
        return [self.state_units(k)]

    @abc.abstractmethod
    def pre(self, k: int, m: nn.Module, x: Tensor) -> Tensor:
        """The cell's input from the block's input."""

    @abc.abstractmethod
    def post(self, k: int, m: nn.Module, x: Tensor, y: Tensor) -> Tensor:
        """The block's output from its input and the cell's output."""

    def final(self, m: nn.Module, x: Tensor) -> Tensor:
        """The module's output from the top block's output (a final norm, a head)."""
        return x

    # ---- a call ------------------------------------------------------------------
    def check(self, inputs: Any, state: Any = None) -> Call:
        if state is not None:
            raise GatelensError(f"{self.name}: an initial state is not supported (got "
                                f"{type(state).__name__}); the analysis runs from zeros")
        if not isinstance(inputs, Tensor) or inputs.ndim != 3 or not inputs.is_floating_point():
            got = tuple(inputs.shape) if isinstance(inputs, Tensor) else type(inputs).__name__
            raise GatelensError(f"{self.name}: inputs must be a float tensor (B, T, F); got {got}")
        return Call(inputs=inputs, layout={"batch_first": True})

    # ---- the module's own trajectory -----------------------------------------------
    def float64(self) -> nn.Module:
        """A float64 copy of the module (made once), for the hand cell and the dynamics."""
        cached = self.__dict__.get("_m64")
        if cached is None or cached[0] != self._weights_version():
            m = copy.deepcopy(self.module, self.float64_memo(self.module)).double().eval()
            self.__dict__["_m64"] = cached = (self._weights_version(), m.requires_grad_(False))
        return cached[1]

    def family64(self) -> Family:
        """The family on its own float64 copy (``float64``, made once), which is that family's
        float64 copy too: one set of weights for the module's float64 forward and its hand
        cell; a module in training mode keeps its mode in a copy of its own."""
        m = self.float64()
        if not isinstance(m, nn.Module) or self.module.training:
            return super().family64()
        fam = type(self)(m)
        fam.__dict__["_m64"] = (fam._weights_version(), m)
        return fam

    def _weights_version(self) -> Any:
        # a fresh copy whenever any parameter was replaced or changed in place
        return tuple((id(p), p._version) for p in self.module.parameters())

    def reference(self, call: Call) -> Reference:
        was = self.module.training
        self.module.eval()
        try:
            with torch.no_grad():
                tr = self._forward_trajectory(call)
                if tr is None:  # the decode path, one token a call
                    output = self._forward(call)
                    tr = self._trajectory(call)
                    tr["step_vs_forward"] = scaled_diff(tr["output"], output)
                else:  # the states read from the forward itself
                    output = tr["output"]
        finally:
            self.module.train(was)
        return self._reference_of(call, tr, output)

    def reference_recorded(self, call: Call, rec: Recorder, returned: Any) -> Reference:
        """The reference of a call the module already ran with ``scan_modules`` recorded
        (``open_cells`` reads the user's own forward: no second run). ``returned``: what the
        module returned."""
        with torch.no_grad():
            tr = self.trajectory_recorded(rec, self._output_of(returned))
            return self._reference_of(call, tr, tr["output"])

    def _reference_of(self, call: Call, tr: dict, output: Tensor,
                      layers: Sequence[int] | None = None) -> Reference:
        """The Reference of a trajectory dict (of ``layers`` only, if given); ``output``: the
        module's whole-sequence forward's (the step path's in ``extra["step_output"]``)."""
        B = call.batch
        states, inputs, initial = {}, {}, {}
        for k in range(self.num_layers) if layers is None else layers:
            s = self.state_of(k, tr["parts"][k])  # (B, T, S): a selection of the parts
            states[f"{layer_name(k)}.{self.spec.state}"] = s.to(self.state_dtype
                                                                or call.inputs.dtype)
            states[f"{layer_name(k)}.y"] = tr["y"][k]
            inputs[layer_name(k)] = tr["u"][k]
            initial[layer_name(k)] = tuple(self.initial_parts(k, B))
        extra = {"x": tr["x"], "xo": tr["xo"], "parts": tr["parts"], "aux": tr["aux"],
                 "step_output": tr["output"], "step_vs_forward": tr["step_vs_forward"],
                 "own": tr.get("own")}
        return Reference(states=states, inputs=inputs, initial=initial, output=output,
                         final=None, extra=extra)

    # ---- read-outs and checks -------------------------------------------------------
    def read(self, call: Call, ref: Reference) -> Readout:
        m, signals = self.float64(), {}
        for k in range(self.num_layers):
            for letter, v in self._read_layer(k, m, call, ref).items():
                signals[f"{layer_name(k)}.{letter}"] = v
        # the keep gate is per unit, s per coordinate: the perturbation split reads which
        # unit's keep factor scales each coordinate of s (Trace.meta["state_units"])
        units = [self.state_units(k) for k in range(self.num_layers)]
        return Readout(signals=signals, meta={"method": "anchored", "family": self.name,
                                              "state_units": units})

    def _read_layer(self, k: int, m: nn.Module, call: Call, ref: Reference
                    ) -> dict[str, Tensor]:
        """Layer k's anchored signals: its hand cell fed the module's own state at t − 1
        (``official_layers.anchored_layer``: a piece of the window at a time)."""
        return anchored_layer(self, k, m, call, ref)

    def read_own(self, call: Call, ref: Reference) -> Readout | None:
        """Every signal as the module computed it, its states read from its own forward with
        the gates it formed (``_forward_trajectory``'s "own"): no hand cell runs but on a layer
        whose "own" is None (an sLSTM's gates stay in its loop: ``meta["hand_cell_layers"]``)."""
        if (own := ref.extra.get("own")) is None:
            return None
        signals, hand = {}, [k for k, mine in enumerate(own) if mine is None]
        for k in range(self.num_layers):
            mine = self._read_layer(k, self.float64(), call, ref) if k in hand else own[k]
            for letter in self.letters(k):
                name = f"{layer_name(k)}.{letter}"
                signals[name] = mine[letter] if letter in mine else ref.states[name]
        meta = {"method": "own", "family": self.name,
                "state_units": [self.state_units(k) for k in range(self.num_layers)]}
        return Readout(signals=signals, meta={**meta, "hand_cell_layers": hand} if hand else meta)

    def judge(self, readout: Readout, ref: Reference) -> list[LayerDiff]:
        return [self._row(k, {letter: readout.signals[f"{layer_name(k)}.{letter}"]
                              for letter in self.letters(k)
                              if f"{layer_name(k)}.{letter}" in readout.signals}, ref)
                for k in range(self.num_layers)]

    def _row(self, k: int, signals: Mapping[str, Tensor], ref: Reference,
             link: tuple[float, float] = (0.0, 0.0)) -> LayerDiff:
        """Layer k's state and output (``signals``: the layer's, by letter) against the
        trajectory, and ``link`` (``_link``'s figures); the one rule of ``judge``,
        ``one_step`` and ``free_running``, which a family may refine."""
        worst = worst_of_windows([window_diff(signals[x], ref.states[f"{layer_name(k)}.{x}"])
                                  for x in (self.spec.state, "y")], link)
        return LayerDiff(k, False, worst[0], None, max_scaled_diff_h=worst[1],
                         worst_window=worst[2])

    def _link(self, k: int, m: nn.Module, ref: Reference) -> tuple[float, float]:
        """Layer k's block around its cell against the module: pre(x_k) against u_k, post(x_k,
        y_k) against the block's output (the top one's through ``final`` against the module's)."""
        with torch.no_grad():
            x, u = ref.extra["x"][k].double(), ref.inputs[layer_name(k)]
            y, xo = ref.states[f"{layer_name(k)}.y"].double(), ref.extra["xo"][k]
            ds = [scaled_diff(self.pre(k, m, x), u), scaled_diff(self.post(k, m, x, y), xo)]
            if k == self.num_layers - 1:
                ds.append(scaled_diff(self.final(m, xo.double()), ref.extra["step_output"]))
        return worst_of(ds)

    def one_step(self, call: Call, ref: Reference) -> list[LayerDiff]:
        # one layer at a time: no more than one layer's hand-cell signals exist at once
        m = self.float64()
        return [self._row(k, self._read_layer(k, m, call, ref), ref, self._link(k, m, ref))
                for k in range(self.num_layers)]

    def free_running(self, call: Call, ref: Reference) -> list[LayerDiff]:
        return ([self._row(k, sig, ref) for k, sig in self._rerun_layers(call)]
                if hasattr(self, "scan_layer") else super().free_running(call, ref))

    def rerun(self, call: Call) -> Readout:
        if hasattr(self, "scan_layer"):
            return self._rerun_by_layer(call)
        return self._rerun_by_step(call)

    def _rerun_by_step(self, call: Call) -> Readout:
        """The free-running re-run token by token, every layer at each step."""
        L = self.num_layers
        aux_all = self.reference(call).extra["aux"] if self.uses_aux else [None] * L
        m, B, dtype = self.float64(), call.batch, call.inputs.dtype
        parts = [self.initial_parts(k, B) for k in range(self.num_layers)]
        seq: dict[str, list[Tensor]] = {}
        with torch.no_grad():
            for t in range(call.length):
                x = call.inputs[:, t].double()
                for k in range(self.num_layers):
                    aux = aux_all[k]
                    aux = None if aux is None else aux[:, t].double()
                    u = self.pre(k, m, x)
                    sig, parts[k], y = self.step_cell(k, m, u, parts[k], aux)
                    sig = {**sig, self.spec.state: self.state_of(k, parts[k]), "y": y}
                    x = self.post(k, m, x, y)
                    for letter in self.letters(k):
                        seq.setdefault(f"{layer_name(k)}.{letter}", []).append(sig[letter])
        signals = {n: torch.stack(v, dim=1).to(self.dtype_of(n.split(".")[-1], dtype))
                   for n, v in seq.items()}
        return Readout(signals={n: signals[n] for n in self.names()},
                       meta={"method": "free-running", "family": self.name})

    def _rerun_by_layer(self, call: Call) -> Readout:
        """The free-running re-run one layer at a time, each over the whole window
        (``scan_layer``: a family whose step reads its state only through a linear
        recurrence computes every step's input side at once): the same hand cell on its own
        outputs as the step-by-step loop, without T·L calls from Python."""
        signals = {f"{layer_name(k)}.{letter}": v for k, sig in self._rerun_layers(call)
                   for letter, v in sig.items()}
        return Readout(signals={n: signals[n] for n in self.names()},
                       meta={"method": "free-running", "family": self.name})

    def _rerun_layers(self, call: Call) -> Iterator[tuple[int, Mapping[str, Tensor]]]:
        """``_rerun_by_layer``'s layers one by one, (k, signals by letter, each in its dtype
        when read: ``AsDtypes``)."""
        m, dtype = self.float64(), call.inputs.dtype
        with torch.no_grad():
            x = call.inputs.double()
            for k in range(self.num_layers):
                sig, parts, y = self.scan_layer(k, m, self.pre(k, m, x))
                # state_of reads the last dimension, whatever the leading ones: (B, T, ·)
                # views of a time-major scan stay views (no copy of the window's states)
                sig = {**sig, self.spec.state: self.state_of(k, parts), "y": y}
                x = self.post(k, m, x, y)
                yield k, AsDtypes(sig, self.letters(k), lambda x: self.dtype_of(x, dtype))

    # ---- the dynamics ----------------------------------------------------------------
    def dynamics(self, call: Call, ref: Reference) -> list[Dynamics]:
        m, L = self.float64(), self.num_layers
        offsets = [sum(self.unit_count(j) for j in range(k)) for k in range(L)]
        counts = [len(self.initial_parts(k, 1)) for k in range(L)]
        aux = [ref.extra["aux"][k] for k in range(L)]
        widths = [0 if a is None else a.shape[-1] for a in aux]
        F0 = call.inputs.shape[-1]
        packed = torch.cat([call.inputs.double()] + [a.double() for a in aux if a is not None],
                           dim=-1)  # (B, T, F0 + Σ aux)

        def step(x: Tensor, parts: Sequence[Tensor]) -> list[Tensor]:
            h, off, pos, out = x[:, :F0], F0, 0, []
            for k in range(L):
                a = None if not widths[k] else x[:, off : off + widths[k]]
                off += widths[k]
                own = list(parts[pos : pos + counts[k]])
                pos += counts[k]
                _, new, y = self.step_cell(k, m, self.pre(k, m, h), own, a)
                h = self.post(k, m, h, y)
                out += new
            return out

        trajectory = [p for k in range(L) for p in ref.extra["parts"][k]]  # read in float64
        initial = [p for k in range(L) for p in self.initial_parts(k, call.batch)]
        units = torch.cat([torch.where(u >= 0, u + offsets[k], u) for k in range(L)
                           for u in self.part_units(k)])
        return [Dynamics(step=step, inputs=packed, trajectory=trajectory, initial=initial,
                         order=list(range(call.length)), units=units)]

