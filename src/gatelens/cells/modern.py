"""gatelens's own modern gated cells, traced by construction: minGRU, minLSTM, sLSTM.

Each module takes PyTorch's recurrent calling convention, batch first:
``forward(x (B, T, F), state=None) -> (out (B, T, H), state)``; ``state`` is h (L, B, H)
for minGRU and minLSTM and the tuple (h, c, n, m) of (L, B, H) tensors for sLSTM (m the
stabiliser). ``run(x, state, signals=True)`` also returns every signal of every layer (what
``gatelens.trace`` reads, families/modern.py); minGRU/minLSTM's forward takes the parallel scan
(modern_scan.py) on CUDA and the sequential step on CPU, where one thread runs it 1.3–1.7×
faster (``scan_mode``). docs/methods.md, "The cells", gives the equations.

The language-model block (Feng et al. 2024 stack their cells the same way; Beck et al.
2024 likewise around sLSTM): layer 0's cell reads x itself and y_0 = h_0 + MLP(LN(h_0));
layer k ≥ 1's cell reads LN(y_{k−1}), u_k = y_{k−1} + h_k and y_k = u_k + MLP(LN(u_k)),
MLP(v) = W_2 GELU(W_1 v + b_1) + b_2 with W_1 (2H × H). The module's output is y of the
top layer. So one layer is one cell (its state h reaches the output through a
position-wise map only) and depth gives the nonlinearity between cells.

Trace letters per layer (cellspec.py), besides ``y`` (the block's output):
minGRU z, cand (h̃), keep (1 − z), h; minLSTM f, i, cand, keep (f* = f/(f + i)), h;
sLSTM z, i, f, o (i and f stabilised: i = exp(ĩ − m'), f = exp(ln σ(f̃) + m − m')), c, n,
m, kappa (κ = f ⊙ n / n'), s (= c/n), h. An empty state (n = 0, as in the zero state)
enters with m = −∞, so its first step has m = ĩ, i = 1 and f = 0.

>>> import torch
>>> cell = MinGRU(3, 4, num_layers=2)
>>> out, h = cell(torch.randn(2, 5, 3))
>>> _, _, sig = cell.run(torch.randn(2, 5, 3), signals=True)
>>> tuple(out.shape), tuple(h.shape), list(sig)[:4]
((2, 5, 4), (2, 2, 4), ['layer0.z', 'layer0.cand', 'layer0.keep', 'layer0.h'])
"""

from __future__ import annotations

import abc
import math
from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from gatelens.cells.names import layer_name
from gatelens.cells.scan import scan, scan_sequential
from gatelens.errors import GatelensError

State = Tensor | tuple[Tensor, ...] | None
#: an edit inside a layer (interventions): (letter, the value computed) -> the value used
Edit = Callable[[str, Tensor], Tensor]


def _keep(letter: str, value: Tensor) -> Tensor:
    return value


