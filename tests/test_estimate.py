"""The cost of an analysis said before it runs (analysis/estimate.py): its chunks and
their working memory at the start, the time of all chunks once the first is timed."""

from __future__ import annotations

import re

import torch

from gatelens.analysis.estimate import (
    chunk_bytes,
    peak_resident,
    plan_line,
    time_line,
    working_bytes,
)
from gatelens.analysis.measure import (
    MEMORY_BUDGET,
    chunk_windows,
    encoder_runner,
    measure,
    trace_bytes,
)
from gatelens.families.registry import family_of


def test_the_lines_before_and_after_the_first_chunk(capsys):
    torch.manual_seed(0)
    lstm = torch.nn.LSTM(4, 6, num_layers=2, batch_first=True)
    ids = torch.randint(0, 4, (5, 20))
    run = encoder_runner(lambda i: torch.nn.functional.one_hot(i, 4).float())
    measure(lstm, run, ids, list("abcd"), perturb_pos=5, exponents=0, chunk=2, progress=True)
    err = capsys.readouterr().err.splitlines()
    plan = next(i for i, line in enumerate(err) if "working memory" in line)
    weights = 2 * sum(p.numel() * 4 for p in lstm.parameters())  # their float64 copy
    per_token = 2 * 6 * 6 * 4  # 2 layers × i f g o c h × 6 units × 4 bytes
    assert err[plan] == plan_line(windows=5, length=20, step=2, per_token=per_token,
                                  module=weights, layers=2)
    assert "5 windows × 20 in 3 chunks of 2" in err[plan]
    timed = [line for line in err if "the first chunk took" in line]
    assert len(timed) == 1 and err.index(timed[0]) > plan
    first, total = map(float, re.findall(r"([\d.]+) s", timed[0]))
    # the process's own peak resident memory so far, measured, in GiB
    peak = float(re.search(r"peak resident memory so far ([\d.]+) GiB$", timed[0]).group(1))
    assert 0.05 < peak <= peak_resident() / 2**30 + 0.05
    # its own rule: total = first × 5 / 2, both printed to 0.1 s (first's rounding × 2.5)
    assert abs(total - first * 5 / 2) <= 0.05 * 5 / 2 + 0.05 + 1e-9
    assert not any(" so far)" in line for line in err)  # several chunks: the bar says it
    measure(lstm, run, ids, list("abcd"), perturb_pos=5, exponents=0, progress=False)
    assert capsys.readouterr().err == ""  # nothing said without progress


def test_one_chunk_says_each_stage_and_the_spectrum_s_steps(capsys, monkeypatch):
    """With one chunk there is no bar over the windows: each stage says its time when it is
    done, in order, and the Lyapunov spectrum (the longest) its steps' rate and ETA, once it
    has run 5 s (made to look so here)."""
    from gatelens.progress import Progress

    torch.manual_seed(0)
    lstm = torch.nn.LSTM(4, 6, num_layers=2, batch_first=True)
    ids = torch.randint(0, 4, (3, 24))
    run = encoder_runner(lambda i: torch.nn.functional.one_hot(i, 4).float())
    monkeypatch.setattr(Progress, "elapsed", property(lambda self: 6.0))
    measure(lstm, run, ids, list("abcd"), perturb_pos=5, exponents=4, progress=True)
    err = capsys.readouterr().err.splitlines()
    done = [line.split(" took ")[0].removeprefix("gatelens analyze: ") for line in err
            if " so far)" in line]
    assert done == ["trace", "divergence rate", "verification", "Lyapunov spectrum",
                    "context used", "gate, unit and perturbation figures"]
    bar = "gatelens analyze: Lyapunov spectrum (4 exponents)"
    steps = [line for line in err if line.startswith(bar)]
    # 24 steps on each of 3 windows, all at once: a line every 3 steps
    assert len(steps) == 8 and steps[-1].split(": ")[2].startswith("24/24 (100%)")
    assert all("ETA" in line for line in steps)
    assert err.index(steps[-1]) < next(i for i, ln in enumerate(err) if "spectrum took" in ln)


