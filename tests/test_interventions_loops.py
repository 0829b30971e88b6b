"""Interventions on modules called one step at a time (issue 28, part 1): nn.LSTMCell /
GRUCell / RNNCell stepped in a Python loop, an nn.LSTM decoder called once per step behind
an encoder, gatelens's own CharLM, and a family not supported yet (one line, never a
silent no-op). References: the model's own loop run from the edited state."""

from __future__ import annotations

import pytest
import torch
from torch import Tensor, nn

import gatelens
from gatelens.errors import GatelensError
from gatelens.training.model import CharLM

pytestmark = pytest.mark.usefixtures("one_thread")

V, E, H, B, T = 7, 5, 8, 3, 16
CELLS = {"lstm": nn.LSTMCell, "gru": nn.GRUCell, "rnn": nn.RNNCell}


class Loop(nn.Module):
    """embedding -> a cell stepped in a loop (``cell``) -> head; ``start``/``state``: run
    only steps ``start`` .. T − 1 from ``state`` (the test's own reference)."""

    def __init__(self, kind: str, scale: float = 1.0, seed: int = 0) -> None:
        super().__init__()
        torch.manual_seed(seed)
        self.embed, self.cell, self.head = nn.Embedding(V, E), CELLS[kind](E, H), nn.Linear(H, V)
        with torch.no_grad():
            self.cell.weight_hh.mul_(scale)
            self.cell.weight_ih.mul_(scale)

    def forward(self, ids: Tensor, start: int = 0, state=None) -> Tensor:
        e, ys = self.embed(ids), []
        for t in range(start, ids.shape[1]):
            state = self.cell(e[:, t], state)
            ys.append(state[0] if isinstance(state, tuple) else state)
        return self.head(torch.stack(ys, 1))


def ids_of(seed: int = 1) -> Tensor:
    return torch.randint(0, V, (B, T), generator=torch.Generator().manual_seed(seed))


def diff(a: Tensor, b: Tensor) -> float:
    return float((a.double() - b.double()).abs().max()) if a.numel() else 0.0


@pytest.mark.parametrize("scale", [1.0, 16.0])
@pytest.mark.parametrize("kind", list(CELLS))
def test_a_cell_in_a_loop(kind, scale) -> None:
    net, ids, t = Loop(kind, scale), ids_of(), 6
    with torch.no_grad():
        own = net(ids)
    lens = gatelens.Lens(net)
    assert torch.equal(lens.run(ids, edits=[]).output, own)
    res = lens.run(ids, edits=[gatelens.Add("cell.layer0.h", 0.0, at=t)])
    assert torch.equal(res.output[:, :t], own[:, :t])
    assert diff(res.output[:, t], own[:, t]) < 1e-6
    # a state edit at t: later steps are the cell's own calls from the edited state
    g = torch.Generator().manual_seed(2)
    h = torch.randn(B, H, generator=g).tanh()
    edits = [gatelens.Set("cell.layer0.h", h, at=t)]
    state = h
    if kind == "lstm":
        c = torch.randn(B, H, generator=g)
        edits.append(gatelens.Set("cell.layer0.c", c, at=t))
        state = (h, c)
    res = lens.run(ids, edits=edits)
    with torch.no_grad():
        ref = net(ids, start=t + 1, state=state)
    assert torch.equal(res.output[:, t + 1 :], ref)
    assert torch.equal(res.trace["cell.layer0.h"][:, t], h)
    assert diff(res.output[:, t + 1 :], own[:, t + 1 :]) > 1e-3  # it carried


def test_a_cells_f_one_i_zero_holds_c_exactly_and_carry_false_is_refused() -> None:
    net, ids, t0 = Loop("lstm", 8.0, seed=3), ids_of(3), 5
    lens = gatelens.Lens(net)
    res = lens.run(ids, edits=[gatelens.Set("cell.layer0.f", 1.0, at=slice(t0, None), units=[3]),
                               gatelens.Zero("cell.layer0.i", at=slice(t0, None), units=[3])])
    state, e = None, net.embed(ids)
    with torch.no_grad():
        for t in range(t0):  # the cell's own c after step t0 − 1: what step t0 read
            state = net.cell(e[:, t], state)
    c = res.trace["cell.layer0.c"][:, t0:, 3]
    assert torch.equal(c, state[1][:, 3:4].expand_as(c))  # held from there, exactly
    with pytest.raises(GatelensError, match="carry=False cannot apply to a LSTMCell"):
        lens.run(ids, edits=[gatelens.Zero("cell.layer0.h", at=2, carry=False)])