class ModernRNN(nn.Module, abc.ABC):
    """The block stack around a cell; subclasses give the cell's chunks and layer step."""

    gatelens_modern = True  # trace() and verify() dispatch on this
    cell = ""
    chunks: tuple[str, ...] = ()
    n_state = 1  # tensors in one layer's carried state
    batch_first = True
    bidirectional = False

    def __init__(self, input_size: int, hidden_size: int, num_layers: int = 1) -> None:
        super().__init__()
        if min(input_size, hidden_size, num_layers) < 1:
            raise GatelensError("input_size, hidden_size and num_layers must be positive")
        self.input_size, self.hidden_size, self.num_layers = input_size, hidden_size, num_layers
        H, L = hidden_size, num_layers
        self.proj = nn.ModuleList(nn.Linear(input_size if k == 0 else H, len(self.chunks) * H)
                                  for k in range(L))
        self.norm_in = nn.ModuleList(nn.LayerNorm(H) for _ in range(L - 1))
        self.norm_mlp = nn.ModuleList(nn.LayerNorm(H) for _ in range(L))
        self.mlp = nn.ModuleList(nn.Sequential(nn.Linear(H, 2 * H), nn.GELU(), nn.Linear(2 * H, H))
                                 for _ in range(L))
        bound = 1 / math.sqrt(H)  # PyTorch's RNN init, U(−1/√H, 1/√H)
        for lin in self.proj:
            nn.init.uniform_(lin.weight, -bound, bound)
            nn.init.uniform_(lin.bias, -bound, bound)

    @property
    def weight_ih_l0(self) -> Tensor:
        """Layer 0's input weights (dtype and device, as on PyTorch's modules)."""
        return self.proj[0].weight

    def bias_of(self, layer: int, letter: str) -> Tensor:
        """The bias block of one gate's pre-activation (a view: writing it sets the bias)."""
        H = self.hidden_size
        k = self.chunks.index(letter)
        return self.proj[layer].bias[k * H : (k + 1) * H]

    def _states(self, state: State, x: Tensor) -> list[tuple[Tensor, ...]]:
        """Per-layer initial states; zeros when ``state`` is None."""
        L, B, H = self.num_layers, x.shape[0], self.hidden_size
        if x.ndim != 3 or x.shape[-1] != self.input_size:
            raise ValueError(f"inputs must be (B, T, {self.input_size}); got {tuple(x.shape)}")
        if state is None:
            return [tuple(x.new_zeros(B, H) for _ in range(self.n_state)) for _ in range(L)]
        parts = (state,) if isinstance(state, Tensor) else tuple(state)
        if len(parts) != self.n_state or any(p.shape != (L, B, H) for p in parts):
            raise ValueError(f"a {type(self).__name__}'s state is {self.n_state} tensor(s) of "
                             f"shape {(L, B, H)}")
        return [tuple(p[k] for p in parts) for k in range(L)]

    def _pack(self, finals: list[tuple[Tensor, ...]]) -> State:
        parts = tuple(torch.stack([f[j] for f in finals]) for j in range(self.n_state))
        return parts[0] if self.n_state == 1 else parts  # (L, B, H) each

    def block(self, k: int, h: Tensor, below: Tensor | None) -> Tensor:
        """y_k from the cell's h_k and the block below's y_{k−1} (None for layer 0)."""
        u = h if below is None else below + h  # (B, T, H)
        return u + self.mlp[k](self.norm_mlp[k](u))

    def run(self, x: Tensor, state: State = None, parallel: bool = True,
            signals: bool = False) -> tuple[Tensor, State, dict[str, Tensor]]:
        """(y of the top layer (B, T, H), final state, the trace's signals if asked)."""
        init = self._states(state, x)
        below, finals, sig = None, [], {}
        for k in range(self.num_layers):
            inp = x if k == 0 else self.norm_in[k - 1](below)  # (B, T, F_k)
            layer, final = self.layer(k, inp, init[k], parallel)
            below = self.block(k, layer["h"], below)  # (B, T, H)
            finals.append(final)
            if signals:
                sig.update({f"{layer_name(k)}.{n}": t for n, t in layer.items()})
                sig[f"{layer_name(k)}.y"] = below
        return below, self._pack(finals), sig

    #: minGRU/minLSTM's forward: "parallel" (the scan), "sequential", or "auto": the scan
    #: on CUDA, the sequential step on CPU, where it is the faster (BENCHMARKS.md)
    scan_mode = "auto"

    def forward(self, x: Tensor, state: State = None) -> tuple[Tensor, State]:
        mode = self.scan_mode
        out, final, _ = self.run(x, state, parallel=mode == "parallel" or (
            mode == "auto" and x.is_cuda))
        return out, final  # (B, T, H)

    #: signals computed from the others that no later one reads (editing them would change
    #: nothing but their read-out)
    derived: tuple[str, ...] = ()

    @abc.abstractmethod
    def layer(self, k: int, inp: Tensor, init: tuple[Tensor, ...], parallel: bool,
              edit: Edit | None = None) -> tuple[dict[str, Tensor], tuple[Tensor, ...]]:
        """Layer k of the cell on its whole input: its signals and its final state.
        ``edit`` (interventions, sequential only) receives each signal (B, T, H) as it is
        computed and returns the value the layer goes on with."""

    def stack_step(self, x_t: Tensor, parts: list[Tensor]) -> list[Tensor]:
        """One step of the whole stack on the divergence rate's carried state: per layer h
        (sLSTM h, s, ℓ = m + ln n, which carries c and n without their arbitrary scale)."""
        per = len(parts) // self.num_layers
        below, out = None, []
        for k in range(self.num_layers):
            inp = x_t if k == 0 else self.norm_in[k - 1](below)  # (B, F_k)
            new = self.free_step(k, inp, parts[per * k : per * (k + 1)])
            below = self.block(k, new[0], below)  # (B, H)
            out += new
        return out

    def free_step(self, k: int, inp: Tensor, parts: list[Tensor]) -> list[Tensor]:
        sig, _ = self.layer(k, inp[:, None], tuple(parts), parallel=False)
        return [sig["h"][:, 0]]  # (B, H)

    def free_states(self, sig: dict[str, Tensor]) -> list[Tensor]:
        """``stack_step``'s state along a run's signals, (B, T, H) per part, layer by layer."""
        return [sig[f"{layer_name(k)}.h"] for k in range(self.num_layers)]


