"""The `gatelens` command: parse, call, print. Exit 0 done, 1 a check failed, 2 bad input."""

from __future__ import annotations

import argparse
import signal
import sys
from collections.abc import Sequence

from gatelens.errors import (
    CheckFailed,
    GatelensError,
    finite_float,
    one_line,
    os_reason,
    positive_float,
    positive_int,
    seed_int,
)
from gatelens.families.registry import recipes
from gatelens.interventions.patch_cli import add_patch, cmd_patch
from gatelens.lens.analyze_cli import add_analyze, cmd_analyze
from gatelens.readout.verify_cli import add_verify, cmd_verify
from gatelens.stops import Stopped, exit_code, signal_name, signals_raise
from gatelens.studies.seed_compare import CELLS as SEED_COMPARE_CELLS
from gatelens.training.config import BIAS_INITS, OPTIMIZER_NAMES, TrainConfig


class CellChoices(tuple):
    """``--cell``'s choices: the families' names, an earlier name (an alias) accepted too."""

    def __new__(cls, cells: dict):
        out = super().__new__(cls, cells)
        out.aliases = {a for r in cells.values() for a in r.aliases}
        return out

    def __contains__(self, name: object) -> bool:
        return super().__contains__(name) or name in self.aliases


class _Parser(argparse.ArgumentParser):
    def error(self, message: str):  # one line, exit 2, no usage dump
        raise GatelensError(f"{self.prog}: {message} (see {self.prog} --help)")


def _add_train(sub) -> None:
    p = sub.add_parser("train", help="train a character-level model into a run directory")
    d = TrainConfig()
    p.add_argument("--corpus", help="built-in name (shakespeare, recall[:gap=LO-HI,seed=S,"
                   f"chars=N,…], brackets[:depth=D,…]) or UTF-8 text file (default {d.corpus})")
    cells = recipes()
    official = ", ".join(n for n, r in cells.items() if r.official)
    p.add_argument("--cell", choices=CellChoices(cells), metavar="CELL",
                   help=f"default {d.cell}; one of {', '.join(cells)}. {official}: the "
                   "official implementations, --hidden their width (pip install "
                   "'gatelens[modern]')")
    p.add_argument("--hidden", type=positive_int, help=f"units per layer (default {d.hidden})")
    p.add_argument("--layers", type=positive_int, help=f"default {d.layers}")
    p.add_argument("--embed", type=positive_int, help="embedding size (default: one-hot)")
    p.add_argument("--nonlinearity", choices=["tanh", "relu"], help="plain RNN only (tanh or relu)")
    heads = ", ".join(n for n, r in cells.items() if r.takes("heads"))
    p.add_argument("--heads", type=positive_int,
                   help=f"{heads} only: recurrent heads (default 1)")
    p.add_argument("--steps", type=positive_int, help=f"default {d.steps}")
    p.add_argument("--batch", type=positive_int, help=f"default {d.batch}")
    p.add_argument("--seq", type=positive_int, help=f"default {d.seq}")
    p.add_argument("--lr", type=positive_float,
                   help=f"learning rate, finite and above 0 (default {d.lr}); one too large "
                        "for the model stops training as diverged (exit 1)")
    p.add_argument("--clip", type=positive_float,
                   help=f"gradient norm clip, finite (default {d.clip})")
    p.add_argument("--optimizer", choices=OPTIMIZER_NAMES,
                   help=f"default {d.optimizer}; PyTorch's defaults but for --lr (Adam betas "
                        "0.9, 0.999; SGD plain, no momentum; RMSprop alpha 0.99)")
    p.add_argument("--bias-init", choices=BIAS_INITS,
                   help=f"default {d.bias_init}: PyTorch's init; zero: every bias of the "
                        "recurrent module 0 at step 0 (before --forget-bias/--chrono; the "
                        "head keeps PyTorch's)")
    g = p.add_mutually_exclusive_group()
    g.add_argument("--forget-bias", type=finite_float, metavar="B",
                   help="the keep gate's total bias in every unit, for "
                        f"{', '.join(n for n, r in cells.items() if r.takes('keep'))} (each "
                        "family's keep gate: LSTM f, GRU z ...)")
    g.add_argument("--chrono", type=finite_float, metavar="TMAX",
                   help="chrono initialisation (TMAX above 2)")
    p.add_argument("--eval-every", type=positive_int, help=f"default {d.eval_every}")
    p.add_argument("--val-windows", type=positive_int, help=f"default {d.val_windows}")
    p.add_argument("--seed", type=seed_int, help=f"default {d.seed} (-2**63 … 2**64 − 1)")
    p.add_argument("--device", choices=["auto", "cpu", "cuda"], help="default auto")
    p.add_argument("--resume", action="store_true", help="continue the run in --out")
    p.add_argument("--out", required=True, help="run directory")
    p.add_argument("--quiet", action="store_true", help="no progress bar")


