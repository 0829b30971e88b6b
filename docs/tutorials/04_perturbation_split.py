# ---
# jupyter:
#   jupytext:
#     formats: py:percent
#   kernelspec:
#     display_name: Python 3
#     name: python3
# ---

# %% [markdown]
# # How long a changed character stays: the forget path and the return path
#
# gatelens changes one character at position p of every window and follows the difference
# δs it leaves in the carried state (an LSTM's c). The **measured** decay r(k) is
# ‖δs_{p+k}‖ / ‖δs_p‖. The **forget path** carries δs_p forward through the clean run's
# forget gates alone, a(k) = ‖(∏ f) ⊙ δs_p‖ / ‖δs_p‖: what the forget gate by itself would
# keep. The rest, the **return path**, is the difference re-entering through the gates
# (they read h, which the change altered). The two add up to the measured difference
# exactly (docs: Measuring memory, "Exact split").
#
# Side by side: an LSTM, whose gates read h, and a minGRU, whose gates read only the
# layer's input, so one minGRU layer has no return path at all.

# %%
import matplotlib.pyplot as plt

import gatelens
from gatelens.cli import main
from gatelens.training.synthetic import synthetic_text

for cell in ("lstm", "mingru"):
    assert main(["train", "--corpus", "brackets:chars=40000", "--cell", cell, "--hidden", "32",
                 "--steps", "100", "--batch", "16", "--seq", "64", "--eval-every", "100",
                 "--val-windows", "8", "--out", f"run-{cell}", "--quiet"]) == 0
text = synthetic_text("brackets:chars=40000")[-4000:]
analyses = {cell: gatelens.Lens(gatelens.load_run(f"run-{cell}")).analyze(
    text, windows=8, length=80, perturb_pos=16, exponents=0).analyses["rnn"]
    for cell in ("lstm", "mingru")}

# %% [markdown]
# `a.perturbation` holds the curves at every lag (`curves`) and the reported figures;
# `a.decomposition` the split itself, per window, position and state coordinate.

# %%
fig, axes = plt.subplots(1, 2, figsize=(9, 3), sharey=True)
for ax, (cell, a) in zip(axes, analyses.items(), strict=True):
    for name in ("measured", "forget_path", "return_path"):
        ax.semilogy(a.perturbation.curves[name], label=name.replace("_", " "))
    ax.set(title=cell, xlabel="characters after the change")
axes[0].set_ylabel("‖δs‖ / ‖δs_p‖")
axes[0].legend()
fig.tight_layout()

# %%
for cell, a in analyses.items():
    p = a.perturbation
    k8 = p.lags.index(8)
    print(f"{cell:7s} measured t½ {p.half_life_measured:5.2f}   forget path alone "
          f"{p.half_life_forget_only:5.2f}   r(8)/a(8) {p.measured[k8] / p.forget_only[k8]:.2f}"
          f"   largest split residual {p.max_abs_residual:.1e}")

# %% [markdown]
# The split is exact: forget path + return path = measured difference, coordinate by
# coordinate. In the one-layer minGRU the return path is zero and the measured decay *is*
# the forget path.

# %%
d = analyses["lstm"].decomposition  # (B, T, S) tensors
gap = (d["forget_path"] + d["return_path"] - d["measured"]).abs().max().item()
mingru_return = analyses["mingru"].decomposition["return_path"].abs().max().item()
assert gap < 1e-5 and mingru_return == 0.0
gap, mingru_return
