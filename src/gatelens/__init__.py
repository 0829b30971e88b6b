"""gatelens: open recurrent language models, from a character LSTM to a Mamba-2 hybrid.

Every gate and state of a recurrent module (nn.LSTM, nn.GRU and nn.RNN, cells in loops, and
the modern recurrences: xLSTM, Mamba, Gated DeltaNet, RWKV, RG-LRU, inside whole models) as
a tensor, verified against the module's own computation, and measurements of how long the
model really remembers. ``import gatelens`` loads the read-out
only; the analysis and report stack (matplotlib) load on first use of ``analyze``,
``Analysis``, ``measure`` or ``reproduce``.

>>> import torch, gatelens
>>> lstm = torch.nn.LSTM(3, 4, batch_first=True)
>>> tr = gatelens.trace(lstm, torch.randn(2, 5, 3))
>>> list(tr), tuple(tr["layer0.f"].shape)
(['layer0.i', 'layer0.f', 'layer0.g', 'layer0.o', 'layer0.c', 'layer0.h'], (2, 5, 4))
"""

from __future__ import annotations

from importlib import import_module
from typing import Any

from gatelens import families
from gatelens._version import version as _version
from gatelens.analysis.units import half_life
from gatelens.readout.hooks import CellCache, open_cells
from gatelens.readout.trace import trace, trace_chunked
from gatelens.readout.trace_types import Trace, gate_names
from gatelens.readout.verify import VERIFY_TOL, VerifyResult, verify

__version__ = _version()

#: Public names whose modules pull in the report stack: imported on first use (PEP 562).
_LAZY = {"Analysis": "gatelens.analysis.measure", "analyze": "gatelens.lens.analyze",
         "measure": "gatelens.analysis.measure", "reproduce": "gatelens.studies.reproduce",
         "Lens": "gatelens.lens.lens", "LensResult": "gatelens.lens.lens",
         "load_run": "gatelens.lens.run",
         # interventions (Lens.run's edits)
         "Set": "gatelens.interventions.edits", "Add": "gatelens.interventions.edits",
         "Scale": "gatelens.interventions.edits", "Zero": "gatelens.interventions.edits",
         "Mean": "gatelens.interventions.edits", "Patch": "gatelens.interventions.edits",
         "RunResult": "gatelens.interventions.run",
         # causal memory and steering (docs/interventions.md)
         "return_cut": "gatelens.interventions.causal",
         "state_ablation": "gatelens.interventions.causal",
         "steer": "gatelens.interventions.steering",
         "contrastive_vector": "gatelens.interventions.steering",
         # activation patching (issue 28 part 2)
         "patch_sweep": "gatelens.interventions.patching",
         "PatchResult": "gatelens.interventions.patching",
         "logit_diff": "gatelens.interventions.metrics", "loss": "gatelens.interventions.metrics",
         "kl": "gatelens.interventions.metrics", "spearman": "gatelens.interventions.metrics",
         "fixed_points": "gatelens.analysis.fixed_points:module_fixed_points",
         # the file loaders import onnx / onnxruntime / h5py only when called
         "open_onnx": "gatelens.loaders.onnx_file", "trace_onnx": "gatelens.loaders.onnx_trace",
         "open_keras": "gatelens.loaders.keras_file",
         # a local Hugging Face directory: transformers is imported only when called
         "load_hf": "gatelens.loaders.hf_dir", "HFModel": "gatelens.loaders.hf_dir"}

__all__ = ["Add", "Analysis", "CellCache", "HFModel", "Lens", "LensResult", "Mean", "Patch",
           "PatchResult", "RunResult", "Scale", "Set", "Trace", "VERIFY_TOL", "VerifyResult",
           "Zero", "analyze", "families", "fixed_points", "gate_names", "half_life", "kl",
           "load_hf", "load_run", "logit_diff", "loss", "measure", "open_cells",
           "patch_sweep", "spearman",
           "open_keras", "open_onnx", "reproduce", "trace", "trace_onnx",
           "trace_chunked", "verify", "__version__",
           "contrastive_vector", "return_cut", "state_ablation", "steer"]


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        where, _, attr = _LAZY[name].partition(":")
        value = getattr(import_module(where), attr or name)
        globals()[name] = value
        return value
    raise AttributeError(f"module 'gatelens' has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_LAZY))
