"""The classic cells that PyTorch has no module for, as functions and as nn.Modules.

ONNX and Keras files hold LSTM and GRU layers whose equations differ from nn.LSTM/nn.GRU
(docs/methods.md "Families from elsewhere"); loading their weights into PyTorch's modules
would give the read-out of a different model. Two cells cover them all:

- **VariantLSTM**: i, f, o = ρ(z_i + p_i ⊙ c), ρ(z_f + p_f ⊙ c), ρ(z_o + p_o ⊙ c');
  g = α(z_g); c' = f ⊙ c + i ⊙ g; h' = o ⊙ α(c'), with z = W_ih x + b_ih + W_hh h + b_hh in
  PyTorch's chunk order i, f, g, o, ρ the recurrent activation (any of ``ACTIVATIONS``),
  α the activation, and optional peepholes p (ONNX's P; zero without them).
- **VariantGRU**: r, z = ρ(·) in chunk order r, z, n; reset after (PyTorch, Keras
  ``reset_after=True``): n = α(W_in x + b_in + r ⊙ (W_hn h + b_hn)); reset before (ONNX
  ``linear_before_reset=0``, Keras ``reset_after=False``): n = α(W_in x + b_in +
  W_hn (r ⊙ h) + b_hn); h' = (1 − z) ⊙ n + z ⊙ h (z keeps).

One layer, one or two directions ("forward", "reverse" or both), batch first:
``forward(x (B, T, F), state=None) -> (out (B, T, D·H), (h_n (D, B, H), c_n))`` like
PyTorch's modules (the GRU's state is h_n alone). The steps (``lstm_variant_step``,
``gru_variant_step``) are pure and take any leading shape and dtype (float32, float64):
the read-out feeds them the module's own states; ``forward`` is the module's own
computation (input projections of all steps in one product, then the recurrence).

>>> import torch
>>> lstm = torch.nn.LSTM(3, 4, batch_first=True)
>>> v = VariantLSTM.from_lstm(lstm)
>>> x = torch.randn(2, 5, 3)
>>> bool((v(x)[0] - lstm(x)[0]).abs().max() < 1e-6)
True
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, replace

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from gatelens.cells.equations import StepEdit
from gatelens.errors import GatelensError


def _sparse_plus(x: Tensor) -> Tensor:
    return torch.where(x <= -1, torch.zeros_like(x),
                       torch.where(x >= 1, x, (x + 1) ** 2 / 4))


#: Elementwise activations by Keras name (Keras 3's definitions, keras.activations);
#: ``hard_sigmoid_v2`` is Keras 2's clip(0.2·x + 0.5, 0, 1), Keras 3's being x/6 + 0.5.
ACTIVATIONS: dict[str, Callable[[Tensor], Tensor]] = {
    "sigmoid": torch.sigmoid, "tanh": torch.tanh, "linear": lambda x: x,
    "hard_sigmoid": F.hardsigmoid,  # relu6(x + 3) / 6 = clip(x/6 + 0.5, 0, 1)
    "hard_sigmoid_v2": lambda x: torch.clamp(0.2 * x + 0.5, 0.0, 1.0),
    "relu": torch.relu, "relu6": lambda x: torch.clamp(x, 0.0, 6.0),
    "leaky_relu": lambda x: F.leaky_relu(x, 0.2), "elu": F.elu, "selu": F.selu,
    "celu": F.celu, "gelu": F.gelu, "silu": F.silu, "swish": F.silu, "mish": F.mish,
    "hard_silu": F.hardswish, "hard_swish": F.hardswish, "softplus": F.softplus,
    "softsign": F.softsign, "exponential": torch.exp, "log_sigmoid": F.logsigmoid,
    "hard_tanh": lambda x: torch.clamp(x, -1.0, 1.0), "tanh_shrink": lambda x: x - torch.tanh(x),
    "hard_shrink": lambda x: F.hardshrink(x, 0.5), "soft_shrink": lambda x: F.softshrink(x, 0.5),
    "squareplus": lambda x: (x + torch.sqrt(x * x + 4)) / 2, "sparse_plus": _sparse_plus,
    "sparse_sigmoid": lambda x: torch.clamp((x + 1) / 2, 0.0, 1.0),
}
DIRECTIONS = (("forward",), ("reverse",), ("forward", "reverse"))


def activation(name: str) -> Callable[[Tensor], Tensor]:
    """The activation of a Keras name; a one-line GatelensError for any other.

    >>> float(activation("hard_sigmoid_v2")(torch.tensor(1.0)))
    0.699999988079071
    """
    try:
        return ACTIVATIONS[name]
    except (KeyError, TypeError):
        raise GatelensError(f"activation {name!r} is not one gatelens computes; it computes "
                            f"{', '.join(sorted(ACTIVATIONS))}") from None


_activation = activation  # the constructors' argument of that name shadows it


@dataclass(frozen=True)
class VariantWeights:
    """One direction's parameters, detached, in PyTorch's chunk order (LSTM i, f, g, o;
    GRU r, z, n), with the cell's activations."""

    kind: str  # "lstm" or "gru"
    w_ih: Tensor  # (G, F)  G = 4H (LSTM) or 3H (GRU)
    w_hh: Tensor  # (G, H)
    b_ih: Tensor  # (G,)
    b_hh: Tensor  # (G,)
    peephole: Tensor | None = None  # (3, H): p_i, p_f, p_o (LSTM only)
    recurrent_activation: str = "sigmoid"
    activation: str = "tanh"
    reset_after: bool = True  # GRU only

    def to(self, dtype: torch.dtype) -> VariantWeights:
        """The same weights cast (e.g. float64 for the dynamics)."""
        cast = {k: getattr(self, k).to(dtype) for k in ("w_ih", "w_hh", "b_ih", "b_hh")}
        p = None if self.peephole is None else self.peephole.to(dtype)
        return replace(self, peephole=p, **cast)


