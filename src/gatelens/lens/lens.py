"""Lens: open every recurrent module inside any model and measure each one.

Each recurrent module is found by its ``named_modules()`` path ("" when the model IS the
module; its directory is then "model"). The WHOLE model runs on the windows, so a module
deep inside (a decoder behind its encoder) is perturbed through everything before it, and
a forward hook records what that module received: its input and initial state. The
measurements (``gatelens.analysis.measure.measure``) trace the module on exactly that, so each
analysis is of the module's own trajectory.

>>> import torch
>>> net = torch.nn.Sequential(torch.nn.Embedding(3, 4), torch.nn.GRU(4, 5, batch_first=True))
>>> result = Lens(net, vocab=list("ab ")).analyze("ab ba " * 20, windows=2, length=24,
...                                                perturb_pos=4)
>>> list(result.reports), result.reports["1"]["model"]["cell"]
(['1'], 'gru')
"""

from __future__ import annotations

import os
from collections.abc import Callable, Sequence
from dataclasses import replace
from typing import TYPE_CHECKING, Any

import torch
from torch import Tensor, nn

from gatelens.analysis.estimate import each_module
from gatelens.analysis.settings import AnalysisSettings
from gatelens.errors import GatelensError
from gatelens.families.base import Family
from gatelens.families.registry import family_of
from gatelens.families.torch_ops import as_computed
from gatelens.families.unopened import nothing_opened
from gatelens.lens.capture import capturer, names_a_file, rows
from gatelens.lens.device import on, placed
from gatelens.lens.logits import (
    output_logits,
)
from gatelens.lens.result import LensResult
from gatelens.lens.run import Run
from gatelens.lens.tokens import (
    Utf8Bytes,
    check_tokenizer,
    check_unit,
    encode_text,
    names_tokens,
    pieces,
    vocab_list,
    vocab_size,
)
from gatelens.readout.select import Selection, select_paths

if TYPE_CHECKING:
    from gatelens.analysis.measure import Analysis, Captured, Runner
    from gatelens.interventions.edits import Edit
    from gatelens.interventions.run import RunResult

__all__ = ["Lens", "LensResult", "output_logits"]  # LensResult: lens/result.py

HALF = (torch.float16, torch.bfloat16)