class MinGRU(ModernRNN):
    """minGRU: z = σ(W_z x + b_z), h̃ = W_h x + b_h, h' = (1 − z) ⊙ h + z ⊙ h̃."""

    cell, chunks = "mingru", ("z", "cand")

    def layer(self, k, inp, init, parallel, edit=None):
        e = edit or _keep
        pre_z, cand = self.proj[k](inp).chunk(2, dim=-1)  # (B, T, H) each
        z = e("z", torch.sigmoid(pre_z))
        cand = e("cand", cand)
        keep = e("keep", 1 - z)
        if parallel:
            h = scan(keep, z * cand, init[0])  # (B, T, H)
        else:
            h = e("h", scan_sequential(keep, z * cand, init[0]))  # (B, T, H)
        return {"z": z, "cand": cand, "keep": keep, "h": h}, (h[:, -1],)


class MinLSTM(ModernRNN):
    """minLSTM: f, i = σ(·), h̃ = W_h x + b_h; f* = f/(f + i), i* = i/(f + i);
    h' = f* ⊙ h + i* ⊙ h̃."""

    cell, chunks = "minlstm", ("f", "i", "cand")

    def layer(self, k, inp, init, parallel, edit=None):
        e = edit or _keep
        pre_f, pre_i, cand = self.proj[k](inp).chunk(3, dim=-1)  # (B, T, H) each
        f0, i0 = torch.sigmoid(pre_f), torch.sigmoid(pre_i)
        f, i, cand = e("f", f0), e("i", i0), e("cand", cand)
        # f* = f/(f + i) = σ(ln σ(f̃) − ln σ(ĩ)): finite where f and i both underflow to 0
        gap = F.logsigmoid(pre_f) - F.logsigmoid(pre_i)  # (B, T, H)
        keep, write = torch.sigmoid(gap), torch.sigmoid(-gap)  # f*, i*
        if f is not f0 or i is not i0:  # an edited f or i: f*, i* from the edited values
            keep, write = f / (f + i), i / (f + i)
        keep = e("keep", keep)
        if parallel:
            h = scan(keep, write * cand, init[0])  # (B, T, H)
        else:
            h = e("h", scan_sequential(keep, write * cand, init[0]))  # (B, T, H)
        return {"f": f, "i": i, "cand": cand, "keep": keep, "h": h}, (h[:, -1],)


