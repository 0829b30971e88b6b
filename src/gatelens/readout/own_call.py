"""The module's own call: what ``module(inputs, state)`` runs when the module has hooks.

``trace`` and ``verify`` read a module through its family, which calls the module's
forward itself; hooks do not fire there. A forward pre-hook can change what the forward
receives (x scaled by 3), a forward hook what the call returns (its output replaced), so a
trace of the forward alone would not be the module's trajectory. With any hook on the
module (its own forward pre-hooks and forward hooks, gatelens's own left out), ``own_call``
runs the module's own call once, hooks included, and records:

- what the forward **received** (after every pre-hook): the trace and the verdict are
  computed on that, so they are what the call computed;
- whether the call **returned** what the forward computed (before any forward hook): a
  hook that replaced or edited the output (by any amount) is refused in one line naming it,
  as gatelens reads the forward's cells, not what a hook made of them.

Nothing runs without hooks. The families that are not nn.LSTM / nn.GRU / nn.RNN (cells,
gatelens's own cells, the official packages') are refused in one line naming the hook:
their read-out calls the module per step or in its own way, so its hooks would not run as
the module's one call runs them. ``torch.nn.utils.prune``'s pre-hooks only recompute a
weight and are not refused (the weights are read through them, families/torch_ops.py).

>>> import torch
>>> lstm = torch.nn.LSTM(2, 3, batch_first=True)
>>> _ = lstm.register_forward_pre_hook(lambda m, a: (3 * a[0],) + a[1:])
>>> x = torch.randn(1, 4, 2)
>>> got = own_call(lstm, x, None, "trace()")
>>> torch.equal(got.inputs, 3 * x), got.hooks[0].startswith("forward pre-hook ")
(True, True)
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor, nn
from torch.nn.modules import module as torch_module
from torch.nn.utils.prune import BasePruningMethod
from torch.nn.utils.rnn import PackedSequence

from gatelens.errors import GatelensError

#: the attribute that marks gatelens's own hooks (readout/hooks.py, lens/lens.py)
OWN = "_gatelens_hook"


def mark(hook: Any) -> Any:
    """``hook`` marked as gatelens's own (not a user's hook: ``user_hooks`` leaves it out)."""
    setattr(hook, OWN, True)
    return hook


def _name(hook: Any) -> str:
    fn = getattr(hook, "__func__", hook)
    mod, qual = getattr(fn, "__module__", None), getattr(fn, "__qualname__", None)
    if qual is None:  # a callable object
        return type(hook).__qualname__
    return f"{mod}.{qual}" if mod else qual


def user_hooks(module: nn.Module, prune: bool = True) -> list[str]:
    """Every hook that ``module(...)`` runs besides the forward, named ("forward hook
    tests.x.<lambda>"): the module's forward pre-hooks and forward hooks, and global ones
    (``register_module_forward_hook``), not gatelens's own; prune's pre-hooks only with
    ``prune``.

    >>> lstm = torch.nn.GRU(2, 3)
    >>> user_hooks(lstm), user_hooks(torch.nn.utils.prune.l1_unstructured(
    ...     lstm, "weight_ih_l0", 0.5), prune=False)
    ([], [])
    """
    out = []
    groups = (("global forward pre-hook", torch_module._global_forward_pre_hooks),
              ("forward pre-hook", module._forward_pre_hooks),
              ("global forward hook", torch_module._global_forward_hooks),
              ("forward hook", module._forward_hooks))
    for kind, hooks in groups:
        for h in hooks.values():
            if getattr(h, OWN, False):
                continue
            pruning = isinstance(h, BasePruningMethod)
            if pruning and not prune:
                continue
            out.append(f"{kind} {_name(h)}" + (" (torch.nn.utils.prune)" if pruning else ""))
    return out


@dataclass
class OwnCall:
    """What the module's own call (hooks included) gave: the forward's inputs and state as
    it received them, its output as returned, and the hooks that ran."""

    inputs: Any
    state: Any
    output: Any
    hooks: list[str]
    changed_inputs: bool = False  # a pre-hook handed the forward something else

    def meta(self) -> dict:
        """What a Trace's or a VerifyResult's meta records of the call (empty: no hooks)."""
        if not self.hooks:
            return {}
        return {"hooks": list(self.hooks), "inputs": "as the module's pre-hooks handed them "
                "to its forward" if self.changed_inputs else "as given (no hook changed them)"}


def _same(a: Any, b: Any) -> bool:
    """Exact equality of two outputs (tensors, packed sequences, tuples of them)."""
    if isinstance(a, PackedSequence) and isinstance(b, PackedSequence):
        return _same(tuple(a), tuple(b))
    if isinstance(a, Tensor) and isinstance(b, Tensor):
        return a.shape == b.shape and a.dtype == b.dtype and bool(torch.equal(a, b))
    if isinstance(a, (tuple, list)) and isinstance(b, (tuple, list)):
        return len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b, strict=True))
    return a is b


def _gap(a: Any, b: Any) -> str:
    """How far apart two outputs are, in words (the largest |difference| where shapes agree)."""
    pairs: list[tuple[Tensor, Tensor]] = []

    def walk(x: Any, y: Any) -> bool:
        if isinstance(x, PackedSequence) and isinstance(y, PackedSequence):
            return walk(tuple(x), tuple(y))
        if isinstance(x, Tensor) and isinstance(y, Tensor):
            if x.shape != y.shape:
                return False
            pairs.append((x, y))
            return True
        if isinstance(x, (tuple, list)) and isinstance(y, (tuple, list)) and len(x) == len(y):
            return all(walk(p, q) for p, q in zip(x, y, strict=True))
        return x is y

    if not walk(a, b):
        return "another structure or shape"
    gap = max((float((x.double() - y.double()).abs().max()) for x, y in pairs if x.numel()
               and x.is_floating_point()), default=0.0)
    return f"max |difference| {gap:.3g}"


def _clone(x: Any) -> Any:
    if isinstance(x, PackedSequence):
        return x._replace(data=x.data.detach().clone())
    if isinstance(x, Tensor):
        return x.detach().clone()
    if isinstance(x, (tuple, list)):
        return type(x)(_clone(v) for v in x)
    return x


def refuse_global_hooks(what: str, cls: str) -> None:
    """A global forward pre-hook or forward hook (``register_module_forward_pre_hook``,
    ``register_module_forward_hook``) is a one-line GatelensError: it runs on every call of
    every module, the one-layer modules gatelens runs to check a read-out included (a
    global pre-hook scaling an LSTM's input made the one-step check fail by 0.28 on a
    correct read-out), and a global forward hook leaves no way to tell ``cls``'s own output
    from what it made of it."""
    glob = [h for h in user_hooks(nn.Module()) if h.startswith("global")]
    if glob:
        raise GatelensError(
            f"{what}: a {glob[0]} runs on every module's call, the modules gatelens runs to "
            f"check {cls}'s read-out included, so no read-out of {cls} could be checked "
            "against its own call; remove it while tracing (its handle's .remove())")


def refuse_random_call(module: nn.Module, what: str) -> None:
    """A verdict on a stack in training mode with dropout between its layers is refused:
    its call drops units at random, so no read-out (gatelens reads it as in eval mode) is
    its trajectory, and "passed" would say one was (0.07 apart on a 2-layer LSTM)."""
    p, layers = getattr(module, "dropout", 0), getattr(module, "num_layers", 1)
    if (isinstance(module, nn.RNNBase) and module.training and isinstance(p, float | int)
            and p > 0 and layers > 1):
        cls = type(module).__name__
        raise GatelensError(
            f"{what}: {cls} is in training mode with dropout {p} between its {layers} layers, "
            f"so its call drops units at random and no trace is its trajectory; call "
            f"{cls}.eval() first (gatelens reads it as in eval mode)")


def own_call(module: nn.Module, inputs: Any, state: Any, what: str,
             split: Any = None, runs_hooks: bool = True) -> OwnCall:
    """``module(inputs[, state])`` once, hooks included (see the module docstring), under
    torch.no_grad(). ``split`` maps (args, kwargs) to (inputs, state) (a family's
    ``split_call``; default: the first two positional arguments). ``runs_hooks`` False (a
    family whose read-out is not the module's one call): any hook but prune's is refused.
    A forward hook that changed the output, or a global hook, is a GatelensError naming
    it; so is a verdict (``what`` "verify()") on a stack whose call is random
    (``refuse_random_call``)."""
    if what.startswith("verify"):
        refuse_random_call(module, what)
    hooks = user_hooks(module, prune=runs_hooks)
    if not hooks:
        return OwnCall(inputs, state, None, [])
    cls = type(module).__name__
    if not runs_hooks:
        raise GatelensError(
            f"{what}: {cls} has a {hooks[0]}; gatelens reads a {cls} in its own way, not as "
            "one call with its hooks, so a trace would not be what its call computes: remove "
            "the hook (its handle's .remove()) or read the model around it with Lens")
    refuse_global_hooks(what, cls)
    seen: dict[str, Any] = {}

    def received(mod: nn.Module, args: tuple, kwargs: dict) -> None:
        seen["args"], seen["kwargs"] = args, dict(kwargs)

    def computed(mod: nn.Module, args: tuple, output: Any) -> None:
        seen["raw"] = _clone(output)

    handles = [module.register_forward_pre_hook(mark(received), with_kwargs=True),
               module.register_forward_hook(mark(computed), prepend=True)]
    try:
        with torch.no_grad():
            output = module(inputs) if state is None else module(inputs, state)
    finally:
        for h in handles:
            h.remove()
    if not _same(seen["raw"], output):
        fwd = [h for h in hooks if h.startswith("forward hook")]
        name = fwd[0] if fwd else "hook"
        raise GatelensError(
            f"{what}: the {name} on {cls} changes what its call returns "
            f"({_gap(seen['raw'], output)} from what its forward computed); gatelens reads the "
            f"forward's cells, so no trace is the call's trajectory: remove the hook (its "
            "handle's .remove()) to read the module")
    if split is None:
        args, kwargs = seen["args"], seen["kwargs"]
        got = (args[0] if args else kwargs.get("input"),
               args[1] if len(args) > 1 else kwargs.get("hx"))
    else:
        got = split(seen["args"], seen["kwargs"])
    changed = not (_same(got[0], inputs) and _same(got[1], state))
    return OwnCall(got[0], got[1], output, hooks, changed)
