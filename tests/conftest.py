"""Shared fixtures: small texts the tests make themselves (no network, no downloads)."""

from __future__ import annotations

import math
import os
import random
from pathlib import Path

import pytest

WORDS = ("the quick brown fox jumps over a lazy dog and then runs home to sleep "
         "while it rains").split()


def make_text(n_lines: int = 400, seed: int = 1) -> str:
    """A learnable text: short lines of common words, spaces and newlines."""
    rng = random.Random(seed)
    return "\n".join(" ".join(rng.choice(WORDS) for _ in range(8)) for _ in range(n_lines))


def pytest_configure(config: pytest.Config) -> None:
    """Under pytest-xdist, each worker's torch (and the gatelens, Ray and training
    subprocesses it starts, through OMP_NUM_THREADS) takes its share of the CPUs, not all
    of them: two workers of 2 OpenMP threads each on 2 cores spun against each other, and
    the README's Lens example, 5 s alone, took 105–162 s in the suite. A user's own
    OMP_NUM_THREADS is kept."""
    workers = os.environ.get("PYTEST_XDIST_WORKER_COUNT")
    if not os.environ.get("PYTEST_XDIST_WORKER") or not workers:
        return
    share = max(1, len(os.sched_getaffinity(0)) // int(workers))
    os.environ.setdefault("OMP_NUM_THREADS", str(share))
    import torch

    torch.set_num_threads(int(os.environ["OMP_NUM_THREADS"]))


@pytest.fixture(scope="module")
def one_thread():
    """One torch thread for a test module, restored after: on 2 shared cores a second
    OpenMP thread spins against other jobs and tiny models run several times slower."""
    import torch

    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


@pytest.fixture
def tiny_text(tmp_path: Path) -> Path:
    path = tmp_path / "tiny.txt"
    path.write_text(make_text(), encoding="utf-8")
    return path


def random_analysis(cell: str, windows: int = 5, length: int = 40, hidden: int = 12,
                    perturb_pos: int = 8, seed: int = 3, layers: int = 1):
    """A real ``measure`` of a random model (and a second one as its step 0) on real text.

    The figures come from gatelens's own measurements, so the report and the page built
    from it can be checked against the traces it holds.
    """
    import torch

    from gatelens.analysis.measure import encoder_runner, measure

    text = make_text(n_lines=60, seed=seed)
    chars = sorted(set(text))
    index = {c: i for i, c in enumerate(chars)}
    ids = torch.tensor([[index[c] for c in text[k * length:(k + 1) * length]]
                        for k in range(windows)])  # (B, T)
    cls = {"lstm": torch.nn.LSTM, "gru": torch.nn.GRU, "rnn_tanh": torch.nn.RNN}[cell]
    torch.manual_seed(seed)
    model, untrained = (cls(len(chars), hidden, layers, batch_first=True) for _ in range(2))
    head = torch.nn.Linear(hidden, len(chars))  # so the output-level reach has logits

    def encode(i):
        return torch.nn.functional.one_hot(i, len(chars)).float()

    def logits(i):
        return head(model(encode(i))[0])  # (B, T, V)

    return measure(model, encoder_runner(encode, logits), ids, chars, perturb_pos=perturb_pos,
                   seed=seed, baseline=(0, untrained, encoder_runner(encode)),
                   model={"cell": cell, "hidden": hidden, "layers": layers, "step": 5},
                   text={"windows": windows, "length": length, "source": "make_text"})


@pytest.fixture(scope="session")
def analysis_of():
    """The ``random_analysis`` factory, for tests to call with their own sizes."""
    return random_analysis


def _load_test_helper(name: str):
    """A helper module of tests/ by file (tests are imported with --import-mode=importlib,
    so tests/ is not on sys.path)."""
    import importlib.util

    spec = importlib.util.spec_from_file_location(f"gatelens_tests_{name}",
                                                  Path(__file__).with_name(f"{name}.py"))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="session")
def dynamics_of():
    """``family_dynamics.dynamics_of``: a module's Dynamics through its family, as the
    divergence rate builds them."""
    return _load_test_helper("family_dynamics").dynamics_of


@pytest.fixture
def seeded_rerun(monkeypatch: pytest.MonkeyPatch):
    """The step-by-step re-run of PyTorch's recurrent modules (the free-running check, and
    trace(method="step")) fed inputs one ulp off at one element of step 0.

    Where the hand cell is bitwise the CPU's kernel (PyTorch's GRU on some Intel Xeons) the
    free-running figure of a chaotic model is exactly 0; a test that shows chaos seeds the
    difference itself, so it holds on every CPU whatever the kernels round.
    """
    import dataclasses

    import torch

    from gatelens.families.torch_rnn import TorchRNNFamily

    rerun = TorchRNNFamily.rerun

    def seeded(self, call):
        x = call.inputs.clone()
        j = int(x[0, 0].abs().argmax())  # a nonzero element: one ulp of 0 is lost in a sum
        x[0, 0, j] = torch.nextafter(x[0, 0, j], torch.tensor(math.inf, dtype=x.dtype))
        return rerun(self, dataclasses.replace(call, inputs=x))

    monkeypatch.setattr(TorchRNNFamily, "rerun", seeded)
