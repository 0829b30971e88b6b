"""``gatelens verify --model DIR``: the read-out of every recurrent module of a local Hugging
Face checkpoint (loaders/hf_dir.py) checked on token windows of a text, without an analysis.

The text is tokenised once by the directory's tokenizer and cut into its first WINDOWS
LENGTH-token windows; the whole model reads them, and each recurrent module (or those
``layers`` picks: readout/select.py) is verified on what it received
(``gatelens.verify``: the one-step error, the verdict, and the free-running divergence),
one module after another, so only one module's states are held at a time. The model reads
the windows once (``Lens.capture``): every module's input and initial state are caught in
that one forward, so a stack of L recurrent layers costs one whole forward, not L.

>>> import torch, transformers as tf
>>> from gatelens.loaders.hf_dir import HFModel
>>> m = tf.MambaForCausalLM(tf.MambaConfig(vocab_size=12, hidden_size=8, num_hidden_layers=2,
...                                        state_size=4, use_cache=False)).eval()
>>> ids = torch.randint(0, 12, (2, 6), generator=torch.Generator().manual_seed(0))
>>> [(path, res.passed) for path, res in verify_modules(m, ids)]
[('backbone', True)]
"""

from __future__ import annotations

import os
from collections.abc import Iterator

from torch import Tensor, nn

from gatelens.readout.select import Selection, select_paths
from gatelens.readout.verify import VerifyResult

__all__ = ["verify_hf", "verify_modules"]


def verify_modules(model: nn.Module, ids: Tensor, layers: Selection = None,
                   tol: float | None = None, vocab: int | None = None,
                   device: str | None = None) -> Iterator[tuple[str, VerifyResult]]:
    """(path, ``verify``'s result) for each recurrent module of ``model`` (those ``layers``
    picks), on what it received when ``model`` read ``ids`` (B, T); one module at a time.
    ``vocab``: the embedding's size (default: the largest id + 1); ``device``: as ``Lens``
    takes it."""
    from gatelens.lens.lens import Lens
    from gatelens.readout.verify import verify

    lens = Lens(model, vocab=vocab or max(2, int(ids.max()) + 1), device=device)
    paths = select_paths(list(lens.families), layers)  # a bad pick: before any work

    def each() -> Iterator[tuple[str, VerifyResult]]:
        seen = lens.capture(ids, paths)  # one forward: every module's input, held together
        for path in paths:
            got = seen.pop(path)  # each input dropped once its module is verified
            yield path, verify(lens.families[path].module, got.inputs, got.state, tol=tol)

    return each()


def verify_hf(directory: str | os.PathLike, *, text: str | os.PathLike,
              windows: int | str = 2, length: int = 128, tol: float | None = None,
              layers: Selection = None, trust_remote_code: bool = False,
              device: str | None = None) -> tuple[Tensor, Iterator[tuple[str, VerifyResult]]]:
    """The token windows (B, T) of ``text`` a checkpoint directory's tokenizer gives, and
    ``verify_modules`` of its model on them (a generator: each module verified as it is
    read)."""
    from gatelens.io import read_utf8
    from gatelens.loaders.hf_dir import load_hf

    hf = load_hf(directory, trust_remote_code=trust_remote_code)  # refuses no recurrence
    ids = hf.windows(read_utf8(text), windows, length, where=str(text))
    return ids, verify_modules(hf.model, ids, layers, tol, vocab=hf.vocab_size, device=device)