class Lens:
    """Every recurrent module of ``model``, ready to be measured on text or ids.

    ``model``: any nn.Module, or a training run's context (``gatelens.load_run(RUN)``, a
    ``Run``), which brings its model and its own vocabulary, step-0 baseline, keep gate's
    starting value, seed and provenance (``run=`` gives the same context beside a model).
    ``vocab``: the characters in index order (needed for text input); an int V names
    the ids ``<0>`` .. ``<V-1>``; None with ids input uses V = max(ids) + 1 (at least 2).
    ``tokenizer``, instead of ``vocab``: a Hugging Face tokenizer, a ``tokenizers``
    Tokenizer or any object with ``encode(text)`` and ``decode(ids)``; a text is then
    tokenised once and its windows are token windows (``lens/tokens.py``). ``unit``: what
    the model reads, "characters" (a vocabulary), "tokens" (the default with a tokenizer)
    or "bytes"; every figure and page speaks of it, and a model read in tokens or bytes has
    its replacement drawn from the tokens occurring in the windows. A byte model with no
    vocabulary list reads a text as its UTF-8 bytes (``tokens.Utf8Bytes``).
    ``device`` ("cpu", "cuda", "auto"; default: where the model is): the model is moved
    there, in place, and so is every window of ids (``lens/device.py``).
    ``encode`` maps ids (B, T) int64 to what ``model(...)`` takes (default: the ids). A
    model with no module gatelens opens raises GatelensError naming its class; modules
    nested inside an opened one are part of it."""

    def __init__(self, model: nn.Module | Run, vocab: Sequence[str] | int | None = None,
                 encode: Callable[[Tensor], Any] | None = None, *,
                 tokenizer: Any = None, unit: str | None = None,
                 run: Run | None = None, device: str | torch.device | None = None) -> None:
        if isinstance(model, Run):
            model, run = model.model, model
        if run is not None and not isinstance(run, Run):
            raise GatelensError(f"Lens(run=...) takes gatelens.load_run(RUN); got "
                                f"{type(run).__name__}")
        if not isinstance(model, nn.Module):
            raise GatelensError(f"Lens takes an nn.Module; got {type(model).__name__}")
        meta = next((n for n, p in model.named_parameters() if p.is_meta), None)
        if meta is not None:
            raise GatelensError(f"{type(model).__name__}: parameter {meta!r} is on the meta "
                                "device (no values); load the weights first")
        self.model, self.run_info = model, run
        self.device = placed(model, device)  # the model moved there, and every ids
        if tokenizer is not None:
            if vocab is not None:
                raise GatelensError("Lens takes vocab= or tokenizer=, not both")
            check_tokenizer(tokenizer)
        self.tokenizer = tokenizer
        self.unit = check_unit(unit or ("tokens" if tokenizer is not None or names_tokens(vocab)
                                        else "characters"))
        if tokenizer is None and self.unit == "bytes" and (
                vocab is None or isinstance(vocab, int) and vocab >= 256) and (
                rows(model) or 256) >= 256:
            self.tokenizer = Utf8Bytes()  # a text is read as its UTF-8 bytes, ids 0..255
        self.vocab = self.run_info.vocab if vocab is None and self.run_info is not None else vocab
        if self.vocab is not None and not isinstance(self.vocab, int):
            self.vocab = vocab_list(self.vocab, self.unit)
        self.encode = encode
        self.families: dict[str, Family] = {}
        for path, m in model.named_modules():
            inside = any(path.startswith(p + ".") or p == "" for p in self.families)
            fam = None if inside else family_of(m)
            if fam is not None:
                self.families[path] = fam
        self.modules = {path: fam.module for path, fam in self.families.items()}
        if not self.families:
            raise GatelensError(nothing_opened(model))
        self._check_vocab()

    def run(self, ids: Tensor, edits: Sequence[Edit] = ()) -> RunResult:
        """The whole model on ids (B, T) int64 with ``edits`` inside its recurrent modules
        (``gatelens.Set``, ``Add``, ``Scale``, ``Zero``, ``Mean``, ``Patch``;
        docs/interventions.md): ``res.output`` is what the model's forward returned,
        ``res.trace`` every module's signals on the edited run, keyed like ``open_cells``."""
        from gatelens.interventions.run import run_edits

        return run_edits(self, on(ids, self.device), edits)

    def _check_vocab(self) -> None:
        """The vocabulary against the model's first lookup: an embedding's rows, or a
        gatelens run's / weights file's vocabulary size."""
        if self.tokenizer is not None and self.encode is None:
            n, size = vocab_size(self.tokenizer), rows(self.model)
            if n is not None and size is not None and n > size:
                raise GatelensError(f"the tokenizer has {n} ids but {type(self.model).__name__} "
                                    f"reads {size} (its embedding's rows)")
        if self.vocab is None or isinstance(self.vocab, int) or self.encode is not None:
            return
        size = rows(self.model)
        if size is not None and len(self.vocab) > size:
            raise GatelensError(f"vocab has {len(self.vocab)} characters but "
                                f"{type(self.model).__name__} reads {size} (its embedding's "
                                "rows): ids past them would not exist")

    def _chars(self, ids: Tensor) -> list[str]:
        if self.tokenizer is not None:
            size = vocab_size(self.tokenizer) or 0
            return pieces(self.tokenizer, torch.unique(ids).tolist(),
                          max(size, int(ids.max()) + 1, 2))
        if isinstance(self.vocab, int):
            return [f"<{i}>" for i in range(self.vocab)]
        if self.vocab is not None:
            return list(self.vocab)
        return [f"<{i}>" for i in range(max(int(ids.max()) + 1, 2))]

    def windows(self, text_or_ids: str | os.PathLike | Tensor, windows: int | str,
                length: int) -> tuple[Tensor, list[str], str]:
        """(ids (B, T) int64, chars, source). A Path, or a str that names an existing file,
        is read as a UTF-8 text file (as ``--text``); any other str is the text itself.
        Text becomes its first ``windows`` consecutive ``length``-character slices
        (``"all"``: every whole one); ids (B, T) are used as they are."""
        from gatelens.analysis.text import Vocab, analysis_windows, read_text_file

        if isinstance(text_or_ids, Tensor):
            ids = text_or_ids
            if ids.ndim != 2 or ids.dtype != torch.long or 0 in ids.shape:
                raise GatelensError(f"ids must be a non-empty (B, T) int64 tensor; got "
                                    f"{ids.dtype} {tuple(ids.shape)}")
            chars = self._chars(ids)
            if int(ids.min()) < 0 or int(ids.max()) >= len(chars):
                raise GatelensError(f"ids range {int(ids.min())}..{int(ids.max())} is outside "
                                    f"the vocabulary of {len(chars)}")
            return ids, chars, "ids"
        if not isinstance(text_or_ids, (str, os.PathLike)):
            raise GatelensError(f"Lens.analyze takes a text, a file path or ids (B, T); got "
                                f"{type(text_or_ids).__name__}")
        where = "text"
        if isinstance(text_or_ids, os.PathLike) or names_a_file(text_or_ids):
            where, text_or_ids = str(text_or_ids), read_text_file(text_or_ids)
        if self.tokenizer is not None:
            return self._token_windows(text_or_ids, windows, length, where)
        if self.unit == "bytes" and not isinstance(self.vocab, list):
            n = f"Lens(vocab={self.vocab})" if isinstance(self.vocab, int) else \
                f"{type(self.model).__name__}'s embedding ({rows(self.model)} rows)"
            raise GatelensError(f"a byte model reads a text as its UTF-8 bytes, ids 0..255; "
                                f"{n} holds fewer")
        if self.vocab is None or isinstance(self.vocab, int):
            raise GatelensError("text input needs vocab: the model's characters in index order")
        vocab = Vocab(list(self.vocab))
        ids = analysis_windows(vocab, windows, length, text=text_or_ids, where=where)
        how = "every whole window" if windows == "all" else f"first {windows} windows"
        source = f"{where} ({len(text_or_ids)} characters; {how} of {length})"
        return ids, vocab.chars, source

    def _token_windows(self, text: str, windows: int | str, length: int,
                       where: str) -> tuple[Tensor, list[str], str]:
        """A text tokenised once, as a whole; its first ``windows`` consecutive
        ``length``-token slices ("all": every whole one)."""
        ids = torch.tensor(encode_text(self.tokenizer, text), dtype=torch.long)  # (N,)
        n = len(ids) // length if windows == "all" else windows
        u = "bytes" if isinstance(self.tokenizer, Utf8Bytes) else "tokens"
        if n < 1 or len(ids) < n * length:
            raise GatelensError(f"{where}: {len(ids)} {u}, too short for "
                                f"{windows} windows of {length} {u}")
        ids = ids[: n * length].view(n, length)  # (B, T)
        how = "every whole window" if windows == "all" else f"first {windows} windows"
        read = "as UTF-8 bytes" if u == "bytes" else "tokenised"
        return ids, self._chars(ids), (f"{where} ({len(text)} characters, {read}; {how} "
                                       f"of {length} {u})")

    def runner(self, path: str) -> Runner:
        """ids (B, T) -> what the module at ``path`` received when the whole model read them.

        The model runs under torch.no_grad() in eval mode (every module's training flag
        is restored after). A packed input is unpacked (``unpack_equal``). A cell stepped
        in a loop, or a module called one step at a time, is its calls stitched into one
        trajectory (``one_trajectory``); a module called more than once otherwise raises
        GatelensError.
        """
        return self._runner(self.model, self.families[path], path)

    def capture(self, ids: Tensor, paths: Sequence[str] | None = None) -> dict[str, Captured]:
        """What each module at ``paths`` (default: every one) received when the whole model
        read ``ids`` (B, T) once, by path: ``runner(path)(ids)`` for all of them from one
        forward (the logits are that forward's, shared).

        >>> import torch
        >>> net = torch.nn.LSTM(3, 4, batch_first=True)  # one module: the model itself
        >>> seen = Lens(net, encode=lambda i: torch.nn.functional.one_hot(i, 3).float(),
        ...             vocab=3).capture(torch.tensor([[0, 1, 2, 1]]))
        >>> {path: tuple(cap.inputs.shape) for path, cap in seen.items()}
        {'': (1, 4, 3)}
        """
        paths = list(self.families) if paths is None else list(paths)
        unknown = [path for path in paths if path not in self.families]
        if unknown:
            raise GatelensError(f"Lens.capture: {unknown[0]!r} is not a recurrent module of "
                                f"this model (its modules: {', '.join(self.families)})")
        fams = {path: self.families[path] for path in paths}
        return capturer(self, self.model, fams)(on(ids, self.device))

    def _runner(self, model: nn.Module, fam: Family, path: str) -> Runner:
        capture = capturer(self, model, {path: fam})

        def run(ids: Tensor) -> Captured:
            return capture(ids)[path]

        for attr in ("logit_notes", "logits_at", "pad_to"):  # read by Lens.measure, context
            setattr(run, attr, getattr(capture, attr))
        return run

    def _vocab_size(self) -> int | None:
        """V the logits must have: the vocabulary's size (None: not known, any V)."""
        if isinstance(self.vocab, int):
            return self.vocab
        return None if self.vocab is None else len(self.vocab)

    def _forward(self, model: nn.Module, ids: Tensor) -> Any:
        """``model`` on ids (or ``encode(ids)``); a model that cannot read ids is one line."""
        ids = on(ids, self.device)
        if self.encode is not None:
            return model(self.encode(ids))
        # an HF model reads whole windows without its cache: transformers 5.23's RWKV, its
        # cache on (the default in eval), broadcasts a one-token batch (B, 1) to (B, B, V)
        kwargs = {"use_cache": False} if hasattr(getattr(model, "config", 0), "use_cache") else {}
        try:
            return model(ids, **kwargs)
        except (TypeError, RuntimeError, IndexError, AttributeError, ValueError) as e:
            first = " ".join(str(e).split())[:160]
            hint = ("if its forward takes something else, pass Lens(model, encode=...) "
                    "mapping ids to what it takes")
            half = next((p.dtype for p in model.parameters() if p.dtype in HALF), None)
            if half is not None and "dtype" in first:  # its own code computes some in float32
                hint = (f"its weights are {str(half).removeprefix('torch.')} and its own "
                        "forward mixes them with float32 here; load it in float32 "
                        "(model.float())")
            raise GatelensError(f"{type(model).__name__}(ids) failed on ids (B, T) int64 "
                                f"({type(e).__name__}: {first}); {hint}") from None

    def describe(self, path: str) -> dict:
        """report.json's "model" block for the module at ``path``."""
        info = {**self.families[path].describe(), "step": None, "path": path,
                "class": type(self.model).__name__, "unit": self.unit}
        if self.run_info is not None:
            info.update(self.run_info.model_block())
        return info

    def _baseline(self, path: str) -> tuple[int, nn.Module, Runner] | None:
        """(step 0, its module, its runner) of a run's untrained model, else None."""
        base = None if self.run_info is None else self.run_info.baseline()
        if base is None:
            return None
        lens = Lens(base.model, self.vocab, self.encode, unit=self.unit, device=self.device)
        fam = lens.families[path]
        return base.step, fam.module, lens._runner(base.model, fam, path)

    def measure(self, path: str, ids: Tensor, chars: list[str],
                settings: AnalysisSettings | None = None, *, text: dict | None = None,
                model: dict | None = None, chunk: int | None = None, progress: bool = False,
                timings: dict | None = None, shared: dict | None = None,
                **options: Any) -> Analysis:
        """Every measurement of the module at ``path`` on windows ``ids`` (B, T): the one
        path ``Lens.analyze``, ``gatelens analyze RUN`` and ``--weights`` take.
        ``settings`` (or its fields as keyword arguments) as ``measure`` takes them; the
        seed defaults to the run's own seed for a run, else 0. ``model``: report.json's
        model block (default: ``describe(path)``). ``shared``: one dict for every module
        measured on the same ``ids`` and settings; the whole model's figures (the context
        used) are measured once and read from it."""
        from gatelens.analysis.measure import measure

        s = AnalysisSettings.build(settings, **options)
        s = replace(s, seed=s.seed_or(0 if self.run_info is None else self.run_info.seed))
        run, ids = self.runner(path), on(ids, self.device)
        run.shared = shared  # type: ignore[attr-defined]  # analysis/measurements.py
        with as_computed(self.modules[path]):  # parametrized weights read, never changed
            a = measure(self.modules[path], run, ids, chars, s,
                        init_value=0.5 if self.run_info is None else self.run_info.init_keep,
                        baseline=self._baseline(path),
                        model=self.describe(path) if model is None else model,
                        text=text or {"windows": int(ids.shape[0]),
                                      "length": int(ids.shape[1]), "source": "ids"},
                        run=None if self.run_info is None else self.run_info.facts(),
                        unit=self.unit, chunk=chunk, progress=progress, timings=timings)
        notes = getattr(run, "logit_notes", None)  # how the logits were read, or why not
        if notes:
            a.reach_note = " ".join(notes)
        return a

    def analyze(self, text_or_ids: str | os.PathLike | Tensor,
                settings: AnalysisSettings | None = None, *,
                out: str | os.PathLike | None = None, chunk: int | None = None,
                progress: bool = False, layers: Selection = None,
                **options: Any) -> LensResult:
        """Measure every recurrent module; with ``out``, write OUT/<path or "model">/report.*
        and OUT/index.html (each analysis appears whole). ``settings`` (an
        ``AnalysisSettings``, or its fields as keyword arguments: ``windows``, ``length``,
        ``perturb_pos``, ``exponents``, ``fixed_points``, ``memory_windows``, ``seed``)
        says what is measured; ``seed`` draws the replacement characters (default: the
        run's seed for a run's model, else 0). ``layers`` measures only some of the
        recurrent modules: positions among ``families`` (0, -1), module paths or shell
        patterns (readout/select.py)."""
        s = AnalysisSettings.build(settings, **options)
        ids, chars, source = self.windows(text_or_ids, s.windows, s.length)  # (B, T)
        text = {"windows": int(ids.shape[0]), "length": int(ids.shape[1]), "source": source}
        analyses = self.measure_each(select_paths(list(self.families), layers), ids, chars, s,
                                     text=text, chunk=chunk, progress=progress)
        return LensResult.written(analyses, out)

    def measure_each(self, paths: Sequence[str], ids: Tensor, chars: list[str],
                     settings: AnalysisSettings, *, text: dict | None = None,
                     model: Callable[[str], dict] | None = None, chunk: int | None = None,
                     progress: bool = False) -> dict[str, Analysis]:
        """``measure`` of each module at ``paths`` on the same windows, one after another (with
        ``progress``, each named and timed: ``estimate.each_module``); the whole model's
        figures (the context used) are measured for the first and handed to the others.
        ``model``: path -> report.json's model block (default: ``describe(path)``)."""
        shared: dict = {}
        return {path: self.measure(path, ids, chars, settings=settings, text=text, chunk=chunk,
                                   progress=progress, shared=shared,
                                   model=None if model is None else model(path))
                for path in each_module(paths, progress)}
