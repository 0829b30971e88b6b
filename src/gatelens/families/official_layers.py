"""An official family's one-step check one layer at a time, from one recorded forward.

The float64 re-judgement (readout/depth.py) judges a read-out against the module's own
float64 forward. ``OfficialFamily.reference`` replays every layer's states at once: at 24
layers of mamba-130m's shape that is 2.3 GB of float64 for one window of 128 tokens. A
family whose recorded forward gives each layer's states on their own (``layers_apart``: its
``trajectory_recorded`` is each layer's ``layer_recorded``) is judged here instead: the
forward runs once with its ``scan_modules`` recorded (each block's input and output, each
mixer's projections: a few MB a layer), then each layer's states are replayed, its hand
cell run on them, judged and dropped in turn. The rows are the ones ``one_step`` gives on
the whole reference.

>>> import torch, transformers as tf
>>> from gatelens.families.registry import open_family
>>> m = tf.MambaModel(tf.MambaConfig(vocab_size=8, hidden_size=8, num_hidden_layers=2,
...                                  state_size=4, expand=2, use_cache=False)).double()
>>> fam, x = open_family(m), torch.randn(1, 6, 8, dtype=torch.float64)
>>> call = fam.check(x)
>>> whole = fam.one_step(call, fam.reference(call))
>>> streams(fam), [r.max_scaled_diff_h for r in one_step_by_layer(fam, call)] == [
...     r.max_scaled_diff_h for r in whole]
(True, True)
"""

from __future__ import annotations

from collections.abc import Collection, Iterator, Mapping, Sequence
from functools import partial
from typing import Any

import torch
from torch import Tensor

from gatelens.cells.names import layer_name
from gatelens.cells.numerics import faithful_matmul
from gatelens.families.base import Call, LayerDiff, Readout, Reference
from gatelens.families.forward_scan import SequentialScanStates
from gatelens.families.records import Recorder

__all__ = ["LayerReplay", "layer_steps", "one_step_by_layer", "read_layers", "replayed",
           "streams"]


def streams(fam: Any) -> bool:
    """Whether ``fam`` gives each layer's recorded states on their own (``layers_apart``:
    its ``trajectory_recorded`` is each layer's ``layer_recorded``; FalconMamba's normed scan
    replays every layer together) and its scan modules are at hand."""
    return bool(getattr(fam, "layers_apart", False)) and fam.scan_modules() is not None


def _recorded(fam: Any, call: Call) -> tuple[Recorder, dict]:
    """One forward of the module on ``call`` with its ``scan_modules`` recorded, and the
    trajectory dict's entries every layer shares (``Recorder.blocks``, the output)."""
    with Recorder(fam.scan_modules()) as rec:
        output = fam._forward(call)
    return rec, _shared(fam, rec, output)


def _shared(fam: Any, rec: Recorder, output: Tensor) -> dict:
    """The trajectory dict's entries every layer shares, from a recorded forward."""
    L = fam.num_layers
    return {**rec.blocks(L), "aux": [None] * L, "output": output, "step_vs_forward": None}


def layer_steps(fam: Any, names: Sequence[str]) -> dict[str, tuple] | None:
    """``fam.scan_steps()`` of the layers ``names`` (full trace keys) name only: the states of
    a layer no name asks for are not kept during the forward (``scan{k}`` is layer k's), and
    a layer whose names skip its keep gate keeps its states without the keep
    (``SequentialScanStates(keep=False)``: at 24 layers of mamba-130m's width, 0.6 GB)."""
    steps = fam.scan_steps()
    if steps is None:
        return None
    layers = {_layer_of(n) for n in names}
    keep = fam.spec.keep_gate
    kept = {_layer_of(n) for n in names if n.split(".")[-1] == keep}
    return {key: (mod, partial(SequentialScanStates, keep=False)
                  if mode is SequentialScanStates and k not in kept else mode)
            for key, (mod, mode) in steps.items()
            if (k := _scan_layer(key)) is None or k in layers}


def _scan_layer(key: str) -> int | None:
    """The layer of a ``scan_steps`` key (``scan{k}``), None for another key."""
    return int(key[len("scan"):]) if key.startswith("scan") else None


def _layer_reference(fam: Any, call: Call, rec: Recorder, shared: dict, k: int
                     ) -> tuple[Reference, dict]:
    """Layer k's Reference alone (``_reference_of``) and its own signals."""
    parts, own, _ = fam.layer_recorded(rec, k)
    tr = {**shared, "parts": {k: parts}}
    return fam._reference_of(call, tr, shared["output"], [k]), own


#: the most bytes of the float64 states before one piece of steps that the anchored read
#: steps at once (``anchored_layer``): one layer of 24 Mamba-2 heads of 64 × 128 is 200 MB
#: a window in float64, and the step's work several times that
PIECE_BYTES = 16 * 2**20