class SLSTM(ModernRNN):
    """sLSTM with ``heads`` blocks of recurrent weights R (block-diagonal), stabilised."""

    cell, chunks, n_state = "slstm", ("z", "i", "f", "o"), 4
    derived = ("kappa",)

    def __init__(self, input_size: int, hidden_size: int, num_layers: int = 1,
                 heads: int = 1) -> None:
        if heads < 1 or hidden_size % heads:
            raise GatelensError(f"--heads {heads} must divide --hidden {hidden_size}")
        super().__init__(input_size, hidden_size, num_layers)
        self.heads = heads
        d = hidden_size // heads
        bound = 1 / math.sqrt(hidden_size)
        self.R = nn.ParameterList(nn.Parameter(torch.empty(4, heads, d, d).uniform_(-bound, bound))
                                  for _ in range(num_layers))

    def recurrent(self, k: int, h: Tensor) -> Tensor:
        """R h, block-diagonal over heads: (B, H) -> (B, 4H) in chunk order z, i, f, o."""
        B = h.shape[0]
        hh = h.view(B, self.heads, -1)  # (B, heads, d)
        return torch.einsum("bnd,gnde->bgne", hh, self.R[k]).reshape(B, -1)  # (B, 4H)

    def layer(self, k, inp, init, parallel, edit=None):
        e = edit or _keep
        pre_x = self.proj[k](inp)  # (B, T, 4H)
        h, c, n, m = init
        # An empty state (n = 0) carries nothing for the stabiliser to keep in range, so its
        # m is −∞ and m₁ = ĩ₁: h is the same for any m₀ (c and n are 0), but m₀ = 0 lets i₁
        # underflow to 0 when ĩ₁ ≪ ln σ(f̃₁) and c₁/n₁ is 0/0 (weights ×16 did it).
        m = torch.where(n > 0, m, torch.full_like(m, -math.inf))
        names = ("z", "i", "f", "o", "c", "n", "m", "kappa", "s", "h")
        out: dict[str, list[Tensor]] = {name: [] for name in names}
        for x_t in pre_x.unbind(1):  # one backward for all steps (pre_x[:, t] costs O(T²))
            pz, pi, pf, po = (x_t + self.recurrent(k, h)).chunk(4, dim=-1)  # (B, H)
            z, o, log_f = e("z", torch.tanh(pz)), e("o", torch.sigmoid(po)), F.logsigmoid(pf)
            m_new = e("m", torch.maximum(log_f + m, pi))  # (B, H)
            i, f = e("i", torch.exp(pi - m_new)), e("f", torch.exp(log_f + m - m_new))
            n_new = e("n", f * n + i)
            kappa = f * n / n_new
            c, n, m = e("c", f * c + i * z), n_new, m_new
            s = e("s", c / n)
            h = e("h", o * s)
            for name, v in zip(names, (z, i, f, o, c, n, m, kappa, s, h), strict=True):
                out[name].append(v)
        sig = {name: torch.stack(v, dim=1) for name, v in out.items()}  # (B, T, H)
        return sig, (h, c, n, m)

    def free_step(self, k: int, inp: Tensor, parts: list[Tensor]) -> list[Tensor]:
        """The same step on (h, s, ℓ): ℓ' = ln(f e^ℓ + e^ĩ), κ = f e^ℓ / e^ℓ',
        s' = κ ⊙ s + (1 − κ) ⊙ z, h' = o ⊙ s'."""
        h, s, ell = parts
        pz, pi, pf, po = (self.proj[k](inp) + self.recurrent(k, h)).chunk(4, dim=-1)  # (B, H)
        log_f = F.logsigmoid(pf)
        ell_new = torch.logaddexp(log_f + ell, pi)
        kappa = torch.exp(log_f + ell - ell_new)
        s_new = kappa * s + (1 - kappa) * torch.tanh(pz)
        return [torch.sigmoid(po) * s_new, s_new, ell_new]

    def free_states(self, sig: dict[str, Tensor]) -> list[Tensor]:
        out = []
        for k in range(self.num_layers):
            h, s, m, n = (sig[f"{layer_name(k)}.{x}"] for x in ("h", "s", "m", "n"))
            out += [h, s, m + torch.log(n)]  # (B, T, H)
        return out