def test_stages_of_the_first_windows_only_are_counted_once_a_chunk_of_them(monkeypatch):
    """The spectrum and the context used read the first ``memory_windows`` windows (the
    spectrum fewer under its cost rule): the estimate counts their first-chunk time once for
    each chunk holding those windows, the rest for every chunk (24 Mamba layers, 8 windows:
    the estimate said 24.7 min where the analysis took 17.2)."""
    import gatelens.analysis.measure as measure_mod

    said = []

    def spy(**kw):
        said.append(kw)
        return time_line(**kw)

    monkeypatch.setattr(measure_mod, "time_line", spy)
    torch.manual_seed(0)
    lstm = torch.nn.LSTM(4, 6, batch_first=True)
    ids = torch.randint(0, 4, (6, 20))
    run = encoder_runner(lambda i: torch.nn.functional.one_hot(i, 4).float())
    a = measure(lstm, run, ids, list("abcd"), perturb_pos=5, exponents=2, memory_windows=2,
                chunk=2, progress=True)
    (kw,) = said
    assert a.lyapunov.windows == 2 and set(kw["fewer"]) == {"spectrum", "context"}
    assert all(read == 2 and took > 0 for took, read in kw["fewer"].values())
    some = sum(took for took, _ in kw["fewer"].values())
    line = time_line(**kw)
    total = float(re.search(r"all 3 ≈ ([\d.]+) s", line).group(1))
    assert abs(total - ((kw["first"] - some) * 3 + some)) <= 0.05 + 1e-9
    # the others read every window (fixed points: under the first chunk's inputs only)
    from gatelens.analysis.chunk import Accumulator
    from gatelens.analysis.measurements import MEASUREMENTS

    fewer = {m.__name__ for m in MEASUREMENTS if m.windows_read is not Accumulator.windows_read}
    assert fewer == {"Spectrum", "Context", "FixedPointSearch"}


def test_the_chunk_rule_is_the_estimates():
    fam = family_of(torch.nn.LSTM(84, 325))
    step = chunk_windows(fam, 128)
    assert chunk_bytes(step, 128, 325) <= MEMORY_BUDGET < chunk_bytes(step + 1, 128, 325)
    assert time_line(first=90.0, windows=40, step=10).endswith("all 4 ≈ 6.0 min")
    assert plan_line(windows=3, length=8, step=10, per_token=4).startswith(
        "gatelens analyze: 3 windows × 8 in 1 chunk of 3")


def test_a_deep_stack_is_held_one_layer_at_a_time_in_the_estimate():
    """The split and the one-step checks hold one layer at a time: a chunk of a deep stack
    costs the whole stack's held part and one layer's share of the rest."""
    one = chunk_bytes(1, 128, 24 * 24_576)
    deep = chunk_bytes(1, 128, 24 * 24_576, layers=24)
    assert deep < one / 3  # 23 GB estimated before for one window, measured peak 7.4 GB
    assert chunk_bytes(2, 128, 325, 1) == 2 * chunk_bytes(1, 128, 325)


def test_a_state_wider_than_its_units_is_counted_by_its_coordinates():
    """A Mamba-2 head keeps 64 × 128 numbers under one keep gate: the estimate and the chunk
    rule count the state's coordinates (``state_units``), not the keep gate's units (24 heads
    a layer of mamba2-130m's width said 10 MiB for a window of 2.4 GB of states, and put
    two windows in a chunk)."""
    import pytest

    from gatelens.analysis.measure import _units

    transformers = pytest.importorskip("transformers")
    m = transformers.Mamba2Model(transformers.Mamba2Config(
        vocab_size=11, hidden_size=64, num_hidden_layers=2, state_size=16, head_dim=16,
        num_heads=8, expand=2, n_groups=1, use_cache=False))
    fam = family_of(m)
    assert fam.hidden_size == 8 and _units(fam) == 2 * 8 * 16 * 16
    lstm = family_of(torch.nn.LSTM(84, 325, num_layers=2))
    assert _units(lstm) == 2 * 325  # a unit a coordinate: as before


def test_the_estimate_counts_the_trace_a_token_really_holds():
    """The line before the start counts the widths of the first window's trace: a Mamba-2
    layer's trace is mostly its state (heads × head_dim × d_state a token), one number a
    coordinate, where the chunk rule counts 80 bytes a coordinate (24 layers of mamba2-130m's
    width: 43,008 MiB said for a window that held 4.8 GiB)."""
    import pytest

    transformers = pytest.importorskip("transformers")
    import gatelens

    torch.manual_seed(0)
    m = transformers.Mamba2ForCausalLM(transformers.Mamba2Config(
        vocab_size=11, hidden_size=64, num_hidden_layers=2, state_size=16, head_dim=16,
        num_heads=8, expand=2, n_groups=1, use_cache=False)).eval()
    lens = gatelens.Lens(m, vocab=11)
    (path,) = list(lens.families)
    fam, run = lens.families[path], lens.runner(path)
    ids = torch.randint(0, 11, (1, 6))
    per = trace_bytes(fam, run, ids[:, :4])
    state = 2 * 8 * 16 * 16 * 4  # 2 layers × 8 heads × 16 × 16, float32
    assert state <= per < 1.25 * state
    assert trace_bytes(fam, run, ids) == per  # the same a token, whatever the length
    estimate = working_bytes(1, 128, per, layers=2)
    assert estimate < chunk_bytes(1, 128, 2 * 8 * 16 * 16, 2) / 4