def anchored_layer(fam: Any, k: int, m: Any, call: Call, ref: Reference) -> dict[str, Tensor]:
    """Layer k's anchored signals (B, T, ·) by letter: its hand cell (``m``, the family's
    float64 copy) fed the module's own state at t − 1 (the initial state at t = 0) and its
    own input at t, a piece of steps at a time. Each step reads nothing but its own
    previous state, so the pieces give the whole window's values; only one piece's float64
    work exists at once."""
    B, T = call.batch, call.length
    init, parts = ref.initial[layer_name(k)], ref.extra["parts"][k]  # parts: (B, T, n_i)
    u_all, aux_all = ref.inputs[layer_name(k)], ref.extra["aux"][k]
    n = max(1, min(T, PIECE_BYTES // (8 * B * max(1, sum(p.shape[-1] for p in parts)))))
    out: dict[str, Tensor] = {}
    with torch.no_grad():
        for a in range(0, T, n):
            b = min(a + n, T)
            rows = lambda v, a=a, b=b: v[:, a:b].double().reshape(B * (b - a), -1)  # noqa: E731
            prev = [(torch.cat([i0.to(p)[:, None].double(), p[:, : b - 1].double()], dim=1)
                     if a == 0 else p[:, a - 1 : b - 1].double()).reshape(B * (b - a), -1)
                    for i0, p in zip(init, parts, strict=True)]
            sig, new, y = fam.step_cell(k, m, rows(u_all), prev,
                                        None if aux_all is None else rows(aux_all))
            sig = {**sig, fam.spec.state: fam.state_of(k, new), "y": y}
            for x in fam.letters(k):
                v = sig[x].reshape(B, b - a, -1)
                if x not in out:
                    out[x] = v.new_empty(B, T, v.shape[-1],
                                         dtype=fam.dtype_of(x, call.inputs.dtype))
                out[x][:, a:b] = v
            del sig, new, y, prev
    return out


def one_step_by_layer(fam: Any, call: Call, layers: Collection[int] | None = None
                      ) -> list[LayerDiff]:
    """``fam.one_step(call, fam.reference(call))``, holding one layer's states at a time;
    the rows of ``layers`` only, if given (no other layer's states are replayed)."""
    m, rows = fam.float64(), []
    with torch.no_grad():
        rec, shared = _recorded(fam, call)
        for k in range(fam.num_layers) if layers is None else sorted(layers):
            ref, _ = _layer_reference(fam, call, rec, shared, k)
            rows.append(fam._row(k, fam._read_layer(k, m, call, ref), ref, fam._link(k, m, ref)))
            del ref
    return rows


class LayerReplay(Mapping[str, Tensor]):
    """The module's own signals ``names`` (``read_own``'s values) of one recorded forward,
    each layer replayed when one of its names is asked for, and only the layer last asked
    for held: a perturbed run's trace read layer by layer (the split, the return path cut)
    holds one layer's states, not the stack's (2.5 GB a window at 24 layers of mamba2-130m's
    width). Asked for in layer order, each layer is replayed once."""

    def __init__(self, fam: Any, call: Call, names: Sequence[str],
                 recorded: tuple[Recorder, Tensor] | None = None) -> None:
        self.fam, self.call, self.names = fam, call, list(names)
        if recorded is not None:  # a forward the user ran (readout/hooks.py): not run again
            self.rec, self.shared = recorded[0], _shared(fam, *recorded)
        else:
            with torch.no_grad(), faithful_matmul(call.inputs.device):
                self.rec, self.shared = _recorded(fam, call)
        self.layers = sorted({_layer_of(n) for n in self.names})
        self._held: dict[str, Tensor] = {}

    def __getitem__(self, name: str) -> Tensor:
        if name not in self._held:
            if name not in self.names:
                raise KeyError(name)
            self._replay(_layer_of(name))
        return self._held[name]

    def __iter__(self) -> Iterator[str]:
        return iter(self.names)

    def __len__(self) -> int:
        return len(self.names)

    def _replay(self, k: int) -> None:
        """Layer k's names replayed (``read_own``'s rule: the module's own value, else its
        state), the layer held before dropped first."""
        self._held = {}
        prefix = f"{layer_name(k)}."
        with torch.no_grad(), faithful_matmul(self.call.inputs.device):
            ref, own = _layer_reference(self.fam, self.call, self.rec, self.shared, k)
            for name in (n for n in self.names if n.startswith(prefix)):
                letter = name[len(prefix):]
                self._held[name] = own[letter] if letter in own else ref.states[name]


def _layer_of(name: str) -> int:
    """The layer index of a trace name (``layerK.x``)."""
    return int(name.split(".", 1)[0][len("layer"):])


def replayed(fam: Any, call: Call, names: Sequence[str],
             recorded: tuple[Recorder, Tensor] | None = None) -> Readout:
    """The module's own signals ``names`` as a Readout whose signals replay their layers as
    they are read (``LayerReplay``), with ``read_own``'s meta; from ``recorded`` (a Recorder
    of the module's ``scan_modules`` during a forward, and that forward's output tensor)
    where given, else from a forward of its own."""
    replay = LayerReplay(fam, call, [n for n in fam.names() if n in names], recorded)
    return Readout(signals=replay, meta={  # type: ignore[arg-type]
        "method": "own", "family": fam.name, "layers_read": replay.layers,
        "state_units": [fam.state_units(k) for k in range(fam.num_layers)]})


def read_layers(fam: Any, call: Call, names: list[str],
                recorded: tuple[Recorder, Tensor] | None = None) -> Readout:
    """The module's own signals ``names`` (``read_own``'s values), replaying only the layers
    they name from one recorded forward (``recorded``'s, else one of its own): a trace of one
    layer of a 24-layer Mamba-2 holds that layer's states, not the stack's (4.8 GB at
    mamba2-130m's width, B = 2, T = 128)."""
    ro = replayed(fam, call, names, recorded)
    return Readout(signals=dict(ro.signals), meta=ro.meta)