def _cmd_train(args) -> int:
    from gatelens.training.train import train

    given = {k: v for k, v in vars(args).items()
             if v is not None and k not in ("command", "resume", "out", "quiet")}
    if args.resume:
        res = train(None, args.out, resume=True, progress=not args.quiet, overrides=given)
    else:
        res = train(TrainConfig(**given), args.out, progress=not args.quiet)
    print(f"{res.run}: {res.steps_done} steps, best validation loss {res.best_val_loss:.4f} "
          f"at step {res.best_step}")
    if res.interrupted:
        print(f"gatelens: {res.stop_line()}", file=sys.stderr)
    if res.best_step == 0 and res.steps_done > 0 and not res.interrupted:  # a verdict at the end
        print(f"gatelens: note: the validation loss never got below the untrained model's "
              f"(best step 0); is --lr {_lr_of(res.run)} too large or too small?",
              file=sys.stderr)
    return (128 + (res.signum or signal.SIGINT)) if res.interrupted else 0


def _lr_of(run) -> str:
    from gatelens.training.runs import read_config

    return f"{read_config(run)['train'].get('lr'):g}"


def _add_sample(sub) -> None:
    p = sub.add_parser("sample", help="text from a trained model")
    p.add_argument("run")
    p.add_argument("--length", type=int, default=500)
    p.add_argument("--temperature", type=positive_float, default=1.0)
    p.add_argument("--prime", default=None,
                   help="text the model reads first (default: a newline, or the first "
                        "character of the vocabulary when it has no newline)")
    p.add_argument("--seed", type=seed_int, default=0)
    p.add_argument("--checkpoint", default="best", help="best, final or a step number")


def _cmd_sample(args) -> int:
    from gatelens.training.runs import load_run
    from gatelens.training.sample import sample_chunks

    run = load_run(args.run, args.checkpoint)
    for piece in sample_chunks(run, args.length, args.temperature, args.prime, args.seed):
        print(piece, end="", flush=True)  # as it comes: any --length in constant memory
    print()
    return 0


def _add_report(sub) -> None:
    p = sub.add_parser("report", help="rebuild report.html from an analysis")
    p.add_argument("run", help="run directory (its analysis/) or an analysis directory")


def _cmd_report(args) -> int:
    from pathlib import Path

    from gatelens.report.html import rebuild_html

    run = Path(args.run)
    out = run / "analysis" if (run / "analysis" / "report.json").exists() else run
    if not run.exists():
        raise GatelensError(f"{run}: no such directory")
    notes: list[str] = []
    try:
        path = rebuild_html(out, notes)
    except (FileNotFoundError, ValueError) as e:
        raise GatelensError(str(e)) from None
    for line in notes:
        print(f"gatelens: note: {line}", file=sys.stderr)
    print(path)
    return 0


def _add_reproduce(sub) -> None:
    p = sub.add_parser("reproduce", help="the seed end to end on the default corpus, beside "
                       "the seed's figures")
    p.add_argument("--out", default="runs/reproduce", metavar="DIR",
                   help="output directory (default runs/reproduce); rerun to resume")
    p.add_argument("--corpus", default="shakespeare",
                   help="corpus name or text file (default: shakespeare, the seed's setup)")
    p.add_argument("--seeds", type=positive_int, default=1, metavar="N",
                   help="train every cell with seeds 0 … N−1 and report the spread (default 1)")
    p.add_argument("--cells", default="lstm,gru,rnn", metavar="LIST",
                   help="comma-separated cells to train and compare (default lstm,gru,rnn; "
                        f"any of {','.join(SEED_COMPARE_CELLS)})")
    p.add_argument("--forget-bias", type=float, default=None, metavar="B", dest="forget_bias",
                   help="also train the LSTM with total forget bias B and set it beside the "
                        "plain one (the seed's forget-bias claim; ~2 more minutes)")
    p.add_argument("--quiet", action="store_true", help="no progress messages")


