"""A synthetic analysis for previewing and testing report.html without a trained run.

``demo_analysis`` runs a small random recurrent cell by hand over a made-up text and
returns an object with the fields of ``gatelens.analyze.Analysis`` (report, out, run,
chars, windows, perturbed, perturb_pos, trace, baseline, trace_perturbed,
decomposition, plots). Its numbers mean nothing; its shapes and JSON are the real ones.

>>> a = demo_analysis("gru", windows=2, length=16, hidden=5, perturb_pos=4)
>>> a.trace["layer0.z"].shape, a.decomposition["measured"].shape
(torch.Size([2, 16, 5]), torch.Size([2, 16, 5]))
"""

from __future__ import annotations

import math
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import numpy as np
import torch

from gatelens.trace_types import GATES, Trace

LINES = ("Now is the winter of our discontent, made glorious summer; and all the clouds",
         "that lour'd upon our house in the deep bosom of the ocean buried. [Exit.]",
         "O, what a noble mind is here o'erthrown! The courtier's, soldier's, scholar's eye,",
         "QUEEN. Give me my robe, put on my crown; I have immortal longings in me: 1-2-3?")


def _vocab(size: int) -> list[str]:
    """The demo text's characters, then other printable ones, up to ``size``."""
    used = sorted(set("\n".join(LINES)))
    if size < len(used):
        raise ValueError(f"the demo text needs a vocabulary of at least {len(used)}")
    extra = [chr(c) for c in range(32, 0x250) if chr(c).isprintable() and chr(c) not in used]
    return sorted(used + extra[: size - len(used)])


def _run(cell: str, w: dict[str, torch.Tensor], x: torch.Tensor) -> Trace:
    """Run the cell of METHODS.md step by step on one-hot input x (B, T, V)."""
    b, t, _ = x.shape
    h_size = w["whh"].shape[1]
    h = torch.zeros(b, h_size)  # (B, H)
    c = torch.zeros_like(h)
    out: dict[str, list[torch.Tensor]] = {}
    x_in = x @ w["wih"].T + w["b"]  # (B, T, nH): the input's share, all steps at once
    for k in range(t):
        zi = x_in[:, k]  # (B, nH)
        zh = h @ w["whh"].T  # (B, nH)
        if cell == "lstm":
            i, f, g, o = (zi + zh).chunk(4, dim=1)
            i, f, g, o = i.sigmoid(), f.sigmoid(), g.tanh(), o.sigmoid()
            c = f * c + i * g
            h = o * c.tanh()
            step = {"i": i, "f": f, "g": g, "o": o, "c": c, "h": h}
        elif cell == "gru":
            (xr, xz, xn), (hr, hz, hn) = zi.chunk(3, dim=1), zh.chunk(3, dim=1)
            r, z = (xr + hr).sigmoid(), (xz + hz).sigmoid()
            n = (xn + r * hn).tanh()
            h = (1 - z) * n + z * h
            step = {"r": r, "z": z, "n": n, "h": h}
        else:
            pre = zi + zh
            h = pre.tanh()
            step = {"pre": pre, "h": h}
        for name, v in step.items():
            out.setdefault(name, []).append(v)
    tensors = {f"layer0.{n}": torch.stack(v, dim=1) for n, v in out.items()}  # (B, T, H)
    return Trace(cell=cell, num_layers=1, bidirectional=False, tensors=tensors)


def _weights(cell: str, v: int, h: int, gen: torch.Generator, trained: bool) -> dict:
    n = {"lstm": 4, "gru": 3}.get(cell, 1)
    s = 1 / math.sqrt(h)

    def u(*shape: int) -> torch.Tensor:
        return (torch.rand(*shape, generator=gen, dtype=torch.float64) * 2 - 1) * s

    w = {"wih": u(n * h, v), "whh": u(n * h, h), "b": 2 * u(n * h)}
    if trained:  # spread units out, as training does: some hold on, some forget fast
        w["wih"] *= 3 * math.sqrt(h)
        w["whh"] *= 1.5
        w["b"] += torch.randn(n * h, generator=gen, dtype=torch.float64) * 1.5
    return {k: t.float() for k, t in w.items()}


def _stats(x: np.ndarray) -> dict[str, float]:
    qs = (5, 25, 50, 75, 95)
    p = np.percentile(x, qs)
    return {"mean": float(x.mean()), **{f"p{q}": float(v) for q, v in zip(qs, p, strict=True)}}


def _tables(tr: Trace) -> dict[str, Any]:
    gates = {"n_values": int(tr[f"layer0.{tr.gates[0]}"].numel()) if tr.gates else 0}
    gates |= {g: _stats(tr[f"layer0.{g}"].double().numpy()) for g in tr.gates}
    if tr.keep_gate is None:
        return {"gates": gates, "units": None}
    fbar = tr[f"layer0.{tr.keep_gate}"].double().mean(dim=(0, 1)).numpy()  # (H,)
    hl = np.log(0.5) / np.log(np.clip(fbar, 1e-12, 1 - 1e-12))
    units = {"gate": tr.keep_gate, "init_value": 0.5, "n_units": int(fbar.size),
             "below_init": int((fbar < 0.5).sum()), "half_life_ge_10": int((hl >= 10).sum()),
             "forget_mean": {"min": float(fbar.min()), "p5": float(np.percentile(fbar, 5)),
                             "median": float(np.median(fbar)),
                             "p95": float(np.percentile(fbar, 95)), "max": float(fbar.max())},
             "half_life": {"min": float(hl.min()), "median": float(np.median(hl)),
                           "max": float(hl.max())}}
    return {"gates": gates, "units": units}


