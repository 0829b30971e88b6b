"""``gatelens analyze``: measure a run (``RUN``), weights gatelens did not train
(``--weights FILE``) or a local Hugging Face checkpoint (``--model DIR``), and write
report.json, report.md, plots and report.html (docs/report.md, docs/opening-models.md).
One source of a model a call; a flag of another source is refused in one line.
"""

from __future__ import annotations

import argparse
import sys
from typing import TYPE_CHECKING

from gatelens.analysis.settings import DEFAULTS, AnalysisSettings
from gatelens.errors import (
    MODEL_FLAGS,
    RUN_FLAGS,
    CheckFailed,
    GatelensError,
    exponents_count,
    positive_int,
    refuse_other_sources,
    windows_count,
)
from gatelens.lens.device import DEVICES

if TYPE_CHECKING:
    from gatelens.lens.lens import LensResult

__all__ = ["add_analyze", "add_analyze_arguments", "cmd_analyze"]


def add_analyze(sub) -> None:
    """The ``analyze`` subcommand."""
    p = sub.add_parser("analyze", help="measure a run (or weights gatelens did not train): "
                       "report.json, report.md, plots, report.html")
    add_analyze_arguments(p)


def add_analyze_arguments(p: argparse.ArgumentParser) -> None:
    """The flags of ``gatelens analyze``: a run directory, or --weights/--vocab/--text."""
    from gatelens.lens.foreign import add_foreign_arguments
    from gatelens.loaders.hf_dir import add_model_dir_arguments

    p.add_argument("run", nargs="?", help="run directory (from gatelens train); or give "
                   "--weights, --vocab and --text for a model gatelens did not train")
    p.add_argument("--checkpoint", default=None,
                   help="best (default), final, or a step number")
    p.add_argument("--text", default=None, metavar="FILE",
                   help="analyse the first WINDOWS x LENGTH characters of FILE (tokens with "
                        "--model; default: windows evenly spaced over the validation split; "
                        "with --model, the built-in corpus's)")
    p.add_argument("--windows", type=windows_count, default=DEFAULTS.windows,
                   help="B, windows (default 32); all: every whole window of the validation "
                        "split (or of --text), in chunks with a progress bar")
    p.add_argument("--length", type=positive_int, default=DEFAULTS.length,
                   help="T, characters per window (tokens with --model; default 128)")
    p.add_argument("--perturb-pos", type=int, default=DEFAULTS.perturb_pos, dest="perturb_pos",
                   help="position p of the changed character (token with --model; default 32)")
    p.add_argument("--exponents", type=exponents_count, default=DEFAULTS.exponents,
                   help="Lyapunov exponents: auto (default: 64, capped above 4,096 state "
                        "dimensions by the cost rule), the N largest, all, or 0 for none")
    p.add_argument("--fixed-points", action="store_true", dest="fixed_points",
                   help="also find the fixed points under held inputs (slow)")
    p.add_argument("--out", default=None, metavar="DIR",
                   help="output directory (default RUN/analysis; DIR/analysis with --model)")
    p.add_argument("--device", choices=DEVICES, default=None,
                   help="where the model and the measurements run: cpu (default), cuda, or "
                        "auto (cuda where PyTorch sees a device)")
    p.add_argument("--quiet", action="store_true", help="no progress messages")
    add_foreign_arguments(p)
    add_model_dir_arguments(
        p, "a local Hugging Face checkpoint; --text is read as its tokens (windows of LENGTH "
        "tokens; default: the built-in corpus's validation split); --out defaults to "
        "DIR/analysis",
        "the recurrent modules to analyse (default: every one): positions among them (0, -1), "
        "module paths or shell patterns, comma-separated (--layers LIST says the same)")


def cmd_analyze(args: argparse.Namespace) -> int:
    """``gatelens analyze``: a run directory, --weights FILE or --model DIR."""
    from pathlib import Path

    from gatelens.io import check_out_dir
    from gatelens.lens.analyze import analyze, analyze_foreign

    if sum(x is not None for x in (args.run, args.weights, args.model)) != 1:
        raise GatelensError("analyze: give a run directory, or --weights FILE (with --vocab "
                            "and --text) or --model DIR for a model gatelens did not train; "
                            "one of them")
    _check_source_flags(args)
    if args.out is not None:  # before the work, not after it
        check_out_dir(args.out)
    elif args.run is not None and Path(args.run).is_dir():
        check_out_dir(Path(args.run) / "analysis")
    settings = AnalysisSettings.build(
        windows=args.windows, length=args.length, perturb_pos=args.perturb_pos,
        exponents=args.exponents, fixed_points=args.fixed_points)
    if args.model is not None:
        from gatelens.loaders.hf_analyze import analyze_hf_from_args

        a = analyze_hf_from_args(args)
        if not hasattr(a, "verification"):  # several modules: a LensResult
            return _several(a)
    elif args.run is not None:
        a = analyze(args.run, settings, checkpoint=args.checkpoint or "best", text=args.text,
                    out=args.out, progress=not args.quiet, device=args.device)
    else:
        from gatelens.lens.foreign import foreign_from_args

        if args.text is None or args.out is None:
            raise GatelensError(f"{args.weights}: a model gatelens did not train needs --text "
                                "FILE (the text to read) and --out DIR")
        a = analyze_foreign(foreign_from_args(args), settings, text=args.text, out=args.out,
                            progress=not args.quiet, device=args.device)
    print(a.out / "report.json")
    print(a.out / "report.md")
    v = a.verification
    print(f"verification: {v.explain()}", file=sys.stderr)
    if not v.passed:  # the report is still written
        raise CheckFailed(f"verification: one-step error {v.max_abs_diff_h:.3g} > {v.tol:g}")
    return 0


def _several(result: LensResult) -> int:
    """``analyze --model``'s output for several recurrent modules: the index page, each
    module's report.json and its verification; exit 1 when any failed (all are written)."""
    print(result.out / "index.html")
    failed = []
    for path, a in result.analyses.items():
        print(a.out / "report.json")
        print(f"{path}: verification: {a.verification.explain()}", file=sys.stderr)
        failed += [] if a.verification.passed else [path]
    if failed:
        raise CheckFailed(f"verification failed in {', '.join(failed)}")
    return 0


#: the flags of ``gatelens analyze`` that belong to one source of a model (the attribute and
#: the flag), so that one given with another source is refused instead of left unread
SOURCE_FLAGS = {
    "run": RUN_FLAGS,
    "weights": tuple((a, "--" + a.replace("_", "-")) for a in (
        "vocab", "cell", "prefix", "hidden", "embed_tensor", "head", "nonlinearity",
        "recurrent_activation")),
    "model": MODEL_FLAGS,
}


def _check_source_flags(args: argparse.Namespace) -> None:
    """One line for a flag of another source than the one given (``--checkpoint`` with
    ``--model DIR``, ``--hidden`` with a run directory): it would be left unread."""
    given = "run" if args.run is not None else "weights" if args.weights is not None else "model"
    layers = getattr(args, "layers", None)  # a count with --weights, a pick with --model
    if layers is not None and given == "run":
        raise GatelensError("analyze: --layers applies to --weights FILE (how many) or --model "
                            "DIR (which), not to a run directory; leave it out")
    if layers is not None and given == "model":
        if args.modules is not None:
            raise GatelensError("analyze: --layers and --modules say the same; give one")
        args.modules, args.layers = ([layers] if isinstance(layers, int) else layers), None
    refuse_other_sources("analyze", args, given, SOURCE_FLAGS)
