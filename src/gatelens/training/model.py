"""CharLM: one-hot (or embedding) -> nn.RNN/GRU/LSTM -> Linear, and its initialisers.

Parameter names are the checkpoint format: ``rnn.weight_ih_l0`` ... keep PyTorch's own
names, the decoder is ``head.weight``/``head.bias``, an embedding ``embed.weight``.

>>> m = CharLM(vocab_size=5, hidden=4, cell="gru")
>>> logits, state = m(torch.zeros(2, 3, dtype=torch.long))
>>> tuple(logits.shape), tuple(state.shape)
((2, 3, 5), (1, 2, 4))
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from gatelens.cells.modern import MODERN, is_modern
from gatelens.families.spec import CellSpec, family_spec
from gatelens.training.config import check_chrono
from gatelens.training.official_model import OfficialLM, is_official, size_multiple

#: PyTorch's modules by ``--cell`` name; gatelens's own cells are ``modern.MODERN``.
CELLS = {"lstm": nn.LSTM, "gru": nn.GRU, "rnn": nn.RNN}


class CharLM(nn.Module):
    """A character-level language model around one PyTorch recurrent module.

    Args:
        vocab_size: V, characters in the vocabulary.
        hidden: H, units per layer.
        layers: stacked recurrent layers.
        cell: "lstm", "gru", "rnn" (PyTorch's modules) or "mingru", "minlstm", "slstm"
            (gatelens.cells.modern; parameters under ``rnn.`` all the same).
        embed: None for one-hot input (W_ih has one column per character), else the
            embedding size.
        nonlinearity: "tanh" or "relu" (plain RNN only).
        heads: sLSTM only, blocks of its block-diagonal recurrent weights.
    """

    def __init__(self, vocab_size: int, hidden: int = 325, layers: int = 1, cell: str = "lstm",
                 embed: int | None = None, nonlinearity: str = "tanh", heads: int = 1) -> None:
        super().__init__()
        if cell not in CELLS and cell not in MODERN:
            raise ValueError(f"cell must be one of {sorted(CELLS) + sorted(MODERN)}, "
                             f"got {cell!r}")
        self.vocab_size, self.cell = vocab_size, cell
        self.embed = nn.Embedding(vocab_size, embed) if embed else None
        n_in = embed if embed else vocab_size
        if cell in MODERN:
            kwargs = {"heads": heads} if cell == "slstm" else {}
            self.rnn = MODERN[cell](n_in, hidden, num_layers=layers, **kwargs)
        else:
            kwargs = {"nonlinearity": nonlinearity} if cell == "rnn" else {}
            self.rnn = CELLS[cell](n_in, hidden, num_layers=layers, batch_first=True, **kwargs)
        self.head = nn.Linear(hidden, vocab_size)

    @classmethod
    def from_config(cls, model: dict, vocab_size: int) -> CharLM:
        """The (untrained) model a run's config.json "model" block describes.

        >>> CharLM.from_config({"cell": "gru", "hidden": 4, "layers": 2}, 5).rnn.num_layers
        2
        """
        return cls(vocab_size=vocab_size, hidden=model["hidden"], layers=model["layers"],
                   cell=model["cell"], embed=model.get("embed"),
                   nonlinearity=model.get("nonlinearity", "tanh"), heads=model.get("heads", 1))

    def encode(self, idx: Tensor) -> Tensor:
        """The recurrent module's input for character indices (B, T) -> (B, T, V or E)."""
        if self.embed is not None:
            return self.embed(idx)
        return F.one_hot(idx, self.vocab_size).to(self.head.weight.dtype)

    def forward(self, idx: Tensor, state=None) -> tuple[Tensor, object]:
        out, state = self.rnn(self.encode(idx), state)  # (B, T, H)
        return self.head(out), state  # (B, T, V)


def _bias_chunks(rnn: nn.RNNBase, layer: int, suffix: str = "") -> tuple[Tensor, Tensor]:
    H = rnn.hidden_size
    b_ih = getattr(rnn, f"bias_ih_l{layer}{suffix}")
    b_hh = getattr(rnn, f"bias_hh_l{layer}{suffix}")
    return b_ih.view(-1, H), b_hh.view(-1, H)  # (chunks, H)


def _keep_spec(model: CharLM, what: str) -> CellSpec:
    spec = family_spec(model.cell)
    if spec.keep_gate is None:
        raise ValueError(f"{what} needs a gated cell (lstm or gru), not {model.cell!r}")
    return spec


def _layers(rnn: nn.RNNBase):
    for layer in range(rnn.num_layers):
        for suffix in ("", "_reverse") if rnn.bidirectional else ("",):
            yield layer, suffix


@torch.no_grad()
def zero_biases(model: CharLM) -> list[str]:
    """``--bias-init zero``: set every bias of the recurrent module (``rnn.*bias*``: PyTorch's
    b_ih and b_hh, a gatelens cell's gate and MLP biases) to 0; the head keeps its own.
    Returns the names set.

    >>> m = CharLM(5, hidden=3, cell="gru"); zero_biases(m)
    ['rnn.bias_ih_l0', 'rnn.bias_hh_l0']
    >>> bool((m.rnn.bias_ih_l0 == 0).all()), bool((m.head.bias != 0).any())
    (True, True)
    """
    names = []
    for name, p in model.rnn.named_parameters():
        if name.rsplit(".", 1)[-1].startswith("bias"):
            p.zero_()
            names.append(f"rnn.{name}")
    return names


@torch.no_grad()
def set_forget_bias(model: CharLM, value: float) -> None:
    """Make the keep gate's total bias (b_ih + b_hh on the f slice; GRU: z) equal ``value``.

    >>> m = CharLM(5, hidden=3); set_forget_bias(m, 2.0)
    >>> (m.rnn.bias_ih_l0[3:6] + m.rnn.bias_hh_l0[3:6]).tolist()
    [2.0, 2.0, 2.0]
    """
    if is_modern(model.rnn):
        for layer in range(model.rnn.num_layers):
            _modern_keep_bias(model.rnn, layer, torch.full((model.rnn.hidden_size,), value))
        return
    k = _keep_spec(model, "a forget bias").chunk_of_keep
    for layer, suffix in _layers(model.rnn):
        b_ih, b_hh = _bias_chunks(model.rnn, layer, suffix)
        b_ih[k].fill_(value)
        b_hh[k].zero_()


@torch.no_grad()
def set_chrono(model: CharLM, t_max: float, generator: torch.Generator | None = None) -> None:
    """Tallec & Ollivier's chrono initialisation: b_f ~ log U(1, t_max − 1), b_i = −b_f.

    For a GRU it acts on z, the keep gate (a GRU has no separate input gate).
    """
    spec = _keep_spec(model, "chrono initialisation")
    check_chrono(t_max)
    if is_modern(model.rnn):
        for layer in range(model.rnn.num_layers):
            u = torch.rand(model.rnn.hidden_size, generator=generator, dtype=torch.float64)
            _modern_keep_bias(model.rnn, layer, torch.log(1 + u * (t_max - 2)), chrono=True)
        return
    k = spec.chunk_of_keep
    for layer, suffix in _layers(model.rnn):
        b_ih, b_hh = _bias_chunks(model.rnn, layer, suffix)
        u = torch.rand(b_ih.shape[1], generator=generator, dtype=torch.float64)
        b_f = torch.log(1 + u * (t_max - 2)).to(b_ih.dtype)  # log U(1, t_max - 1)
        b_ih[k].copy_(b_f)
        b_hh[k].zero_()
        if spec.input_gate is not None:
            b_ih[spec.chunk(spec.input_gate)].copy_(-b_f)
            b_hh[spec.chunk(spec.input_gate)].zero_()


def _modern_keep_bias(rnn: nn.Module, layer: int, b_f: Tensor, chrono: bool = False) -> None:
    """A gatelens cell's keep bias: minGRU b_z = −b (keep 1 − z = σ(−z̃) starts at σ(b));
    minLSTM b_f = b, b_i = −b (f* = σ(b)/(σ(b) + σ(−b)) = σ(b) before the weights act);
    sLSTM b_f = b (its forget gate; κ has no bias of its own), with chrono b_i = −b too."""
    b_f = b_f.to(rnn.weight_ih_l0.dtype)
    if rnn.cell == "mingru":
        rnn.bias_of(layer, "z").copy_(-b_f)
        return
    rnn.bias_of(layer, "f").copy_(b_f)
    if rnn.cell == "minlstm" or chrono:
        rnn.bias_of(layer, "i").copy_(-b_f)


def initial_keep_value(forget_bias: float | None) -> float:
    """The starting value of the keep gate that "below init" is measured against.

    >>> initial_keep_value(None), round(initial_keep_value(1.0), 4)
    (0.5, 0.7311)
    """
    return 0.5 if forget_bias is None else 1.0 / (1.0 + math.exp(-forget_bias))


def build_lm(model: dict, vocab_size: int) -> CharLM | OfficialLM:
    """The (untrained) language model a run's config.json "model" block describes: a
    CharLM, or an official implementation's module in an OfficialLM.

    >>> type(build_lm({"cell": "gru", "hidden": 4, "layers": 1}, 5)).__name__
    'CharLM'
    """
    if is_official(model["cell"]):
        return OfficialLM.from_config(model, vocab_size)
    return CharLM.from_config(model, vocab_size)


def parameter_count(model: dict, vocab_size: int) -> int:
    """Trainable parameters of the CharLM a "model" block describes (built on the meta
    device: no memory, no init).

    >>> parameter_count({"cell": "lstm", "hidden": 325, "layers": 1}, 84)
    561684
    >>> 4 * (325 * 84 + 325 * 325 + 2 * 325) + 325 * 84 + 84  # W_ih, W_hh, 2 biases; head
    561684
    """
    with torch.device("meta"):
        m = build_lm(model, vocab_size)
    return sum(p.numel() for p in m.parameters())


def matched_hidden(model: dict, target: int, vocab_size: int) -> int:
    """The hidden size (a multiple of sLSTM's heads, or of what an official cell's width
    must divide by) whose parameter count is nearest ``target``, the rest of ``model`` as
    given; the smaller on a tie.

    >>> matched_hidden({"cell": "gru", "layers": 1}, 561684, 84)
    379
    >>> [parameter_count({"cell": "gru", "hidden": h, "layers": 1}, 84) - 561684
    ...  for h in (378, 379, 380)]
    [-3672, -1059, 1560]
    """
    step = int(model.get("heads", 1) or 1)
    if is_official(model["cell"]):
        step = size_multiple(model["cell"], step)

    def count(k: int) -> int:  # increasing in k
        return parameter_count({**model, "hidden": k * step}, vocab_size)

    hi = 1
    while count(hi) < target:
        hi *= 2
    lo = max(1, hi // 2)
    while lo < hi:  # smallest k with count(k) >= target
        mid = (lo + hi) // 2
        lo, hi = (mid + 1, hi) if count(mid) < target else (lo, mid)
    best = min((k for k in (lo - 1, lo) if k >= 1), key=lambda k: (abs(count(k) - target), k))
    return best * step
