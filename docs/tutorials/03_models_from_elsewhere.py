# ---
# jupyter:
#   jupytext:
#     formats: py:percent
#   kernelspec:
#     display_name: Python 3
#     name: python3
# ---

# %% [markdown]
# # Models from elsewhere: an ONNX graph and a Hugging Face Mamba
#
# gatelens opens recurrent modules it did not train: an LSTM inside an ONNX graph
# (`pip install 'gatelens[onnx]'`), and the official implementations of modern recurrent
# models, here transformers' Mamba (`pip install 'gatelens[modern]'`). Nothing is
# downloaded: the ONNX file is exported here from PyTorch, and the Mamba is built from a
# small configuration with random weights, saved to a local directory and loaded back, as
# a model of your own would be.

# %%
import warnings

import numpy as np
import torch
from transformers import MambaConfig, MambaForCausalLM
from transformers.utils import logging

import gatelens

torch.manual_seed(0)
lstm = torch.nn.LSTM(8, 16).eval()  # (T, B, F): ONNX's own layout
with warnings.catch_warnings():
    warnings.simplefilter("ignore")  # the exporter's notes on batch sizes
    torch.onnx.export(lstm, (torch.zeros(20, 1, 8),), "model.onnx", input_names=["x"],
                      dynamo=False)

# %% [markdown]
# `open_onnx` rebuilds every recurrent node as a PyTorch module with the graph's weights;
# `trace_onnx` runs the graph in onnxruntime and opens each node on exactly what it
# received, checked against the node's own outputs.

# %%
mods = gatelens.open_onnx("model.onnx")
x = np.random.default_rng(0).normal(size=(20, 1, 8)).astype(np.float32)
traces = gatelens.trace_onnx("model.onnx", {"x": x})
tr = traces["/LSTM"]
print({name: type(m).__name__ for name, m in mods.items()})
print(tuple(tr["layer0.f"].shape), f"{tr.meta['onnx_max_abs_diff_h']:.1e}")
assert tr.meta["onnx_max_abs_diff_h"] < 1e-5  # the opened node gives the graph's own h

# %% [markdown]
# ## A Hugging Face Mamba from a local directory
#
# `MambaForCausalLM` reads token ids and returns logits, so `Lens` measures it as it
# measures a gatelens run: every Mamba mixer is opened through its family, its keep gate is
# exp(Δ·A) per (channel, state) pair, and the output-level reach comes from the logits.

# %%
logging.set_verbosity_error()
logging.disable_progress_bar()
warnings.filterwarnings("ignore", message=".*falling back to its reference PyTorch.*")
TEXT = "abc def ghij jig fed cba " * 40
chars = sorted(set(TEXT))
torch.manual_seed(0)
MambaForCausalLM(MambaConfig(vocab_size=len(chars), hidden_size=16, state_size=4,
                             num_hidden_layers=2)).save_pretrained("my-mamba")
mamba = MambaForCausalLM.from_pretrained("my-mamba")  # a local directory: no download
lens = gatelens.Lens(mamba, vocab=chars)
list(lens.families)

# %%
result = lens.analyze(TEXT, windows=4, length=64, perturb_pos=16, exponents=0)
for path, a in result.analyses.items():
    print(path, a.model["family"], "verified:", a.verification.passed,
          "| median unit keep gate", round(a.units.forget_mean["median"], 3),
          "| perturbation half-life", round(a.perturbation.half_life_measured, 2))
    assert a.verification.passed

# %% [markdown]
# A model whose forward does not take ids (a classifier reading embeddings, a model with a
# tokenizer of its own) takes `Lens(model, vocab=..., encode=f)`, with `f` mapping ids
# (B, T) to what the forward takes. `gatelens.families()` lists every kind of module
# gatelens opens:

# %%
gatelens.families()