class Seq2Seq(nn.Module):
    """An nn.LSTM encoder reads the window; a 2-layer nn.LSTM decoder runs one step a call
    from the encoder's final state, fed the window's tokens (teacher forcing, stepped)."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(4)
        self.embed = nn.Embedding(V, E)
        self.encoder = nn.LSTM(E, H, batch_first=True)
        self.decoder = nn.LSTM(E, H, num_layers=2, batch_first=True)
        self.head = nn.Linear(H, V)
        self.steps: int | None = None  # the decoder's steps (None: the window's)

    def forward(self, ids: Tensor, start: int = 0, state=None) -> Tensor:
        if state is None:
            _, (h, c) = self.encoder(self.embed(ids))
            state = (h.repeat(2, 1, 1), c.repeat(2, 1, 1))
        ys = []
        for t in range(start, self.steps or ids.shape[1]):
            y, state = self.decoder(self.embed(ids[:, t : t + 1]), state)
            ys.append(self.head(y))
        return torch.cat(ys, 1)


def test_a_decoder_called_per_step_behind_an_encoder() -> None:
    net, ids, t = Seq2Seq(), ids_of(5), 7
    with torch.no_grad():
        own = net(ids)
    lens = gatelens.Lens(net)
    assert torch.equal(lens.run(ids, edits=[]).output, own)
    # an edit of the encoder's last state reaches the decoder through the state it hands on
    res = lens.run(ids, edits=[gatelens.Zero("encoder.layer0.c", at=T - 1)])
    assert diff(res.output[:, 0], own[:, 0]) > 1e-3
    # the decoder's state set after step t: later steps are its own calls from there
    g = torch.Generator().manual_seed(6)
    hs, cs = torch.randn(2, B, H, generator=g).tanh(), torch.randn(2, B, H, generator=g)
    edits = [gatelens.Set(f"decoder.layer{k}.{s}", v[k], at=t) for k in (0, 1)
             for s, v in (("h", hs), ("c", cs))]
    res = lens.run(ids, edits=edits)
    with torch.no_grad():
        assert torch.equal(res.output[:, t + 1 :], net(ids, start=t + 1, state=(hs, cs)))
        assert torch.equal(res.output[:, :t], own[:, :t])
    # this position only: the step's read-out changes, the state handed back does not
    res = lens.run(ids, edits=[gatelens.Zero("decoder.layer1.h", at=t, carry=False)])
    assert diff(res.output[:, t], own[:, t]) > 1e-3
    assert diff(res.output[:, t + 1 :], own[:, t + 1 :]) < 1e-5
    with pytest.raises(GatelensError, match="outside the 10 positions"):
        lens.run(ids[:, :10], edits=[gatelens.Zero("decoder.layer0.h", at=12)])
    net.steps = 5  # a decoder that stops early never reaches an edit at 5: said, not skipped
    with pytest.raises(GatelensError, match="never ran position 5"):
        lens.run(ids, edits=[gatelens.Zero("decoder.layer0.h", at=slice(3, 8))])


def test_gatelens_charlm_and_a_family_not_supported_yet(monkeypatch) -> None:
    torch.manual_seed(7)
    lm, ids = CharLM(vocab_size=V, hidden=H, layers=2, cell="lstm"), ids_of(7)
    with torch.no_grad():
        logits, (h_n, c_n) = lm(ids)
    res = gatelens.Lens(lm).run(ids, edits=[gatelens.Set("rnn.layer1.f", 1.0, at=slice(4, None)),
                                            gatelens.Zero("rnn.layer1.i", at=slice(4, None))])
    out, (h2, c2) = res.output  # what CharLM's forward returns: (logits, state)
    assert torch.equal(out[:, :4], logits[:, :4])
    assert torch.equal(c2[1], res.trace["rnn.layer1.c"][:, 3])  # c held from step 3 on
    assert torch.equal(c2[0], c_n[0])  # layer 0 untouched
    from gatelens.cells.variants import VariantLSTM
    from gatelens.families.base import Family
    from gatelens.families.variants import VariantLSTMFamily

    # every family gatelens opens takes edits: one registered without ``intervene``
    monkeypatch.setattr(VariantLSTMFamily, "intervene", Family.intervene)
    peep = nn.Sequential(nn.Embedding(V, E), VariantLSTM(E, H, peepholes=True))
    with pytest.raises(GatelensError, match="interventions do not support the variant_lstm "
                                            r"family \(VariantLSTM\) yet"):
        gatelens.Lens(peep).run(ids, edits=[gatelens.Zero("1.layer0.h", at=3)])