def _keep(letter: str, value: Tensor) -> Tensor:
    return value


def lstm_variant_step(w: VariantWeights, x: Tensor, h: Tensor, c: Tensor,
                      edit: StepEdit | None = None) -> dict[str, Tensor]:
    """One VariantLSTM step from x (..., F), h (..., H), c (..., H): i, f, g, o, c', h'.
    ``edit`` (interventions): applied to each signal where the step computes it, so an
    edited gate reaches c' (and the peephole of o reads the edited c').

    >>> lstm = torch.nn.LSTM(3, 4)
    >>> w = VariantLSTM.from_lstm(lstm).weights(0)
    >>> s = lstm_variant_step(w, torch.randn(3), torch.zeros(4), torch.zeros(4))
    >>> list(s), bool(torch.equal(s["c"], s["i"] * s["g"]))
    (['i', 'f', 'g', 'o', 'c', 'h'], True)
    """
    e = edit or _keep
    rho, act = activation(w.recurrent_activation), activation(w.activation)
    z = F.linear(x, w.w_ih, w.b_ih) + F.linear(h, w.w_hh, w.b_hh)  # (..., 4H)
    zi, zf, zg, zo = z.chunk(4, dim=-1)  # (..., H) each
    if w.peephole is not None:
        zi, zf = zi + w.peephole[0] * c, zf + w.peephole[1] * c
    i, f, g = e("i", rho(zi)), e("f", rho(zf)), e("g", act(zg))
    c_new = e("c", f * c + i * g)  # (..., H)
    if w.peephole is not None:
        zo = zo + w.peephole[2] * c_new  # the output gate peeks at the new cell state
    o = e("o", rho(zo))
    return {"i": i, "f": f, "g": g, "o": o, "c": c_new, "h": e("h", o * act(c_new))}


def gru_variant_step(w: VariantWeights, x: Tensor, h: Tensor,
                     edit: StepEdit | None = None) -> dict[str, Tensor]:
    """One VariantGRU step from x (..., F) and h (..., H): r, z, n, h'. ``edit``: as for
    ``lstm_variant_step`` (an edited r reaches n, an edited z or n h').

    >>> gru = torch.nn.GRU(3, 4)
    >>> w = VariantGRU.from_gru(gru).weights(0)
    >>> list(gru_variant_step(w, torch.randn(2, 3), torch.zeros(2, 4)))
    ['r', 'z', 'n', 'h']
    """
    e = edit or _keep
    rho, act = activation(w.recurrent_activation), activation(w.activation)
    H = w.w_hh.shape[1]
    xr, xz, xn = F.linear(x, w.w_ih, w.b_ih).chunk(3, dim=-1)  # (..., H) each
    hr, hz = F.linear(h, w.w_hh[: 2 * H], w.b_hh[: 2 * H]).chunk(2, dim=-1)  # (..., H) each
    r, z = e("r", rho(xr + hr)), e("z", rho(xz + hz))
    if w.reset_after:
        n = act(xn + r * F.linear(h, w.w_hh[2 * H :], w.b_hh[2 * H :]))
    else:
        n = act(xn + F.linear(r * h, w.w_hh[2 * H :], w.b_hh[2 * H :]))
    n = e("n", n)
    return {"r": r, "z": z, "n": n, "h": e("h", (1 - z) * n + z * h)}


