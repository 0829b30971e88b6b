# ---
# jupyter:
#   jupytext:
#     formats: py:percent
#   kernelspec:
#     display_name: Python 3
#     name: python3
# ---

# %% [markdown]
# # Train a character LSTM, then read the run
#
# `gatelens train` writes a run directory: the configuration, the best weights, a
# checkpoint at every evaluation (step 0, the untrained model, included) and the loss
# history. This notebook trains a small LSTM on `brackets`, a built-in synthetic corpus in
# which every closing bracket must remember its opener, analyses the run, and follows the
# forget gate over training.
#
# The command line is called through `gatelens.cli.main`, which takes the arguments a
# shell would pass (`gatelens train --corpus brackets ...` in a terminal does the same).

# %%
import json
import math
from pathlib import Path

import matplotlib.pyplot as plt

import gatelens
from gatelens.cli import main
from gatelens.training.runs import checkpoint_steps, read_history
from gatelens.training.synthetic import synthetic_text

code = main(["train", "--corpus", "brackets:chars=40000", "--hidden", "32", "--steps", "150",
             "--batch", "16", "--seq", "64", "--eval-every", "75", "--val-windows", "8",
             "--out", "run", "--quiet"])
code, sorted(p.name for p in Path("run").iterdir())

# %% [markdown]
# `config.json` records every setting, the corpus's sha256 and the best step;
# `history.csv` holds the training loss of every step and the validation loss of every
# evaluation.

# %%
config = json.loads(Path("run/config.json").read_text(encoding="utf-8"))
run = gatelens.load_run("run")  # the run's CharLM at its best step
history = read_history(Path("run"))
print(config["best"], {k: config["model"][k] for k in ("cell", "hidden", "layers")})
fig, ax = plt.subplots(figsize=(6, 2.5))
ax.plot(history["train_step"], history["train_loss"], label="training")
ax.plot(history["step"], history["val_loss"], "o-", label="validation")
ax.set(xlabel="step", ylabel="nats / character")
ax.legend()
fig.tight_layout()

# %% [markdown]
# ## The analysis
#
# `Lens` on a run's model knows its vocabulary, its step-0 baseline and its seed, so its
# `Analysis` also holds the untrained model's figures (`a.baseline`) and, for a synthetic
# corpus, the loss a memoryless predictor and a perfect one would reach (`a.control`).
# `gatelens analyze run` does the same and writes `run/analysis/`.

# %%
text = synthetic_text("brackets:chars=40000")[-4000:]  # the validation split's end
a = gatelens.Lens(run).analyze(text, windows=4, length=64, perturb_pos=16,
                               exponents=0).analyses["rnn"]
print("mean forget gate: untrained", round(a.baseline.gates.stats["f"]["mean"], 3),
      "trained", round(a.gates.stats["f"]["mean"], 3))
print("perturbation half-life:", round(a.perturbation.half_life_measured, 2), "characters")
c = a.control
print(f"validation loss {c['best_val_loss']:.3f}: memoryless {c['memoryless_loss']:.3f}, "
      f"perfect memory {c['best_loss']:.3f}")

# %% [markdown]
# `gatelens analyze run` reads evenly spaced windows of the validation split unless it is
# given `--text`; on the same text it finds the same figures.

# %%
Path("val.txt").write_text(text, encoding="utf-8")
assert main(["analyze", "run", "--text", "val.txt", "--windows", "4", "--length", "64",
             "--perturb-pos", "16", "--exponents", "0"]) == 0
report = json.loads(Path("run/analysis/report.json").read_text(encoding="utf-8"))
assert math.isclose(report["perturbation"]["half_life_measured"],
                    a.perturbation.half_life_measured, rel_tol=1e-6)
report["perturbation"]["half_life_measured"], a.perturbation.half_life_measured

# %% [markdown]
# ## The forget gate over training
#
# Every checkpoint is a model too: `load_run(RUN, checkpoint=STEP)`.

# %%
steps = checkpoint_steps("run")
mean_f = []
for step in steps:
    model = gatelens.load_run("run", checkpoint=step)
    b = gatelens.Lens(model).analyze(text, windows=4, length=64, perturb_pos=16,
                                     exponents=0).analyses["rnn"]
    mean_f.append(b.gates.stats["f"]["mean"])
fig, ax = plt.subplots(figsize=(6, 2.5))
ax.plot(steps, mean_f, "o-")
ax.set(xlabel="step", ylabel="mean forget gate")
fig.tight_layout()
assert abs(mean_f[0] - 0.5) < 0.02  # step 0: the untrained gate sits at sigmoid(0)
dict(zip(steps, [round(f, 3) for f in mean_f], strict=True))
