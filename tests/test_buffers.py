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


def test_joined_is_a_view_only_where_the_parts_lie_side_by_side():
    from gatelens.families.buffers import joined

    both = torch.arange(2 * 3 * 10, dtype=torch.float32).view(2, 3, 10)
    parts = list(both.split((6, 4), dim=-1))
    j = joined(parts)
    assert torch.equal(j, both) and j.data_ptr() == both.data_ptr() and j.stride() == both.stride()
    cases = [
        [both[..., :4], both[..., 6:]],  # a gap between them
        [both[..., 6:], both[..., :6]],  # out of order
        [both[..., :6], both[..., 6:].double()],  # another dtype
        [both[..., :6], both[..., 6:].clone()],  # another buffer
        [both[:, :2, :6], both[:, 1:, 6:]],  # other rows
        [both[..., :6]],  # one part
    ]
    for case in cases:
        got = joined(case)
        assert torch.equal(got, torch.cat(case, dim=-1))
        assert all(got.data_ptr() != p.data_ptr() for p in case)  # a copy


def test_an_xlstm_trace_holds_its_memory_once(monkeypatch):
    """hf-xlstm's trace: s is the one buffer its replay wrote C̄ and n̄ into (no copy)."""
    from gatelens.families import hf_xlstm

    model, path, reads = whole_model("hf-xlstm")
    module = model.get_submodule(path)
    with torch.no_grad():
        x = reads(torch.randint(0, VOCAB, (2, 7), generator=torch.Generator().manual_seed(3)))
    seen = []
    real = hf_xlstm.joined
    monkeypatch.setattr(hf_xlstm, "joined", lambda parts: seen.append(parts) or real(parts))
    s = gatelens.trace(module, x)["layer0.s"]
    assert seen and any(s.data_ptr() == parts[0].data_ptr() for parts in seen)
