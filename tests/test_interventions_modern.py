"""Interventions on gatelens's own cells (minGRU, minLSTM, sLSTM) inside gatelens's CharLM
(issue 28, part 1), plain and chaotic (input weights x8, x16): the exact checks against the
model's own forward, and CharLM's forward from an edited state as the reference."""

from __future__ import annotations

import pytest
import torch
from torch import Tensor

import gatelens
from gatelens.errors import GatelensError
from gatelens.training.model import CharLM

pytestmark = pytest.mark.usefixtures("one_thread")

V, H, B, T = 7, 8, 3, 16
#: each cell's carried state, as its module takes it (parts of (L, B, H))
PARTS = {"mingru": ("h",), "minlstm": ("h",), "slstm": ("h", "c", "n", "m")}


def lm_of(cell: str, scale: float = 1.0, seed: int = 0) -> CharLM:
    torch.manual_seed(seed)
    lm = CharLM(vocab_size=V, hidden=H, layers=2, cell=cell).eval()
    with torch.no_grad():
        for lin in lm.rnn.proj:
            lin.weight.mul_(scale)
    return lm


def ids_of(seed: int = 1) -> Tensor:
    return torch.randint(0, V, (B, T), generator=torch.Generator().manual_seed(seed))


def diff(a: Tensor, b: Tensor) -> float:
    return float((a.double() - b.double()).abs().max()) if a.numel() else 0.0


@pytest.mark.parametrize("scale", [1.0, 8.0, 16.0])
@pytest.mark.parametrize("cell", list(PARTS))
def test_the_identities(cell, scale) -> None:
    lm, ids, t = lm_of(cell, scale), ids_of(), 6
    with torch.no_grad():
        own, _ = lm(ids)
    lens = gatelens.Lens(lm)
    assert torch.equal(lens.run(ids, edits=[]).output[0], own)
    res = lens.run(ids, edits=[gatelens.Add("rnn.layer1.h", 0.0, at=t)])
    assert torch.equal(res.output[0][:, :t], own[:, :t])
    assert diff(res.output[0], own) < 1e-5
    # every layer's carried state set after step t: later steps are CharLM's own forward
    g = torch.Generator().manual_seed(2)
    values = {"h": torch.randn(2, B, H, generator=g).tanh(),
              "c": torch.randn(2, B, H, generator=g),
              "n": 1 + torch.rand(2, B, H, generator=g),
              "m": torch.randn(2, B, H, generator=g)}
    parts = PARTS[cell]
    edits = [gatelens.Set(f"rnn.layer{k}.{p}", values[p][k], at=t) for k in (0, 1)
             for p in parts]
    res = lens.run(ids, edits=edits)
    state = values["h"] if len(parts) == 1 else tuple(values[p] for p in parts)
    with torch.no_grad():
        ref, _ = lm(ids[:, t + 1 :], state)
    assert torch.equal(res.output[0][:, t + 1 :], ref)
    assert diff(res.output[0][:, t + 1 :], own[:, t + 1 :]) > 1e-3
    with torch.no_grad():  # the final state the module returned is the edited run's
        _, final = lm(ids[:, t + 1 :], state)
    got = res.output[1] if len(parts) > 1 else (res.output[1],)
    want = final if len(parts) > 1 else (final,)
    assert all(torch.equal(a, b) for a, b in zip(got, want, strict=True))


@pytest.mark.parametrize("scale", [1.0, 16.0])
def test_a_unit_held_exactly(scale) -> None:
    ids, t0 = ids_of(3), 5
    for cell, edits in (
            ("mingru", [gatelens.Set("rnn.layer0.keep", 1.0, at=slice(t0, None), units=[2]),
                        gatelens.Zero("rnn.layer0.z", at=slice(t0, None), units=[2])]),
            ("minlstm", [gatelens.Set("rnn.layer0.f", 1.0, at=slice(t0, None), units=[2]),
                         gatelens.Zero("rnn.layer0.i", at=slice(t0, None), units=[2])])):
        res = gatelens.Lens(lm_of(cell, scale, seed=4)).run(ids, edits=edits)
        h = res.trace["rnn.layer0.h"][:, t0 - 1 :, 2]
        assert torch.equal(h, h[:, :1].expand_as(h)), cell


@pytest.mark.parametrize("cell", list(PARTS))
def test_carry_forward_and_this_position_only(cell) -> None:
    lm, ids, t = lm_of(cell, seed=5), ids_of(4), 7
    with torch.no_grad():
        own, _ = lm(ids)
    lens = gatelens.Lens(lm)
    carried = lens.run(ids, edits=[gatelens.Zero("rnn.layer1.h", at=t)]).output[0]
    local = lens.run(ids, edits=[gatelens.Zero("rnn.layer1.h", at=t, carry=False)]).output[0]
    for out in (carried, local):
        assert torch.equal(out[:, :t], own[:, :t])
        assert diff(out[:, t], own[:, t]) > 1e-3
    assert diff(carried[:, t + 1 :], own[:, t + 1 :]) > 1e-3
    assert diff(local[:, t + 1 :], own[:, t + 1 :]) < 1e-5
    # the block's output y: what the layer above (and the head) reads at t
    res = lens.run(ids, edits=[gatelens.Zero("rnn.layer1.y", at=t)])
    assert bool((res.trace["rnn.layer1.y"][:, t] == 0).all())
    with torch.no_grad():
        assert torch.allclose(res.output[0][:, t], lm.head(torch.zeros(H)).expand(B, V))


def test_a_derived_signal_is_refused() -> None:
    with pytest.raises(GatelensError, match="layer0.kappa is derived"):
        gatelens.Lens(lm_of("slstm")).run(ids_of(), edits=[gatelens.Set("rnn.layer0.kappa", 1.0,
                                                                        at=3)])
