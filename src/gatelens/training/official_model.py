"""The official implementations as a character language model's recurrent part.

``--cell xlstm-slstm | xlstm-mlstm | mingru-lm | hf-mamba | hf-mamba2 | hf-rwkv | mambapy``
builds the package's own module at ``--hidden`` (its model width d) and ``--layers`` (its
blocks), between an embedding and a linear head, and trains it with the same loop as a
CharLM (``training/train.py``). The weights keep the package's own names under ``rnn.``
(``rnn.blocks.0.xlstm.slstm_cell._recurrent_kernel_`` ..., ``rnn.layers.0.mixer.A_log``),
the embedding ``embed.weight``, the head ``head.weight``/``head.bias``; config.json's model
block records under "official" every setting that rebuilds the module (``OFFICIAL``'s
fixed choices), so ``load_run`` and ``gatelens analyze RUN`` reopen it.

    xlstm-slstm  xlstm's xLSTMBlockStack of sLSTM blocks (vanilla backend, conv 4, FFN 1.3)
    xlstm-mlstm  xlstm's xLSTMBlockStack of mLSTM blocks (proj 2, conv 4, qkv blocks 4)
    mingru-lm    mingru-pytorch's minLM (minGRU, expansion 1.5, FFN 4); its own embedding
                 and head (token_emb, to_logits) stand for ours
    hf-mamba     transformers' MambaModel (state 16, expand 2, conv 4); its embedding
    hf-mamba2    transformers' Mamba2Model (state 16, expand 2, head_dim 16, 1 group)
    hf-rwkv      transformers' RwkvModel (RWKV-4, FFN 4 d); two layers at least
    mambapy      mambapy's Mamba (state 16, expand 2, conv 4)

Initialisation is each package's own. xlstm starts its recurrent kernel R and the mLSTM
gate weights at zero: training moves them (tests/test_official_train.py checks that R is
no longer zero after a few steps), but an untrained (step-0) xlstm model has no recurrent
weights, which its baseline figures show. The packages are imported only inside these
functions (``import gatelens`` never imports them); a missing one is a one-line error.

>>> OFFICIAL_CELLS[:3]
('xlstm-slstm', 'xlstm-mlstm', 'mingru-lm')
>>> size_multiple("xlstm-mlstm", heads=32), size_multiple("hf-mamba2"), size_multiple("hf-rwkv")
(16, 8, 1)
"""

from __future__ import annotations

import math
from importlib import import_module

import torch
from torch import Tensor, nn

from gatelens.errors import GatelensError

#: ``--cell`` names of the official implementations, in the order the command line lists them
OFFICIAL_CELLS: tuple[str, ...] = ("xlstm-slstm", "xlstm-mlstm", "mingru-lm", "hf-mamba",
                                   "hf-mamba2", "hf-rwkv", "mambapy")
#: the package each needs (import name, PyPI name)
PACKAGES = {"xlstm-slstm": ("xlstm", "xlstm"), "xlstm-mlstm": ("xlstm", "xlstm"),
            "mingru-lm": ("minGRU_pytorch", "mingru-pytorch"),
            "hf-mamba": ("transformers", "transformers"),
            "hf-mamba2": ("transformers", "transformers"),
            "hf-rwkv": ("transformers", "transformers"), "mambapy": ("mambapy", "mambapy")}
