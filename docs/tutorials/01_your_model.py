# ---
# jupyter:
#   jupytext:
#     formats: py:percent
#   kernelspec:
#     display_name: Python 3
#     name: python3
# ---

# %% [markdown]
# # Your own model, opened
#
# A character-level language model written the usual way: an embedding, a two-layer
# `nn.LSTM`, a linear head, trained with a plain PyTorch loop. gatelens changes nothing in
# it. `gatelens.trace` hands back every gate of the LSTM as a tensor, and `gatelens.Lens`
# measures how long the model remembers, returning typed result objects (dataclasses with
# one field per measurement) alongside the `report.json` they are written to.
#
# Small on purpose: it runs in a few seconds on a laptop's CPU.

# %%
import json
from pathlib import Path

import matplotlib.pyplot as plt
import torch

import gatelens

TEXT = ("the quick brown fox jumps over the lazy dog. "
        "a stitch in time saves nine. "
        "the early bird catches the worm, but the second mouse gets the cheese.\n") * 60
chars = sorted(set(TEXT))
ids_all = torch.tensor([chars.index(c) for c in TEXT])
len(TEXT), len(chars)


# %%
class CharModel(torch.nn.Module):
    def __init__(self, vocab_size: int, hidden: int = 32) -> None:
        super().__init__()
        self.embed = torch.nn.Embedding(vocab_size, 16)
        self.lstm = torch.nn.LSTM(16, hidden, num_layers=2, batch_first=True)
        self.head = torch.nn.Linear(hidden, vocab_size)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:  # (B, T) int64 -> (B, T, V) logits
        return self.head(self.lstm(self.embed(ids))[0])


torch.manual_seed(0)
model = CharModel(len(chars))
opt = torch.optim.Adam(model.parameters(), lr=1e-2)
gen = torch.Generator().manual_seed(0)
STEPS = 120
for _ in range(STEPS):  # your training loop, unchanged
    starts = torch.randint(0, len(ids_all) - 65, (16,), generator=gen)
    batch = torch.stack([ids_all[s:s + 65] for s in starts.tolist()])  # (16, 65)
    logits = model(batch[:, :-1])
    loss = torch.nn.functional.cross_entropy(logits.reshape(-1, len(chars)),
                                             batch[:, 1:].reshape(-1))
    opt.zero_grad()
    loss.backward()
    opt.step()
print(f"training loss after {STEPS} steps: {loss.item():.3f} nats/char")

# %% [markdown]
# ## Every gate, as a tensor
#
# `nn.LSTM` returns only h. `gatelens.trace` re-runs the module from its own weights and
# returns a `Trace`: every gate of every layer at every step, batch first, and
# `gatelens.verify` checks the read-out against PyTorch's own computation.

# %%
x = model.embed(ids_all[:4 * 64].reshape(4, 64)).detach()  # what the LSTM reads, (B, T, 16)
tr = gatelens.trace(model.lstm, x)
print(list(tr))
print(tuple(tr["layer1.f"].shape))  # (B, T, H)
check = gatelens.verify(model.lstm, x)
print(check.passed, f"{check.max_abs_diff_h:.1e}")
assert check.passed  # the read-out is PyTorch's own computation, step by step

# %%
fig, ax = plt.subplots(figsize=(8, 2.5))
ax.imshow(tr["layer1.f"][0].T.numpy(), aspect="auto", cmap="viridis", vmin=0, vmax=1)
ax.set(xlabel="character", ylabel="unit", title="forget gate f of layer 1, window 0")
ax.set_xticks(range(0, 64, 4), list(TEXT[:64:4]))
fig.tight_layout()

# %% [markdown]
# ## Every measurement, through the whole model
#
# `Lens` finds every recurrent module inside the model (here one, at path `"lstm"`),
# runs the whole model on windows of the text, changes one character in each window and
# runs it again. `analyze` returns a `LensResult`; `result.analyses[path]` is an
# `Analysis` whose fields are the measurements. Small settings keep it fast: 4 windows of
# 64 characters, the changed character at position 16, 4 Lyapunov exponents (the defaults
# are 32 windows of 128, the change at 32, 64 exponents).

# %%
lens = gatelens.Lens(model, vocab=chars)
result = lens.analyze(TEXT, windows=4, length=64, perturb_pos=16, exponents=4, out="lens_out")
a = result.analyses["lstm"]
type(a).__name__, a.model["cell"], a.text["source"]

# %%
print("verification:", a.verification.passed, f"one-step error {a.verification.max_abs_diff_h:.1e}")
print("mean forget gate:", round(a.gates.stats["f"]["mean"], 3))
print("median unit half-life:", round(a.units.half_life["median"], 2), "characters")
p = a.perturbation
print("perturbation half-life:", round(p.half_life_measured, 2), "characters;",
      "forget gate alone:", round(p.half_life_forget_only, 2))
print("output reach:", a.reach.describe())
print("divergence rate:", round(a.divergence.lyapunov_per_char, 3), "nats/char")
assert a.verification.passed
assert p.half_life_forget_only < p.half_life_measured  # the return path lengthens memory

# %% [markdown]
# The same figures are in `report.json` (what `a.report` returns and what
# `lens_out/lstm/report.json` holds), next to `report.md`, the plots and `report.html`.

# %%
saved = json.loads(Path("lens_out/lstm/report.json").read_text(encoding="utf-8"))
assert saved["perturbation"]["half_life_measured"] == a.report["perturbation"]["half_life_measured"]
sorted(p.name for p in Path("lens_out/lstm").iterdir())

# %% [markdown]
# ## Per-unit timescales
#
# `a.units.forget_means` is each unit's mean forget gate (both layers pooled), and
# `a.units.half_lives` the half-life it implies, ln 0.5 / ln f̄.

# %%
fig, ax = plt.subplots(figsize=(6, 2.5))
ax.hist(a.units.half_lives, bins=30)
ax.set(xlabel="unit half-life (characters)", ylabel="units",
       title=f"{a.units.n_units} units, {a.units.half_life_ge_10} with half-life ≥ 10")
fig.tight_layout()

# %% [markdown]
# In Jupyter, `result` (and `a`) display the report page itself.

# %%
result
