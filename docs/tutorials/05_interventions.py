# ---
# jupyter:
#   jupytext:
#     formats: py:percent
#   kernelspec:
#     display_name: Python 3
#     name: python3
# ---

# %% [markdown]
# # Reaching in: patch, ablate and steer a trained LSTM
#
# gatelens runs a recurrent model with edits inside its cells: a gate set, a state
# patched from another input or ablated to its mean, a vector added. The edit carries
# forward through the recurrence (every later step reads the edited state), which a
# hook on a module's output cannot do. Here, on a small character LSTM trained for a
# minute: activation patching between a text and the same text with one character
# changed, the return path cut (the causal check of the perturbation's split), a state
# ablation, and a contrastive steering vector.

# %%
import matplotlib.pyplot as plt
import torch

import gatelens
from gatelens.cli import main

text = "the cat on a mat. the dog on a log. " * 300
with open("tiny.txt", "w", encoding="utf-8") as f:
    f.write(text)
assert main(["train", "--corpus", "tiny.txt", "--hidden", "32", "--steps", "300",
             "--batch", "16", "--seq", "48", "--eval-every", "300", "--val-windows", "4",
             "--out", "run", "--quiet"]) == 0
run = gatelens.load_run("run")
lens = gatelens.Lens(run)
chars = run.vocab
ids = lambda s: torch.tensor([[chars.index(c) for c in s]])  # noqa: E731
list(lens.families)

# %% [markdown]
# **Activation patching.** The clean text is "the dog on a ", whose next character
# is "l" (log); the corrupted one has "cat" for "dog", whose next is "m" (mat). Each cell
# of the sweep runs the corrupted text with one key (the cell state c, or h) at one
# position set to its clean value, carried forward, and measures the logit difference of
# "l" against "m" at the last position, normalised so that 0 is the corrupted run and 1
# the clean one.

# %%
clean, corrupt = ids("the dog on a "), ids("the cat on a ")
metric = gatelens.logit_diff(chars.index("l"), chars.index("m"))
res = gatelens.patch_sweep(lens, clean, corrupt, names=["rnn.layer0.c", "rnn.layer0.h"],
                           metric=metric)
fig, ax = plt.subplots(figsize=(8, 1.8))
ax.imshow(res.effect, cmap="RdBu_r", vmin=-1, vmax=1, aspect="auto")
ax.set(yticks=range(len(res.names)), yticklabels=res.names, xlabel="position patched",
       xticks=range(len(res.positions)), xticklabels=list("the dog on a "))
fig.tight_layout()
print(f"m(clean) {res.m_clean:.3f}  m(corrupt) {res.m_corrupt:.3f}  "
      f"attribution vs patching: Spearman {res.spearman:.2f}")

# %% [markdown]
# Before position 4 the two texts agree, so patching changes nothing (effect 0); from
# position 6 on, after the last changed character, the whole state carries everything
# (effect 1, exactly).

# %%
both = gatelens.patch_sweep(lens, clean, corrupt, names=[("rnn.layer0.c", "rnn.layer0.h")],
                            metric=metric, attribution=False)
before, after = both.effect[0, :4], both.effect[0, 6:]
assert abs(before).max() < 1e-4 and abs(after - 1).max() < 1e-4
before.round(6), after.round(4)

# %% [markdown]
# **The return path cut.** In the perturbation measurement the difference a changed
# character leaves in c decays through the forget gates (the forget path) and re-enters
# through the other gates (the return path). Freezing every gate at its clean value from
# the next step on leaves the forget path alone: the cut run's curve equals the
# forget-only curve of the decomposition.

# %%
windows, _ = run.windows(8, 64)
cut = gatelens.return_cut(lens, windows, p=16)
print("lag   cut run   forget-only   uncut")
for k, a, b, u in zip(cut.lags, cut.pooled.measured, cut.pooled.forget_only, cut.pooled.uncut,
                      strict=True):
    print(f"{k:3d}   {a:.5f}   {b:.5f}       {u:.5f}")
assert cut.max_abs_diff < 1e-5

# %% [markdown]
# **State ablation.** The carried state after position 16 replaced by its mean over the
# windows, carried forward: how far from the clean predictions the model then is, by lag.

# %%
ab = gatelens.state_ablation(lens, windows, p=16)
by_lag = {k: round(v, 5) for k, v in zip(ab.reach.lags, ab.reach.kl, strict=True)}
print(f"KL at the ablated step {ab.kl_at_p:.4f} nats; by lag {by_lag}")

# %% [markdown]
# **Steering.** A contrastive vector: the mean cell state at the last character of texts
# ending in "the d" minus that of texts ending in "the c", added at the last position of
# "the c". The next-character distribution moves towards what follows "d".

# %%
a_texts = [ids(s)[0] for s in ("a mat. the d", "a log. the d", ". the d")]
b_texts = [ids(s)[0] for s in ("a mat. the c", "a log. the c", ". the c")]
v = gatelens.contrastive_vector(lens, a_texts, b_texts, "rnn.layer0.c")
st = gatelens.steer(lens, ids("the c"), "rnn.layer0.c", v, at=4, scale=1.0)
zero = gatelens.steer(lens, ids("the c"), "rnn.layer0.c", 0 * v, at=4)
assert max(zero.kl) < 1e-9 and st.kl[0] > 0.1  # v = 0 changes nothing
print("rise:", [(t, round(d, 3)) for _, t, d in st.rise[:3]])
print("fall:", [(t, round(d, 3)) for _, t, d in st.fall[:3]])
