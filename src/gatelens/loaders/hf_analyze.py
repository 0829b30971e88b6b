"""``gatelens analyze --model DIR``: a local Hugging Face checkpoint (loaders/hf_dir.py)
measured through ``Lens`` on token windows of a text, written as ``analyze`` writes a run.

The text is tokenised once by the directory's tokenizer; the windows are its first
WINDOWS consecutive LENGTH-token slices, fed to the whole model as ids, and the recurrent
module inside it is measured (``Lens.measure``). The vocabulary handed to the measurements
is each id's decoded text. The figures are in positions of the model's input, here tokens:
``Lens`` takes the directory's tokenizer, so the report speaks of tokens and the
perturbation draws its replacement from the tokens that occur in the windows
(lens/tokens.py).
"""

from __future__ import annotations

import argparse
import os
from pathlib import Path
from typing import TYPE_CHECKING

from gatelens.analysis.settings import DEFAULTS
from gatelens.errors import GatelensError
from gatelens.loaders.hf_dir import HFModel, load_hf, token_windows
from gatelens.readout.select import Selection, as_flag, select_paths

if TYPE_CHECKING:
    from gatelens.analysis.measure import Analysis
    from gatelens.lens.lens import Lens

def add_hf_arguments(parser: argparse.ArgumentParser) -> None:
    """``--model DIR`` and ``--trust-remote-code`` (``gatelens analyze``).

    >>> p = argparse.ArgumentParser(); add_hf_arguments(p)
    >>> a = p.parse_args(["--model", "ckpt"]); a.model, a.trust_remote_code
    ('ckpt', False)
    """
    g = parser.add_argument_group(
        "a Hugging Face model directory",
        "config.json, *.safetensors and tokenizer files (save_pretrained), opened offline")
    g.add_argument("--model", metavar="DIR",
                   help="a local Hugging Face checkpoint; --text is read as its tokens "
                        "(windows of LENGTH tokens); needs --text and --out")
    g.add_argument("--modules", metavar="LIST", type=layer_list, default=None,
                   help="the recurrent module to analyse, of a model with several: its "
                        "position among them (0, -1) or its module path or a shell pattern")
    g.add_argument("--trust-remote-code", action="store_true", dest="trust_remote_code",
                   help="let transformers run the directory's own Python code (auto_map): "
                        "only for a directory you trust (default: never)")


def layer_list(text: str) -> list[int | str]:
    """An argparse type for --modules: comma-separated positions or module paths/patterns.

    >>> layer_list("0,-1,model.layers.3.linear_attn")
    [0, -1, 'model.layers.3.linear_attn']
    """
    items = [t.strip() for t in text.split(",") if t.strip()]
    if not items:
        raise argparse.ArgumentTypeError(f"expected positions or module paths, got {text!r}")
    return [int(t) if t.lstrip("-").isdigit() else t for t in items]


def only_module(lens: Lens, where: str, layers: Selection = None) -> str:
    """The path of the one recurrent module ``lens`` opened, or the one ``layers`` picks
    (readout/select.py); a one-line error for several."""
    paths = select_paths(list(lens.families), layers)
    if len(paths) != 1:
        listed = ", ".join(repr(p) for p in paths[:8]) + (" ..." if len(paths) > 8 else "")
        raise GatelensError(f"{where}: {len(paths)} recurrent modules ({listed}); --model "
                            "analyses one: pick it with --modules (a position or its path), "
                            "or use gatelens.Lens(...).analyze(layers=...) for several")
    return paths[0]


def analyze_hf(model: HFModel | str | os.PathLike, *, text: str | os.PathLike,
               windows: int | str = DEFAULTS.windows, length: int = DEFAULTS.length,
               perturb_pos: int = DEFAULTS.perturb_pos, out: str | os.PathLike,
               seed: int = 0, chunk: int | None = None, progress: bool = False,
               exponents: int | str = DEFAULTS.exponents,
               fixed_points: bool = DEFAULTS.fixed_points,
               trust_remote_code: bool = False, layers: Selection = None) -> Analysis:
    """Analyse a Hugging Face checkpoint (an :class:`HFModel`, or its directory) on the
    first token windows of a UTF-8 text file; writes OUT/report.json, report.md, plots and
    report.html, as ``analyze`` does."""
    from gatelens.analysis.measure import check_perturb_pos
    from gatelens.io import read_utf8
    from gatelens.lens.lens import Lens
    from gatelens.report.write import write_analysis

    check_perturb_pos(perturb_pos, length, "tokens")
    hf = model if isinstance(model, HFModel) else load_hf(model,
                                                          trust_remote_code=trust_remote_code)
    every = hf.encode(read_utf8(text))  # (N,)
    ids = token_windows(every, windows, length, where=str(text))  # (B, T)
    # the tokenizer makes the unit tokens: the replacement drawn from the tokens that
    # occur, token classes, every report in tokens (lens/tokens.py)
    lens = Lens(hf.model, tokenizer=hf.tokenizer) if hf.tokenizer is not None else Lens(
        hf.model, vocab=hf.tokens(), unit="tokens")
    path = only_module(lens, str(hf.directory), layers)
    _, vocab, _ = lens.windows(ids, windows, length)  # ids: their tokens' texts
    how = "every whole window" if windows == "all" else f"first {ids.shape[0]} windows"
    source = f"{text} ({len(every)} tokens; {how} of {length} tokens)"
    info = {**lens.describe(path), "checkpoint": str(hf.directory),
            "model_type": hf.model_type, "notes": list(hf.notes)}
    a = lens.measure(path, ids, vocab, model=info, perturb_pos=perturb_pos, seed=seed,
                     text={"windows": int(ids.shape[0]), "length": length, "source": source},
                     chunk=chunk, progress=progress, exponents=exponents,
                     fixed_points=fixed_points)
    return write_analysis(a, Path(out))


def analyze_hf_from_args(args: argparse.Namespace) -> Analysis:
    """:func:`analyze_hf` with ``gatelens analyze``'s flags (``--model``, ``--text`` and
    ``--out`` required)."""
    if args.text is None or args.out is None:
        raise GatelensError(f"{args.model}: --model needs --text FILE (the text to read, as "
                            "its tokens) and --out DIR")
    try:
        return analyze_hf(args.model, text=args.text, windows=args.windows, length=args.length,
                          perturb_pos=args.perturb_pos, out=args.out, progress=not args.quiet,
                          exponents=args.exponents, fixed_points=args.fixed_points,
                          trust_remote_code=args.trust_remote_code,
                          layers=getattr(args, "modules", None))
    except GatelensError as e:  # select_paths names the Python argument: here it is a flag
        raise as_flag(e, "--modules") from None
