"""``gatelens analyze --model DIR``: a local Hugging Face checkpoint (loaders/hf_dir.py)
measured through ``Lens`` on token windows of a text, written as ``analyze`` writes a run.

The text (``--text``, else the built-in corpus's validation split) is tokenised once by the
directory's tokenizer; the windows are its first WINDOWS consecutive LENGTH-token slices,
fed to the whole model as ids, and each recurrent module inside it (or those ``--modules``
picks) is measured (``Lens.measure``): one is written to OUT as a run's analysis is, several
each to OUT/<module path>/ beside OUT/index.html. The vocabulary handed to the measurements
is each id's decoded text. The figures are in positions of the model's input, here tokens:
``Lens`` takes the directory's tokenizer, so the report speaks of tokens and the
perturbation draws its replacement from the tokens that occur in the windows
(lens/tokens.py).
"""

from __future__ import annotations

import argparse
import os
from typing import TYPE_CHECKING

from gatelens.analysis.settings import DEFAULTS, AnalysisSettings
from gatelens.errors import GatelensError
from gatelens.loaders.hf_dir import HFModel, load_hf, token_windows
from gatelens.readout.select import Selection, as_flag, select_paths

if TYPE_CHECKING:
    from gatelens.analysis.measure import Analysis
    from gatelens.lens.lens import LensResult

def analyze_hf(model: HFModel | str | os.PathLike, *, text: str | os.PathLike | None = None,
               windows: int | str = DEFAULTS.windows, length: int = DEFAULTS.length,
               perturb_pos: int = DEFAULTS.perturb_pos, out: str | os.PathLike | None = None,
               seed: int = 0, chunk: int | None = None, progress: bool = False,
               exponents: int | str = DEFAULTS.exponents,
               fixed_points: bool = DEFAULTS.fixed_points,
               trust_remote_code: bool = False, layers: Selection = None,
               device: str | None = None) -> Analysis | LensResult:
    """Analyse a Hugging Face checkpoint (an :class:`HFModel`, or its directory) on the
    first token windows of a UTF-8 text file (None: the built-in corpus's validation split,
    ``model_text``). Each recurrent module ``layers`` picks (default: every one) is
    measured. One module: OUT/report.json, report.md, plots and report.html, as ``analyze``
    writes a run's, and its ``Analysis``; several: OUT/<module path>/ each and
    OUT/index.html, as ``Lens.analyze`` writes, and the ``LensResult``. OUT: ``out``, else
    DIR/analysis (as a run's is RUN/analysis). ``device``: as ``Lens`` takes it."""
    from gatelens.analysis.measure import check_perturb_pos
    from gatelens.io import check_out_dir
    from gatelens.lens.lens import Lens, LensResult
    from gatelens.report.write import write_analysis

    check_perturb_pos(perturb_pos, length, "tokens")
    hf = model if isinstance(model, HFModel) else load_hf(model,
                                                          trust_remote_code=trust_remote_code)
    dest = check_out_dir(hf.directory / "analysis" if out is None else out)
    raw, where = model_text(text)
    every = hf.encode(raw)  # (N,)
    ids = token_windows(every, windows, length, where=where)  # (B, T)
    # the tokenizer makes the unit tokens: the replacement drawn from the tokens that
    # occur, token classes, every report in tokens (lens/tokens.py)
    lens = Lens(hf.model, tokenizer=hf.tokenizer, device=device) if hf.tokenizer is not None \
        else Lens(hf.model, vocab=hf.tokens(), unit="tokens", device=device)
    paths = select_paths(list(lens.families), layers)
    _, vocab, _ = lens.windows(ids, windows, length)  # ids: their tokens' texts
    how = "every whole window" if windows == "all" else f"first {ids.shape[0]} windows"
    source = f"{where} ({len(every)} tokens; {how} of {length} tokens)"
    settings = AnalysisSettings.build(windows=windows, length=length, perturb_pos=perturb_pos,
                                      seed=seed, exponents=exponents, fixed_points=fixed_points)
    analyses = lens.measure_each(
        paths, ids, vocab, settings, chunk=chunk, progress=progress,
        model=lambda path: {**lens.describe(path), "checkpoint": str(hf.directory),
                            "model_type": hf.model_type, "notes": list(hf.notes)},
        text={"windows": int(ids.shape[0]), "length": length, "source": source})
    if len(analyses) == 1:
        return write_analysis(next(iter(analyses.values())), dest)
    return LensResult.written(analyses, dest)


def model_text(text: str | os.PathLike | None) -> tuple[str, str]:
    """The text a checkpoint is read on (``analyze --model``, ``patch --model``), and its
    name: the UTF-8 file ``text``, else the built-in corpus's validation split (the last
    10 % of the shakespeare corpus, what a run is analysed on by default)."""
    from gatelens.io import read_utf8
    from gatelens.training.corpus import load_corpus, split

    if text is not None:
        return read_utf8(text), str(text)
    corpus = load_corpus("shakespeare")
    return split(corpus.text)[1], f"the built-in corpus {corpus.name} (validation split)"


def analyze_hf_from_args(args: argparse.Namespace) -> Analysis | LensResult:
    """:func:`analyze_hf` with ``gatelens analyze``'s flags."""
    try:
        return analyze_hf(args.model, text=args.text, windows=args.windows, length=args.length,
                          perturb_pos=args.perturb_pos, out=args.out, progress=not args.quiet,
                          exponents=args.exponents, fixed_points=args.fixed_points,
                          trust_remote_code=args.trust_remote_code,
                          layers=getattr(args, "modules", None), device=args.device)
    except GatelensError as e:  # select_paths names the Python argument: here it is a flag
        raise as_flag(e, "--modules") from None