#: the fixed settings of each (config.json "official"); the package's defaults otherwise.
#: xlstm's mLSTM needs its whole-sequence mask at least as long as any text it reads, so
#: its context is at least 2048 characters (a mask of booleans, not a weight)
OFFICIAL: dict[str, dict] = {
    "xlstm-slstm": {"backend": "vanilla", "conv1d_kernel_size": 4, "ffn_proj_factor": 1.3,
                    "ffn_act_fn": "gelu", "bias_init": "powerlaw_blockdependent",
                    "context_length": 2048},
    "xlstm-mlstm": {"conv1d_kernel_size": 4, "qkv_proj_blocksize": 4, "proj_factor": 2.0,
                    "context_length": 2048},
    "mingru-lm": {"ff_mult": 4, "expansion": 1.5, "use_lstm": False},
    # use_mambapy: transformers' own CPU training path, mambapy's parallel scan (its
    # default sequential loop backpropagates through 128 slices of one (B, d, T, N)
    # tensor, each writing a zero copy of it: 178x the LSTM's step, BENCHMARKS.md)
    "hf-mamba": {"state_size": 16, "expand": 2, "conv_kernel": 4, "use_mambapy": True},
    "hf-mamba2": {"state_size": 16, "expand": 2, "head_dim": 16, "n_groups": 1,
                  "conv_kernel": 4, "chunk_size": 64},
    "hf-rwkv": {"intermediate_factor": 4, "context_length": 2048},
    "mambapy": {"d_state": 16, "d_conv": 4, "expand_factor": 2},
}
EXTRA = "pip install 'gatelens[modern]'"


def is_official(cell: str) -> bool:
    return cell in OFFICIAL_CELLS


