"""The worked example of docs/design.md's "Adding a family": a family written in one file
outside gatelens, registered in one line (``GATELENS_FAMILIES``), then trained with
``gatelens train --cell``, studied on Ray, opened by ``Lens`` and measured by ``analyze`` —
with no other source file touched.

The cell is a leaky gated RNN of one layer: f = σ(W_f x + U_f h + b_f), ĉ = tanh(W_c x),
h' = f ⊙ h + (1 − f) ⊙ ĉ. Its module computes the recurrence in a loop; the family reads
the gates from the module's own trajectory, re-runs it free, and gives its dynamics in
float64, as every family does (families/base.py).
"""

from __future__ import annotations

import json
import os
import sys
import textwrap

import pytest
import torch

from gatelens.cli import main
from gatelens.families import registry
from gatelens.lens.analyze import analyze
from gatelens.lens.lens import Lens
from gatelens.lens.run import load_run
from gatelens.studies.study import ray_session, run_study
from gatelens.training.runs import read_config

pytestmark = pytest.mark.xdist_group("ray")

FAMILY_FILE = '''
"""A leaky gated RNN and its family: everything gatelens needs, in one file."""
import torch
from torch import nn

from gatelens.families.base import Call, Dynamics, Family, LayerDiff, Readout, Reference
from gatelens.families.recipe import Recipe
from gatelens.families.spec import SIGMOID, CellSpec


class Leaky(nn.Module):
    """h' = f h + (1 - f) tanh(W_c x), f = sigmoid(W_f x + U_f h + b_f); batch first."""

    def __init__(self, input_size, hidden_size, num_layers=1):
        super().__init__()
        assert num_layers == 1
        self.input_size, self.hidden_size, self.num_layers = input_size, hidden_size, 1
        self.w_f = nn.Parameter(torch.randn(hidden_size, input_size) * 0.3)
        self.u_f = nn.Parameter(torch.randn(hidden_size, hidden_size) * 0.3)
        self.bias_f = nn.Parameter(torch.zeros(hidden_size))
        self.w_c = nn.Parameter(torch.randn(hidden_size, input_size) * 0.3)

    def forward(self, x, state=None):
        h = x.new_zeros(x.shape[0], self.hidden_size) if state is None else state[0]
        out = []
        for t in range(x.shape[1]):
            f = torch.sigmoid(x[:, t] @ self.w_f.T + h @ self.u_f.T + self.bias_f)
            h = f * h + (1 - f) * torch.tanh(x[:, t] @ self.w_c.T)
            out.append(h)
        return torch.stack(out, 1), h[None]


SPEC = CellSpec(name="leaky", kind="leaky", chunks=("f", "cand"),
                signals=("f", "cand", "h"), gates=("f",), keep_gate="f", input_gate=None,
                state="h", candidate="cand", bounds={"f": SIGMOID},
                display={"f": "keep f", "cand": "candidate tanh(W_c x)"})


def build(n_in, hidden, layers, **_):
    return Leaky(n_in, hidden, layers)


@torch.no_grad()
def keep_init(module, draw, chrono):
    module.bias_f.copy_(draw(module.hidden_size).to(module.bias_f.dtype))


def signals(m, x, prev):
    """f, cand, h at every step from the inputs and the state each step read."""
    f = torch.sigmoid(x @ m.w_f.T + prev @ m.u_f.T + m.bias_f)
    cand = torch.tanh(x @ m.w_c.T)
    return f, cand, f * prev + (1 - f) * cand


class LeakyFamily(Family):
    name = "leaky"
    opens_what = "the worked example's Leaky cell"
    specs = (SPEC,)
    recipe = Recipe("leaky", "the worked example's leaky gated RNN", build,
                    flags=frozenset({"embed", "bias_init", "keep"}), keep_init=keep_init,
                    keep_words="leaky f")

    @classmethod
    def opens(cls, module):
        return isinstance(module, Leaky)

    @property
    def spec(self):
        return SPEC

    @property
    def num_layers(self):
        return 1

    @property
    def hidden_size(self):
        return self.module.hidden_size

    def check(self, inputs, state=None):
        if not isinstance(inputs, torch.Tensor) or inputs.ndim != 3:
            raise ValueError("Leaky reads inputs (B, T, F)")
        return Call(inputs, None if state is None else state[0])

    def _h0(self, call):
        if call.state is not None:
            return call.state
        return call.inputs.new_zeros(call.batch, self.hidden_size)

    def reference(self, call):
        with torch.no_grad():
            out, h_n = self.module(call.inputs, None if call.state is None
                                   else call.state[None])
        return Reference({"layer0.h": out}, {"layer0": call.inputs},
                         {"layer0.h": (self._h0(call),)}, output=out, final=h_n)

    def read(self, call, ref):
        h = ref.states["layer0.h"]
        prev = torch.cat([self._h0(call)[:, None], h[:, :-1]], 1)
        with torch.no_grad():
            f, cand, h_new = signals(self.module, call.inputs, prev)
        return Readout({"layer0.f": f, "layer0.cand": cand, "layer0.h": h_new},
                       h_n=h_new[:, -1][None])

    def rerun(self, call):
        h, out = self._h0(call), {"f": [], "cand": [], "h": []}
        with torch.no_grad():
            for t in range(call.length):
                f, cand, h = signals(self.module, call.inputs[:, t], h)
                for k, v in (("f", f), ("cand", cand), ("h", h)):
                    out[k].append(v)
        sig = {f"layer0.{k}": torch.stack(v, 1) for k, v in out.items()}
        return Readout(sig, h_n=sig["layer0.h"][:, -1][None])

    def judge(self, readout, ref):
        d = (readout.signals["layer0.h"].double() - ref.states["layer0.h"].double()).abs()
        return [LayerDiff(0, False, float(d.max()), None)]

    def one_step(self, call, ref):
        return self.judge(self.read(call, ref), ref)

    def dynamics(self, call, ref):
        m = self.module
        w = {k: getattr(m, k).detach().double() for k in ("w_f", "u_f", "bias_f", "w_c")}

        def step(x, s):
            f = torch.sigmoid(x @ w["w_f"].T + s[0] @ w["u_f"].T + w["bias_f"])
            return [f * s[0] + (1 - f) * torch.tanh(x @ w["w_c"].T)]

        return [Dynamics(step, call.inputs.double(), [ref.states["layer0.h"].double()],
                         [self._h0(call).double()], list(range(call.length)),
                         torch.arange(self.hidden_size))]
'''


