"""What nn.LSTM, nn.GRU and nn.RNN share as families: their calls, PyTorch's own states,
the step-by-step re-run, the checks and the dynamics. Each cell's own read-out and step are
in lstm.py, gru.py and rnn.py.

PyTorch returns only the top layer's sequence, so the state of a layer below the top is the
output of a module holding PyTorch's own layers up to it; such copies are built on the meta
device and given the module's own tensors (no weight is initialised, nothing is copied).
Everything here only reads the user's module.

>>> import torch
>>> from gatelens.families.registry import family_of
>>> fam = family_of(torch.nn.GRU(3, 4, num_layers=2))
>>> call = fam.check(torch.randn(5, 2, 3))  # (T, B, F): the module is not batch_first
>>> ref = fam.reference(call)
>>> tuple(call.inputs.shape), sorted(ref.states), tuple(ref.inputs["layer1"].shape)
((2, 5, 3), ['layer0.h', 'layer1.h'], (2, 5, 4))
"""

from __future__ import annotations

import re
from typing import Any, ClassVar

import torch
from torch import Tensor, nn
from torch.nn.utils.rnn import PackedSequence, pad_packed_sequence

from gatelens.cells import kernels
from gatelens.cells.equations import cell_weights
from gatelens.cells.numerics import quiet_onednn
from gatelens.families.base import Call, Dynamics, Family, LayerDiff, Readout, Reference
from gatelens.families.records import nan_max
from gatelens.families.spec import CellSpec, layer_name
from gatelens.families.stepped import Recorded, Step, recorded_call, recorded_reference, torch_step
from gatelens.families.torch_ops import (  # noqa: F401 - re-exported
    flat_names,
    like,
    max_diff,
    previous,
    weights_of,
)


