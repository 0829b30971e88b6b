"""An official family's one-step check one layer at a time, from one recorded forward.

The float64 re-judgement (readout/depth.py) judges a read-out against the module's own
float64 forward. ``OfficialFamily.reference`` replays every layer's states at once: at 24
layers of mamba-130m's shape that is 2.3 GB of float64 for one window of 128 tokens. A
family whose recorded forward gives each layer's states on their own (``layer_recorded``,
beside a ``trajectory_recorded`` built from it) is judged here instead: the forward runs once
with its ``scan_modules`` recorded (each block's input and output, each mixer's projections:
a few MB a layer), then each layer's states are replayed, its hand cell run on them, judged
and dropped in turn. The rows are the ones ``one_step`` gives on the whole reference.

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

from typing import Any

import torch

from gatelens.cells.names import layer_name
from gatelens.families.base import Call, LayerDiff, Readout, Reference
from gatelens.families.records import Recorder

__all__ = ["one_step_by_layer", "read_layers", "streams"]


def _owner(cls: type, name: str) -> type | None:
    return next((c for c in cls.__mro__ if name in c.__dict__), None)


def streams(fam: Any) -> bool:
    """Whether ``fam`` gives each layer's recorded states on their own: a ``layer_recorded``
    from the same class as its ``trajectory_recorded`` (a subclass that replays its layers
    another way, e.g. FalconMamba's normed scan, does not) and its scan modules at hand."""
    cls = type(fam)
    owner = _owner(cls, "layer_recorded")
    return (owner is not None and owner is _owner(cls, "trajectory_recorded")
            and fam.scan_modules() is not None)


def one_step_by_layer(fam: Any, call: Call) -> list[LayerDiff]:
    """``fam.one_step(call, fam.reference(call))``, holding one layer's states at a time."""
    L, B, m = fam.num_layers, call.batch, fam.float64()
    with torch.no_grad():
        with Recorder(fam.scan_modules()) as rec:
            output = fam._forward(call)
        blocks = rec.blocks(L)
        rows = []
        for k in range(L):
            parts, _, _ = fam.layer_recorded(rec, k)
            name = layer_name(k)
            ref = Reference(
                states={f"{name}.{fam.spec.state}": fam.state_of(k, parts).to(call.inputs.dtype),
                        f"{name}.y": blocks["y"][k]},
                inputs={name: blocks["u"][k]}, initial={name: tuple(fam.initial_parts(k, B))},
                output=output, final=None,
                extra={"x": blocks["x"], "xo": blocks["xo"], "parts": {k: parts},
                       "aux": [None] * L, "step_output": output})
            rows.append(fam._row(k, fam._read_layer(k, m, call, ref), ref, fam._link(k, m, ref)))
            del parts, ref
    return rows


def read_layers(fam: Any, call: Call, names: list[str]) -> Readout:
    """The module's own signals ``names`` (``read_own``'s values), replaying only the layers
    they name from one recorded forward: a trace of one layer of a 24-layer Mamba-2 holds
    that layer's states, not the stack's (4.8 GB at mamba2-130m's width, B = 2, T = 128)."""
    L, dtype = fam.num_layers, call.inputs.dtype
    wanted = sorted({k for k in range(L) for n in names if n.startswith(f"{layer_name(k)}.")})
    with torch.no_grad():
        with Recorder(fam.scan_modules()) as rec:
            fam._forward(call)
        signals = {}
        for k in wanted:
            parts, own, _ = fam.layer_recorded(rec, k)
            sig = {**own, fam.spec.state: fam.state_of(k, parts).to(dtype),
                   "y": rec.stacked(f"mixer{k}", outputs=True)}
            signals.update({f"{layer_name(k)}.{x}": sig[x] for x in fam.letters(k)
                            if f"{layer_name(k)}.{x}" in names})
            del parts, own, sig
    return Readout(signals=signals, meta={
        "method": "own", "family": fam.name, "layers_read": wanted,
        "state_units": [fam.state_units(k) for k in range(L)]})
