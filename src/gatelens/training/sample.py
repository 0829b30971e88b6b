"""Text from a trained model: the quickest sanity check a char-rnn user expects."""

from __future__ import annotations

import math
from collections.abc import Iterator

import torch

from gatelens.errors import GatelensError
from gatelens.training.runs import LoadedRun


def default_prime(chars: list[str]) -> str:
    """A newline, or the vocabulary's first character when it has none.

    >>> default_prime(["\\n", "a"]), default_prime(["a", "b"])
    ('\\n', 'a')
    """
    return "\n" if "\n" in chars else chars[0]


#: Characters handed out at a time by ``sample_chunks``: memory stays this small whatever
#: ``--length`` asks (the command writes each piece as it comes).
CHUNK = 4096


def sample(run: LoadedRun, length: int = 500, temperature: float = 1.0,
           prime: str | None = None, seed: int = 0) -> str:
    """``prime`` (default ``default_prime``) followed by ``length`` sampled characters.

    The model reads the prime, then draws each next character from
    softmax(logits / temperature) with a generator seeded by ``seed``. Probabilities that
    are not finite (a model whose logits overflow) are a GatelensError, not a traceback.
    """
    return "".join(sample_chunks(run, length, temperature, prime, seed))


def sample_chunks(run: LoadedRun, length: int = 500, temperature: float = 1.0,
                  prime: str | None = None, seed: int = 0) -> Iterator[str]:
    """``sample``'s text in pieces of at most ``CHUNK`` characters, the prime first: what
    ``gatelens sample`` writes as it goes, so a long ``--length`` takes no more memory than
    a short one. Bad settings are refused here, before the first piece."""
    if length < 0:
        raise GatelensError(f"--length must be zero or positive, got {length}")
    if not (temperature > 0 and math.isfinite(temperature)):
        raise GatelensError(f"--temperature must be a positive finite number, got {temperature}")
    if prime is None:
        prime = default_prime(run.vocab.chars)
    if not prime:
        raise GatelensError("--prime must hold at least one character")
    ids = run.vocab.encode(prime, where="--prime")
    return _draw(run, ids, prime, length, temperature, seed)


@torch.no_grad()
def _draw(run: LoadedRun, ids: torch.Tensor, prime: str, length: int, temperature: float,
          seed: int) -> Iterator[str]:
    gen = torch.Generator().manual_seed(seed)
    model = run.model.eval()
    yield prime
    logits, state = model(ids[None, :])  # (1, P, V)
    out: list[int] = []
    for k in range(length):
        probs = torch.softmax(logits[0, -1].double() / temperature, dim=-1)  # (V,)
        if not bool(torch.isfinite(probs).all()):
            raise GatelensError(f"{run.weights}: the model's next-character probabilities are "
                                f"not finite after {k} sampled characters (its logits "
                                "overflow); these weights cannot be sampled")
        nxt = int(torch.multinomial(probs, 1, generator=gen))
        out.append(nxt)
        if len(out) == CHUNK:
            yield run.vocab.decode(out)
            out = []
        logits, state = model(torch.tensor([[nxt]]), state)
    if out:
        yield run.vocab.decode(out)
