"""Buffers for a trace's per-token states: the largest tensors gatelens writes.

A trace writes every state of a window once, into memory nothing has touched: for a
Mamba-2 layer of width 256 at B = 2, T = 128 that is 33.5 MB. glibc hands a request that
large (32 MiB and up, its largest mmap threshold) straight to the kernel as a fresh mapping,
every time, and on Linux with 4 KiB pages the first touch of each page (a fault, then the
page zeroed) costs more than writing the states themselves: ~20 ms for 33.5 MB against
~3 ms for the writes on an AMD EPYC (BENCHMARKS.md). ``state_empty`` maps such a buffer
itself and asks the kernel for 2 MiB pages (``MADV_HUGEPAGE``, which transparent huge pages'
``madvise`` mode, most distributions' default, grants): ~5 ms for the same 33.5 MB. A
smaller buffer comes from PyTorch's allocator, where glibc recycles memory already touched
(faster still, from the second window on). Where THP is off, or the kernel has no free huge
page, the mapping gets 4 KiB pages, as glibc's would. Only the speed differs: the tensor is
an ordinary CPU tensor of the asked shape and dtype, uninitialised like ``torch.empty``'s,
and its memory goes back to the system when the last tensor viewing it is freed.
``GATELENS_HUGE_PAGES=0`` in the environment turns it off.

>>> s = state_empty((2, 128, 4, 128, 64), torch.float32, torch.device("cpu"))
>>> s.shape, s.dtype, s.is_contiguous()
(torch.Size([2, 128, 4, 128, 64]), torch.float32, True)
"""

from __future__ import annotations

import math
import mmap
import os

import torch
from torch import Tensor, nn

__all__ = ["HUGE_BYTES", "HUGE_PAGE", "joined", "state_empty", "zeros64"]

#: buffers of this many bytes or more are mapped with huge pages (glibc's largest mmap
#: threshold: below it, glibc may recycle memory already touched)
HUGE_BYTES = 32 << 20
#: the huge page size the mapping is aligned to (x86-64's and arm64's THP size)
HUGE_PAGE = 2 << 20
_ADVICE = getattr(mmap, "MADV_HUGEPAGE", None)


def _enabled() -> bool:
    """Whether huge-page buffers are used: on Linux (where mmap has MADV_HUGEPAGE), unless
    the environment sets GATELENS_HUGE_PAGES=0."""
    return _ADVICE is not None and os.environ.get("GATELENS_HUGE_PAGES", "1") != "0"


def state_empty(shape: tuple[int, ...], dtype: torch.dtype,
                device: torch.device | str) -> Tensor:
    """An uninitialised contiguous tensor of ``shape`` and ``dtype`` on ``device``: on the
    CPU from ``HUGE_BYTES`` up, in its own mapping advised for huge pages and aligned to
    ``HUGE_PAGE``; else ``torch.empty``."""
    shape = tuple(int(n) for n in shape)
    nbytes = math.prod(shape) * dtype.itemsize
    if torch.device(device).type != "cpu" or nbytes < HUGE_BYTES or not _enabled():
        return torch.empty(shape, dtype=dtype, device=device)
    mapped = mmap.mmap(-1, nbytes + HUGE_PAGE, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    mapped.madvise(_ADVICE)
    raw = torch.frombuffer(mapped, dtype=torch.uint8)  # holds the mapping while it lives
    start = -raw.data_ptr() % HUGE_PAGE
    return raw[start : start + nbytes].view(dtype).view(shape)


def joined(parts: list[Tensor]) -> Tensor:
    """``torch.cat(parts, dim=-1)``, or, where the parts already lie side by side along the
    last dimension of one buffer (as a replay that writes a state's parts into one
    ``state_empty`` leaves them), the view of that buffer they span: the same values,
    nothing copied (the view shares the parts' memory).

    >>> both = torch.arange(12.0).view(2, 6)
    >>> j = joined([both[:, :4], both[:, 4:]])
    >>> torch.equal(j, both), j.data_ptr() == both.data_ptr()
    (True, True)
    >>> torch.equal(joined([both[:, 4:], both[:, :4]]), torch.cat([both[:, 4:], both[:, :4]], -1))
    True
    """
    first = parts[0]
    lead, strides = first.shape[:-1], first.stride()[:-1]
    storage = first.untyped_storage().data_ptr()
    end = first.storage_offset()
    for p in parts:
        if p.dtype != first.dtype or p.device != first.device or p.shape[:-1] != lead or \
                p.stride()[:-1] != strides or p.stride(-1) != 1 or \
                p.untyped_storage().data_ptr() != storage or p.storage_offset() != end:
            return torch.cat(parts, dim=-1)
        end += p.shape[-1]
    width = end - first.storage_offset()
    rows = [st for st, n in zip(strides, lead, strict=True) if n > 1]
    if len(parts) < 2 or not width or any(st < width for st in rows):
        return torch.cat(parts, dim=-1)  # one part, nothing, or rows that would overlap
    return first.as_strided((*lead, width), (*strides, 1), first.storage_offset())


def zeros64(module: nn.Module, batch: int, *widths: int, fill: float = 0.0) -> list[Tensor]:
    """A hand cell's state before the first step: one (batch, w) float64 tensor of ``fill`` a
    width, on the device of ``module``'s weights (where its float64 copy computes; the CPU for
    a module with none).

    >>> [tuple(z.shape) for z in zeros64(torch.nn.Linear(2, 2), 3, 4, 5)]
    [(3, 4), (3, 5)]
    """
    w = next(iter(module.parameters()), None)
    device = w.device if w is not None else torch.device("cpu")
    return [torch.full((batch, n), fill, dtype=torch.float64, device=device) for n in widths]
