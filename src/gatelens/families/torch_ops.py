"""Small tensor helpers the PyTorch families share (differences, the state each step reads,
the weights a module computes with, a module of some of a module's own tensors)."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import torch
from torch import Tensor, nn
from torch.nn.utils import parametrize


def max_diff(a: Tensor, b: Tensor, scaled: bool = False) -> float:
    """max |a − b| in float64, or with ``scaled`` max |a − b| / max(1, |b|); 0 when empty.

    >>> max_diff(torch.tensor([30.0]), torch.tensor([30.0003]), scaled=True) < 1e-5
    True
    """
    if not a.numel():
        return 0.0
    diff = (a.double() - b.double()).abs()
    if scaled:
        diff = diff / b.double().abs().clamp(min=1.0)
    return float(diff.max())


def previous(seq: Tensor, init: Tensor, reverse: bool) -> Tensor:
    """The state each step reads, (B, T, ·): init, then the step before in processing order."""
    init = init.unsqueeze(1)  # (B, 1, ·)
    if reverse:
        return torch.cat([seq[:, 1:], init], dim=1)
    return torch.cat([init, seq[:, :-1]], dim=1)


def like(module: nn.RNNBase, num_layers: int, tensors: dict[str, Tensor], *,
         bidirectional: bool, input_size: int) -> nn.RNNBase:
    """A fresh eval module of ``module``'s class holding ``tensors`` (PyTorch's names),
    built on the meta device so no weight is initialised, then given the tensors as they
    are (shared, never copied)."""
    kw: dict[str, Any] = dict(num_layers=num_layers, bias=module.bias, batch_first=True,
                              bidirectional=bidirectional)
    if isinstance(module, nn.LSTM):
        kw["proj_size"] = module.proj_size
    if isinstance(module, nn.RNN):
        kw["nonlinearity"] = module.nonlinearity
    with torch.device("meta"):
        fresh = type(module)(input_size, module.hidden_size, **kw)
    fresh.load_state_dict(tensors, assign=True)
    return fresh.eval()


def weights_of(module: nn.Module, names: list[str]) -> dict[str, Tensor]:
    """The tensors ``module`` computes with, by PyTorch's names (``weight_ih_l0`` ...),
    detached: read by attribute, so a parametrized weight (``weight_norm``,
    ``spectral_norm``, any ``register_parametrization``) is its parametrization's value and
    a pruned one (``torch.nn.utils.prune``) is its masked value, as the module's forward
    reads them; ``state_dict`` names (``parametrizations.weight_ih_l0.original0``,
    ``weight_ih_l0_orig``) are never used.

    >>> from torch.nn.utils.parametrizations import weight_norm
    >>> lstm = weight_norm(torch.nn.LSTM(2, 3), "weight_hh_l0")
    >>> w = weights_of(lstm, ["weight_hh_l0"])["weight_hh_l0"]
    >>> w.shape, torch.equal(w, lstm.weight_hh_l0)
    (torch.Size([12, 3]), True)
    """
    return {n: getattr(module, n).detach() for n in names}


def flat_names(module: nn.RNNBase) -> list[str]:
    """The names of every weight an nn.LSTM / GRU / RNN computes with, in PyTorch's order."""
    return list(module._flat_weights_names)


@contextmanager
def as_computed(module: nn.Module) -> Iterator[None]:
    """Read ``module``'s parametrized weights once each and without changing them: every
    parametrization in eval mode (``spectral_norm`` then runs no power iteration, which
    would update its vectors in place: the trace is an eval-mode read) and cached
    (``torch.nn.utils.parametrize.cached``); every flag restored afterwards.

    >>> from torch.nn.utils.parametrizations import spectral_norm
    >>> lstm = spectral_norm(torch.nn.LSTM(2, 3), "weight_ih_l0")
    >>> u = lstm.parametrizations.weight_ih_l0[0]._u.clone()
    >>> with as_computed(lstm):
    ...     _ = lstm.weight_ih_l0
    >>> torch.equal(u, lstm.parametrizations.weight_ih_l0[0]._u)
    True
    """
    parts = [m for n, m in module.named_modules() if ".parametrizations." in f".{n}."
             or n.startswith("parametrizations")]
    flags = {m: m.training for m in parts}
    try:
        for m in parts:
            m.training = False
        with parametrize.cached():
            yield
    finally:
        for m, flag in flags.items():
            m.training = flag

def no_embedding(module: nn.Module) -> dict:
    """A ``deepcopy`` memo that leaves a Hugging Face model's input embedding table out of
    its copy (a one-row table in its place): a family is handed embeddings, never ids, and
    mamba-130m's table alone is 309 MB in float64.

    >>> import transformers as tf
    >>> m = tf.MambaModel(tf.MambaConfig(vocab_size=100, hidden_size=8, num_hidden_layers=1))
    >>> import copy; copy.deepcopy(m, no_embedding(m)).embeddings.weight.shape
    torch.Size([1, 8])
    """
    get = getattr(module, "get_input_embeddings", None)
    emb = get() if callable(get) else None
    if not isinstance(emb, nn.Embedding):
        return {}
    return {id(emb): nn.Embedding(1, emb.embedding_dim, dtype=emb.weight.dtype)}


def float64_bytes(module: nn.Module, memo: dict[int, Any]) -> int:
    """The bytes of a float64 ``deepcopy`` of ``module`` with ``memo``: its floating-point
    parameters at 8 bytes each, less those of the modules the memo puts something else in
    place of (``no_embedding``'s table, upcast.py's widened Linears).

    >>> float64_bytes(nn.Linear(3, 2), {})
    64
    """
    out = {id(p) for m in module.modules() if id(m) in memo for p in m.parameters()}
    return sum(p.numel() * 8 for p in module.parameters()
               if p.is_floating_point() and id(p) not in out)