class TorchRNNFamily(Family):
    """nn.LSTM / nn.GRU / nn.RNN: what the three share."""

    edit_reads_whole = True  # its edited run reads every stretch (families/base.py)

    module_class: ClassVar[type] = nn.RNNBase

    @classmethod
    def opens(cls, module: nn.Module) -> bool:
        return isinstance(module, cls.module_class) and any(
            s.mode == getattr(module, "mode", "") for s in cls.specs)

    # ---- facts -----------------------------------------------------------------------
    @property
    def spec(self) -> CellSpec:
        return next(s for s in self.specs if s.mode == self.module.mode)

    @property
    def num_layers(self) -> int:
        return self.module.num_layers

    @property
    def bidirectional(self) -> bool:
        return bool(self.module.bidirectional)

    @property
    def hidden_size(self) -> int:
        return self.module.hidden_size

    @property
    def proj(self) -> bool:
        return getattr(self.module, "proj_size", 0) > 0

    @property
    def directions(self) -> int:
        return 2 if self.module.bidirectional else 1

    @property
    def output_size(self) -> int:
        """H_out: proj_size for a projected LSTM, else H."""
        return getattr(self.module, "proj_size", 0) or self.module.hidden_size

    @property
    def two_states(self) -> bool:
        """Whether the state is (h, c) (the LSTM)."""
        return self.spec.name == "lstm"

    def describe(self) -> dict:
        info = {**super().describe(),
                "nonlinearity": getattr(self.module, "nonlinearity", None)}
        if self.bidirectional:
            info["directions"] = ("forward direction measured; the reverse direction's gates "
                                  "are in the trace")
        return info

    def step_call(self, inputs: Any) -> bool:
        if not isinstance(inputs, Tensor):  # packed: not one step
            return False
        if inputs.ndim == 2:  # unbatched (T, F)
            return inputs.shape[0] == 1
        return inputs.ndim == 3 and inputs.shape[1 if self.module.batch_first else 0] == 1

    def step_of(self, inputs: Tensor, state: Any, output: Any) -> Step:
        return torch_step(inputs, state, output, cell=False,
                          batch_first=self.module.batch_first)

    def directions_of(self) -> list[tuple[int, bool, str, int]]:
        """(layer, reverse, name, row of h0) of every layer and direction, in trace order."""
        D = self.directions
        return [(k, bool(d), layer_name(k, bool(d)), k * D + d)
                for k in range(self.num_layers) for d in range(D)]

    # ---- a call ----------------------------------------------------------------------
    def check(self, inputs: Any, state: Any = None) -> Call:
        """Validate everything before any work; errors say what was expected and what came.
        A ``Recorded`` trajectory (stitched calls, families/stepped.py) is one call."""
        if isinstance(inputs, Recorded):
            return recorded_call(self, inputs)
        m, w = self.module, self.module.weight_ih_l0
        layout: dict[str, Any] = {"batch_first": m.batch_first, "unbatched": False,
                                  "packed": None, "lengths": None}
        if isinstance(inputs, PackedSequence):
            _check_tensor("inputs.data", inputs.data, w)
            if inputs.data.ndim != 2 or inputs.data.shape[1] != m.input_size:
                raise ValueError(f"packed inputs.data must be (N, {m.input_size}); "
                                 f"got {tuple(inputs.data.shape)}")
            x, lens = pad_packed_sequence(inputs, batch_first=True)  # (B, T, F), caller order
            layout.update(packed=inputs, lengths=lens.to(x.device))
        elif isinstance(inputs, Tensor):
            _check_tensor("inputs", inputs, w)
            if inputs.ndim not in (2, 3) or inputs.shape[-1] != m.input_size:
                form = "(B, T, F)" if m.batch_first else "(T, B, F)"
                raise ValueError(f"inputs must be {form} or unbatched (T, F) with F = "
                                 f"{m.input_size}; got shape {tuple(inputs.shape)}")
            layout["unbatched"] = inputs.ndim == 2
            x = inputs.unsqueeze(0) if inputs.ndim == 2 else (
                inputs if m.batch_first else inputs.transpose(0, 1))
        else:
            raise TypeError(f"inputs must be a Tensor or PackedSequence; got "
                            f"{type(inputs).__name__}")
        B, T = x.shape[0], x.shape[1]
        if B == 0 or T == 0:
            raise ValueError(f"inputs must hold at least one step of one sequence; got B={B}, "
                             f"T={T}")
        return Call(x, self._check_state(state, B, layout["unbatched"]), layout)

    def _check_state(self, state: Any, B: int, unbatched: bool) -> tuple[Tensor, ...]:
        """Initial states as (L·D, B, ·) tensors, zeros when ``state`` is None."""
        w = self.module.weight_ih_l0
        LD, H = self.num_layers * self.directions, self.hidden_size
        if state is None:
            h0 = w.new_zeros(LD, B, self.output_size)
            return (h0, w.new_zeros(LD, B, H)) if self.two_states else (h0,)
        if self.two_states:
            if not (isinstance(state, tuple) and len(state) == 2):
                raise TypeError(f"an LSTM's state is a tuple (h0, c0); got {type(state).__name__}")
            pairs = [("h0", state[0], self.output_size), ("c0", state[1], H)]
        else:
            if not isinstance(state, Tensor):
                raise TypeError(f"a {type(self.module).__name__}'s state is a Tensor h0; "
                                f"got {type(state).__name__}")
            pairs = [("h0", state, H)]
        out = []
        for name, t, size in pairs:
            if not isinstance(t, Tensor):
                raise TypeError(f"{name} must be a Tensor; got {type(t).__name__}")
            _check_tensor(name, t, w)
            want = (LD, size) if unbatched else (LD, B, size)
            if tuple(t.shape) != want:
                raise ValueError(f"{name} must have shape {want} (layers*directions, "
                                 f"{'' if unbatched else 'batch, '}units); got {tuple(t.shape)}")
            out.append(t.unsqueeze(1) if unbatched else t)
        return tuple(out)

    def module_state(self, state: tuple[Tensor, ...], rows: int | None = None) -> Any:
        """A Call's state as the module takes it (the first ``rows`` layers·directions)."""
        parts = tuple(s[:rows] for s in state) if rows is not None else state
        return parts if self.two_states else parts[0]

    # ---- PyTorch's own trajectory ----------------------------------------------------
    def layer(self, k: int) -> nn.RNNBase:
        """A one-layer module (batch first) holding layer k's tensors, shared (cached)."""
        cache = self.__dict__.setdefault("_layers", {})
        if k not in cache:
            m = self.module
            # the weights as the forward reads them (a parametrization's or prune's value)
            names = [n for n in flat_names(m) if int(re.search(r"_l(\d+)", n).group(1)) == k]
            tensors = {re.sub(r"_l\d+", "_l0", n): w for n, w in weights_of(m, names).items()}
            width = tensors["weight_ih_l0"].shape[1]
            cache[k] = like(m, 1, tensors, bidirectional=m.bidirectional, input_size=width)
        return cache[k]

    def run(self, module: nn.RNNBase, call: Call, rows: int | None = None,
            inputs: Any = None, state: Any = None) -> tuple[Any, Any]:
        """``module`` on ``inputs`` (default: the call's, packed if it was) from ``state``
        (default: the call's first ``rows`` layers·directions): its raw output (packed or
        in its layout) and final state. Its forward itself runs, so no hook of the user's
        fires."""
        if inputs is None:
            inputs = call.layout["packed"]
            if inputs is None:
                inputs = call.inputs if module.batch_first else call.inputs.transpose(0, 1)
        if state is None:
            state = self.module_state(call.state, rows)
        with torch.no_grad(), quiet_onednn():
            return module.forward(inputs, state)

    def padded(self, module: nn.RNNBase, out: Any) -> Tensor:
        """A module's raw output as (B, T', ·) batch first."""
        if isinstance(out, PackedSequence):
            return pad_packed_sequence(out, batch_first=True)[0]
        return out if module.batch_first else out.transpose(0, 1)

    def reference(self, call: Call) -> Reference:
        """PyTorch's h of every layer and direction. One layer is the module itself; a
        stack is run layer by layer, each a module of that layer's own tensors fed the
        layer below's output (PyTorch runs a stack the same way: on the CPU the top layer's
        output is bitwise the module's, tested); each layer's input; the initial states.
        A recorded trajectory's reference is what its calls returned (nothing re-run)."""
        if call.layout.get("recorded") is not None:
            return recorded_reference(self, call)
        D, L = self.directions, self.num_layers
        states: dict[str, Tensor] = {}
        finals, raw = [], None
        for k in range(L):
            mod = self.module if L == 1 else self.layer(k)
            part = tuple(s[k * D : (k + 1) * D] for s in call.state)
            raw, fin = self.run(mod, call, inputs=raw,
                                state=part if self.two_states else part[0])
            out = self.padded(mod, raw)  # (B, T', D·H_out)
            for d, h in enumerate(out.chunk(D, dim=-1)):
                states[layer_name(k, bool(d)) + ".h"] = h
            finals.append(fin if isinstance(fin, tuple) else (fin,))
        final = tuple(torch.cat([f[j] for f in finals]) for j in range(len(finals[0])))
        inputs = {"layer0": call.inputs}
        for k in range(1, L):
            below = [states[layer_name(k - 1, bool(d)) + ".h"] for d in range(D)]
            inputs[layer_name(k)] = torch.cat(below, dim=-1)  # (B, T, D·H_out)
        initial = {name: tuple(s[j] for s in call.state)
                   for _, _, name, j in self.directions_of()}
        return Reference(states, inputs, initial, out,
                         final if self.two_states else final[0])

    def layer_input(self, ref: Reference, layer: int) -> Tensor:
        return ref.inputs[layer_name(layer)]

    # ---- the step-by-step re-run -----------------------------------------------------
    def rerun(self, call: Call) -> Readout:
        """Every layer and direction re-run on its own outputs (cells/kernels.py)."""
        lengths, order = call.layout["lengths"], None
        x, state = call.inputs, call.state
        if lengths is not None:  # the kernels want columns sorted by decreasing length
            order = torch.argsort(lengths, descending=True, stable=True)
            x, lengths = x[order], lengths[order]
            state = tuple(s[:, order] for s in state)
        bufs, h_n, c_n = self.run_kernels(
            x.permute(1, 2, 0).contiguous(),  # (T, F, B)
            *(s.transpose(1, 2).contiguous() for s in state), lengths=lengths)
        signals = {n: b.permute(2, 0, 1) for n, b in bufs.items()}  # (B, T, R)
        h_n, c_n = h_n.transpose(1, 2), None if c_n is None else c_n.transpose(1, 2)
        if order is not None:
            back = torch.argsort(order)
            signals = {n: t.index_select(0, back) for n, t in signals.items()}
            h_n = h_n.index_select(1, back)
            c_n = None if c_n is None else c_n.index_select(1, back)
        return Readout(signals, h_n, c_n, {"method": "step"})

    def run_kernels(self, x: Tensor, h0: Tensor, c0: Tensor | None = None,
                    lengths: Tensor | None = None) -> tuple[dict[str, Tensor], Tensor,
                                                             Tensor | None]:
        """Every layer and direction on ``x`` (T, F, B) from states (L·D, ·, B): the signal
        buffers (T, R, B) by trace name, h_n and c_n (``cells.kernels.run_stack``)."""
        bufs, h_n, c_n = kernels.run_stack(self.module, self.spec.name, x, h0, c0, lengths)
        return {f"{layer_name(k, r)}.{s}": b for (k, r, s), b in bufs.items()}, h_n, c_n

    # ---- checks ----------------------------------------------------------------------
    def judge(self, readout: Readout, ref: Reference) -> list[LayerDiff]:
        """max |read-out − PyTorch| of h at every step (and h_n, c_n) per layer and direction."""
        h_n, c_n = (ref.final if isinstance(ref.final, tuple) else (ref.final, None))
        rows = []
        for k, reverse, name, j in self.directions_of():
            ref_h = ref.states[name + ".h"]  # (B, T', H_out); T' < T when packed
            diff = nan_max(max_diff(readout.signals[name + ".h"][:, : ref_h.shape[1]], ref_h),
                           max_diff(readout.h_n[j], h_n[j]))
            dc = sc = None
            if c_n is not None:
                dc, sc = (max_diff(readout.c_n[j], c_n[j], s) for s in (False, True))
            rows.append(LayerDiff(k, reverse, diff, dc, sc))
        return rows

    def output_diff(self, readout: Readout, output: Any) -> float:
        """max |read-out − module| over the top layer's output and the final states."""
        out, final = output
        if isinstance(out, PackedSequence):
            out, _ = pad_packed_sequence(out, batch_first=True)
        elif out.ndim == 2:
            out = out.unsqueeze(0)
        elif not self.module.batch_first:
            out = out.transpose(0, 1)
        top = [layer_name(self.num_layers - 1, bool(d)) + ".h" for d in range(self.directions)]
        mine = torch.cat([readout.signals[n] for n in top], dim=-1)[:, : out.shape[1]]
        h_n, c_n = final if isinstance(final, tuple) else (final, None)
        if h_n.ndim == 2:  # unbatched
            h_n, c_n = h_n.unsqueeze(1), None if c_n is None else c_n.unsqueeze(1)
        diffs = [max_diff(mine, out.detach()), max_diff(readout.h_n, h_n.detach())]
        if c_n is not None:
            diffs.append(max_diff(readout.c_n, c_n.detach()))
        return nan_max(*diffs)

    # ---- dynamics ----------------------------------------------------------------------
    def dynamics(self, call: Call, ref: Reference) -> list[Dynamics]:
        """Per causal direction, the stack's step along PyTorch's own states in float64.

        Unidirectional: one step s_{t−1} → s_t of the whole stack (layer k reads layer
        k − 1's new h). Bidirectional: each direction on its own, in its own time order,
        every layer's input fixed to the module's own lower-layer output (both directions).
        """
        L, D, T = self.num_layers, self.directions, call.length
        states = self.trajectory_states(call, ref)
        x = call.inputs.detach().double()  # (B, T, F)
        out = []
        for d in range(D):
            rev = bool(d)
            ws = [cell_weights(self.module, k, rev, dtype=torch.float64) for k in range(L)]
            traj, init, units = [], [], []
            for k in range(L):
                name, j = layer_name(k, rev), k * D + d
                for part, s0 in zip(self.state_parts, call.state, strict=False):
                    traj.append(states[f"{name}.{part}"].double())  # (B, T, ·)
                    init.append(s0[j].double())
                    n = traj[-1].shape[-1]
                    mapped = part != "h" or not self.proj
                    units.append(torch.arange(n) + k * self.hidden_size if mapped
                                 else torch.full((n,), -1))
            if D == 1:
                xs = [x]
            else:
                xs = [x] + [torch.cat([states[layer_name(k) + ".h"],
                                       states[layer_name(k, True) + ".h"]], -1).double()
                            for k in range(L - 1)]  # (B, T, 2·H_out)
            sizes = [t.shape[-1] for t in xs]
            step = self.stack_step(ws, sizes, fixed=D > 1)
            order = list(range(T - 1, -1, -1)) if rev else list(range(T))
            out.append(Dynamics(step, torch.cat(xs, dim=-1), traj, init, order,
                                torch.cat(units), "reverse" if rev else "forward"))
        return out

    def intervene(self, call: Call, plan: Any, output: Any, offset: int = 0
                  ) -> tuple[Any, dict[str, Tensor]]:
        """Edits inside the steps (families/torch_edit.py)."""
        from gatelens.families.torch_edit import intervene

        return intervene(self, call, plan, output, offset)

    #: the parts of one layer's carried state, in order (the LSTM: h then c)
    state_parts: ClassVar[tuple[str, ...]] = ("h",)

    def trajectory_states(self, call: Call, ref: Reference) -> dict[str, Tensor]:
        """PyTorch's own state parts at every step (the LSTM adds its stepped c)."""
        return ref.states

    def stack_step(self, ws: list, sizes: list[int], fixed: bool):
        """F(x_t, parts) of the stack: layer k reads layer k − 1's new h (or, ``fixed``, its
        own slice of x_t)."""
        from gatelens.cells.equations import step

        per = len(self.state_parts)

        def stack(x_t: Tensor, parts: list[Tensor]) -> list[Tensor]:
            inp = list(x_t.split(sizes, dim=-1))
            out: list[Tensor] = []
            below = inp[0]
            for k, w in enumerate(ws):
                sig = step(w, inp[k] if fixed else below, *parts[per * k : per * (k + 1)])
                out += [sig[p] for p in self.state_parts]
                below = sig["h"]
            return out

        return stack


def _check_tensor(what: str, t: Tensor, w: Tensor) -> None:
    if not t.is_floating_point() or t.dtype != w.dtype:
        raise TypeError(f"{what} must have the module's dtype {w.dtype}; got {t.dtype}")
    if t.device != w.device:
        raise ValueError(f"{what} must be on the module's device {w.device}; got {t.device}")
