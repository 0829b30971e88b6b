"""Text from a trained model: the quickest sanity check a char-rnn user expects."""

from __future__ import annotations

import torch

from gatelens.errors import GatelensError
from gatelens.training.runs import LoadedRun


@torch.no_grad()
def sample(run: LoadedRun, length: int = 500, temperature: float = 1.0, prime: str = "\n",
           seed: int = 0) -> str:
    """``prime`` followed by ``length`` sampled characters.

    The model reads the prime, then draws each next character from
    softmax(logits / temperature) with a generator seeded by ``seed``.
    """
    if length < 0:
        raise GatelensError(f"--length must be zero or positive, got {length}")
    if not temperature > 0:
        raise GatelensError(f"--temperature must be positive, got {temperature}")
    if not prime:
        raise GatelensError("--prime must hold at least one character")
    ids = run.vocab.encode(prime, where="--prime")
    gen = torch.Generator().manual_seed(seed)
    model = run.model.eval()
    logits, state = model(ids[None, :])  # (1, P, V)
    out = []
    for _ in range(length):
        probs = torch.softmax(logits[0, -1].double() / temperature, dim=-1)  # (V,)
        nxt = int(torch.multinomial(probs, 1, generator=gen))
        out.append(nxt)
        logits, state = model(torch.tensor([[nxt]]), state)
    return prime + run.vocab.decode(out)
