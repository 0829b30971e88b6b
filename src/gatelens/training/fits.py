"""Sizes that cannot fit, refused in one line before any work.

A size a user gives (``--hidden``, ``--layers``, ``--batch``, a config.json's model block,
a study spec's [train]) is an integer Python takes at any magnitude; PyTorch does not. A
width of 2**62 overflowed a storage-size computation deep inside ``nn.LSTM`` (a C++ stack
as the message), 2**70 layers looped forever building modules, a batch of 2**62 overflowed
``torch.randint``, and a batch that merely exceeded the machine's memory was killed by the
kernel. Two rules, one place:

- **bounds** (``TrainConfig.validate``, so the CLI, a spec and a run's config.json alike):
  a layer's width (``--hidden``, ``--embed``) at most ``MAX_UNITS``, at most ``MAX_LAYERS``
  layers: beyond any recurrent model, and small enough that the model's shapes can be
  computed (on PyTorch's meta device) in milliseconds;
- **memory** (``check_training_fits``, before the model is built): what training must hold
  at least, the parameters with their gradients and the optimiser's state, and one
  batch's inputs, layer outputs and logits in float32, against this machine's memory. It
  is a lower bound, so only what cannot possibly fit is refused.

>>> needs = training_bytes(1_000, batch=2, seq=3, width_in=5, hidden=4, layers=1, vocab=5,
...                        optimizer="adam")
>>> needs == 4 * (4 * 1_000 + 2 * 3 * (5 + 4 + 5))
True
"""

from __future__ import annotations

import os
from pathlib import Path

from gatelens.errors import GatelensError

#: The widest layer gatelens builds (--hidden, --embed): 2**20 units. A dense recurrence of
#: that width holds 2**40 recurrent weights (4 TiB in float32) per gate.
MAX_UNITS = 2**20
#: The most stacked layers gatelens builds.
MAX_LAYERS = 1024
#: The optimiser's float32 values per parameter besides the weight and its gradient.
OPTIMIZER_STATES = {"adam": 2, "rmsprop": 1, "sgd": 0}
_CGROUP_LIMITS = ("/sys/fs/cgroup/memory.max", "/sys/fs/cgroup/memory/memory.limit_in_bytes")


def check_bounds(name: str, value: int, most: int) -> None:
    """GatelensError unless ``value`` is at most ``most`` (``name`` is its flag).

    >>> check_bounds("--layers", 2**70, MAX_LAYERS)
    Traceback (most recent call last):
    ...
    gatelens.errors.GatelensError: --layers must be at most 1024, got 1180591620717411303424
    """
    if value > most:
        raise GatelensError(f"{name} must be at most {most}, got {value}")


def memory_bytes() -> int:
    """This machine's memory in bytes, or the container's limit (cgroup) where lower."""
    try:
        total = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError, AttributeError):  # no sysconf: no check
        return 2**63
    for path in _CGROUP_LIMITS:
        try:
            limit = Path(path).read_text().strip()
        except OSError:
            continue
        if limit.isdigit():
            total = min(total, int(limit))
    return total


def size_words(n: float) -> str:
    """Bytes in words, to three figures.

    >>> size_words(3 * 1024**3), size_words(5.5 * 1024**6)
    ('3 GiB', '5.5 EiB')
    """
    for unit, k in (("EiB", 6), ("PiB", 5), ("TiB", 4), ("GiB", 3), ("MiB", 2), ("KiB", 1)):
        if n >= 1024**k:
            return f"{n / 1024**k:.3g} {unit}"
    return f"{int(n)} bytes"


def training_bytes(parameters: int, *, batch: int, seq: int, width_in: int, hidden: int,
                   layers: int, vocab: int, optimizer: str) -> int:
    """The least memory training can take, in bytes (float32): every parameter with its
    gradient and the optimiser's state, and one batch's inputs, each layer's outputs and
    the logits."""
    per_parameter = 2 + OPTIMIZER_STATES.get(optimizer, 0)
    activations = batch * seq * (width_in + hidden * layers + vocab)
    return 4 * (per_parameter * parameters + activations)


def check_training_fits(cfg, parameters: int, vocab_size: int) -> None:
    """GatelensError when training ``cfg`` (a TrainConfig) of ``parameters`` parameters on
    ``vocab_size`` characters needs more memory than this machine has (``training_bytes``,
    a lower bound; ``training.model.check_fits`` counts the parameters)."""
    needs = training_bytes(parameters, batch=cfg.batch, seq=cfg.seq,
                           width_in=cfg.embed or vocab_size, hidden=cfg.hidden,
                           layers=cfg.layers, vocab=vocab_size, optimizer=cfg.optimizer)
    total = memory_bytes()
    if needs > total:
        raise GatelensError(
            f"--hidden {cfg.hidden} --layers {cfg.layers} --batch {cfg.batch} --seq {cfg.seq}: "
            f"training needs at least {size_words(needs)} ({parameters:,} parameters with "
            f"their gradients and {cfg.optimizer}'s state, and one batch's activations), "
            f"more than this machine's {size_words(total)} of memory")
