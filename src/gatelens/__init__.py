"""gatelens: open small recurrent language models.

Every gate of nn.LSTM, nn.GRU and nn.RNN as a tensor, verified against PyTorch, and
measurements of how long the model really remembers.

>>> import torch, gatelens
>>> lstm = torch.nn.LSTM(3, 4, batch_first=True)
>>> tr = gatelens.trace(lstm, torch.randn(2, 5, 3))
>>> list(tr), tuple(tr["layer0.f"].shape)
(['layer0.i', 'layer0.f', 'layer0.g', 'layer0.o', 'layer0.c', 'layer0.h'], (2, 5, 4))
"""

__version__ = "0.1.0"  # before the imports: submodules read it

from gatelens.analysis import half_life
from gatelens.analyze import Analysis, analyze
from gatelens.hooks import CellCache, open_cells
from gatelens.reproduce import reproduce
from gatelens.trace import trace, trace_chunked
from gatelens.trace_types import Trace, gate_names
from gatelens.verify import VERIFY_TOL, VerifyResult, verify

__all__ = ["Analysis", "CellCache", "Trace", "VERIFY_TOL", "VerifyResult", "analyze",
           "gate_names", "half_life", "open_cells", "reproduce", "trace", "trace_chunked",
           "verify", "__version__"]