@pytest.fixture(scope="module")
def leaky(tmp_path_factory):
    """The family file in a folder of its own, registered by the environment variable
    (which the command line and a study's Ray workers read too)."""
    d = tmp_path_factory.mktemp("leaky_family")
    (d / "leaky_family.py").write_text(textwrap.dedent(FAMILY_FILE), encoding="utf-8")
    mp = pytest.MonkeyPatch()
    mp.syspath_prepend(str(d))
    mp.setenv("PYTHONPATH", os.pathsep.join([str(d), *filter(None, [
        os.environ.get("PYTHONPATH")])]))
    mp.setenv(registry.ENV, "leaky_family:LeakyFamily")
    corpus = d / "c.txt"
    corpus.write_text("the cat sat on the mat; a dog ran far away!\n" * 80, encoding="utf-8")
    yield d, corpus
    mp.undo()
    sys.modules.pop("leaky_family", None)


SMALL = ["--hidden", "8", "--steps", "4", "--batch", "4", "--seq", "16", "--eval-every",
         "2", "--val-windows", "2", "--quiet"]


def test_the_registry_lists_it_and_train_takes_it(leaky, tmp_path):
    d, corpus = leaky
    assert registry.recipe("leaky").keep_words == "leaky f"
    assert "leaky" in registry.cell_names() and "leaky" in registry.cell_specs()
    out = tmp_path / "run"
    assert main(["train", "--cell", "leaky", "--corpus", str(corpus), "--forget-bias", "1.5",
                 *SMALL, "--out", str(out)]) == 0
    cfg = read_config(out)
    assert cfg["model"]["cell"] == "leaky" and cfg["status"] == "done"
    step0 = load_run(out, 0)
    assert torch.allclose(step0.rnn.bias_f, torch.full((8,), 1.5))  # its keep_init ran
    # analyze: the report of the trained run, verified against the module's own forward
    a = analyze(out, windows=2, length=20, perturb_pos=5, out=tmp_path / "a",
                progress=False, plots=False, exponents=1)
    rep = a.report
    assert rep["verification"]["passed"] is True
    assert rep["model"]["family"] == "leaky" and rep["model"]["cell"] == "leaky"
    assert rep["perturbation"]["forget_only"] is not None
    assert rep["baseline"]["step"] == 0
    # Lens: the trained model, opened inside its language model by a forward hook
    res = Lens(load_run(out)).analyze("the cat sat on the mat", windows=1, length=16,
                                      perturb_pos=4, progress=False)
    (path, analysis), = res.analyses.items()
    assert path == "rnn" and analysis.report["verification"]["passed"] is True


def test_a_study_trains_it_on_ray_workers(leaky, tmp_path):
    d, corpus = leaky
    spec = tmp_path / "spec.toml"
    spec.write_text(f'[grid]\ncell = ["leaky", "gru"]\nseed = [0]\n[train]\ncorpus = '
                    f'{json.dumps(str(corpus))}\nhidden = 8\nsteps = 4\neval_every = 2\n'
                    'batch = 4\nseq = 16\nval_windows = 2\n[analysis]\nwindows = 2\n'
                    'length = 16\nperturb_pos = 4\n', encoding="utf-8")
    with ray_session(workers=2):
        res = run_study(spec, tmp_path / "out", workers=2, progress=False)
    study = json.loads((res.out / "study.json").read_text(encoding="utf-8"))
    assert all(t["status"] == "done" for t in study["trials"]), study["trials"]
    md = (res.out / "study.md").read_text(encoding="utf-8")
    assert "carried state: leaky f, GRU z." in md

