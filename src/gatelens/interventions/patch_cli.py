"""``gatelens patch RUN`` (or ``--model DIR``): activation patching of a run's model, or of
a local Hugging Face checkpoint read in tokens (docs/interventions.md).

Clean and corrupted inputs are two texts of the same length (``--clean``, ``--corrupt``;
with ``--model``, of the same number of tokens), or analysis windows (``--windows``,
``--length``; a run's validation split or ``--text``; with ``--model``, ``--text`` or the
built-in corpus's validation split) with the character (token) at ``--perturb-pos``
replaced in each, drawn as ``gatelens analyze`` draws it (a checkpoint's from the tokens
that occur in the windows). Writes OUT/patch.json, patch.png and patch.md (OUT: --out,
default RUN/patch or DIR/patch).
"""

from __future__ import annotations

import sys

from gatelens.errors import (
    GatelensError,
    positive_int,
    run_or_model,
    windows_count,
)
from gatelens.lens.device import DEVICES

__all__ = ["add_patch", "cmd_patch"]

METRICS = ("kl", "loss", "logit-diff")


def add_patch(sub) -> None:
    """The ``patch`` subcommand's flags."""
    from gatelens.analysis.settings import DEFAULTS
    from gatelens.loaders.hf_dir import add_model_dir_arguments

    p = sub.add_parser("patch", help="activation patching: which state at which position "
                       "carries the difference between a clean and a corrupted input")
    p.add_argument("run", nargs="?", help="run directory (from gatelens train); or --model DIR")
    add_model_dir_arguments(p, "a local Hugging Face checkpoint, read in its tokens "
                            "(--length, --perturb-pos and --positions count tokens)")
    p.add_argument("--checkpoint", default=None, help="best (default), final or a step")
    p.add_argument("--clean", metavar="TEXT", help="the clean text (with --corrupt, of the "
                   "same length); default: the run's windows")
    p.add_argument("--corrupt", metavar="TEXT", help="the corrupted text")
    p.add_argument("--text", metavar="FILE", help="without --clean: windows of FILE instead "
                   "of the run's validation split")
    p.add_argument("--windows", type=windows_count, default=8,
                   help="without --clean: B windows (default 8)")
    p.add_argument("--length", type=positive_int, default=DEFAULTS.length,
                   help=f"without --clean: characters per window (default {DEFAULTS.length})")
    p.add_argument("--perturb-pos", type=int, default=DEFAULTS.perturb_pos, dest="perturb_pos",
                   help="without --clean: the position whose character is replaced "
                        f"(default {DEFAULTS.perturb_pos})")
    p.add_argument("--names", metavar="KEYS", help="comma-separated trace keys to sweep "
                   "(rnn.layer0.c,rnn.layer0.h; k1+k2 patches two together); default: every "
                   "layer's carried state and h")
    p.add_argument("--positions", metavar="LIST", help="comma-separated positions or "
                   "ranges A:B (B excluded); default: every position")
    p.add_argument("--metric", choices=METRICS, default="kl",
                   help="kl (default): KL(clean ‖ run) at the last position; loss: the "
                        "next-character loss on the clean text; logit-diff: logit of "
                        "--pair's first character minus its second's at the last position")
    p.add_argument("--pair", metavar="AB", help="logit-diff's two characters (with --model: "
                   "two tokens' texts as the tokenizer decodes them, comma-separated)")
    p.add_argument("--no-attribution", action="store_true", dest="no_attribution",
                   help="skip attribution patching (the gradient estimate)")
    p.add_argument("--out", metavar="DIR", help="output directory (default RUN/patch, or "
                   "DIR/patch with --model)")
    p.add_argument("--device", choices=DEVICES, default=None,
                   help="where the model runs: cpu (default), cuda, or auto")
    p.add_argument("--quiet", action="store_true", help="no summary on stderr")


def _positions(spec: str | None) -> list[int] | None:
    if spec is None:
        return None
    out: list[int] = []
    for part in spec.split(","):
        try:
            if ":" in part:
                a, b = part.split(":")
                out += list(range(int(a), int(b)))
            else:
                out.append(int(part))
        except ValueError:
            raise GatelensError(f"--positions {spec!r}: {part!r} is not a position or a "
                                "range A:B") from None
    return out


def _names(spec: str | None) -> list | None:
    if spec is None:
        return None
    items = [tuple(k.strip() for k in item.split("+")) for item in spec.split(",")]
    if any(not k for item in items for k in item):
        raise GatelensError(f"--names {spec!r}: an empty key")
    return [item[0] if len(item) == 1 else item for item in items]


def _metric(args, vocab: list[str]):
    import gatelens

    if args.metric != "logit-diff":
        if args.pair is not None:
            raise GatelensError(f"--pair is for --metric logit-diff, not {args.metric}")
        return args.metric
    tokens = getattr(args, "model", None) is not None
    pair = None if args.pair is None else args.pair.split(",") if tokens else list(args.pair)
    what = "tokens' texts, comma-separated" if tokens else "characters"
    if pair is None or len(pair) != 2:
        raise GatelensError(f"--metric logit-diff needs --pair AB: two {what}; got "
                            f"{args.pair!r}")
    missing = [c for c in pair if c not in vocab]
    if missing:
        unit = "token" if tokens else "character"
        raise GatelensError(f"--pair: {unit} {missing[0]!r} is not in the model's "
                            f"vocabulary of {len(vocab)} {unit}s")
    return gatelens.logit_diff(vocab.index(pair[0]), vocab.index(pair[1]))


