"""Lens: open every nn.LSTM / nn.GRU / nn.RNN inside any model and measure each one.

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
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
from torch import Tensor, nn
from torch.nn.utils.rnn import PackedSequence, pad_packed_sequence

from gatelens.errors import GatelensError
from gatelens.families.base import Family
from gatelens.families.registry import family_of, supported
from gatelens.report.index import dirname, index_page

if TYPE_CHECKING:
    from gatelens.analysis.measure import Analysis, Captured, Runner

__all__ = ["Lens", "LensResult", "unpack_equal"]


def unpack_equal(packed: PackedSequence, length: int, batch_first: bool = True) -> Tensor:
    """A packed batch whose sequences all have ``length`` steps, as a padded tensor in the
    caller's order ((B, T, F) batch first, else (T, B, F)).

    A recurrent module fed an equal-length packed batch computes the same as fed this
    tensor (no step is padding), so the measurements, defined on equal-length windows,
    apply unchanged. Unequal lengths raise GatelensError.

    >>> from torch.nn.utils.rnn import pack_padded_sequence
    >>> x = torch.randn(3, 5, 2)
    >>> p = pack_padded_sequence(x, torch.tensor([5, 5, 5]), batch_first=True,
    ...                          enforce_sorted=False)
    >>> torch.equal(unpack_equal(p, 5), x)
    True
    """
    # pad_packed_sequence restores the caller's order through packed.unsorted_indices
    x, lengths = pad_packed_sequence(packed, batch_first=True)  # (B, T, F), caller's order
    if bool((lengths != length).any()):
        raise GatelensError(
            f"a packed batch with lengths {int(lengths.min())}..{int(lengths.max())} cannot be "
            f"measured: the measurements need every sequence {length} steps long")
    return x if batch_first else x.transpose(0, 1)


def _output_tensor(output: Any) -> Tensor | None:
    """The model's output if it is a Tensor, or the first element of a tuple output."""
    if isinstance(output, Tensor):
        return output
    if isinstance(output, (tuple, list)) and output and isinstance(output[0], Tensor):
        return output[0]
    return None


@dataclass
class LensResult:
    """What ``Lens.analyze`` measured: one ``Analysis`` per recurrent module path."""

    analyses: dict[str, Analysis]
    out: Path | None = None
    index_html: str = ""
    notes: dict[str, str] = field(default_factory=dict)  # path -> why no output reach

    @property
    def reports(self) -> dict[str, dict]:
        """{module path: report.json dict}."""
        return {path: a.report for path, a in self.analyses.items()}

    def _repr_html_(self) -> str:
        """Jupyter shows the index page (isolated in an iframe, as report.html is)."""
        from gatelens.report.html import HtmlReport

        return HtmlReport(self.index_html, height=320)._repr_html_()


