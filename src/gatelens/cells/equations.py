"""The cell equations as pure functions: one step of PyTorch's LSTM, GRU and RNN.

cells.py re-runs a module fast, in place, in a transposed time-major layout. This module
says the same equations the plain way (docs/methods.md, "The cells"), for the places that need a
function rather than a loop: the anchored read-out feeds every step PyTorch's own state and
computes all T steps at once, and the divergence rate differentiates a step with
``torch.func.jvp``. So nothing here writes in place, and every step takes any leading
batch shape ``(...)``: one window ``(B, ·)``, or all positions ``(B, T, ·)`` given the
previous states of each.

Weights stay in PyTorch's own chunk order (LSTM i, f, g, o; GRU r, z, n) with both biases
added, as PyTorch adds them.

>>> import torch
>>> lstm = torch.nn.LSTM(3, 4)
>>> w = cell_weights(lstm)
>>> x, h, c = torch.randn(2, 5, 3), torch.zeros(2, 5, 4), torch.zeros(2, 5, 4)
>>> sig = step(w, x, h, c)
>>> list(sig), sig["c"].shape
(['i', 'f', 'g', 'o', 'c', 'h'], torch.Size([2, 5, 4]))
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import Tensor, nn
from torch.nn import functional as F

#: the trace cell of each ATen ``module.mode`` of PyTorch's recurrent modules
MODES = {"LSTM": "lstm", "GRU": "gru", "RNN_TANH": "rnn_tanh", "RNN_RELU": "rnn_relu"}

#: an edit inside a step: (trace letter, the value the step computed) -> the value it goes on
#: with (interventions: a gate edited here changes the state through the cell's equations)
StepEdit = Callable[[str, Tensor], Tensor]


def _keep(letter: str, value: Tensor) -> Tensor:
    return value


@dataclass(frozen=True)
class CellWeights:
    """One layer and direction's parameters, detached, in PyTorch's chunk order."""

    cell: str  # "lstm", "gru", "rnn_tanh" or "rnn_relu"
    w_ih: Tensor  # (G, F)  G = 4H (LSTM: i, f, g, o), 3H (GRU: r, z, n), H (RNN)
    w_hh: Tensor  # (G, H_out)  H_out = proj_size or H
    b_ih: Tensor | None  # (G,) or None when the module has bias=False
    b_hh: Tensor | None  # (G,)
    w_hr: Tensor | None  # (P, H) LSTM projection, else None

    @property
    def hidden_size(self) -> int:
        """H: the units of c (LSTM) or h (GRU, RNN)."""
        return self.w_ih.shape[0] // {"lstm": 4, "gru": 3}.get(self.cell, 1)

    @property
    def output_size(self) -> int:
        """H_out: the size of h (proj_size for a projected LSTM, else H)."""
        return self.w_hh.shape[1]


def cell_weights(module: nn.RNNBase, layer: int = 0, reverse: bool = False,
                 dtype: torch.dtype | None = None) -> CellWeights:
    """Read one layer and direction of an nn.LSTM, nn.GRU or nn.RNN (read only).

    ``dtype`` casts the copies (e.g. float64 for the divergence rate); None keeps the module's.

    >>> w = cell_weights(torch.nn.GRU(2, 3, bidirectional=True), 0, reverse=True)
    >>> w.cell, tuple(w.w_ih.shape), w.hidden_size
    ('gru', (9, 2), 3)
    """
    cell = MODES.get(module.mode) if isinstance(module, (nn.LSTM, nn.GRU, nn.RNN)) else None
    if cell is None:
        raise TypeError(f"cell_weights takes an nn.LSTM, nn.GRU or nn.RNN; "
                        f"got {type(module).__name__}")
    if not 0 <= layer < module.num_layers:
        raise ValueError(f"layer {layer} is outside the module's {module.num_layers} layers")
    if reverse and not module.bidirectional:
        raise ValueError("reverse=True needs a bidirectional module")
    sfx = f"_l{layer}{'_reverse' if reverse else ''}"

    def get(name: str) -> Tensor | None:
        p = getattr(module, name + sfx, None)
        return None if p is None else p.detach().to(dtype=dtype or p.dtype)

    w_hr = get("weight_hr") if cell == "lstm" and module.proj_size > 0 else None
    return CellWeights(cell, get("weight_ih"), get("weight_hh"), get("bias_ih"),
                       get("bias_hh"), w_hr)


def lstm_gates(w: CellWeights, x: Tensor, h: Tensor) -> dict[str, Tensor]:
    """i, f, g, o of an LSTM from the input ``x`` (..., F) and the previous ``h`` (..., H_out).

    >>> w = cell_weights(torch.nn.LSTM(3, 4))
    >>> g = lstm_gates(w, torch.randn(5, 3), torch.zeros(5, 4))
    >>> bool(((g["f"] > 0) & (g["f"] < 1)).all()), g["g"].shape
    (True, torch.Size([5, 4]))
    """
    z = F.linear(x, w.w_ih, w.b_ih) + F.linear(h, w.w_hh, w.b_hh)  # (..., 4H)
    zi, zf, zg, zo = z.chunk(4, dim=-1)  # (..., H) each
    return {"i": torch.sigmoid(zi), "f": torch.sigmoid(zf), "g": torch.tanh(zg),
            "o": torch.sigmoid(zo)}


def lstm_output(w: CellWeights, o: Tensor, c: Tensor,
                edit: StepEdit | None = None) -> dict[str, Tensor]:
    """h = o ⊙ tanh(c), or with a projection m = o ⊙ tanh(c) and h = W_hr m.

    >>> w = cell_weights(torch.nn.LSTM(3, 4, proj_size=2))
    >>> out = lstm_output(w, torch.ones(4), torch.zeros(4))
    >>> list(out), out["h"].shape
    (['m', 'h'], torch.Size([2]))
    """
    m = o * torch.tanh(c)  # (..., H)
    if w.w_hr is None:
        return {"h": m if edit is None else edit("h", m)}
    if edit is not None:
        m = edit("m", m)
        return {"m": m, "h": edit("h", F.linear(m, w.w_hr))}
    return {"m": m, "h": F.linear(m, w.w_hr)}  # (..., P)


def lstm_step(w: CellWeights, x: Tensor, h: Tensor, c: Tensor,
              edit: StepEdit | None = None) -> dict[str, Tensor]:
    """One LSTM step: i, f, g, o, c' = f ⊙ c + i ⊙ g, (m,) h'. ``edit`` (interventions)
    receives each signal as the step computes it and returns the value the step goes on with.

    >>> w = cell_weights(torch.nn.LSTM(3, 4))
    >>> s = lstm_step(w, torch.randn(3), torch.zeros(4), torch.zeros(4))
    >>> bool(torch.equal(s["c"], s["i"] * s["g"]))
    True
    """
    sig = lstm_gates(w, x, h)
    if edit is not None:
        sig = {k: edit(k, v) for k, v in sig.items()}
    sig["c"] = (edit or _keep)("c", sig["f"] * c + sig["i"] * sig["g"])  # (..., H)
    sig.update(lstm_output(w, sig["o"], sig["c"], edit))
    return sig


def gru_step(w: CellWeights, x: Tensor, h: Tensor,
             edit: StepEdit | None = None) -> dict[str, Tensor]:
    """One GRU step: r, z, n = tanh(W_in x + b_in + r ⊙ (W_hn h + b_hn)), h' = (1 − z) ⊙ n + z ⊙ h.
    ``edit``: as for ``lstm_step``.

    >>> w = cell_weights(torch.nn.GRU(3, 4))
    >>> list(gru_step(w, torch.randn(2, 3), torch.zeros(2, 4)))
    ['r', 'z', 'n', 'h']
    """
    xr, xz, xn = F.linear(x, w.w_ih, w.b_ih).chunk(3, dim=-1)  # (..., H) each
    hr, hz, hn = F.linear(h, w.w_hh, w.b_hh).chunk(3, dim=-1)  # (..., H) each
    e = edit or _keep
    r = e("r", torch.sigmoid(xr + hr))
    z = e("z", torch.sigmoid(xz + hz))
    n = e("n", torch.tanh(xn + r * hn))
    return {"r": r, "z": z, "n": n, "h": e("h", (1 - z) * n + z * h)}


def rnn_step(w: CellWeights, x: Tensor, h: Tensor,
             edit: StepEdit | None = None) -> dict[str, Tensor]:
    """One plain RNN step: pre = W_ih x + b_ih + W_hh h + b_hh, h' = tanh(pre) or relu(pre).
    ``edit``: as for ``lstm_step``.

    >>> w = cell_weights(torch.nn.RNN(3, 4, nonlinearity="relu"))
    >>> s = rnn_step(w, torch.randn(3), torch.zeros(4))
    >>> bool(torch.equal(s["h"], s["pre"].clamp(min=0)))
    True
    """
    e = edit or _keep
    pre = e("pre", F.linear(x, w.w_ih, w.b_ih) + F.linear(h, w.w_hh, w.b_hh))  # (..., H)
    return {"pre": pre, "h": e("h", torch.tanh(pre) if w.cell == "rnn_tanh" else torch.relu(pre))}


def step(w: CellWeights, x: Tensor, h: Tensor, c: Tensor | None = None,
         edit: StepEdit | None = None) -> dict[str, Tensor]:
    """One step of whichever cell ``w`` belongs to; ``c`` is required for the LSTM only;
    ``edit`` as for ``lstm_step``.

    >>> w = cell_weights(torch.nn.RNN(3, 4))
    >>> list(step(w, torch.randn(3), torch.zeros(4)))
    ['pre', 'h']
    """
    if w.cell == "lstm":
        if c is None:
            raise ValueError("an LSTM step needs the previous cell state c")
        return lstm_step(w, x, h, c, edit)
    if c is not None:
        raise ValueError(f"a {w.cell} step has no cell state; got c")
    if w.cell == "gru":
        return gru_step(w, x, h, edit)
    return rnn_step(w, x, h, edit)
