"""``measure``: one recurrent module and its windows in, an ``Analysis`` of result objects out.

``measure`` reads each chunk of windows once (the trained and perturbed models' traces,
PyTorch's own states, the untrained model's trace) and hands it to every measurement of
``gatelens.analysis.measurements.MEASUREMENTS``, each timed under its stage; the
``Analysis`` it returns holds every result object, and report.json, report.md, the plots
and the page are all read from it (``gatelens.report.write``). Every number is defined in
docs/methods.md.
"""

from __future__ import annotations

import time
from typing import Any

import torch
from torch import Tensor, nn

from gatelens.analysis import perturb_windows
from gatelens.analysis.chunk import Chunk, Setup
from gatelens.analysis.common import give_back
from gatelens.analysis.estimate import (
    chunk_bytes,
    peak_resident,
    plan_line,
    stage_line,
    time_line,
)
from gatelens.analysis.measurements import MEASUREMENTS
from gatelens.analysis.result import (
    Analysis,
    Baseline,
    Captured,
    Runner,
    encoder_runner,
    kept_for_page,
)
from gatelens.analysis.settings import AnalysisSettings, check_perturb_pos
from gatelens.analysis.split import perturbed_letters, perturbed_part
from gatelens.cells.numerics import faithful_matmul
from gatelens.errors import GatelensError
from gatelens.families.base import Call, Family, Reference
from gatelens.families.official_layers import replayed, streams
from gatelens.families.registry import open_family
from gatelens.progress import Progress
from gatelens.readout.trace import assemble, read, trace
from gatelens.readout.trace_types import Trace

__all__ = ["STAGES", "Analysis", "Baseline", "Captured", "Runner", "check_perturb_pos",
           "chunk_windows", "encoder_runner", "measure"]

#: the stages an analysis is timed by (``timings``), in the order a chunk goes through them
STAGES = ("trace", "divergence", "verification", "spectrum", "fixed_points", "context",
          "analyses")


#: the working memory an analysis aims at (docs/design.md "Streaming analysis")
MEMORY_BUDGET = 3 << 28  # 768 MiB