class _Variant(nn.Module):
    """One layer of a variant cell over one or two directions (see the module docstring)."""

    kind = ""
    n_chunks = 0
    gatelens_variant = True  # gatelens.families.variants opens these
    batch_first = True
    num_layers = 1

    def __init__(self, input_size: int, hidden_size: int, *, directions: tuple[str, ...] =
                 ("forward",), recurrent_activation: str = "sigmoid",
                 activation: str = "tanh") -> None:
        super().__init__()
        if min(input_size, hidden_size) < 1:
            raise GatelensError(f"input_size and hidden_size must be positive; got "
                                f"{input_size}, {hidden_size}")
        if tuple(directions) not in DIRECTIONS:
            raise GatelensError(f"directions must be one of {DIRECTIONS}; got {directions!r}")
        for name in (recurrent_activation, activation):
            _activation(name)  # a clear error now rather than at the first step
        self.input_size, self.hidden_size = input_size, hidden_size
        self.directions = tuple(directions)
        self.recurrent_activation, self.activation = recurrent_activation, activation
        D, G, bound = len(self.directions), self.n_chunks * hidden_size, 1 / math.sqrt(hidden_size)
        self.weight_ih = nn.Parameter(torch.empty(D, G, input_size).uniform_(-bound, bound))
        self.weight_hh = nn.Parameter(torch.empty(D, G, hidden_size).uniform_(-bound, bound))
        self.bias_ih = nn.Parameter(torch.empty(D, G).uniform_(-bound, bound))
        self.bias_hh = nn.Parameter(torch.empty(D, G).uniform_(-bound, bound))

    @property
    def bidirectional(self) -> bool:
        return len(self.directions) == 2

    @property
    def weight_ih_l0(self) -> Tensor:
        """The first direction's input weights (dtype and device, as on PyTorch's modules)."""
        return self.weight_ih[0]

    def weights(self, d: int, dtype: torch.dtype | None = None) -> VariantWeights:
        """Direction d's parameters (detached, cast to ``dtype`` if given)."""
        p = getattr(self, "peephole", None)
        w = VariantWeights(self.kind, self.weight_ih[d].detach(), self.weight_hh[d].detach(),
                           self.bias_ih[d].detach(), self.bias_hh[d].detach(),
                           None if p is None else p[d].detach().view(3, -1),
                           self.recurrent_activation, self.activation,
                           getattr(self, "reset_after", True))
        return w if dtype is None else w.to(dtype)

    def initial(self, x: Tensor, state: object) -> list[Tensor]:
        """The state parts (D, B, H) each (h, and c for the LSTM); zeros when None."""
        n = 2 if self.kind == "lstm" else 1
        D, B, H = len(self.directions), x.shape[0], self.hidden_size
        if x.ndim != 3 or x.shape[-1] != self.input_size:
            raise ValueError(f"inputs must be batch-first (B, T, {self.input_size}); got "
                             f"{tuple(x.shape)}")
        if state is None:
            return [x.new_zeros(D, B, H) for _ in range(n)]
        parts = [state] if isinstance(state, Tensor) else list(state)
        if len(parts) != n or any(not isinstance(p, Tensor) or p.shape != (D, B, H)
                                  for p in parts):
            what = "(h0, c0)" if n == 2 else "h0"
            raise ValueError(f"a {type(self).__name__}'s state is {what} of shape {(D, B, H)}")
        return parts

    def run(self, x: Tensor, state: object = None) -> tuple[list[list[Tensor]], list[Tensor]]:
        """The module's own computation: per direction the state sequences [h (B, T, H),
        (c)], in time order, and the final parts (D, B, H) each."""
        init = self.initial(x, state)
        seqs, finals = [], [[] for _ in init]
        for d, name in enumerate(self.directions):
            w = self.weights(d)
            xw = F.linear(x, w.w_ih, w.b_ih)  # (B, T, G): every step's input projection at once
            order = range(x.shape[1] - 1, -1, -1) if name == "reverse" else range(x.shape[1])
            parts, out = [p[d] for p in init], [[None] * x.shape[1] for _ in init]
            for t in order:
                parts = self.cell(w, xw[:, t], parts)
                for j, p in enumerate(parts):
                    out[j][t] = p
            seqs.append([torch.stack(o, dim=1) for o in out])  # (B, T, H) each
            for j, p in enumerate(parts):
                finals[j].append(p)
        return seqs, [torch.stack(f) for f in finals]

    def forward(self, x: Tensor, state: object = None) -> tuple[Tensor, object]:
        seqs, finals = self.run(x, state)
        out = torch.cat([s[0] for s in seqs], dim=-1)  # (B, T, D·H)
        return out, (tuple(finals) if self.kind == "lstm" else finals[0])

    @classmethod
    def _from_module(cls, m: nn.RNNBase) -> _Variant:
        """This variant with the weights of a one-layer nn.LSTM / nn.GRU, either direction."""
        dirs = ("forward", "reverse") if m.bidirectional else ("forward",)
        v = cls(m.input_size, m.hidden_size, directions=dirs)
        _copy_from(v, m)
        return v

    def extra_repr(self) -> str:
        return (f"{self.input_size}, {self.hidden_size}, directions={self.directions}, "
                f"recurrent_activation={self.recurrent_activation!r}, "
                f"activation={self.activation!r}")


