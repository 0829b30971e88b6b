"""One script for a CUDA machine: same results on the GPU (TF32 off) as on the CPU, and the
read-out's cost against cuDNN's forward. At most about five minutes on one GPU.

    .venv/bin/python benchmarks/gpu_check.py            # prints a table, exits 1 on a mismatch
    .venv/bin/python benchmarks/gpu_check.py --json OUT.json

Without a CUDA device it prints one line, "no CUDA device", and exits 0. What it checks:

1. training: 50 steps of the seed's LSTM (325 units) on CUDA, through ``gatelens.training``,
   finite losses and a checkpoint that loads on the CPU;
2. the read-out: LSTM, GRU, RNN (1 and 2 layers) and gatelens's minGRU, minLSTM and sLSTM
   traced on CUDA and on the CPU from the same weights and input; every signal's largest
   difference, and the one-step verification on CUDA (its tolerance);
3. an analysis: ``Lens.measure`` of the trained model on the CPU and with
   ``Lens(run, device="cuda")`` (8 windows);
   the largest relative difference of every number in report.json, and whether every verdict
   (the words) is the same;
4. speed: the read-out (``trace``, every gate kept) / the module's cuDNN forward, B = 32 and
   256, T = 128, H = 325, median of interleaved repeats after warm-up (ratios, never times).

The GPU may differ from the CPU by float32 rounding (a different summation order in cuBLAS
and cuDNN): the read-out agrees within 1e-5 of a signal's scale; report figures within
1e-3 relative; the verdicts are the same words.
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch
from torch import nn

READ_TOL = 1e-5  # |GPU − CPU| of a read-out signal, over max(1, |signal|)
REPORT_RTOL = 1e-3  # report.json numbers, relative (float32 reductions in another order)


def tf32_off() -> None:
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    torch.set_float32_matmul_precision("highest")


def modules() -> dict[str, nn.Module]:
    from gatelens.cells.modern import SLSTM, MinGRU, MinLSTM

    torch.manual_seed(0)
    return {"lstm": nn.LSTM(65, 325, batch_first=True),
            "lstm 2-layer": nn.LSTM(65, 128, num_layers=2, batch_first=True),
            "gru": nn.GRU(65, 325, batch_first=True),
            "rnn": nn.RNN(65, 325, batch_first=True),
            "mingru": MinGRU(65, 128), "minlstm": MinLSTM(65, 128), "slstm": SLSTM(65, 128)}


def check_readout(rows: list[dict], dev: str, T: int = 96) -> None:
    from gatelens import trace, verify

    g = torch.Generator().manual_seed(1)
    x = nn.functional.one_hot(torch.randint(0, 65, (8, T), generator=g), 65).float()
    for name, mod in modules().items():
        cpu = trace(mod, x)
        dev_mod = mod.to(dev)
        gpu = trace(dev_mod, x.to(dev))
        worst = max(float(((gpu[k].cpu() - cpu[k]).abs() / cpu[k].abs().clamp(min=1)).max())
                    for k in cpu)
        v = verify(dev_mod, x.to(dev))
        err = max(d.max_abs_diff_h for d in v.layers)
        rows.append({"check": f"read-out {name}", "value": worst, "limit": READ_TOL,
                     "ok": worst <= READ_TOL and v.passed,
                     "note": f"verify on {dev} {'passed' if v.passed else 'FAILED'} "
                             f"(one-step h {err:.2e}, tol {v.tol:.0e})"})


def leaves(node: object, kinds: tuple[type, ...], path: str = "") -> dict[str, object]:
    """Every leaf of a report of one of ``kinds``, by its path (bools are not numbers)."""
    out: dict[str, object] = {}
    if isinstance(node, dict):
        for k, v in node.items():
            out.update(leaves(v, kinds, f"{path}.{k}"))
    elif isinstance(node, list):
        for i, v in enumerate(node):
            out.update(leaves(v, kinds, f"{path}[{i}]"))
    elif isinstance(node, kinds) and (bool in kinds or not isinstance(node, bool)):
        out[path] = node
    return out


def numbers(report: dict) -> dict[str, float]:
    return {k: float(v) for k, v in leaves(report, (int, float)).items()}


def words(report: dict) -> dict[str, object]:
    """The verdict-like leaves: strings and booleans."""
    return leaves(report, (str, bool))


def train_and_analyze(rows: list[dict], workdir: Path, dev: str, steps: int = 50,
                      hidden: int = 325) -> None:
    from gatelens import Lens, load_run
    from gatelens.report.json_report import build_report
    from gatelens.training.config import TrainConfig
    from gatelens.training.train import train

    cfg = TrainConfig(steps=steps, eval_every=max(1, steps // 2), device=dev, seed=0,
                      hidden=hidden)
    t0 = time.perf_counter()
    res = train(cfg, workdir / "run", progress=False)
    rows.append({"check": f"train {steps} steps on {dev}", "value": time.perf_counter() - t0,
                 "limit": None, "ok": math.isfinite(res.best_val_loss),
                 "note": f"best val loss {res.best_val_loss:.4f} (seconds in value)"})
    run = load_run(workdir / "run")
    lens = Lens(run)
    ids, _ = run.windows(8, 128)  # (8, 128)
    chars = list(run.vocab)
    path = next(iter(lens.families))
    cpu = build_report(lens.measure(path, ids, chars))
    lens_gpu = Lens(run, device=dev)  # the model moved there in place, the ids on each call
    gpu = build_report(lens_gpu.measure(path, ids, chars))
    a, b = numbers(cpu), numbers(gpu)
    skip = ("timing", "seconds", "wall")
    worst, where = 0.0, ""
    for k in a.keys() & b.keys():
        if any(s in k for s in skip) or not (math.isfinite(a[k]) and math.isfinite(b[k])):
            continue
        rel = abs(a[k] - b[k]) / max(abs(a[k]), 1e-6)
        if rel > worst:
            worst, where = rel, k
    wa, wb = words(cpu), words(gpu)
    differ = sorted(k for k in wa.keys() & wb.keys() if wa[k] != wb[k] and "device" not in k)
    rows.append({"check": f"report.json {dev} vs cpu", "value": worst, "limit": REPORT_RTOL,
                 "ok": worst <= REPORT_RTOL and not differ and a.keys() == b.keys(),
                 "note": f"worst at {where}; verdicts differing: {differ or 'none'}"})


def speed(rows: list[dict], repeats: int = 20) -> None:
    from gatelens import trace

    for B in (32, 256):
        torch.manual_seed(0)
        mod = nn.LSTM(65, 325, batch_first=True).cuda()
        idx = torch.randint(0, 65, (B, 128), device="cuda")
        x = nn.functional.one_hot(idx, 65).float()

        def fwd(mod: nn.Module = mod, x: torch.Tensor = x) -> None:
            with torch.no_grad():
                mod(x)

        def tr(mod: nn.Module = mod, x: torch.Tensor = x) -> None:
            trace(mod, x)

        times: list[list[float]] = [[], []]
        for i in range(repeats + 3):
            for fn, acc in zip((fwd, tr), times, strict=True):
                torch.cuda.synchronize()
                t0 = time.perf_counter()
                fn()
                torch.cuda.synchronize()
                if i >= 3:
                    acc.append(time.perf_counter() - t0)
        f, t = (statistics.median(v) for v in times)
        rows.append({"check": f"speed lstm B={B} read-out / cuDNN forward", "value": t / f,
                     "limit": None, "ok": True,
                     "note": f"forward {f * 1e3:.2f} ms, read-out {t * 1e3:.2f} ms"})


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--json", type=Path, help="also write the rows here")
    ap.add_argument("--device", default="cuda",
                    help="compare this device with the CPU (cpu: the script's own test)")
    args = ap.parse_args(argv)
    dev = args.device
    if dev == "cuda" and not torch.cuda.is_available():
        print("no CUDA device")
        return 0
    tf32_off()
    rows: list[dict] = []
    small = dev == "cpu"  # the test of the script itself: small and quick
    check_readout(rows, dev, T=16 if small else 96)
    with tempfile.TemporaryDirectory() as tmp:
        train_and_analyze(rows, Path(tmp), dev, steps=4 if small else 50,
                          hidden=32 if small else 325)
    if dev == "cuda":
        speed(rows)
    name = torch.cuda.get_device_name() if dev == "cuda" else "cpu"
    print(f"device: {name}, torch {torch.__version__}, TF32 off")
    for r in rows:
        lim = "" if r["limit"] is None else f" (limit {r['limit']:.0e})"
        print(f"{'ok  ' if r['ok'] else 'FAIL'} {r['check']:<44} {r['value']:.3g}{lim}  "
              f"{r['note']}")
    if args.json:
        args.json.write_text(json.dumps(rows, indent=1))
    return 0 if all(r["ok"] for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
