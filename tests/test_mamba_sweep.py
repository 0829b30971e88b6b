"""The divergence rate's tangent through a Mamba-1 stack a layer at a time over the whole
window (families/mamba_sweep.py, ``Dynamics.sweep``) against the step-by-step JVP through
the stack's step (analysis/divergence.py): the same growth, window by window, for every
family that steps as MambaCell does; a tangent that leaves out a term is not; one that
leaves float64's range is handed back to the step-by-step JVP."""

from __future__ import annotations

import sys
from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest
import torch

from gatelens.analysis.divergence import rate_of, start_vectors, window_rates
from gatelens.families import mamba_sweep
from gatelens.families.registry import open_family

sys.path.insert(0, str(Path(__file__).parent))  # the shared helpers (importlib mode)
from test_open_cells_families import VOCAB, whole_model  # noqa: E402

pytestmark = pytest.mark.usefixtures("one_thread")


def _dynamics(name: str, windows: int = 3, length: int = 40):
    model, path, reads = whole_model(name)
    ids = torch.randint(0, VOCAB, (windows, length), generator=torch.Generator().manual_seed(5))
    fam = open_family(model.get_submodule(path))
    with torch.no_grad():
        call = fam.check(reads(ids))
        (dyn,) = fam.dynamics(call, fam.reference(call))
    return fam, dyn


def _rates(dyn, burn_in: int = 8) -> tuple[np.ndarray, np.ndarray]:
    v = start_vectors([dyn], dyn.trajectory[0].shape[0], seed=0)
    swept = window_rates([dyn], burn_in, v)["forward"]
    stepped = window_rates([replace(dyn, sweep=None)], burn_in, v)["forward"]
    return swept, stepped


SWEPT = ["hf-mamba", "mambapy", "hf-jamba", "hf-falcon-mamba"]


def test_the_families_swept_are_those_that_step_as_mamba_cell_does():
    """Mamba-2 (its own step, a keep a head) is stepped token by token: at its width the
    whole window's state tangents cost more than the steps (a generic sweep through its step
    was tried: 4.8 s against 3.1 s a window at 2 layers of mamba2-130m's width)."""
    from gatelens.families.hf_mamba import MambaCell
    from gatelens.families.registry import family_classes

    swept = {c.name for c in family_classes() if issubclass(c, MambaCell)
             and c.step_cell is MambaCell.step_cell and not c.uses_aux}
    assert swept == set(SWEPT)
    _, dyn = _dynamics("hf-mamba2")
    assert dyn.sweep is None


@pytest.mark.parametrize("name", SWEPT)
def test_the_whole_window_tangent_grows_as_the_step_by_step_one(name):
    fam, dyn = _dynamics(name)
    assert dyn.sweep is not None
    swept, stepped = _rates(dyn)
    # the primal point differs by float32 rounding (the module's own inputs above layer 0)
    np.testing.assert_allclose(swept, stepped, rtol=1e-6, atol=1e-9)
    assert dyn.first(1).sweep is None  # the spectrum's windows: stepped


def test_a_tangent_through_a_wrong_keep_is_told_apart(monkeypatch):
    """The tangent's recurrence run with a keep off by 1e-3 relative: the rates part from
    the step-by-step JVP's by about that much a token, far above their agreement."""
    _, dyn = _dynamics("hf-mamba")
    swept, stepped = _rates(dyn)
    assert np.max(np.abs(swept - stepped)) < 1e-8
    scan = mamba_sweep.linear_scan
    monkeypatch.setattr(mamba_sweep, "linear_scan",
                        lambda a, b, **kw: scan(a * (1 + 1e-3), b, **kw))
    wrong, _ = _rates(dyn)
    assert np.min(np.abs(wrong - stepped)) > 1e-4


def test_a_tangent_that_leaves_float64_s_range_is_stepped():
    """A keep of e^{-150} a token: over 300 tokens the whole window's tangent underflows
    (λ ≈ −3 a token), so ``sweep`` says None and the step-by-step JVP (renormalised every
    step) gives λ."""
    fam, _ = _dynamics("hf-mamba")
    with torch.no_grad():
        for mix in fam.mixers(fam.module):
            mix.A_log.fill_(8.0)  # A = −e^8: exp(Δ A) ≈ e^{−150} for Δ ≈ 0.05
    model_call = fam.check(torch.randint(0, VOCAB, (2, 300)))
    with torch.no_grad():
        (dyn,) = fam.dynamics(model_call, fam.reference(model_call))
    v = torch.nn.functional.normalize(torch.randn(2, dyn.size, dtype=torch.float64), dim=-1)
    assert dyn.sweep(v) is None
    got = rate_of([dyn], burn_in=8).lyapunov_per_char
    assert got == rate_of([replace(dyn, sweep=None)], burn_in=8).lyapunov_per_char
    assert np.isfinite(got) and got < -2
