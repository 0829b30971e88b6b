"""Training recipes of PyTorch's nn.LSTM, nn.GRU and nn.RNN (``--cell lstm | gru | rnn``).

Each family file calls ``torch_recipe`` with its module class and keep-gate words; the
keep gate's bias is set on the stacked biases of every layer and direction, in PyTorch's
order (``keep_bias``).

>>> r = torch_recipe("gru", nn.GRU, (), "GRU z", "PyTorch's nn.GRU")
>>> m = r.build(3, 4, 2, nonlinearity="tanh"); type(m).__name__, m.num_layers, m.batch_first
('GRU', 2, True)
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import Tensor, nn

from gatelens.families.recipe import Recipe
from gatelens.families.spec import CellSpec


def _layers(rnn: nn.RNNBase):
    for layer in range(rnn.num_layers):
        for suffix in ("", "_reverse") if rnn.bidirectional else ("",):
            yield layer, suffix


def keep_bias(specs: tuple[CellSpec, ...]) -> Callable[[nn.Module, Callable, bool], None]:
    """``Recipe.keep_init`` of a PyTorch module whose cell is one of ``specs``: the keep
    gate's total bias (b_ih + b_hh on its slice) becomes ``draw(H)``, b_hh's slice 0; with
    ``chrono`` the input gate's (an LSTM's i) becomes −draw."""

    @torch.no_grad()
    def init(rnn: nn.Module, draw: Callable[[int], Tensor], chrono: bool) -> None:
        spec = next(s for s in specs if s.mode == rnn.mode)
        k, H = spec.chunk_of_keep, rnn.hidden_size
        for layer, suffix in _layers(rnn):
            b_ih = getattr(rnn, f"bias_ih_l{layer}{suffix}").view(-1, H)
            b_hh = getattr(rnn, f"bias_hh_l{layer}{suffix}").view(-1, H)
            b_f = draw(H).to(b_ih.dtype)
            b_ih[k].copy_(b_f)
            b_hh[k].zero_()
            if chrono and spec.input_gate is not None:
                b_ih[spec.chunk(spec.input_gate)].copy_(-b_f)
                b_hh[spec.chunk(spec.input_gate)].zero_()

    return init


def torch_recipe(name: str, module_class: type, specs: tuple[CellSpec, ...], keep_words: str,
                 help: str, nonlinearity: bool = False) -> Recipe:
    """The recipe of a PyTorch recurrent module: one-hot or embedded characters in,
    ``batch_first``; the keep-gate initialisers where the cell has a keep gate."""

    def build(n_in: int, hidden: int, layers: int, *, nonlinearity: str = "tanh",
              **_: object) -> nn.Module:
        kwargs = {"nonlinearity": nonlinearity} if module_class is nn.RNN else {}
        return module_class(n_in, hidden, num_layers=layers, batch_first=True, **kwargs)

    keep = bool(keep_words)
    flags = {"embed", "bias_init"} | ({"keep"} if keep else set()) | (
        {"nonlinearity"} if nonlinearity else set())
    return Recipe(name, help, build, flags=frozenset(flags),
                  keep_init=keep_bias(specs) if keep else None, keep_words=keep_words)