class Lens:
    """Every recurrent module of ``model``, ready to be measured on text or ids.

    ``vocab``: the characters in index order (needed for text input); an int V names
    the ids ``<0>`` .. ``<V-1>``; None with ids input uses V = max(ids) + 1 (at least 2).
    ``encode`` maps ids (B, T) int64 to what ``model(...)`` takes (default: the ids).
    A model without nn.LSTM / nn.GRU / nn.RNN raises GatelensError naming its class.
    """

    def __init__(self, model: nn.Module, vocab: Sequence[str] | int | None = None,
                 encode: Callable[[Tensor], Any] | None = None) -> None:
        self.model = model
        self.vocab = vocab
        self.encode = encode
        self.families: dict[str, Family] = {}
        for path, m in model.named_modules():
            inside = any(path.startswith(p + ".") or p == "" for p in self.families)
            fam = None if inside else family_of(m)
            if fam is not None:
                self.families[path] = fam
        self.modules = {path: fam.module for path, fam in self.families.items()}
        if not self.families:
            raise GatelensError(f"{type(model).__name__} has no recurrent module for gatelens "
                                f"to open (it opens {supported()})")

    def _chars(self, ids: Tensor) -> list[str]:
        if isinstance(self.vocab, int):
            return [f"<{i}>" for i in range(self.vocab)]
        if self.vocab is not None:
            return list(self.vocab)
        return [f"<{i}>" for i in range(max(int(ids.max()) + 1, 2))]

    def windows(self, text_or_ids: str | os.PathLike | Tensor, windows: int,
                length: int) -> tuple[Tensor, list[str], str]:
        """(ids (B, T) int64, chars, source): text becomes its first ``windows``
        consecutive ``length``-character slices; ids (B, T) are used as they are."""
        from gatelens.training.corpus import Vocab, analysis_windows, read_text_file

        if isinstance(text_or_ids, Tensor):
            ids = text_or_ids
            if ids.ndim != 2 or ids.dtype != torch.long:
                raise GatelensError(f"ids must be a (B, T) int64 tensor; got {ids.dtype} "
                                    f"{tuple(ids.shape)}")
            chars = self._chars(ids)
            if int(ids.min()) < 0 or int(ids.max()) >= len(chars):
                raise GatelensError(f"ids range {int(ids.min())}..{int(ids.max())} is outside "
                                    f"the vocabulary of {len(chars)}")
            return ids, chars, "ids"
        where = "text"
        if isinstance(text_or_ids, os.PathLike):
            where, text_or_ids = str(text_or_ids), read_text_file(text_or_ids)
        if self.vocab is None or isinstance(self.vocab, int):
            raise GatelensError("text input needs vocab: the model's characters in index order")
        vocab = Vocab(list(self.vocab))
        ids = analysis_windows(vocab, windows, length, text=text_or_ids, where=where)
        source = f"{where} ({len(text_or_ids)} characters; first {windows} windows of {length})"
        return ids, vocab.chars, source

    def runner(self, path: str) -> Runner:
        """ids (B, T) -> what the module at ``path`` received when the whole model read them.

        The model runs under torch.no_grad() in eval mode (every module's training flag
        is restored after). A packed input is unpacked (``unpack_equal``); a module
        called more than once in one forward raises GatelensError.
        """
        from gatelens.analysis.measure import Captured

        fam = self.families[path]
        module = fam.module
        name = path or type(self.model).__name__

        def run(ids: Tensor) -> Captured:
            calls: list[tuple[Any, Any]] = []

            def hook(mod: nn.Module, args: tuple, kwargs: dict, output: Any) -> None:
                calls.append(fam.split_call(args, kwargs))

            handle = module.register_forward_hook(hook, with_kwargs=True)
            flags = {m: m.training for m in self.model.modules()}
            try:
                self.model.eval()
                with torch.no_grad():
                    out = self.model(ids if self.encode is None else self.encode(ids))
            finally:
                handle.remove()
                for m, flag in flags.items():
                    m.training = flag
            if len(calls) != 1:
                raise GatelensError(
                    f"{name} ran {len(calls)} times in one forward; Lens measures modules "
                    "that read the whole sequence in one call")
            inputs, hx = calls[0]
            if isinstance(inputs, PackedSequence):
                inputs = unpack_equal(inputs, ids.shape[1], module.batch_first)
            return Captured(inputs, hx, _output_tensor(out))

        return run

    def describe(self, path: str) -> dict:
        """report.json's "model" block for the module at ``path``."""
        return {**self.families[path].describe(), "step": None, "path": path,
                "class": type(self.model).__name__}

    def analyze(self, text_or_ids: str | os.PathLike | Tensor, *, windows: int = 32,
                length: int = 128, perturb_pos: int = 32, out: str | os.PathLike | None = None,
                seed: int = 0) -> LensResult:
        """Measure every recurrent module; with ``out``, write OUT/<path or "model">/report.*
        and OUT/index.html (each file atomically)."""
        from gatelens.analysis.measure import measure
        from gatelens.report.write import write_analysis

        ids, chars, source = self.windows(text_or_ids, windows, length)  # (B, T)
        text = {"windows": int(ids.shape[0]), "length": int(ids.shape[1]), "source": source}
        analyses = {}
        for path, module in self.modules.items():
            analyses[path] = measure(module, self.runner(path), ids, chars,
                                     perturb_pos=perturb_pos, seed=seed, baseline=None,
                                     model=self.describe(path), text=text)
        notes = {p: a.reach_note for p, a in analyses.items() if a.reach_note}
        result = LensResult(analyses, None if out is None else Path(out), notes=notes)
        if result.out is not None:
            for path, a in analyses.items():
                write_analysis(a, result.out / dirname(path))
        result.index_html = index_page(result)
        if result.out is not None:
            from gatelens.io import atomic_write_text

            atomic_write_text(result.out / "index.html", result.index_html)
        return result
