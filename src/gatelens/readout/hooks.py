"""Open the cells of every recurrent module inside a user's own model (any family).

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
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import replace
from typing import Any

import torch
from torch import Tensor, nn

from gatelens.cells.numerics import faithful_matmul
from gatelens.errors import GatelensError
from gatelens.families.base import Family
from gatelens.families.official import Recorder
from gatelens.families.official_layers import layer_steps, read_layers, streams
from gatelens.families.records import nan_max
from gatelens.families.registry import family_of
from gatelens.families.stepped import recorded_output_diff
from gatelens.readout.own_call import mark
from gatelens.readout.select import Selection, keeps_name, select_paths
from gatelens.readout.stitch import Stitcher, is_step_call
from gatelens.readout.trace import assemble, own_or_anchored
from gatelens.readout.trace_types import Trace


class CellCache(Mapping[str, Tensor]):
    """What ``open_cells`` caught: ``"<module path>.<trace name>"`` -> (B, T, H) tensor.

    A module that runs several times inside the block keeps every call: the first under
    its plain path (``encoder.lstm.layer0.f``), call n >= 1 under ``encoder.lstm#n.layer0.f``.
    Calls of one step (every nn.LSTMCell/GRUCell/RNNCell call, an nn.LSTM/GRU/RNN call with
    T = 1) are stitched into trajectories at the block's exit (readout/stitch.py): each
    trajectory is one entry, (B, T, H), after the module's whole-sequence calls.
    ``traces[path]`` is the list of Trace objects, one per call or trajectory, and
    ``max_abs_diff[path]`` the largest |read-out − module| of what the module returned (its
    output and final states; every step's h and c of a stitched trajectory) over them (a
    free check: the output is already at hand).
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


class _Running:
    """What ``open_cells`` is in the middle of: which opened modules' forwards are running
    (a call count per path), and whether a read-out is being computed (``busy``).

    While ``busy``, every hook of the block does nothing: a family's reference re-runs the
    module (and the modules inside it) itself, and those calls are the read-out's, not the
    model's (hooking them recursed without end, and re-read inner modules once per step).
    A module called while an opened module above it is running is read by that module's
    family (its layers are that trace's ``layerK``), not again on its own.
    """

    def __init__(self, paths: list[str]) -> None:
        self.busy = False
        self.calls = dict.fromkeys(paths, 0)
        self.above = {p: [q for q in paths if q != p and (q == "" or p.startswith(q + "."))]
                      for p in paths}

    def enter(self, path: str) -> None:
        if not self.busy:
            self.calls[path] += 1

    def leave(self, path: str) -> None:
        if not self.busy:
            self.calls[path] -= 1

    def inside_opened(self, path: str) -> bool:
        """Whether an opened module above ``path`` is running (it reads this call)."""
        return any(self.calls[q] > 0 for q in self.above[path])

    @contextlib.contextmanager
    def reading(self) -> Iterator[None]:
        self.busy = True
        try:
            yield
        finally:
            self.busy = False


#: > 0 while a family runs its module for its own purposes (an edited call's reference):
#: open_cells reads none of those calls
_QUIET = [0]


@contextlib.contextmanager
def family_calls() -> Iterator[None]:
    """Calls of recurrent modules inside the block are a family's own, not the model's:
    ``open_cells`` does not read them (interventions/run.py wraps an edited call in it)."""
    _QUIET[0] += 1
    try:
        yield
    finally:
        _QUIET[0] -= 1


def in_family_call() -> bool:
    """Whether a family is running its module for its own purposes now."""
    return _QUIET[0] > 0


def module_training(fam: Family) -> bool:
    """A module in training mode: its recorded forward may differ from the eval-mode
    reference (dropout, a fused training path), so the reference runs it again."""
    return fam.module.training


#: modules whose call now finishing an edited run read itself (interventions/run.py)
_READ_ELSEWHERE: set[int] = set()


def read_elsewhere(module: nn.Module) -> None:
    """``open_cells`` leaves ``module``'s call now finishing unread: an edited run read it
    whole (its own kernel stretch by stretch, interventions/run.py), so it is read once."""
    _READ_ELSEWHERE.add(id(module))


def only(tr: Trace, names: Sequence[str] | None) -> Trace:
    """``tr`` holding only the trace names ``names`` keeps (None: all)."""
    if names is None:
        return tr
    return replace(tr, tensors={k: v for k, v in tr.tensors.items() if keeps_name(k, names)})


