"""The buffers a trace writes its per-token states into (families/buffers.py): above a size,
a mapping of their own advised for huge pages. Only the speed may differ: every registered
family's trace is the same, bit for bit, whether its states went there or to PyTorch's
allocator; the tensor is an ordinary one, and its memory is unmapped with its last view."""

from __future__ import annotations

import gc
import mmap
import sys
import weakref
from pathlib import Path

import pytest
import torch

import gatelens
from gatelens.families import buffers
from gatelens.families.buffers import HUGE_PAGE, state_empty

sys.path.insert(0, str(Path(__file__).resolve().parent))
from test_open_cells_families import VOCAB, whole_model  # noqa: E402

#: the families whose trace writes its states through ``state_empty`` (those read from a
#: replay or a scan of their forward); the others' states come from elsewhere
MAPPED = {"hf-mamba", "hf-falcon-mamba", "hf-jamba", "hf-mamba2", "hf-mamba2-mixer",
          "hf-gated-deltanet", "hf-kda", "hf-rglru", "hf-xlstm", "mambapy", "rwkv7",
          "xlstm-mlstm", "xlstm-mixed"}


class Maps:
    """Counts, and keeps weak references to, the mappings ``state_empty`` makes."""

    def __init__(self, monkeypatch) -> None:
        self.made: list[weakref.ref] = []
        real = mmap.mmap

        def counted(*args, **kwargs):
            m = real(*args, **kwargs)
            self.made.append(weakref.ref(m))
            return m
        monkeypatch.setattr(buffers.mmap, "mmap", counted)


def test_a_large_buffer_is_its_own_aligned_mapping_and_a_small_one_is_not(monkeypatch):
    monkeypatch.setattr(buffers, "HUGE_BYTES", 4 << 20)  # the rule at a test's size
    maps = Maps(monkeypatch)
    big = state_empty((3, buffers.HUGE_BYTES // 4), torch.float32, "cpu")
    assert big.shape == (3, buffers.HUGE_BYTES // 4) and big.dtype == torch.float32
    assert big.is_contiguous() and big.data_ptr() % HUGE_PAGE == 0 and len(maps.made) == 1
    big.fill_(2.5)
    assert float(big.sum()) == 2.5 * big.numel()
    small = state_empty((4, 5), torch.float64, torch.device("cpu"))
    assert small.shape == (4, 5) and small.dtype == torch.float64 and len(maps.made) == 1
    monkeypatch.setenv("GATELENS_HUGE_PAGES", "0")  # the switch: PyTorch's allocator
    plain = state_empty((3, buffers.HUGE_BYTES // 4), torch.float32, "cpu")
    assert plain.shape == big.shape and len(maps.made) == 1


def test_the_mapping_lives_as_long_as_a_view_of_it(monkeypatch):
    monkeypatch.setattr(buffers, "HUGE_BYTES", 4 << 20)
    maps = Maps(monkeypatch)
    s = state_empty((2, 8, buffers.HUGE_BYTES // 8), torch.float32, "cpu")
    s.copy_(torch.arange(s.numel(), dtype=torch.float32).view(s.shape))
    row = s[1, 3]
    del s
    gc.collect()
    assert maps.made[0]() is not None  # the view holds it
    W = buffers.HUGE_BYTES // 8
    assert torch.equal(row, torch.arange(11 * W, 12 * W, dtype=torch.float32))
    del row
    gc.collect()
    assert maps.made[0]() is None  # unmapped with the last view


@pytest.mark.filterwarnings("ignore:.*torch.jit.script.*deprecated:DeprecationWarning")
@pytest.mark.parametrize("name", list(gatelens.families()))
def test_every_familys_trace_is_the_same_in_mapped_buffers(monkeypatch, name):
    model, path, reads = whole_model(name)
    module = model.get_submodule(path)
    ids = torch.randint(0, VOCAB, (2, 7), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        x = reads(ids)
    monkeypatch.setenv("GATELENS_HUGE_PAGES", "0")
    plain = {k: v.clone() for k, v in gatelens.trace(module, x).items()}
    monkeypatch.delenv("GATELENS_HUGE_PAGES")
    monkeypatch.setattr(buffers, "HUGE_BYTES", 1)  # every state buffer mapped
    maps = Maps(monkeypatch)
    mapped = gatelens.trace(module, x)
    assert (len(maps.made) > 0) == (name in MAPPED), len(maps.made)
    assert list(mapped) == list(plain)
    for k, v in plain.items():
        assert torch.equal(mapped[k], v), k
