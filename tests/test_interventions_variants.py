"""Interventions on the ONNX / Keras variant cells (VariantLSTM with peepholes and a hard
sigmoid, VariantGRU with the reset before the product; issue 28, "every family takes
edits"): the module's own steps before the first edit (bitwise), a state edit at t equals
the module's OWN forward run on the steps after t from the edited state (its state
argument), gate edits hold the state through the cell's equations, a reverse direction is
edited from the end, and carry forward against this position only."""

from __future__ import annotations

import pytest
import torch
from torch import Tensor, nn

import gatelens
from gatelens.cells.variants import VariantGRU, VariantLSTM

pytestmark = pytest.mark.usefixtures("one_thread")

V, F, H, T, t0 = 7, 4, 6, 10, 4


class Whole(nn.Module):
    """An embedding, a variant layer, a head."""

    def __init__(self, rnn: nn.Module) -> None:
        super().__init__()
        self.embed, self.rnn = nn.Embedding(V, F), rnn
        self.head = nn.Linear(H * len(rnn.directions), V)

    def forward(self, ids: Tensor) -> Tensor:
        return self.head(self.rnn(self.embed(ids))[0])


def model(kind: str, directions: tuple[str, ...] = ("forward",)) -> Whole:
    torch.manual_seed(0)
    rnn = (VariantLSTM(F, H, peepholes=True, recurrent_activation="hard_sigmoid",
                       directions=directions) if kind == "lstm"
           else VariantGRU(F, H, reset_after=False, directions=directions))
    with torch.no_grad():
        if kind == "lstm":
            rnn.peephole.normal_(0.0, 0.5)
    return Whole(rnn).eval()


def ids_of() -> Tensor:
    return torch.randint(0, V, (3, T), generator=torch.Generator().manual_seed(1))


def diff(a: Tensor, b: Tensor) -> float:
    return float((a.double() - b.double()).abs().max()) if a.numel() else 0.0


@pytest.mark.parametrize("kind", ["lstm", "gru"])
def test_a_state_edit_is_the_modules_own_forward_from_the_edited_state(kind):
    m = model(kind)
    lens, ids = gatelens.Lens(m, vocab=V), ids_of()
    with torch.no_grad():
        own = m(ids)
        x = m.embed(ids)
    tr = lens.run(ids).trace
    same = lens.run(ids, edits=[gatelens.Set("rnn.layer0.h", tr["rnn.layer0.h"][:, t0],
                                             at=t0)]).output
    assert torch.equal(same[:, :t0], own[:, :t0]) and diff(same, own) < 1e-6
    g = torch.Generator().manual_seed(3)
    new = {s: torch.rand(3, H, generator=g) for s in ("h", "c")[: 2 if kind == "lstm" else 1]}
    res = lens.run(ids, edits=[gatelens.Set(f"rnn.layer0.{s}", v, at=t0) for s, v in new.items()])
    with torch.no_grad():
        state = tuple(v[None] for v in new.values())
        ref = m.rnn(x[:, t0 + 1:], state if kind == "lstm" else state[0])[0]
    assert torch.equal(res.output[:, :t0], own[:, :t0])
    assert diff(res.trace["rnn.layer0.h"][:, t0 + 1:], ref) < 1e-6 < diff(own[:, t0 + 1:],
                                                                           res.output[:, t0 + 1:])


def test_gate_edits_hold_the_state_and_a_reverse_direction_runs_from_the_end():
    lstm = model("lstm")
    lens, ids = gatelens.Lens(lstm, vocab=V), ids_of()
    c = lens.run(ids, edits=[gatelens.Set("rnn.layer0.f", 1.0, at=slice(t0, None)),
                             gatelens.Zero("rnn.layer0.i", at=slice(t0, None))]).trace
    c = c["rnn.layer0.c"][:, t0 - 1:]
    assert torch.equal(c, c[:, :1].expand_as(c))  # f := 1, i := 0: c_t = c_{t−1}, exactly
    gru = model("gru")
    h = gatelens.Lens(gru, vocab=V).run(ids, edits=[gatelens.Set("rnn.layer0.z", 1.0,
                                                                 at=slice(t0, None))])
    h = h.trace["rnn.layer0.h"][:, t0 - 1:]
    assert torch.equal(h, h[:, :1].expand_as(h))  # z := 1: h_t = h_{t−1}
    both = model("lstm", ("forward", "reverse"))
    lens = gatelens.Lens(both, vocab=V)
    own = lens.run(ids).output
    back = lens.run(ids, edits=[gatelens.Zero("rnn.layer0.reverse.c", at=t0)]).output
    assert torch.equal(back[:, t0 + 1:], own[:, t0 + 1:])  # the reverse direction ran to t
    assert diff(back[:, :t0], own[:, :t0]) > 1e-4


@pytest.mark.parametrize("kind", ["lstm", "gru"])
def test_carry_forward_and_this_position_only(kind):
    m = model(kind)
    lens, ids = gatelens.Lens(m, vocab=V), ids_of()
    own = lens.run(ids).output
    carried = lens.run(ids, edits=[gatelens.Scale("rnn.layer0.h", 3.0, at=t0)]).output
    here = lens.run(ids, edits=[gatelens.Scale("rnn.layer0.h", 3.0, at=t0, carry=False)]).output
    assert diff(carried[:, t0 + 1:], own[:, t0 + 1:]) > 1e-3
    assert diff(here[:, t0], own[:, t0]) > 1e-3 and torch.equal(here[:, t0], carried[:, t0])
    # the module's own steps on (a window rerun from a state: bit for bit where the CPU's
    # kernels are the same for both lengths, within float32 rounding everywhere)
    assert diff(here[:, t0 + 1:], own[:, t0 + 1:]) <= 1e-6
