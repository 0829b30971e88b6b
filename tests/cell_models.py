"""Tiny char models with a cell stepped in a Python loop, trained here for a few dozen steps:
shared by test_cell_loops.py and test_stepped_calls.py (no network, no downloads)."""

from __future__ import annotations

import random

import torch
from torch import Tensor, nn

WORDS = "the quick brown fox jumps over a lazy dog and then runs home to sleep".split()
_rng = random.Random(4)
TEXT = "\n".join(" ".join(_rng.choice(WORDS) for _ in range(8)) for _ in range(60))
CHARS = sorted(set(TEXT))
V, H, E = len(CHARS), 12, 8
B, T = 6, 32


class CellLM(nn.Module):
    """embedding -> a cell stepped in a Python loop -> head. ``reset_at``: the state set to
    ``reset`` ("none", "zeros") at that step; ``reorder``: the state index_select'ed there."""

    def __init__(self, cell: nn.Module, reset_at: int | None = None, reset: str = "none",
                 reorder: Tensor | None = None, handback: str = "same") -> None:
        super().__init__()
        self.embed, self.cell, self.head = nn.Embedding(V, E), cell, nn.Linear(H, V)
        self.reset_at, self.reset, self.reorder, self.handback = reset_at, reset, reorder, \
            handback

    def forward(self, ids: Tensor) -> Tensor:
        e, state, ys = self.embed(ids), None, []  # (B, T, E)
        for t in range(ids.shape[1]):
            if t == self.reset_at and self.reorder is not None:
                state = tuple(s.index_select(0, self.reorder) for s in state) \
                    if isinstance(state, tuple) else state.index_select(0, self.reorder)
            elif t == self.reset_at:
                state = None if self.reset == "none" else (
                    torch.zeros(ids.shape[0], H), torch.zeros(ids.shape[0], H)) \
                    if isinstance(self.cell, nn.LSTMCell) else torch.zeros(ids.shape[0], H)
            if self.handback == "clone" and state is not None:  # equal values, new tensors
                state = tuple(s.clone() for s in state) if isinstance(state, tuple) \
                    else state.clone()
            state = self.cell(e[:, t], state)
            h = state[0] if isinstance(state, tuple) else state
            ys.append(h)
            if self.handback == "inplace" and t == 3:  # the very tensor, edited in place
                h.mul_(0.5)
        return self.head(torch.stack(ys, 1))  # (B, T, V)


def batches(n: int, seed: int = 0) -> Tensor:
    idx = torch.tensor([CHARS.index(c) for c in TEXT])
    g = torch.Generator().manual_seed(seed)
    starts = torch.randint(0, len(idx) - T - 1, (n,), generator=g)
    return torch.stack([idx[s : s + T + 1] for s in starts.tolist()])  # (n, T + 1)


def train(model: nn.Module, steps: int = 60) -> nn.Module:
    """Next-character training for a few dozen steps (the model learns the text's words)."""
    torch.manual_seed(0)
    opt = torch.optim.Adam(model.parameters(), lr=0.02)
    for k in range(steps):
        xy = batches(8, seed=k)
        loss = nn.functional.cross_entropy(model(xy[:, :-1]).reshape(-1, V), xy[:, 1:].flatten())
        opt.zero_grad()
        loss.backward()
        opt.step()
    return model.eval()


_TRAINED: dict[str, nn.Module] = {}


def trained(kind: str) -> CellLM:
    """A trained cell-loop model of each kind, once per test session."""
    if kind not in _TRAINED:
        torch.manual_seed(1)
        cell = {"lstm": lambda: nn.LSTMCell(E, H), "gru": lambda: nn.GRUCell(E, H),
                "rnn_relu": lambda: nn.RNNCell(E, H, nonlinearity="relu"),
                "lstm_nobias": lambda: nn.LSTMCell(E, H, bias=False),
                "gru_nobias": lambda: nn.GRUCell(E, H, bias=False)}[kind]()
        _TRAINED[kind] = train(CellLM(cell))
    return _TRAINED[kind]


def ids() -> Tensor:
    return batches(B, seed=99)[:, :T]
