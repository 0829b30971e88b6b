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
   256, T = 128, H = 325, median of interleaved repeats after warm-up (ratios, never times);
5. real size (issue 27): transformers' Mamba at mamba-130m's config (24 layers × 768,
   d_state 16, vocabulary 50,280, random weights), B = 2, T = 128: the top layer's states
   traced on the device against the CPU's, ``verify`` on the device (its verdict), and
   trace and verify as multiples of the device's forward; and an LSTM LM of the PTB-large
   shape (2 × 1,500, vocabulary 10k): ``Lens.measure`` of 4 windows × 128 tokens on the
   device against the CPU's (as in 3), and its time as a multiple of the device's forward.

The GPU may differ from the CPU by float32 rounding (a different summation order in cuBLAS
and cuDNN): the read-out agrees within 1e-5 of a signal's scale; report figures within
1e-3 relative (the figures of rounding itself, a read-out's error or a split's residual,
aside: ``rounding``); the verdicts are the same words. The 24th layer of a Mamba stack reads what
23 layers rounded differently, so its states are held within 1e-3 of their scale.

``--only`` runs some of the five (e.g. ``--only real``), so a second call with the
device time left can finish what a first one did not.

On a lent device (the ``device`` tool's ``run``; the machine has no network): first, here,
``sh benchmarks/device_wheels.sh`` (transformers as gatelens pins it, into .whl/), then one
call with ``carry=[".whl"]`` and ``timeout_s`` about 540::

    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
        --target /tmp/site .whl/*.whl && export PYTHONPATH=/tmp/site:src PYTHONUNBUFFERED=1 \
        && python3 benchmarks/gpu_check.py --json $OUT/gpu.json

and record its table in BENCHMARKS.md ("On a GPU"), with the device's name.
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
DEEP_TOL = 1e-3  # the top layer of 24 against the CPU's, over its scale
PARTS = ("readout", "train", "speed", "real")
#: report figures that measure rounding itself (the read-out's error, a split's residual):
#: on two devices they differ by their own size, so only their verdicts (the words) are
#: compared
ROUNDING = (".verification.", "residual", "max_abs_diff", "max_scaled_diff")


def rounding(key: str) -> bool:
    """Whether a report figure (by its path) is one of ``ROUNDING``'s (a tolerance is not).

    >>> rounding(".verification.one_step_max_abs_diff_h"), rounding(".verification.tolerance")
    (True, False)
    """
    return any(s in key for s in ROUNDING) and not key.endswith("tolerance")


class WordLM(nn.Module):
    """The PTB "large" word model's shape: Embedding(V, H), a 2-layer LSTM, Linear(H, V)."""

    def __init__(self, vocab: int, hidden: int) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab, hidden)
        self.lstm = nn.LSTM(hidden, hidden, num_layers=2, batch_first=True)
        self.head = nn.Linear(hidden, vocab)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.head(self.lstm(self.embed(ids))[0])


def timed(fn, dev: str) -> float:
    """Seconds of one call of ``fn`` (the device synchronised around it)."""
    sync = torch.cuda.synchronize if dev == "cuda" else (lambda: None)
    sync()
    t0 = time.perf_counter()
    fn()
    sync()
    return time.perf_counter() - t0


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
    rows.append(compare_reports(f"report.json {dev} vs cpu", cpu, gpu))


def compare_reports(check: str, cpu: dict, gpu: dict) -> dict:
    """The row for two report.json: the largest relative difference of their numbers (the
    timings and the figures of rounding aside: ``rounding``) and the verdicts (the words)
    that differ."""
    a, b = numbers(cpu), numbers(gpu)
    skip = ("timing", "seconds", "wall")
    worst, where = 0.0, ""
    for k in a.keys() & b.keys():
        if any(s in k for s in skip) or rounding(k) or not (math.isfinite(a[k])
                                                             and math.isfinite(b[k])):
            continue
        rel = abs(a[k] - b[k]) / max(abs(a[k]), 1e-6)
        if rel > worst:
            worst, where = rel, k
    wa, wb = words(cpu), words(gpu)
    differ = sorted(k for k in wa.keys() & wb.keys() if wa[k] != wb[k] and "device" not in k)
    return {"check": check, "value": worst, "limit": REPORT_RTOL,
            "ok": worst <= REPORT_RTOL and not differ and a.keys() == b.keys(),
            "note": f"worst at {where}; verdicts differing: {differ or 'none'}"}


def real_size(rows: list[dict], dev: str, small: bool) -> None:
    """Item 5 of the module docstring (``small``: the same at toy sizes, the script's test):
    the deep Mamba, then the PTB-large LSTM (one model in memory at a time)."""
    deep_mamba(rows, dev, small)
    ptb_large(rows, dev, small)


def deep_mamba(rows: list[dict], dev: str, small: bool) -> None:
    import transformers

    import gatelens

    L, d, V, T = (2, 32, 50, 16) if small else (24, 768, 50_280, 128)
    torch.manual_seed(0)
    model = transformers.MambaForCausalLM(transformers.MambaConfig(
        vocab_size=V, hidden_size=d, num_hidden_layers=L, state_size=16, conv_kernel=4,
        expand=2, use_cache=False)).eval()
    ids = torch.randint(0, V, (2, T), generator=torch.Generator().manual_seed(1))
    lens = gatelens.Lens(model, vocab=V)
    path = next(iter(lens.families))
    module, key = lens.families[path].module, f"layer{L - 1}.s"
    seen = lens.runner(path)(ids)
    ref = gatelens.trace(module, seen.inputs, seen.state, names=[key])[key]
    lens = gatelens.Lens(model, vocab=V, device=dev)  # the model moved there
    seen = lens.runner(path)(ids)
    x = ids.to(dev)
    with torch.no_grad():
        model(x)  # warm-up
        forward = min(timed(lambda: model(x), dev) for _ in range(3))
    got: dict = {}
    t_trace = timed(lambda: got.update(tr=gatelens.trace(module, seen.inputs, seen.state)), dev)
    t_verify = timed(lambda: got.update(res=gatelens.verify(module, seen.inputs, seen.state)),
                     dev)
    states, res = got["tr"][key].cpu(), got["res"]
    off = float((states - ref).abs().max()) / max(float(ref.abs().max()), 1e-12)
    shape = f"mamba {L} x {d}"
    rows += [
        {"check": f"{shape} top states {dev} vs cpu", "value": off, "limit": DEEP_TOL,
         "ok": off <= DEEP_TOL, "note": f"{key}, over its largest |value|"},
        {"check": f"{shape} verify on {dev}", "value": res.one_step_max_scaled_diff_h or 0.0,
         "limit": res.tol, "ok": bool(res.passed),
         "note": ("passed" if res.passed else "FAILED") + (
             "; float32 said no, float64 re-judged" if "float64_rejudge" in res.meta else "")},
        {"check": f"{shape} trace / forward on {dev}", "value": t_trace / forward,
         "limit": None, "ok": True, "note": f"forward {forward * 1e3:.1f} ms; verify "
                                            f"{t_verify / forward:.1f}x the forward"}]


def ptb_large(rows: list[dict], dev: str, small: bool) -> None:
    import gatelens
    from gatelens.report.json_report import build_report

    Vw, H, W, Tw = (50, 24, 2, 16) if small else (10_000, 1_500, 4, 128)
    torch.manual_seed(0)
    lm = WordLM(Vw, H).eval()
    ids = torch.randint(0, Vw, (W, Tw), generator=torch.Generator().manual_seed(2))
    chars = [f"<{i}>" for i in range(Vw)]
    p = min(32, Tw // 4)
    cpu = build_report(gatelens.Lens(lm, vocab=chars, unit="tokens").measure(
        "lstm", ids, chars, perturb_pos=p))
    gpu_lens = gatelens.Lens(lm, vocab=chars, unit="tokens", device=dev)
    x = ids.to(dev)
    with torch.no_grad():
        lm(x)
        forward = min(timed(lambda: lm(x), dev) for _ in range(3))
    out: dict = {}
    took = timed(lambda: out.update(r=build_report(gpu_lens.measure(
        "lstm", ids, chars, perturb_pos=p))), dev)
    row = compare_reports(f"lstm 2 x {H} (PTB-large) report {dev} vs cpu", cpu, out["r"])
    row["note"] += f"; the analysis {took:.1f} s = {took / forward:.0f}x the forward"
    rows.append(row)


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
                took = timed(fn, "cuda")
                if i >= 3:  # after warm-up
                    acc.append(took)
        f, t = (statistics.median(v) for v in times)
        rows.append({"check": f"speed lstm B={B} read-out / cuDNN forward", "value": t / f,
                     "limit": None, "ok": True,
                     "note": f"forward {f * 1e3:.2f} ms, read-out {t * 1e3:.2f} ms"})


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--json", type=Path, help="also write the rows here")
    ap.add_argument("--device", default="cuda",
                    help="compare this device with the CPU (cpu: the script's own test)")
    ap.add_argument("--only", default=",".join(PARTS),
                    help=f"comma-separated parts to run, of {', '.join(PARTS)} (default: all)")
    args = ap.parse_args(argv)
    parts = set(args.only.split(","))
    if not parts <= set(PARTS):
        ap.error(f"--only: {', '.join(sorted(parts - set(PARTS)))} is not one of "
                 f"{', '.join(PARTS)}")
    dev = args.device
    if dev == "cuda" and not torch.cuda.is_available():
        print("no CUDA device")
        return 0
    tf32_off()
    rows: list[dict] = []
    small = dev == "cpu"  # the test of the script itself: small and quick
    if "readout" in parts:
        check_readout(rows, dev, T=16 if small else 96)
    if "train" in parts:
        with tempfile.TemporaryDirectory() as tmp:
            train_and_analyze(rows, Path(tmp), dev, steps=4 if small else 50,
                              hidden=32 if small else 325)
    if dev == "cuda" and "speed" in parts:
        speed(rows)
    if "real" in parts:
        real_size(rows, dev, small)
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
