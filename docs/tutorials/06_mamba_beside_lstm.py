# ---
# jupyter:
#   jupytext:
#     formats: py:percent
#   kernelspec:
#     display_name: Python 3
#     name: python3
# ---

# %% [markdown]
# # A Mamba beside an LSTM: one question, two kinds of memory
#
# An LSTM keeps its cell state through a forget gate f; a Mamba layer keeps its state
# through exp(Δ·A), a decay that depends on the input (the selection). gatelens reads
# both as a **keep gate** (docs: Measuring memory), so the same figures apply: the keep
# gate's distribution, per-unit half-lives, and how long a changed character stays in
# the state. Here both are trained for the same short time on the same corpus (balanced
# brackets, which need memory), with transformers' Mamba built from its config (random
# weights, nothing downloaded), and measured side by side.

# %%
import matplotlib.pyplot as plt

import gatelens
from gatelens.cli import main
from gatelens.training.synthetic import synthetic_text

runs = {"lstm": ["--cell", "lstm", "--hidden", "32"],
        "hf-mamba": ["--cell", "hf-mamba", "--hidden", "16", "--layers", "1"]}
for name, flags in runs.items():
    assert main(["train", "--corpus", "brackets:chars=30000", *flags, "--steps", "60",
                 "--batch", "8", "--seq", "64", "--eval-every", "60", "--val-windows", "4",
                 "--out", f"run-{name}", "--quiet"]) == 0
text = synthetic_text("brackets:chars=30000")[-3000:]
analyses = {}
for name in runs:
    lens = gatelens.Lens(gatelens.load_run(f"run-{name}"))
    (path,) = lens.families
    analyses[name] = lens.analyze(text, windows=4, length=64, perturb_pos=12,
                                  exponents=0).analyses[path]
{name: (a.model["family"], a.units.gate, a.verification.passed) for name, a in analyses.items()}

# %% [markdown]
# Both read-outs are verified against their own runtime (PyTorch's kernel for the LSTM,
# transformers' decode path for the Mamba) before any figure is read.

# %%
fig, axes = plt.subplots(1, 2, figsize=(9, 3))
for name, a in analyses.items():
    lives = [h for h in a.units.half_lives if h is not None]
    axes[0].hist(lives, bins=20, alpha=0.6, label=name)
    axes[1].semilogy(a.perturbation.curves["measured"], label=name)
axes[0].set(xlabel="per-unit half-life (characters)", ylabel="units", xscale="log")
axes[1].set(xlabel="characters after the change", ylabel="‖δs‖ / ‖δs_p‖")
axes[0].legend()
fig.tight_layout()

# %%
for name, a in analyses.items():
    p = a.perturbation
    print(f"{name:9s} keep gate {a.units.gate!r:8s} median unit half-life "
          f"{a.units.half_life['median']:6.2f}   measured t½ {p.half_life_measured:5.2f}   "
          f"forget path alone {p.half_life_forget_only:5.2f}")
assert all(a.verification.passed for a in analyses.values())

# %% [markdown]
# The state of one Mamba layer has no return path once the convolution's window has
# passed (its decay and write read the layer's input, not its state), so its measured
# decay is its keep path; the LSTM's gates read h, and its measured decay is the sum of
# both paths. One short run each is an illustration, not a finding: a claim about
# training needs a study over seeds (`gatelens study`).