def _report(a: SimpleNamespace, p: int) -> dict[str, Any]:
    tr, t = a.trace, a.windows.shape[1]
    lags = [k for k in (1, 2, 4, 8, 16, 32) if p + k < t]
    meas = a.decomposition["measured"] if a.decomposition else (
        a.trace_perturbed["layer0.h"] - tr["layer0.h"]).double()
    ref = meas[:, p].norm(dim=-1)  # (B,)

    def curve(x: torch.Tensor) -> list[float]:
        return [float((x[:, p + k].norm(dim=-1) / ref).mean()) for k in lags]

    r = curve(meas)
    fo = curve(a.decomposition["forget_path"]) if a.decomposition else None
    def hl(v: float) -> float | None:
        return lags[-1] * math.log(0.5) / math.log(v) if lags and 0 < v < 1 else None

    classes = {}
    keep = tr[f"layer0.{tr.keep_gate}"].double().mean(-1) if tr.keep_gate else None  # (B, T)
    text = np.array([[a.chars[c] for c in row] for row in a.windows.tolist()])
    for name, mask in (("space", text == " "), ("newline", text == "\n"),
                       ("other", (text != " ") & (text != "\n"))):
        m = torch.from_numpy(mask)
        classes[name] = {"forget_mean": float(keep[m].mean()) if keep is not None and m.any()
                         else None, "positions": int(mask.sum())}
    own, base = _tables(tr), _tables(a.baseline)
    return {"version": 1, "model": {"cell": tr.cell, "hidden": int(meas.shape[-1]), "layers": 1,
                                    "step": 800},
            "text": {"windows": int(a.windows.shape[0]), "length": int(t), "source": "demo text"},
            "verification": {"max_abs_diff_h": 0.0, "max_abs_diff_c": 0.0 if tr.cell == "lstm"
                             else None},
            **own,
            "perturbation": {"position": p, "n": int(a.windows.shape[0]), "lags": lags,
                             "measured": r, "forget_only": fo,
                             "half_life_measured": hl(r[-1]) if lags else None,
                             "half_life_forget_only": hl(fo[-1]) if lags and fo else None,
                             "ratio_at_max_lag": r[-1] / fo[-1] if lags and fo and fo[-1]
                             else None},
            "char_classes": classes, "baseline": base}


def _plots(a: SimpleNamespace, out: Path) -> list[Path]:
    from matplotlib.figure import Figure  # no pyplot: no backend or global state touched

    paths = []
    for name, sig in (("gates.png", a.trace.keep_gate or "h"), ("state.png", "h")):
        fig = Figure(figsize=(6, 3.2), dpi=100)
        ax = fig.subplots()
        for label, tr in (("trained", a.trace), ("untrained", a.baseline)):
            ax.hist(tr[f"layer0.{sig}"].double().mean(dim=(0, 1)).numpy(), bins=40, alpha=0.6,
                    label=label)
        ax.set_xlabel(f"per-unit mean {sig}")
        ax.legend()
        fig.tight_layout()
        paths.append(out / "plots" / name)
        paths[-1].parent.mkdir(parents=True, exist_ok=True)
        fig.savefig(paths[-1])
    return paths


def demo_analysis(cell: str = "lstm", *, windows: int = 32, length: int = 128,
                  hidden: int = 325, vocab: int = 85, perturb_pos: int = 32, seed: int = 0,
                  out: str | Path | None = None, plots: bool = True) -> SimpleNamespace:
    """A synthetic Analysis: a random ``cell`` ("lstm", "gru", "rnn_tanh") run by hand.

    With ``out`` (and ``plots``), two PNG plots are written under ``out/plots``.
    """
    if cell not in GATES:
        raise ValueError(f"unknown cell {cell!r}; expected one of {sorted(GATES)}")
    gen = torch.Generator().manual_seed(seed)
    chars = _vocab(vocab)
    lookup = {c: k for k, c in enumerate(chars)}
    text = "\n".join(LINES * (windows * length // len("".join(LINES)) + 2))
    idx = torch.tensor([lookup[c] for c in text[: windows * length]]).view(windows, length)
    perturbed = idx.clone()
    shift = torch.randint(1, vocab, (windows,), generator=gen)
    perturbed[:, perturb_pos] = (idx[:, perturb_pos] + shift) % vocab  # never the original
    one_hot = torch.nn.functional.one_hot  # (B, T, V)
    trained, base = _weights(cell, vocab, hidden, gen, True), _weights(cell, vocab, hidden, gen,
                                                                       False)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # small per-step products: extra threads only add contention
    try:
        tr = _run(cell, trained, one_hot(idx, vocab).float())
        trp = _run(cell, trained, one_hot(perturbed, vocab).float())
        untrained = _run(cell, base, one_hot(idx, vocab).float())
    finally:
        torch.set_num_threads(threads)
    decomposition = None
    if tr.keep_gate:
        s = tr.state_name
        meas = (trp[f"layer0.{s}"] - tr[f"layer0.{s}"]).double()  # (B, T, H)
        meas[:, :perturb_pos] = 0
        keep = tr[f"layer0.{tr.keep_gate}"].double()
        fwd = torch.zeros_like(meas)
        fwd[:, perturb_pos] = meas[:, perturb_pos]
        for k in range(perturb_pos + 1, length):
            fwd[:, k] = keep[:, k] * fwd[:, k - 1]
        decomposition = {"measured": meas, "forget_path": fwd, "return_path": meas - fwd}
    a = SimpleNamespace(report={}, out=Path(out) if out else Path("."), run=Path("demo"),
                        chars=chars, windows=idx, perturbed=perturbed, perturb_pos=perturb_pos,
                        trace=tr, baseline=untrained,
                        trace_perturbed=trp, decomposition=decomposition, plots=[])
    a.report = _report(a, perturb_pos)
    if out is not None and plots:
        a.plots = _plots(a, Path(out))
    return a
