"""Analysis time and peak memory against the number of windows (streaming analysis).

Each size runs ``gatelens analyze RUN --windows N`` in a fresh process, so its peak
resident memory (ru_maxrss) is the analysis's own; the model is the seed-size LSTM of RUN
(default: a random one on a random corpus, built here). docs/design.md "Streaming
analysis": the peak must stay bounded (at most 2 GB for the seed-size LSTM) whatever N,
and time grow linearly.

    .venv/bin/python benchmarks/bench_scale.py [--run RUN] [--windows 32,256,1024,all]
"""

from __future__ import annotations

import argparse
import json
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent


def child(run: str, windows: str, out: str) -> None:
    """In the child process: one analysis, then its figures, time and peak memory as JSON."""
    from gatelens.lens.analyze import analyze

    t0 = time.perf_counter()
    a = analyze(run, windows=windows if windows == "all" else int(windows), out=out,
                progress=False, plots=False)
    seconds = time.perf_counter() - t0
    rep = a.report
    print(json.dumps({"windows": rep["text"]["windows"], "chunks": rep["text"]["chunks"],
                      "seconds": seconds,
                      "peak_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,
                      "f_mean": rep["gates"]["f"]["mean"],
                      "half_life_measured": rep["perturbation"]["half_life_measured"],
                      "half_life_forget_only": rep["perturbation"]["half_life_forget_only"],
                      "ratio": rep["perturbation"]["ratio_at_max_lag"],
                      "lyapunov": rep["divergence"]["lyapunov_per_char"],
                      "reach": (rep["output_reach"] or {}).get("half_life"),
                      "units_median_half_life": rep["units"]["half_life"]["median"]}))


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--run", help="a run directory (default: a random seed-size LSTM)")
    ap.add_argument("--windows", default="32,256,1024", help="comma-separated sizes or all")
    ap.add_argument("--child", nargs=3, help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.child:
        child(*args.child)
        return 0
    with tempfile.TemporaryDirectory() as tmp:
        run = args.run
        if run is None:
            sys.path.insert(0, str(HERE))
            from bench_analyze import make_run

            run = str(make_run(Path(tmp), "lstm", 325, 1100, 128))
        print(f"{'windows':>8} {'chunks':>6} {'seconds':>8} {'s/window':>9} {'peak MB':>8}  "
              "figures")
        for w in args.windows.split(","):
            proc = subprocess.run([sys.executable, __file__, "--child", run, w,
                                   str(Path(tmp) / f"out-{w}")], capture_output=True, text=True)
            if proc.returncode:
                print(proc.stderr[-2000:])
                return 1
            r = json.loads(proc.stdout.strip().splitlines()[-1])
            figs = {k: v for k, v in r.items()
                    if k not in ("windows", "chunks", "seconds", "peak_mb")}
            print(f"{r['windows']:>8} {r['chunks']:>6} {r['seconds']:8.1f} "
                  f"{r['seconds'] / r['windows']:9.3f} {r['peak_mb']:8.0f}  {json.dumps(figs)}",
                  flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
