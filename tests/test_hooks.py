"""open_cells: traces of every recurrent module inside a user's own model."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from gatelens.readout.hooks import open_cells
from gatelens.readout.trace import trace


class Encoder(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(12, 5)
        self.lstm = nn.LSTM(5, 6, num_layers=2, batch_first=True)
        self.gru = nn.GRU(6, 4)  # sequence first, on purpose

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        y, _ = self.lstm(self.embed(tokens))  # (B, T, 6)
        z, h = self.gru(y.transpose(0, 1), hx=torch.ones(1, tokens.shape[0], 4))
        return z.transpose(0, 1)  # (B, T, 4)


class Model(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.encoder = Encoder()
        self.head = nn.Linear(4, 12)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        return self.head(self.encoder(tokens))


def recurrent(model: nn.Module):
    return [m for m in model.modules() if isinstance(m, (nn.LSTM, nn.GRU, nn.RNN))]


def test_open_cells_catches_every_module_and_leaves_output_alone():
    torch.manual_seed(0)
    model = Model().eval()
    tokens = torch.randint(0, 12, (3, 9))
    expected = model(tokens)
    with open_cells(model) as cache:
        got = model(tokens)
    assert torch.equal(got, expected)
    assert set(cache.traces) == {"encoder.lstm", "encoder.gru"}
    assert "encoder.lstm.layer1.f" in cache and "encoder.gru.layer0.z" in cache
    assert len(cache) == len(list(cache)) == 12 + 4
    assert cache["encoder.lstm.layer0.f"].shape == (3, 9, 6)
    assert cache["encoder.gru.layer0.n"].shape == (3, 9, 4)
    assert all(d < 1e-5 for d in cache.max_abs_diff.values())
    # the same numbers trace() gives from the module's own input and state
    emb = model.encoder.embed(tokens)
    direct = trace(model.encoder.lstm, emb)
    assert torch.equal(cache["encoder.lstm.layer1.h"], direct["layer1.h"])
    with torch.no_grad():
        encoded = model.encoder(tokens)  # (B, T, 4): the GRU's output, hx = ones
    assert (cache["encoder.gru.layer0.h"] - encoded).abs().max() < 1e-6


def test_hooks_are_removed_afterwards_even_on_error():
    model = Model()
    with open_cells(model):
        assert all(len(m._forward_hooks) == 1 for m in recurrent(model))
    assert all(not m._forward_hooks for m in recurrent(model))
    with pytest.raises(RuntimeError, match="boom"):
        with open_cells(model):
            raise RuntimeError("boom")
    assert all(not m._forward_hooks for m in recurrent(model))


def test_repeated_calls_are_kept_with_a_suffix():
    model = Model().eval()
    with open_cells(model) as cache:
        model(torch.randint(0, 12, (2, 4)))
        model(torch.randint(0, 12, (2, 6)))
    assert len(cache.traces["encoder.lstm"]) == 2
    assert cache["encoder.lstm.layer0.f"].shape == (2, 4, 6)
    assert cache["encoder.lstm#1.layer0.f"].shape == (2, 6, 6)
    with pytest.raises(KeyError, match="not caught"):
        cache["encoder.lstm#2.layer0.f"]


def test_model_that_is_itself_a_module_and_training_graph_intact():
    lstm = nn.LSTM(3, 4, batch_first=True)
    x = torch.randn(2, 5, 3)
    with open_cells(lstm) as cache:
        out, _ = lstm(x)
        out.sum().backward()  # the user's autograd graph is untouched
    assert lstm.weight_hh_l0.grad is not None
    assert list(cache)[:2] == ["layer0.i", "layer0.f"]