def chunk_windows(fam: Family, length: int, budget: int = MEMORY_BUDGET) -> int:
    """Windows per chunk so that one chunk's working memory stays near ``budget``.

    >>> from gatelens.families.registry import family_of
    >>> chunk_windows(family_of(torch.nn.LSTM(84, 325)), 128)
    60
    """
    return max(1, int(budget // chunk_bytes(1, length, _units(fam), fam.num_layers)))


def _units(fam: Family) -> int:
    """The carried state's coordinates over every layer (the estimate's rule is per
    coordinate): a family's ``state_units`` where its state has more coordinates than its
    keep gate has units (a Mamba-2 head's 64 × 128 memory, an mLSTM's d² + d), else its
    units."""
    per = getattr(fam, "state_units", None)
    if per is None:
        return fam.num_layers * (2 if fam.bidirectional else 1) * fam.hidden_size
    return sum(max(len(per(k)), fam.unit_count(k)) for k in range(fam.num_layers))


def trace_bytes(fam: Family, runner: Runner, ids: Tensor) -> int:
    """The bytes a token of ``ids``'s clean trace takes: every signal of every layer, as
    ``measure`` reads them (the estimate's count, ``estimate.working_bytes``).

    >>> lstm = torch.nn.LSTM(3, 4, num_layers=2, batch_first=True)
    >>> run = encoder_runner(lambda i: torch.nn.functional.one_hot(i, 3).float())
    >>> from gatelens.families.registry import family_of
    >>> trace_bytes(family_of(lstm), run, torch.zeros(1, 5, dtype=torch.long))
    192

    (2 layers × 6 signals, i f g o c h, × 4 units × 4 bytes.)
    """
    with torch.no_grad():
        return _per_token(_read(fam, runner(ids))[2])


def _per_token(tr: Trace) -> int:
    """The bytes a token of the trace ``tr`` (B, T, ·) takes."""
    first = next(iter(tr.values()), None)
    tokens = 1 if first is None else first.shape[0] * first.shape[1]
    return sum(t.numel() * t.element_size() for t in tr.values()) // max(1, tokens)


def measure(module: nn.Module, runner: Runner, ids: Tensor, chars: list[str],
            settings: AnalysisSettings | None = None, *, init_value: float = 0.5,
            baseline: tuple[int, nn.Module, Runner] | None = None,
            model: dict | None = None, text: dict | None = None, run: dict | None = None,
            unit: str = "characters", timings: dict | None = None, chunk: int | None = None,
            progress: bool = False, **options: Any) -> Analysis:
    """Every measurement of one recurrent ``module`` on windows ``ids`` (B, T).

    ``settings`` (an ``AnalysisSettings``; its fields may also be given as keyword
    arguments, ``perturb_pos=4``) says what is measured; ``runner(ids)`` returns what the
    module saw when the model read ``ids`` (its input and state, and the model's logits);
    ``baseline`` is (step, module, runner) of the untrained model; ``model`` and ``text``
    are report.json's blocks of the same names; ``run`` what a training run adds (its
    ``history``, ``best_step`` and ``control``). ``unit`` is what the model reads
    (characters, tokens or bytes): a model read in tokens or bytes has its replacement
    drawn from the tokens that occur in the windows and its inputs classed as tokens
    (docs/methods.md "Tokens and depth"). Windows go through in chunks of ``chunk``
    (default: what ``MEMORY_BUDGET`` allows), every figure accumulated; the traces kept for
    the page are the first chunk's. The Lyapunov spectrum and the context used are measured
    on the first ``memory_windows`` windows; the fixed points, when asked, under the first
    chunk's held inputs. ``timings``, if given, gets the seconds of each of ``STAGES``.

    >>> lstm = torch.nn.LSTM(3, 4, batch_first=True)
    >>> ids = torch.randint(0, 3, (2, 12))
    >>> a = measure(lstm, encoder_runner(lambda i: torch.nn.functional.one_hot(i, 3).float()),
    ...             ids, list("abc"), perturb_pos=4)
    >>> a.verification.passed, a.perturbation.lags, a.units.n_units
    (True, [1, 2, 4], 4)
    """
    s = AnalysisSettings.build(settings, **options)
    clock = timings if timings is not None else {}
    for stage in STAGES:
        clock.setdefault(stage, 0.0)
    B, T = ids.shape
    check_perturb_pos(s.perturb_pos, T, unit)
    if len(chars) < 2:
        raise GatelensError(f"a vocabulary of {len(chars)} character cannot be perturbed")
    seed = s.seed_or(0)
    among = None if unit == "characters" else torch.unique(ids)  # tokens: those that occur
    if among is not None and len(among) < 2:
        raise GatelensError("the windows hold one distinct token: a token perturbation "
                            "replaces it by another that occurs in them")
    perturbed = perturb_windows(ids, s.perturb_pos, len(chars), seed, among)  # (B, T)
    fam = open_family(module, "measure()")
    if all(n.split(".")[1] == "reverse" for n in fam.names()):  # an ONNX reverse-only node
        raise GatelensError("a reverse-only recurrent module cannot be measured (the "
                            "measurements follow the text forward); trace it instead")
    base = None if baseline is None else (baseline[0], open_family(baseline[1], "measure()"),
                                          baseline[2])
    step = chunk or chunk_windows(fam, T)
    # one chunk: no bar over the windows, so each stage says when it is done and the
    # spectrum, the longest, has a bar over its steps
    alone = progress and B <= step
    setup = Setup(fam, runner, B, T, s, seed, list(chars), init_value,
                  None if base is None else base[:2], unit, progress=alone)
    active = [m for m in (cls.build(setup) for cls in MEASUREMENTS) if m is not None]
    for m in active:
        clock.setdefault(m.stage, 0.0)
    kept: dict = {}
    bar = Progress(B, "gatelens analyze", unit="window", enabled=progress and B > step)
    started = time.perf_counter()
    for b0 in range(0, B, step):
        w, wp = ids[b0 : b0 + step], perturbed[b0 : b0 + step]
        bar.note(stage="trace")
        t0 = time.perf_counter()
        cap, cap2 = runner(w), runner(wp)
        call, ref, tr = _read(fam, cap)
        if (call.batch, call.length) != tuple(w.shape):
            raise GatelensError(
                f"{type(fam.module).__name__} read {call.batch} sequences of {call.length} "
                f"steps from {len(w)} windows of {T} {unit}: the measurements follow each "
                "window's positions through it, so it must read them one step a position (a "
                "module reading time first, batch_first=False, handed (B, T, F) reads B as "
                "time: transpose its input in the model, or make it batch first)")
        tr2 = _read_perturbed(fam, cap2)  # what its measurements read
        base_tr = None if base is None else _read(base[1], base[2](w))[2]
        part = Chunk(setup, b0, w, cap, cap2, call, ref, tr, tr2, base_tr)
        clock["trace"] += time.perf_counter() - t0
        if progress and b0 == 0:  # what it will cost, from the first trace (estimate.py)
            bar.write(plan_line(windows=B, length=T, step=step, per_token=_per_token(tr),
                                module=fam.float64_bytes(), layers=fam.num_layers))
        if alone:
            bar.write(stage_line("trace", clock["trace"], started))
        for i, m in enumerate(active):
            bar.note(stage=m.stage)
            t0 = time.perf_counter()
            m.update(part)
            give_back()  # what the stage freed, before the next one's peak
            clock[m.stage] += time.perf_counter() - t0
            if alone and (i + 1 == len(active) or active[i + 1].stage != m.stage):
                bar.write(stage_line(m.stage, clock[m.stage], started))
        kept = kept or kept_for_page(tr, tr2)
        # a chunk's traces go before the next is read (24 Mamba layers: 1.2 GB a window)
        del part, call, ref, cap, cap2, tr, tr2, base_tr
        give_back()
        if progress and b0 == 0 and B > step:
            bar.write(time_line(first=time.perf_counter() - started, windows=B, step=step,
                                peak=peak_resident(), fewer=_fewer(active, clock, B)))
        bar.update(len(w))
        bar.milestone(", ".join(f"{k} {v:.1f}s" for k, v in clock.items() if v))
    bar.close()
    t0 = time.perf_counter()
    found: dict = {}
    info = dict(text or {"windows": B, "length": T, "source": "ids"})
    info.update(chars=B * T, chunks=-(-B // step))
    for m in active:
        part = m.result(found)
        info.update(part.pop("text", {}))
        found.update(part)
    info["memory_windows"] = setup.memory_windows
    a = Analysis(model={**(model or {**fam.describe(), "step": None}), "unit": unit},
                 text=info,
                 chars=list(chars), windows=ids, perturbed=perturbed,
                 perturb_pos=s.perturb_pos, **kept, **found, **(run or {}))
    clock["analyses"] += time.perf_counter() - t0
    return a


def _fewer(active: list, clock: dict, windows: int) -> dict[str, tuple[float, int]]:
    """The stages whose measurements all read fewer than ``windows`` windows: {stage: (its
    seconds so far, the most windows one of them reads)} (``estimate.time_line``)."""
    read: dict[str, int] = {}
    for m in active:
        read[m.stage] = max(read.get(m.stage, 0), m.windows_read(windows))
    return {stage: (clock[stage], n) for stage, n in read.items() if n < windows}


def _read(fam: Family, cap: Captured) -> tuple[Call, Reference, Trace]:
    """A captured call checked, its reference computed once, and its anchored trace."""
    call = fam.check(cap.inputs, cap.state)
    with torch.no_grad(), faithful_matmul(call.inputs.device):
        ref = fam.reference(call)
    return call, ref, read(fam, call, ref) if call.layout.get("packed") is None else \
        trace(fam.module, cap.inputs, cap.state, hooks=False)


def _read_perturbed(fam: Family, cap: Captured) -> Trace:
    """The perturbed run's trace, with only what its measurements read (``perturbed_part``);
    a family whose layers replay apart from one recorded forward (transformers' Mamba and
    Mamba-2) replays each layer as it is read, holding one (``LayerReplay``): the same
    values as the whole trace, bit for bit."""
    call = fam.check(cap.inputs, cap.state)
    if not streams(fam) or call.layout.get("packed") is not None:
        return perturbed_part(_read(fam, cap)[2])
    keep = perturbed_letters(Trace(fam.cell, fam.num_layers, fam.bidirectional, {}))
    return assemble(fam, call, replayed(fam, call, [n for n in fam.names()
                                                     if n.rsplit(".", 1)[-1] in keep]))
