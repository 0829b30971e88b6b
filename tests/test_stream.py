"""Streaming analysis: windows in chunks give the figures of one shot (docs/methods.md
"Streaming analysis"); percentiles from the histogram lie within 1e-4 of the exact ones.

The models run in float64: PyTorch's own float32 kernels round differently at another batch
size (a chunk), which is float32 rounding, not the streaming's; in float64 that is 1e-16."""

from __future__ import annotations

import math

import pytest
import torch
from torch import nn

from gatelens.analysis import stream
from gatelens.analysis.measure import encoder_runner, measure
from gatelens.cells.modern import MinGRU

pytestmark = pytest.mark.usefixtures("one_thread")
V, B, T = 7, 11, 20  # lags up to 8: far from float64 noise


def numbers(x, path=""):
    """Every number of a report, by path."""
    if isinstance(x, dict):
        for k, v in x.items():
            yield from numbers(v, f"{path}/{k}")
    elif isinstance(x, list):
        for i, v in enumerate(x):
            yield from numbers(v, f"{path}[{i}]")
    elif isinstance(x, (int, float)) and not isinstance(x, bool):
        yield path, float(x)


def analyse(module: nn.Module, chunk: int | None):
    torch.manual_seed(0)
    head = nn.Linear(module.hidden_size, V).double()
    ids = torch.randint(0, V, (B, T), generator=torch.Generator().manual_seed(1))

    def encode(i):
        return nn.functional.one_hot(i, V).double()

    def logits(i):
        out = module(encode(i))[0]
        return head(out)

    return measure(module, encoder_runner(encode, logits), ids, [chr(97 + k) for k in range(V)],
                   perturb_pos=6, seed=3, baseline=(0, module, encoder_runner(encode)),
                   chunk=chunk)


@pytest.mark.parametrize("kind", ["lstm2", "gru", "rnn", "mingru"])
def test_chunks_give_the_one_shot_figures(kind: str) -> None:
    torch.manual_seed(0)
    module = {"lstm2": lambda: nn.LSTM(V, 9, num_layers=2, batch_first=True),
              "gru": lambda: nn.GRU(V, 9, batch_first=True),
              "rnn": lambda: nn.RNN(V, 9, batch_first=True),
              "mingru": lambda: MinGRU(V, 9, num_layers=2)}[kind]().double().eval()
    whole, parts = analyse(module, None), analyse(module, 3)
    assert parts.text["chunks"] == 4 and whole.text["chunks"] == 1
    a, b = dict(numbers(whole.report)), dict(numbers(parts.report))
    assert set(a) == set(b)
    for path, x in a.items():
        if path == "/text/chunks":
            continue
        assert math.isclose(x, b[path], rel_tol=1e-8, abs_tol=1e-14), (path, x, b[path])
    # the page's traces are the first chunk's windows
    assert parts.trace[next(iter(parts.trace))].shape[0] == 3


def test_histogram_percentiles_are_within_1e4_of_the_exact(monkeypatch) -> None:
    torch.manual_seed(0)
    module = nn.LSTM(V, 9, batch_first=True).double().eval()
    exact = analyse(module, 4)
    monkeypatch.setattr(stream, "EXACT_LIMIT", 100)
    hist = analyse(module, 4)
    assert exact.text["percentiles"].startswith("exact")
    assert hist.text["percentiles"].startswith("histogram")
    for g, st in exact.gates.stats.items():
        for k, v in st.items():
            tol = 1e-12 if k == "mean" else 1e-4
            assert abs(hist.gates.stats[g][k] - v) <= tol, (g, k, hist.gates.stats[g][k], v)
    assert hist.gates.n_values == exact.gates.n_values == B * T * 9
