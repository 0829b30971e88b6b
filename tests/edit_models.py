"""The small language model the intervention tests edit (test_causal.py, test_patching.py,
test_steering.py): embedding -> a recurrent stack ``rnn`` -> head, its recurrent weights
scaled by ``scale`` (×8, ×16: the chaotic models)."""

from __future__ import annotations

import torch
from torch import Tensor, nn

V, E, H = 7, 5, 8
KINDS = {"lstm": nn.LSTM, "gru": nn.GRU, "rnn": nn.RNN}


class Net(nn.Module):
    """embedding -> a recurrent stack ``rnn`` (a KINDS name or an nn.RNNBase class) -> head."""

    def __init__(self, kind: str | type = "lstm", layers: int = 2, scale: float = 1.0,
                 seed: int = 0) -> None:
        super().__init__()
        torch.manual_seed(seed)
        self.embed = nn.Embedding(V, E)
        self.rnn = (KINDS[kind] if isinstance(kind, str) else kind)(
            E, H, num_layers=layers, batch_first=True)
        self.head = nn.Linear(H, V)
        with torch.no_grad():
            for n, p in self.rnn.named_parameters():
                if n.startswith("weight"):
                    p.mul_(scale)

    def forward(self, ids: Tensor) -> Tensor:
        return self.head(self.rnn(self.embed(ids))[0])
