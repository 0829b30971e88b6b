"""``gatelens verify``: the one-step error per layer (exit 1 above the tolerance) and the
free-running divergence, of a run's model (``RUN``) or of every recurrent module of a local
Hugging Face checkpoint (``--model DIR``, on token windows of ``--text``:
loaders/hf_verify.py). docs/opening-models.md, "Verification".
"""

from __future__ import annotations

import argparse
from typing import TYPE_CHECKING

from gatelens.analysis.settings import DEFAULTS
from gatelens.errors import (
    CheckFailed,
    GatelensError,
    nonnegative_float,
    positive_int,
    run_or_model,
)
from gatelens.families.spec import layer_name
from gatelens.lens.device import DEVICES, on, placed

if TYPE_CHECKING:
    from gatelens.readout.verify import VerifyResult

__all__ = ["add_verify", "cmd_verify"]


def add_verify(sub) -> None:
    """The ``verify`` subcommand's flags."""
    from gatelens.loaders.hf_dir import add_model_dir_arguments

    p = sub.add_parser("verify", help="check the gate read-out against PyTorch's own output")
    p.add_argument("run", nargs="?", help="run directory (from gatelens train); or --model DIR")
    p.add_argument("--checkpoint", default=None, help="best (default), final or a step number")
    p.add_argument("--text", help="UTF-8 file: its first windows instead of validation text "
                   "(with --model: needed, read as its tokens)")
    p.add_argument("--windows", type=positive_int, default=None,
                   help="B windows (default 32; 2 with --model)")
    p.add_argument("--length", type=positive_int, default=DEFAULTS.length,
                   help="T, characters per window (tokens with --model; default 128)")
    p.add_argument("--device", choices=DEVICES, default=None,
                   help="where the model runs: cpu (default), cuda, or auto")
    p.add_argument("--tol", type=nonnegative_float, default=None,
                   help="largest difference that passes, finite, 0 or above (default: the "
                        "weights' dtype's, 1e-5 for float32)")
    add_model_dir_arguments(
        p, "verify every recurrent module of this local checkpoint (or those --modules picks) "
        "on token windows of --text",
        "positions among the recurrent modules (0, -1), module paths or shell patterns, "
        "comma-separated (default: every one)")


def cmd_verify(args: argparse.Namespace) -> int:
    """``gatelens verify``: a run's model, or every recurrent module of ``--model DIR``."""
    from gatelens.lens.run import load_run
    from gatelens.readout.verify import verify

    if run_or_model("verify", args) == "model":
        return _verify_model(args)
    run = load_run(args.run, args.checkpoint or "best")
    ids, source = run.windows(args.windows or DEFAULTS.windows, args.length, args.text)
    dev = placed(run.model, args.device)
    res = verify(run.model.rnn, run.model.encode(on(ids, dev)), tol=args.tol)
    print(f"{args.run} (step {run.step}), {ids.shape[0]} windows x {ids.shape[1]} characters "
          f"of {source}:")
    _print_layers(res, "  ")
    print(res.explain())
    if not res.passed:
        raise CheckFailed(f"read-out differs from PyTorch by more than {res.tol:g}")
    print(f"passed (tolerance {res.tol:g})")
    return 0


def _print_layers(res: VerifyResult, indent: str) -> None:
    """One line per layer (and direction) of a VerifyResult: its one-step figures (the
    free-running ones for packed input) beside its free-running difference."""
    kind = "one-step" if res.one_step_max_abs_diff_h is not None else "free-running"
    for d, free in zip(res.layers, res.free_running_layers, strict=True):
        name = layer_name(d.layer, d.reverse)
        c = "" if d.max_abs_diff_c is None else (
            f"  max |c_hand - c_torch| {d.max_abs_diff_c:.3g}"
            f" (/max(1,|c|): {d.max_scaled_diff_c:.3g})")
        if d.max_scaled_diff_h is not None:  # modern cells: h and y unbounded
            c += f" (h and y scaled by the unit's largest |value|: {d.max_scaled_diff_h:.3g})"
        print(f"{indent}{name}: {kind} max |h_hand - h_torch| {d.max_abs_diff_h:.3g}{c}; "
              f"free-running {free.max_abs_diff_h:.3g}")


def _verify_model(args: argparse.Namespace) -> int:
    """``gatelens verify --model DIR``: each recurrent module, one after another; exit 1
    when any fails (every one is still checked and printed)."""
    from gatelens.loaders.hf_verify import verify_hf
    from gatelens.readout.select import as_flag

    if args.text is None:
        raise GatelensError(f"{args.model}: --model needs --text FILE (the text to read, as "
                            "its tokens)")
    try:
        ids, results = verify_hf(args.model, text=args.text, windows=args.windows or 2,
                                 length=args.length, tol=args.tol, layers=args.modules,
                                 trust_remote_code=args.trust_remote_code,
                                 device=args.device)
        print(f"{args.model}, {ids.shape[0]} windows x {ids.shape[1]} tokens of {args.text}:")
        failed = []
        for path, res in results:
            print(f"  {path} ({res.meta.get('family', res.cell)}):")
            _print_layers(res, "    ")
            print(f"    {res.explain()}")
            if not res.passed:
                failed.append(path)
    except GatelensError as e:  # select_paths names the Python argument: here it is a flag
        raise as_flag(e, "--modules") from None
    if failed:
        raise CheckFailed(f"read-out differs from the module by more than the tolerance in "
                          f"{', '.join(failed)}")
    print(f"passed (tolerance {res.tol:g})")
    return 0