class VariantLSTM(_Variant):
    """An LSTM with any recurrent activation and activation, and optional peepholes."""

    kind, n_chunks = "lstm", 4

    def __init__(self, input_size: int, hidden_size: int, *, peepholes: bool = False,
                 **kw) -> None:
        super().__init__(input_size, hidden_size, **kw)
        D = len(self.directions)
        self.peephole = nn.Parameter(torch.zeros(D, 3 * hidden_size)) if peepholes else None

    def cell(self, w: VariantWeights, xw: Tensor, parts: list[Tensor]) -> list[Tensor]:
        h, c = parts  # (B, H) each
        rho, act = activation(w.recurrent_activation), activation(w.activation)
        zi, zf, zg, zo = (xw + F.linear(h, w.w_hh, w.b_hh)).chunk(4, dim=-1)  # (B, H) each
        if w.peephole is not None:
            zi, zf = zi + w.peephole[0] * c, zf + w.peephole[1] * c
        c = rho(zf) * c + rho(zi) * act(zg)
        if w.peephole is not None:
            zo = zo + w.peephole[2] * c
        return [rho(zo) * act(c), c]

    @classmethod
    def from_lstm(cls, lstm: nn.LSTM) -> VariantLSTM:
        """The same weights as a one-layer nn.LSTM (for tests and comparisons)."""
        return cls._from_module(lstm)


class VariantGRU(_Variant):
    """A GRU with any recurrent activation and activation, reset after or before."""

    kind, n_chunks = "gru", 3

    def __init__(self, input_size: int, hidden_size: int, *, reset_after: bool = True,
                 **kw) -> None:
        super().__init__(input_size, hidden_size, **kw)
        self.reset_after = bool(reset_after)

    def cell(self, w: VariantWeights, xw: Tensor, parts: list[Tensor]) -> list[Tensor]:
        (h,) = parts  # (B, H)
        rho, act = activation(w.recurrent_activation), activation(w.activation)
        H = self.hidden_size
        xr, xz, xn = xw.chunk(3, dim=-1)  # (B, H) each
        hw = F.linear(h, w.w_hh[: 2 * H], w.b_hh[: 2 * H])  # (B, 2H)
        r, z = rho(xr + hw[:, :H]), rho(xz + hw[:, H:])
        if self.reset_after:
            n = act(xn + r * F.linear(h, w.w_hh[2 * H :], w.b_hh[2 * H :]))
        else:
            n = act(xn + F.linear(r * h, w.w_hh[2 * H :], w.b_hh[2 * H :]))
        return [z * h + (1 - z) * n]

    @classmethod
    def from_gru(cls, gru: nn.GRU) -> VariantGRU:
        """The same weights as a one-layer nn.GRU (reset after, sigmoid/tanh)."""
        return cls._from_module(gru)

    def extra_repr(self) -> str:
        return super().extra_repr() + f", reset_after={self.reset_after}"


def _copy_from(v: _Variant, module: nn.RNNBase) -> None:
    if module.num_layers != 1 or not module.bias:
        raise ValueError("from_lstm/from_gru take a one-layer module with biases")
    with torch.no_grad():
        for d, sfx in enumerate(["_l0", "_l0_reverse"][: len(v.directions)]):
            for name in ("weight_ih", "weight_hh", "bias_ih", "bias_hh"):
                getattr(v, name)[d].copy_(getattr(module, name + sfx))


def is_variant(module: object) -> bool:
    """Whether ``module`` is a VariantLSTM / VariantGRU.

    >>> is_variant(VariantGRU(2, 3)), is_variant(torch.nn.GRU(2, 3))
    (True, False)
    """
    return isinstance(module, _Variant)
