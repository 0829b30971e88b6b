"""The optimisers ``gatelens train --optimizer`` offers, with PyTorch's own defaults, and
their state as flat tensors for resume.safetensors.

- ``adam``: torch.optim.Adam (betas 0.9, 0.999; eps 1e-8), char-rnn's usual choice;
- ``sgd``: torch.optim.SGD, plain (no momentum, no weight decay);
- ``rmsprop``: torch.optim.RMSprop (alpha 0.99, eps 1e-8, no momentum, not centred).

Only the learning rate is set; every other hyperparameter is PyTorch's default, and
config.json's "optimizer" block records all of them as the optimiser holds them.

>>> opt = make_optimizer("rmsprop", [torch.nn.Parameter(torch.zeros(2))], lr=0.01)
>>> record = optimizer_record(opt, clip=5.0)
>>> record["name"], record["lr"], record["params"]["alpha"], record["clip_grad_norm"]
('RMSprop', 0.01, 0.99, 5.0)
"""

from __future__ import annotations

import json
from collections.abc import Iterable

import torch

#: ``--optimizer`` name -> PyTorch's class.
OPTIMIZERS: dict[str, type[torch.optim.Optimizer]] = {
    "adam": torch.optim.Adam, "sgd": torch.optim.SGD, "rmsprop": torch.optim.RMSprop}
#: Key prefix of the optimiser's state in resume.safetensors (earlier runs wrote
#: ``adam.<param>.<key>``, which is still read).
PREFIX, OLD_PREFIX = "opt.", "adam."


def make_optimizer(name: str, params: Iterable[torch.nn.Parameter],
                   lr: float) -> torch.optim.Optimizer:
    """The optimiser ``name`` over ``params`` with learning rate ``lr``, else defaults."""
    return OPTIMIZERS[name](params, lr=lr)


def _plain(v: object) -> object:
    return list(v) if isinstance(v, tuple) else v


def optimizer_record(opt: torch.optim.Optimizer, clip: float) -> dict:
    """config.json's "optimizer": {"name", "lr", "params" (every other hyperparameter, as
    PyTorch holds it), "clip_grad_norm"}; for Adam also "betas" (as older runs had it)."""
    group = opt.param_groups[0]
    params = {k: _plain(v) for k, v in group.items() if k not in ("params", "lr")}
    out = {"name": type(opt).__name__, "lr": group["lr"], "params": params,
           "clip_grad_norm": clip}
    if "betas" in params:
        out["betas"] = params["betas"]
    return out


def state_tensors(opt: torch.optim.Optimizer) -> tuple[dict[str, torch.Tensor], str]:
    """The optimiser's per-parameter state as ``opt.<param index>.<key>`` tensors, and a
    JSON note of state entries that are None (kept so a resume restores them exactly)."""
    tensors, nones = {}, []
    for pid, s in opt.state_dict()["state"].items():
        for k, v in s.items():
            if v is None:
                nones.append(f"{pid}.{k}")
            else:
                tensors[f"{PREFIX}{pid}.{k}"] = torch.as_tensor(v)
    return tensors, json.dumps(nones)


def load_state(opt: torch.optim.Optimizer, state: dict[str, torch.Tensor],
               nones: str | None = None) -> None:
    """Restore what ``state_tensors`` saved (or an old run's ``adam.`` keys) into ``opt``."""
    prefix = PREFIX if any(k.startswith(PREFIX) for k in state) else OLD_PREFIX
    sd = opt.state_dict()
    per: dict[int, dict] = {}
    for k, v in state.items():
        if k.startswith(prefix):
            pid, key = k[len(prefix):].split(".", 1)
            per.setdefault(int(pid), {})[key] = v
    for item in json.loads(nones or "[]"):
        pid, key = item.split(".", 1)
        per.setdefault(int(pid), {})[key] = None
    sd["state"] = per
    opt.load_state_dict(sd)
