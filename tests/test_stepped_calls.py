"""Decoders called once per step (issue 17, item 2) and the edges of stitching: a trained
2-layer nn.LSTM decoder run greedily from its encoder's state, unbatched calls, a batch
that shrinks, and what Lens refuses (tiny models from cell_models.py)."""

from __future__ import annotations

import math
import sys
from pathlib import Path

import pytest
import torch
from torch import Tensor, nn

import gatelens
from gatelens.errors import GatelensError
from gatelens.readout.hooks import open_cells

sys.path.insert(0, str(Path(__file__).parent))  # the shared tiny models (importlib mode)
from cell_models import CHARS, B, E, H, T, V, batches, ids  # noqa: E402

pytestmark = pytest.mark.usefixtures("one_thread")


class Seq2Seq(nn.Module):
    """An nn.LSTM encoder reads the window; a 2-layer nn.LSTM decoder, trained with teacher
    forcing from the encoder's state, then runs greedily one step a call, fed back its own
    argmax, for as many steps as the window has."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(V, E)
        self.encoder = nn.LSTM(E, H, batch_first=True)
        self.decoder = nn.LSTM(E, H, num_layers=2, batch_first=True)
        self.head = nn.Linear(H, V)
        self.greedy = False

    def forward(self, ids: Tensor) -> Tensor:
        _, (h, c) = self.encoder(self.embed(ids))  # (1, B, H) each
        state = (h.repeat(2, 1, 1), c.repeat(2, 1, 1))  # (2, B, H): both layers start there
        if not self.greedy:  # teacher forcing: the whole window at once
            return self.head(self.decoder(self.embed(ids), state)[0])
        tok, ys = ids[:, :1], []
        for _ in range(ids.shape[1]):
            y, state = self.decoder(self.embed(tok), state)  # (B, 1, H)
            ys.append(self.head(y))
            tok = ys[-1].argmax(-1)  # (B, 1)
        return torch.cat(ys, 1)  # (B, T, V)


def test_per_step_decoder_is_one_trajectory_from_the_encoders_state() -> None:
    torch.manual_seed(2)
    model = Seq2Seq()
    opt = torch.optim.Adam(model.parameters(), lr=0.02)
    for k in range(50):
        xy = batches(8, seed=k)
        loss = nn.functional.cross_entropy(model(xy[:, :-1]).reshape(-1, V), xy[:, 1:].flatten())
        opt.zero_grad()
        loss.backward()
        opt.step()
    model.eval().greedy = True
    w = ids()
    with open_cells(model) as cache:
        model(w)
    assert len(cache.traces["decoder"]) == 1 and cache["decoder.layer1.f"].shape == (B, T, H)
    assert cache.max_abs_diff["decoder"] < 1e-5
    with torch.no_grad():
        _, (h, c) = model.encoder(model.embed(w))
        enc = (h.repeat(2, 1, 1), c.repeat(2, 1, 1))
    tr = cache.traces["decoder"][0]
    # the first step read the encoder's state: layer 0's f from it, by hand
    d, x0 = model.decoder, model.embed(w[:, 0]).detach()
    z = x0 @ d.weight_ih_l0.t() + d.bias_ih_l0 + enc[0][0] @ d.weight_hh_l0.t() + d.bias_hh_l0
    assert (tr["layer0.f"][:, 0] - z.chunk(4, -1)[1].sigmoid()).abs().max() < 1e-6
    # nn.LSTM's sequence kernel on the tokens the loop fed, from the encoder's state
    with torch.no_grad():
        fed = torch.cat([w[:, :1], model(w).argmax(-1)[:, :-1]], 1)  # (B, T)
    seq = gatelens.trace(model.decoder, model.embed(fed).detach(), enc)
    assert max((seq[k] - tr[k]).abs().max().item() for k in seq) < 1e-5
    from_zeros = gatelens.trace(model.decoder, model.embed(fed).detach())
    assert (from_zeros["layer0.f"] - tr["layer0.f"]).abs().max() > 1e-3  # the state matters
    result = gatelens.Lens(model, vocab=CHARS).analyze(w, windows=B, length=T, perturb_pos=4)
    rep = result.reports["decoder"]
    assert rep["verification"]["passed"] and rep["model"]["layers"] == 2
    assert math.isfinite(rep["perturbation"]["half_life_measured"] or 0.0)


class Chunked(nn.Module):
    """A GRU called per step (``mode="unbatched"``: one sequence, (1, F) a call), in two
    halves of the window (``"halves"``), on half the window then per step (``"prompt"``), or
    for half the window (``"short"``); ``"shrink"``: a cell loop whose batch loses a row at
    step 10."""

    def __init__(self, mode: str) -> None:
        super().__init__()
        self.mode, self.embed, self.head = mode, nn.Embedding(V, E), nn.Linear(H, V)
        if mode == "shrink":
            self.cell = nn.GRUCell(E, H)
        else:
            self.gru = nn.GRU(E, H, batch_first=True)

    def forward(self, ids: Tensor) -> Tensor:
        e = self.embed(ids)  # (B, T, E)
        if self.mode in ("halves", "prompt"):
            ys, h = self.gru(e[:, : T // 2])
            ys = [ys]
            for t in range(T // 2, T) if self.mode == "prompt" else [slice(T // 2, T)]:
                y, h = self.gru(e[:, t : t + 1] if isinstance(t, int) else e[:, t], h)
                ys.append(y)
            return self.head(torch.cat(ys, 1))
        if self.mode == "shrink":
            h, ys = None, []
            for t in range(ids.shape[1]):
                x = e[:, t] if t < 10 else e[:-1, t]
                h = self.cell(x, h if t != 10 else h[:-1])
                ys.append(h[:1])
            return self.head(torch.stack(ys, 1))
        if self.mode == "unbatched":
            h, ys = None, []
            for t in range(ids.shape[1]):
                y, h = self.gru(e[0, t : t + 1], h)  # (1, E) unbatched, h (1, H)
                ys.append(y)
            return self.head(torch.cat(ys, 0))[None]
        h, ys = None, []
        for t in range(ids.shape[1] // 2):
            y, h = self.gru(e[:, t : t + 1], h)
            ys.append(y)
        return self.head(torch.cat(ys, 1))


def test_stitching_edge_cases_and_refusals() -> None:
    torch.manual_seed(3)
    w = ids()
    model = Chunked("unbatched").eval()
    with open_cells(model) as cache:
        model(w)
    x = model.embed(w[:1]).detach()  # (1, T, E)
    assert cache["gru.layer0.z"].shape == (1, T, H) and cache.traces["gru"][0].h_n.shape == (1, H)
    assert (cache["gru.layer0.z"] - gatelens.trace(model.gru, x)["layer0.z"]).abs().max() < 1e-6
    model = Chunked("shrink").eval()
    with open_cells(model) as cache:
        model(w)
    assert [tr["layer0.h"].shape[:2] for tr in cache.traces["cell"]] == [(B, 10), (B - 1, T - 10)]
    lens = gatelens.Lens(model, vocab=CHARS)
    with pytest.raises(GatelensError, match="form 2 trajectories .*batch size changed at call 10"):
        lens.analyze(w, windows=B, length=T, perturb_pos=4)
    with pytest.raises(GatelensError, match="gru ran 2 times in one forward; Lens measures "):
        gatelens.Lens(Chunked("halves"), vocab=CHARS).analyze(w, windows=B, length=T,
                                                             perturb_pos=4)
    with pytest.raises(GatelensError, match="gru ran 17 times in one forward, 1 of them on more "
                                            "than one step"):
        gatelens.Lens(Chunked("prompt"), vocab=CHARS).analyze(w, windows=B, length=T,
                                                             perturb_pos=4)
    with pytest.raises(GatelensError, match="has 16 steps but the windows 32"):
        gatelens.Lens(Chunked("short"), vocab=CHARS).analyze(w, windows=B, length=T,
                                                            perturb_pos=4)