@contextlib.contextmanager
def open_cells(model: nn.Module, layers: Selection = None,
               names: Sequence[str] | None = None) -> Iterator[CellCache]:
    """Trace every recurrent module of ``model`` each time it runs inside the block.

    The model runs exactly as usual (its output is untouched); each recurrent module's
    forward hook reads it out through its family on the same input and state; calls of one
    step are recorded and stitched into trajectories when the block exits (a cell stepped in
    a loop, a decoder called per step: one (B, T, H) trace each, starting from the state its
    first call was given). The hooks are removed on exit, also when the block raises.
    Traces use inference semantics (no inter-layer dropout); ``max_abs_diff`` shows any
    mismatch with what actually ran.

    A family's own re-runs of its module are not hooked, and a recurrent module inside an
    opened one (mingru-pytorch's minGRU layers inside its minLM) is read once, as a layer of
    the outer module's trace: each module's reference runs once per forward at any depth.

    ``layers`` reads only some of the recurrent modules (positions among them in the
    model's order, module paths or shell patterns); ``names`` keeps only some trace names
    (``["s"]``, ``["f", "c"]``), so a deep model's trace holds proportionally less
    (readout/select.py). A selection that names nothing is one line listing what there is.
    """
    cache = CellCache()
    handles = []
    stitchers: dict[str, Stitcher] = {}
    opened = [(path, module, fam) for path, module in model.named_modules()
              if (fam := family_of(module)) is not None]
    running = _Running([path for path, _, _ in opened])
    keep = set(select_paths([p for p, _, _ in opened], layers))
    if names is not None:
        known = [n for p, _, fam in opened if p in keep for n in fam.names()]
        unknown = [n for n in names if not any(keeps_name(k, [n]) for k in known)]
        if unknown:
            raise GatelensError(f"names: {unknown[0]!r} is no trace name of the modules read "
                                f"(they have {', '.join(dict.fromkeys(known))})")

    # a family whose reference is read from the module's own forward records the user's
    # forward itself (its scan_modules), so the module is not run a second time; where
    # ``names`` pick some of a stack's layers, only theirs are kept and read (apart)
    apart = {path: [n for n in fam.names() if keeps_name(n, names)] for path, _, fam in opened
             if path in keep and names is not None and streams(fam)}
    recorders = {path: Recorder(mods, layer_steps(fam, apart[path]) if path in apart
                                else fam.scan_steps()) for path, _, fam in opened
                 if path in keep and (mods := fam.scan_modules()) is not None}

    def recorded(path: str, fam: Family) -> Recorder | None:
        rec = recorders.get(path)
        return rec if rec is not None and rec.once() and not module_training(fam) else None

    def reference(path: str, fam: Family, call, output: Any):
        rec = recorded(path, fam)
        return fam.reference(call) if rec is None else fam.reference_recorded(call, rec, output)

    def make_hook(path: str, fam: Family):
        def hook(module: nn.Module, args: tuple, kwargs: dict, output: Any) -> None:
            # always called, also when the forward raised (output None): the count stays true
            running.leave(path)
            try:
                if id(module) in _READ_ELSEWHERE:  # an edited run read this call whole
                    _READ_ELSEWHERE.discard(id(module))
                    return
                read_call(module, args, kwargs, output)
            finally:  # what the user's forward recorded is read once, or dropped
                if path in recorders and not running.busy:
                    recorders[path].clear()

        def read_call(module: nn.Module, args: tuple, kwargs: dict, output: Any) -> None:
            if output is None or running.busy or running.inside_opened(path) or \
                    path not in keep or _QUIET[0]:
                return
            inputs, state = fam.split_call(args, kwargs)
            if is_step_call(fam, inputs):
                stitchers.setdefault(path, Stitcher(fam)).add(inputs, state, output)
                return
            call = fam.check(inputs, state)
            with running.reading(), torch.no_grad(), faithful_matmul(call.inputs.device), \
                    family_calls():
                packed = call.layout.get("packed") is not None
                picked = None  # the names a read of some layers holds, else every name
                if path in apart and (rec := recorded(path, fam)) is not None:
                    picked = apart[path]
                    ro = read_layers(fam, call, picked, (rec, fam._output_of(output)))
                else:
                    ro = fam.rerun(call) if packed else own_or_anchored(
                        fam, call, reference(path, fam, call, output))
                diff = fam.output_diff(ro, output)
            cache.traces.setdefault(path, []).append(only(assemble(fam, call, ro, picked),
                                                          names))
            if diff is not None:
                cache.max_abs_diff[path] = nan_max(cache.max_abs_diff.get(path, 0.0), diff)

        return hook

    try:
        for rec in recorders.values():
            rec.__enter__()
        for path, module, fam in opened:
            handles.append(module.register_forward_pre_hook(
                mark(lambda *_, p=path: running.enter(p))))
            handles.append(module.register_forward_hook(mark(make_hook(path, fam)),
                                                        with_kwargs=True, always_call=True))
        yield cache
        for path, st in stitchers.items():
            fam = st.fam
            for rec in st.result():
                call = fam.check(rec)
                with running.reading(), torch.no_grad(), \
                        faithful_matmul(call.inputs.device), family_calls():
                    ro = fam.read(call, fam.reference(call))
                    diff = recorded_output_diff(fam, ro, call)
                cache.traces.setdefault(path, []).append(only(
                    assemble(fam, call, ro, calls=rec.calls, first_call=rec.first,
                             started=rec.why), names))
                cache.max_abs_diff[path] = nan_max(cache.max_abs_diff.get(path, 0.0), diff)
    finally:
        for h in handles:
            h.remove()
        for rec in recorders.values():
            rec.__exit__()
