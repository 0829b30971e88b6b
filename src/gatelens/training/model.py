"""The language models ``gatelens train`` builds, from the ``--cell`` family's recipe
(families/recipe.py), and their initialisers.

CharLM: one-hot (or embedding) -> a module that carries its state (nn.LSTM/GRU/RNN,
gatelens's cells) -> Linear; OfficialLM: an official implementation's module, fed the whole
text each call.

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

from gatelens.errors import GatelensError
from gatelens.families.recipe import Recipe
from gatelens.families.registry import check_build, recipe
from gatelens.training.config import check_chrono
from gatelens.training.fits import check_training_fits


class CharLM(nn.Module):
    """A character-level language model around one recurrent module that carries its state
    (a recipe that reads ``"features"``: PyTorch's nn.LSTM/GRU/RNN, gatelens's cells).

    Args:
        vocab_size: V, characters in the vocabulary.
        hidden: H, units per layer.
        layers: stacked recurrent layers.
        cell: a ``--cell`` name whose recipe reads features ("lstm", "gru", "rnn",
            "mingru", "minlstm", "slstm" ...); the module is ``rnn``.
        embed: None for one-hot input (W_ih has one column per character), else the
            embedding size.
        nonlinearity: "tanh" or "relu" (plain RNN only).
        heads: sLSTM only, blocks of its block-diagonal recurrent weights.
    """

    def __init__(self, vocab_size: int, hidden: int = 325, layers: int = 1, cell: str = "lstm",
                 embed: int | None = None, nonlinearity: str = "tanh", heads: int = 1) -> None:
        super().__init__()
        r = _recipe(cell)
        if r.official:
            raise ValueError(f"--cell {r.name} reads {r.reads}, not features: build it with "
                             "OfficialLM (or build_lm)")
        self.vocab_size, self.cell = vocab_size, r.name
        self.embed = nn.Embedding(vocab_size, embed) if embed else None
        n_in = embed if embed else vocab_size
        self.rnn = r.build(n_in, hidden, layers, vocab_size=vocab_size, heads=heads,
                           nonlinearity=nonlinearity, settings={})
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


class OfficialLM(nn.Module):
    """An official implementation's module (``rnn``) between an embedding and a head, as
    its recipe says (``reads``: "embedded" gets our embedding, "ids" embeds the ids
    itself, "lm" is a whole language model with its own embedding and head).

    ``forward(idx, state)`` returns (logits (B, T, V), the ids read so far): these modules
    are run over the whole text, so ``state`` (for sampling one character at a time) is the
    ids before ``idx``, and each call reads them again. The weights keep the package's own
    names under ``rnn.``; config.json's model "official" block records every setting that
    rebuilds the module (the recipe's ``settings``), so ``load_run`` reopens it.
    """

    def __init__(self, vocab_size: int, cell: str, hidden: int, layers: int = 1,
                 heads: int = 1, settings: dict | None = None) -> None:
        super().__init__()
        r = _recipe(cell)
        if not r.official:
            raise ValueError(f"--cell {r.name} carries its state: build it with CharLM")
        reason = check_build(r, hidden, layers, heads)
        if reason:
            raise GatelensError(reason)
        # a run's record adds the package's version: only the settings rebuild the module
        s = {**r.settings, **{k: v for k, v in (settings or {}).items() if k in r.settings}}
        self.vocab_size, self.cell, self.settings, self.recipe = vocab_size, r.name, s, r
        r.need()
        self.rnn = r.build(vocab_size if r.reads == "lm" else hidden, hidden, layers,
                           vocab_size=vocab_size, heads=heads, nonlinearity="tanh",
                           settings=s)
        self.embed = nn.Embedding(vocab_size, hidden) if r.reads == "embedded" else None
        self.head = None if r.reads == "lm" else nn.Linear(hidden, vocab_size)

    @classmethod
    def from_config(cls, model: dict, vocab_size: int) -> OfficialLM:
        """The (untrained) model a run's config.json "model" block describes."""
        return cls(vocab_size, model["cell"], model["hidden"], model["layers"],
                   model.get("heads", 1), model.get("official"))

    def encode(self, idx: Tensor) -> Tensor:
        """What ``rnn`` reads for ids (B, T): our embedding's output (a recipe that reads
        "embedded"), else the ids themselves (it embeds them, or is a whole LM)."""
        return idx if self.embed is None else self.embed(idx)

    def core(self, idx: Tensor) -> Tensor:
        """Logits (B, T, V) of ids (B, T), the whole sequence in one call of ``rnn``."""
        out = self.recipe.run(self.rnn, self.encode(idx))  # (B, T, d), or the logits of a whole LM
        # a package's last norm may return float32 whatever the weights (transformers'
        # Mamba-2 does): the head reads its own dtype, as the package's own LM head does
        return out if self.head is None else self.head(out.to(self.head.weight.dtype))

    def forward(self, idx: Tensor, state: Tensor | None = None) -> tuple[Tensor, Tensor]:
        full = idx if state is None else torch.cat([state, idx], dim=1)  # (B, T_seen)
        return self.core(full)[:, full.shape[1] - idx.shape[1]:], full


def _recipe(cell: str) -> Recipe:
    try:
        return recipe(cell)
    except GatelensError as e:
        raise ValueError(str(e)) from None


def _keep_recipe(model: CharLM | OfficialLM, what: str) -> Recipe:
    r = _recipe(model.cell)
    if not r.takes("keep"):
        raise ValueError(f"{what} needs a gated cell (lstm or gru), not {model.cell!r}")
    return r


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
    r = _keep_recipe(model, "a forget bias")
    r.keep_init(model.rnn, lambda n: torch.full((n,), float(value), dtype=torch.float64),
                False)


@torch.no_grad()
def set_chrono(model: CharLM, t_max: float, generator: torch.Generator | None = None) -> None:
    """Tallec & Ollivier's chrono initialisation: b_f ~ log U(1, t_max − 1), b_i = −b_f.

    For a GRU it acts on z, the keep gate (a GRU has no separate input gate).
    """
    r = _keep_recipe(model, "chrono initialisation")
    check_chrono(t_max)

    def draw(n: int) -> Tensor:  # log U(1, t_max - 1), one draw per layer and direction
        u = torch.rand(n, generator=generator, dtype=torch.float64)
        return torch.log(1 + u * (t_max - 2))

    r.keep_init(model.rnn, draw, True)


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
    if _recipe(model["cell"]).official:
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


def check_fits(cfg, model: dict, vocab_size: int) -> None:
    """GatelensError before training ``cfg`` (a TrainConfig; ``model`` its config.json
    model block) on ``vocab_size`` characters that cannot fit in this machine's memory
    (training/fits.py): its parameters counted on the meta device, nothing allocated."""
    check_training_fits(cfg, parameter_count(model, vocab_size), vocab_size)


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
    step = _recipe(model["cell"]).size_multiple(int(model.get("heads", 1) or 1))

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
