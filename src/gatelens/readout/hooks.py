"""Open the cells of every nn.LSTM / nn.GRU / nn.RNN inside a user's own model.

>>> import torch
>>> class Net(torch.nn.Module):
...     def __init__(self):
...         super().__init__()
...         self.embed = torch.nn.Embedding(10, 4)
...         self.lstm = torch.nn.LSTM(4, 6, batch_first=True)
...     def forward(self, tokens):
...         return self.lstm(self.embed(tokens))[0]
>>> net = Net()
>>> with open_cells(net) as cache:
...     y = net(torch.randint(0, 10, (2, 7)))
>>> cache["lstm.layer0.f"].shape, cache.max_abs_diff["lstm"] < 1e-5
(torch.Size([2, 7, 6]), True)
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Mapping
from typing import Any

import torch
from torch import Tensor, nn

from gatelens.families.reference import output_batch_first
from gatelens.readout.trace import trace
from gatelens.readout.trace_types import Trace

RECURRENT = (nn.LSTM, nn.GRU, nn.RNN)


class CellCache(Mapping[str, Tensor]):
    """What ``open_cells`` caught: ``"<module path>.<trace name>"`` -> (B, T, H) tensor.

    A module that runs several times inside the block keeps every call: the first under
    its plain path (``encoder.lstm.layer0.f``), call n >= 1 under ``encoder.lstm#n.layer0.f``.
    ``traces[path]`` is the list of Trace objects, one per call, in call order, and
    ``max_abs_diff[path]`` the largest |h_hand − h_torch| of the module's output and final
    states over its calls (a free check: the output is already at hand).
    A module that is itself the model has the path ``""`` and bare names (``layer0.f``).
    """

    def __init__(self) -> None:
        self.traces: dict[str, list[Trace]] = {}
        self.max_abs_diff: dict[str, float] = {}

    def _key_prefix(self, path: str, call: int) -> str:
        base = path if call == 0 else f"{path}#{call}"
        return f"{base}." if base else ""

    def _flat(self) -> dict[str, Tensor]:
        flat = {}
        for path, calls in self.traces.items():
            for n, tr in enumerate(calls):
                prefix = self._key_prefix(path, n)
                flat.update({prefix + name: t for name, t in tr.items()})
        return flat

    def __getitem__(self, key: str) -> Tensor:
        flat = self._flat()
        if key not in flat:
            raise KeyError(f"{key!r} was not caught; caught {list(flat)}")
        return flat[key]

    def __iter__(self) -> Iterator[str]:
        return iter(self._flat())

    def __len__(self) -> int:
        return sum(len(tr) for calls in self.traces.values() for tr in calls)


def _split_call(args: tuple, kwargs: dict) -> tuple[Any, Any]:
    """The (input, hx) a recurrent module's forward was called with."""
    inputs = args[0] if args else kwargs.get("input")
    hx = args[1] if len(args) > 1 else kwargs.get("hx")
    return inputs, hx


def _output_diff(module: nn.RNNBase, tr: Trace, output: Any) -> float:
    """Max |trace − module| over the last layer's output and the final states."""
    out, h_n, c_n = output_batch_first(module, output)
    k = module.num_layers - 1
    mine = [tr[f"layer{k}.h"]] + ([tr[f"layer{k}.reverse.h"]] if module.bidirectional else [])
    diffs = [(torch.cat(mine, -1)[:, : out.shape[1]] - out).abs().max()]
    diffs.append((tr.h_n - h_n).abs().max())
    if c_n is not None:
        diffs.append((tr.c_n - c_n).abs().max())
    return float(max(diffs).detach())


@contextlib.contextmanager
def open_cells(model: nn.Module) -> Iterator[CellCache]:
    """Trace every recurrent module of ``model`` each time it runs inside the block.

    The model runs exactly as usual (its output is untouched); each recurrent module's
    forward hook re-runs it with ``gatelens.trace`` on the same input and state. The hooks
    are removed on exit, also when the block raises. Traces use inference semantics (no
    inter-layer dropout); ``max_abs_diff`` shows any mismatch with what actually ran.
    """
    cache = CellCache()
    handles = []

    def make_hook(path: str):
        def hook(module: nn.RNNBase, args: tuple, kwargs: dict, output: Any) -> None:
            inputs, hx = _split_call(args, kwargs)
            tr = trace(module, inputs, hx)
            cache.traces.setdefault(path, []).append(tr)
            with torch.no_grad():
                diff = _output_diff(module, tr, output)
            cache.max_abs_diff[path] = max(cache.max_abs_diff.get(path, 0.0), diff)

        return hook

    try:
        for path, module in model.named_modules():
            if isinstance(module, RECURRENT):
                handles.append(module.register_forward_hook(make_hook(path), with_kwargs=True))
        yield cache
    finally:
        for h in handles:
            h.remove()