def _cmd_reproduce(args) -> int:
    from pathlib import Path

    from gatelens.studies.reproduce import reproduce

    cells = tuple(c.strip() for c in args.cells.split(",") if c.strip())
    reproduce(args.out, corpus=args.corpus, progress=not args.quiet,
              forget_bias=args.forget_bias, cells=cells, seeds=args.seeds)
    print(Path(args.out) / "reproduce.md")
    return 0


def _add_study(sub) -> None:
    p = sub.add_parser("study", help="many runs, one finding: a grid of trials (train + analyze "
                       "every checkpoint) as Ray tasks, merged into study.json/md/html")
    p.add_argument("spec", nargs="?", help="SPEC.toml: [grid], [train], [analysis]")
    from gatelens.studies.spec import PRESETS

    p.add_argument("--preset", choices=PRESETS,
                   help="a built-in SPEC instead of a file")
    p.add_argument("--out", required=True, metavar="DIR", help="study directory; rerun to "
                   "reuse finished trials and resume interrupted ones")
    p.add_argument("--address", help="join this Ray cluster (DIR must be on a filesystem "
                   "every node sees); default: a local Ray started for the study")
    p.add_argument("--workers", type=positive_int,
                   help="trials at once (local Ray: its CPUs; default all cores)")
    p.add_argument("--reuse", action="append", default=[], metavar="OTHER_DIR",
                   help="copy, instead of running, any trial whose settings equal a finished "
                   "trial of the study in OTHER_DIR (repeatable)")
    p.add_argument("--quiet", action="store_true", help="no progress messages")


def _cmd_study(args) -> int:
    from gatelens.studies.spec import load_preset, load_spec
    from gatelens.studies.study import failed_lines, run_study

    if (args.spec is None) == (args.preset is None):
        raise GatelensError("study: give SPEC.toml or --preset NAME, one of them")
    spec = load_preset(args.preset) if args.preset else load_spec(args.spec)
    res = run_study(spec, args.out, workers=args.workers, address=args.address,
                    progress=not args.quiet, reuse=args.reuse)
    print(res.out / "study.json")
    print(res.out / "study.html")
    for line in failed_lines(res.study["trials"]):
        print(f"failed: {line}", file=sys.stderr)
    if res.failed:  # every file is still written; the failures are in them too
        raise CheckFailed(f"{res.failed} of {len(res.study['trials'])} trials failed")
    return 0


COMMANDS = {"train": (_add_train, _cmd_train), "sample": (_add_sample, _cmd_sample),
            "verify": (add_verify, cmd_verify), "analyze": (add_analyze, cmd_analyze),
            "report": (_add_report, _cmd_report), "reproduce": (_add_reproduce, _cmd_reproduce),
            "study": (_add_study, _cmd_study), "patch": (add_patch, cmd_patch)}


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(prog="gatelens", description=(
        "Open recurrent language models, from a character LSTM to a pretrained state-space "
        "hybrid: train, read every gate and state, verify, measure memory, patch, report. "
        "Exit 0 done, 1 a check failed, 2 bad input."))
    sub = parser.add_subparsers(dest="command", required=True, parser_class=_Parser)
    for add, _ in COMMANDS.values():
        add(sub)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Run the command line; returns the exit code.

    >>> main(["train", "--hidden", "0", "--out", "x"])
    2
    """
    try:
        with signals_raise():  # SIGTERM, SIGHUP: a clean stop, as Ctrl-C
            args = build_parser().parse_args(argv)
            return COMMANDS[args.command][1](args)
    except GatelensError as e:
        print(f"gatelens: error: {one_line(str(e))}", file=sys.stderr)
        return e.exit_code
    except CheckFailed as e:
        print(f"gatelens: check failed: {one_line(str(e))}", file=sys.stderr)
        return e.exit_code
    except KeyboardInterrupt as e:  # Ctrl-C; Stopped: SIGTERM or SIGHUP
        by = (f" by {signal_name(e.signum)}" if isinstance(e, Stopped)
              and e.signum != signal.SIGINT else "")
        print(f"gatelens: interrupted{by}" + (f": {e.note}" if getattr(e, "note", None)
                                               else ""), file=sys.stderr)
        return exit_code(e)
    except OSError as e:  # a file system that failed under us: one line, naming the path
        where = f"{e.filename}: " if e.filename else ""
        print(f"gatelens: error: {where}{os_reason(e)}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