def size_multiple(cell: str, heads: int = 1) -> int:
    """What ``--hidden`` must be a multiple of: xlstm's heads (mLSTM: of its inner 2 d
    too, in blocks of 4), Mamba-2's head_dim / expand; 1 for the others."""
    if cell == "xlstm-slstm":
        return heads
    if cell == "xlstm-mlstm":  # 2 d in heads and in qkv blocks of 4
        return math.lcm(2, heads // math.gcd(heads, 2))
    if cell == "hf-mamba2":
        s = OFFICIAL[cell]
        return s["head_dim"] // s["expand"]
    return 1


def check_official(cell: str, hidden: int, layers: int, heads: int) -> None:
    """GatelensError naming the first setting an official cell cannot be built with."""
    if heads != 1 and not cell.startswith("xlstm-"):
        raise GatelensError(f"--heads applies to --cell slstm, xlstm-slstm, xlstm-mlstm only, "
                            f"not {cell}")
    step = size_multiple(cell, heads)
    if hidden % step:
        raise GatelensError(f"--cell {cell}: --hidden {hidden} must be a multiple of {step}")
    if cell == "hf-rwkv" and layers < 2:
        raise GatelensError("--cell hf-rwkv needs --layers 2 or more (transformers 5.23 cannot "
                            "build a one-layer RWKV: ZeroDivisionError in its _init_weights)")


def need(cell: str):
    """The package ``cell`` needs, imported; a one-line GatelensError naming the extra."""
    name, pypi = PACKAGES[cell]
    try:
        return import_module(name)
    except ImportError:
        raise GatelensError(f"--cell {cell} needs the {pypi} package: {EXTRA}") from None


def _xlstm(cell: str, d: int, layers: int, heads: int, s: dict) -> nn.Module:
    x = need(cell)
    if cell == "xlstm-slstm":
        block = {"slstm_block": x.sLSTMBlockConfig(
            slstm=x.sLSTMLayerConfig(backend=s["backend"], num_heads=heads,
                                     conv1d_kernel_size=s["conv1d_kernel_size"],
                                     bias_init=s["bias_init"]),
            feedforward=x.FeedForwardConfig(proj_factor=s["ffn_proj_factor"],
                                            act_fn=s["ffn_act_fn"])), "slstm_at": "all"}
    else:
        block = {"mlstm_block": x.mLSTMBlockConfig(mlstm=x.mLSTMLayerConfig(
            conv1d_kernel_size=s["conv1d_kernel_size"], num_heads=heads,
            qkv_proj_blocksize=s["qkv_proj_blocksize"], proj_factor=s["proj_factor"])),
            "slstm_at": []}
    return x.xLSTMBlockStack(x.xLSTMBlockStackConfig(
        context_length=s["context_length"], num_blocks=layers, embedding_dim=d, **block))


def _hf(cell: str, V: int, d: int, layers: int, s: dict) -> nn.Module:
    tf = need(cell)
    from transformers.utils import logging

    logging.set_verbosity_error()  # its notes on the missing fast CUDA kernels
    if cell == "hf-mamba":
        return tf.MambaModel(tf.MambaConfig(vocab_size=V, hidden_size=d, num_hidden_layers=layers,
                                            use_cache=False, **s))
    if cell == "hf-mamba2":
        heads = s["expand"] * d // s["head_dim"]
        return tf.Mamba2Model(tf.Mamba2Config(vocab_size=V, hidden_size=d, num_heads=heads,
                                              num_hidden_layers=layers, use_cache=False, **s))
    return tf.RwkvModel(tf.RwkvConfig(
        vocab_size=V, hidden_size=d, num_hidden_layers=layers, attention_hidden_size=d,
        intermediate_size=s["intermediate_factor"] * d, context_length=s["context_length"],
        use_cache=False))


class OfficialLM(nn.Module):
    """An official implementation's module (``rnn``) between an embedding and a head.

    ``forward(idx, state)`` returns (logits (B, T, V), the ids read so far): these modules
    are run over the whole text, so ``state`` (for sampling one character at a time) is the
    ids before ``idx``, and each call reads them again.
    """

    def __init__(self, vocab_size: int, cell: str, hidden: int, layers: int = 1,
                 heads: int = 1, settings: dict | None = None) -> None:
        super().__init__()
        if not is_official(cell):
            raise ValueError(f"cell must be one of {OFFICIAL_CELLS}, got {cell!r}")
        check_official(cell, hidden, layers, heads)
        # a run's record adds the package's version: only the settings rebuild the module
        s = {**OFFICIAL[cell], **{k: v for k, v in (settings or {}).items()
                                  if k in OFFICIAL[cell]}}
        self.vocab_size, self.cell, self.settings = vocab_size, cell, s
        self.embed: nn.Embedding | None = None
        self.head: nn.Linear | None = None
        if cell == "mingru-lm":  # minLM is a whole language model: its embedding and head
            need(cell)
            from minGRU_pytorch.minLM import minLM

            self.rnn = minLM(num_tokens=vocab_size, dim=hidden, depth=layers, **s)
            return
        if cell.startswith("xlstm-"):
            self.rnn = _xlstm(cell, hidden, layers, heads, s)
        elif cell.startswith("hf-"):
            self.rnn = _hf(cell, vocab_size, hidden, layers, s)  # it embeds the ids itself
        else:
            need(cell)
            from mambapy.mamba import Mamba, MambaConfig

            self.rnn = Mamba(MambaConfig(d_model=hidden, n_layers=layers, **s))
        if not cell.startswith("hf-"):
            self.embed = nn.Embedding(vocab_size, hidden)
        self.head = nn.Linear(hidden, vocab_size)

    @classmethod
    def from_config(cls, model: dict, vocab_size: int) -> OfficialLM:
        """The (untrained) model a run's config.json "model" block describes."""
        return cls(vocab_size, model["cell"], model["hidden"], model["layers"],
                   model.get("heads", 1), model.get("official"))

    def core(self, idx: Tensor) -> Tensor:
        """Logits (B, T, V) of ids (B, T), the whole sequence in one call of ``rnn``."""
        if self.cell == "mingru-lm":
            return self.rnn(idx)
        if self.cell.startswith("hf-"):
            out = self.rnn(input_ids=idx, use_cache=False).last_hidden_state  # (B, T, d)
        else:
            out = self.rnn(self.embed(idx))  # (B, T, d)
        return self.head(out)

    def forward(self, idx: Tensor, state: Tensor | None = None) -> tuple[Tensor, Tensor]:
        full = idx if state is None else torch.cat([state, idx], dim=1)  # (B, T_seen)
        return self.core(full)[:, full.shape[1] - idx.shape[1]:], full


def official_block(cell: str) -> dict:
    """config.json's model "official" record: the fixed settings and the package version."""
    mod = need(cell)
    return {**OFFICIAL[cell], "package": f"{PACKAGES[cell][1]} "
            f"{getattr(mod, '__version__', 'unknown')}"}