def _inputs(args, run) -> tuple:
    """(clean, corrupt, what the report says of them)."""
    from gatelens.analysis.perturbation import perturb_windows

    if (args.clean is None) != (args.corrupt is None):
        raise GatelensError("patch: give --clean and --corrupt together (or neither: the "
                            "run's windows)")
    if args.clean is not None:
        if args.text is not None:
            raise GatelensError("patch: --text is for the run's windows, not with --clean")
        if len(args.clean) != len(args.corrupt):
            raise GatelensError(f"patch: --clean has {len(args.clean)} characters and "
                                f"--corrupt {len(args.corrupt)}; they must be equally long")
        return args.clean, args.corrupt, {"clean": args.clean, "corrupt": args.corrupt,
                                          "source": "--clean / --corrupt"}
    clean, source = run.windows(args.windows, args.length, args.text)
    if not 0 <= args.perturb_pos < clean.shape[1]:
        raise GatelensError(f"--perturb-pos {args.perturb_pos} is outside windows of "
                            f"{clean.shape[1]} characters (0..{clean.shape[1] - 1})")
    corrupt = perturb_windows(clean, args.perturb_pos, len(run.vocab), run.seed)
    return clean, corrupt, {"source": f"{source}, character {args.perturb_pos} replaced",
                            "perturb_pos": args.perturb_pos}


def cmd_patch(args) -> int:
    """Run the sweep and write its files; prints their paths."""
    from pathlib import Path

    import gatelens
    from gatelens.io import check_out_dir
    from gatelens.lens.run import load_run

    if run_or_model("patch", args) == "model":
        return _patch_model(args)
    if not Path(args.run).is_dir():
        raise GatelensError(f"{args.run}: no such run directory")
    out = check_out_dir(args.out if args.out is not None else Path(args.run) / "patch")
    run = load_run(args.run, args.checkpoint or "best")
    lens = gatelens.Lens(run, device=args.device)
    metric = _metric(args, list(run.vocab))
    clean, corrupt, inputs = _inputs(args, run)
    return _sweep(args, lens, metric, clean, corrupt, out,
                  {**inputs, "run": str(args.run), "step": run.step})


def _sweep(args, lens, metric, clean, corrupt, out, inputs: dict) -> int:
    """The sweep, its files written, their paths printed, and the summary line."""
    import gatelens
    from gatelens.interventions.patch_report import write_patch

    res = gatelens.patch_sweep(lens, clean, corrupt, _names(args.names),
                               _positions(args.positions), metric,
                               attribution=not args.no_attribution)
    paths = write_patch(res, out, inputs)
    for p in paths.values():
        print(p)
    if not args.quiet:
        rho = "" if res.spearman is None else f"; attribution Spearman {res.spearman:.3f}"
        print(f"{len(res.names)} keys x {len(res.positions)} positions, {res.metric}: "
              f"m(clean) {res.m_clean:.4g}, m(corrupt) {res.m_corrupt:.4g}{rho}",
              file=sys.stderr)
    return 0


def _patch_model(args) -> int:
    """``gatelens patch --model DIR``: the checkpoint's model on token ids (clean and
    corrupted texts of as many tokens, or token windows with one token replaced)."""
    import gatelens
    from gatelens.analysis.perturbation import perturb_windows
    from gatelens.io import check_out_dir
    from gatelens.loaders.hf_analyze import model_text
    from gatelens.loaders.hf_dir import load_hf

    hf = load_hf(args.model, trust_remote_code=args.trust_remote_code)
    out = check_out_dir(args.out if args.out is not None else hf.directory / "patch")
    lens = gatelens.Lens(hf.model, vocab=hf.tokens(), unit="tokens", device=args.device)
    metric = _metric(args, hf.tokens())
    if (args.clean is None) != (args.corrupt is None):
        raise GatelensError("patch: give --clean and --corrupt together (or neither: token "
                            "windows of --text)")
    if args.clean is not None:
        clean, corrupt = (hf.encode(t)[None] for t in (args.clean, args.corrupt))
        if clean.shape != corrupt.shape or not clean.numel():
            raise GatelensError(f"patch: --clean is {clean.shape[1]} tokens and --corrupt "
                                f"{corrupt.shape[1]}; they must be as many, and not none")
        inputs = {"clean": args.clean, "corrupt": args.corrupt, "source": "--clean / --corrupt"}
    else:
        raw, where = model_text(args.text)
        clean = hf.windows(raw, args.windows, args.length, where=where)
        if not 0 <= args.perturb_pos < clean.shape[1]:
            raise GatelensError(f"--perturb-pos {args.perturb_pos} is outside windows of "
                                f"{clean.shape[1]} tokens (0..{clean.shape[1] - 1})")
        corrupt = perturb_windows(clean, args.perturb_pos, hf.vocab_size, 0, clean.unique())
        inputs = {"source": f"{where}, token {args.perturb_pos} replaced",
                  "perturb_pos": args.perturb_pos}
    return _sweep(args, lens, metric, clean, corrupt, out, {**inputs, "model": str(args.model)})
