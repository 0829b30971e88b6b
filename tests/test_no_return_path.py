"""The no-return-path invariant (METHODS "Window of the input path").

In one layer whose decay and input term read only the layer's input (gatelens's and
mingru-pytorch's minGRU/minLSTM, Mamba, Mamba-2, RWKV-4), once the layer's input is the same again
(from lag w − 1 after the changed position p: w = 1 for minGRU/minLSTM, 2 for RWKV's token
shift, d_conv for Mamba), the state difference the module itself carries is the difference
at lag w − 1 rolled forward by the read-out's keep factor alone:
δs_{t} = a_t ⊙ δs_{t−1}. In float64 that holds to rounding (~1e-15); HF's Mamba and
Mamba-2 steps and RWKV's state run in float32 whatever the model's dtype, so there the figure
is float32's (~1e-6). With two layers the upper layer's input differs at every lag and the
identity breaks; a wrong decay (√a) or starting before the window has passed breaks it too.
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).parent))  # the shared tiny models (importlib mode)
import gatelens
from gatelens.cells.modern import MinGRU, MinLSTM
from official_models import DIM, T, hf_mamba, hf_mamba2, hf_rwkv, mambapy_stack, mingru_lm

P = 6  # the changed position


def rolled_gap(s_clean: torch.Tensor, s_pert: torch.Tensor, keep: torch.Tensor,
               start: int) -> float:
    """max over t > start of |δs_t − (∏ a) ⊙ δs_start|, relative to max |δs_start| of each
    window: 0 when the keep factor alone carries the difference on. (B, T, S) each."""
    ds = (s_pert - s_clean).double()
    rolled, norm = ds[:, start], ds[:, start].abs().amax(dim=-1)  # (B, S), (B,)
    assert float(norm.min()) > 0, "the change never reached the state"
    worst = 0.0
    for t in range(start + 1, ds.shape[1]):
        rolled = keep[:, t].double() * rolled
        worst = max(worst, float(((ds[:, t] - rolled).abs().amax(dim=-1) / norm).max()))
    return worst


def family_gap(build, layers: int, layer: int, lag0: int | None = None,
               wrong: bool = False, dtype=torch.float64) -> float:
    fam, make = build(layers, dtype=dtype)
    clean, pert = make(0), make(0, perturb_at=P)
    ref_c, ref_p = fam.reference(clean), fam.reference(pert)
    name = f"layer{layer}.{fam.spec.state}"
    keep = fam.read(clean, ref_c).signals[f"layer{layer}.{fam.spec.keep_gate}"]
    keep = keep[..., fam.state_units(layer)]  # (B, T, S): each coordinate's keep factor
    if wrong:
        keep = keep.sqrt()
    w = fam.input_window()
    return rolled_gap(ref_c.states[name], ref_p.states[name], keep,
                      P + (w - 1 if lag0 is None else lag0))


EXACT = {"mingru-gru": lambda L, dtype: mingru_lm(L, dtype=dtype),
         "mingru-lstm": lambda L, dtype: mingru_lm(L, lstm=True, dtype=dtype),
         "mambapy": mambapy_stack}
# their steps run in float32 inside, whatever the model's dtype
FLOAT32 = {"hf-mamba": hf_mamba, "hf-mamba2": hf_mamba2, "hf-rwkv": hf_rwkv}
BOTH = {**EXACT, **FLOAT32}


@pytest.mark.parametrize("kind", sorted(EXACT))
def test_one_layer_keeps_the_difference_by_its_decay_alone_exactly(kind):
    assert family_gap(EXACT[kind], 1, 0) < 1e-10


@pytest.mark.parametrize("kind", sorted(FLOAT32))
def test_one_layer_keeps_the_difference_by_its_decay_alone_float32(kind):
    assert family_gap(FLOAT32[kind], 1, 0) < 2e-5


@pytest.mark.parametrize("kind", sorted(BOTH))
def test_two_layers_bring_a_return_path(kind):
    assert family_gap(BOTH[kind], 2, 0) < 2e-5  # the bottom layer still has none
    assert family_gap(BOTH[kind], 2, 1) > 1e-3


@pytest.mark.parametrize("kind", sorted(BOTH))
def test_a_wrong_decay_fails_the_invariant(kind):
    assert family_gap(BOTH[kind], 1, 0, wrong=True) > 1e-2


@pytest.mark.parametrize("kind", ["hf-mamba", "hf-mamba2", "hf-rwkv", "mambapy"])
def test_the_input_window_must_have_passed(kind):
    # Mamba's convolution (d_conv = 3) and RWKV's token shift still read the changed input
    # at lag 1: rolling from lag 0 is not the measured difference
    assert BOTH[kind](1, dtype=torch.float64)[0].input_window() > 1
    assert family_gap(BOTH[kind], 1, 0, lag0=0) > 1e-3


@pytest.mark.parametrize("cls", [MinGRU, MinLSTM])
def test_gatelens_own_cells_have_no_return_path_in_one_layer(cls):
    torch.manual_seed(7)
    g = torch.Generator().manual_seed(0)
    x = torch.randn(3, T, DIM, generator=g, dtype=torch.float64)
    xp = x.clone()
    xp[:, P] += torch.randn(3, DIM, generator=g, dtype=torch.float64)
    for layers, layer, ok in ((1, 0, True), (2, 0, True), (2, 1, False)):
        cell = cls(DIM, 12, num_layers=layers).double()
        tr, trp = gatelens.trace(cell, x), gatelens.trace(cell, xp)
        keep = tr[f"layer{layer}.keep"]
        gap = rolled_gap(tr[f"layer{layer}.h"], trp[f"layer{layer}.h"], keep, P)
        assert (gap < 1e-10) if ok else (gap > 1e-3), (layers, layer, gap)
        wrong = rolled_gap(tr[f"layer{layer}.h"], trp[f"layer{layer}.h"], keep.sqrt(), P)
        assert wrong > 1e-2
