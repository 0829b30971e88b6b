"""Parametrized and pruned weights (weight_norm, spectral_norm, prune) are read as the
module's forward computes them: trace, verify and Lens open them exactly, no traceback."""

from __future__ import annotations

import pytest
import torch
from torch import nn
from torch.nn.utils import prune
from torch.nn.utils.parametrizations import spectral_norm, weight_norm

import gatelens
from gatelens.families.registry import family_of

pytestmark = pytest.mark.usefixtures("one_thread")


def _weight_norm(m: nn.Module, name: str) -> nn.Module:
    weight_norm(m, name)
    with torch.no_grad():  # g away from |v|, so the parametrized weight is not original1
        getattr(m.parametrizations, name).original0.mul_(1.7)
    return m


def _spectral(m: nn.Module, name: str) -> nn.Module:
    return spectral_norm(m, name)


def _prune(m: nn.Module, name: str) -> nn.Module:
    return prune.l1_unstructured(m, name, amount=0.4)


WAYS = {"weight_norm": _weight_norm, "spectral_norm": _spectral, "prune": _prune}
MODULES = {
    "lstm2": lambda: nn.LSTM(3, 6, num_layers=2, batch_first=True),
    "lstm_bi": lambda: nn.LSTM(3, 5, bidirectional=True, batch_first=True),
    "gru2": lambda: nn.GRU(3, 6, num_layers=2, batch_first=True),
    "rnn": lambda: nn.RNN(3, 6, batch_first=True),
}


def _wrapped(kind: str, way: str, names: tuple[str, ...]) -> nn.Module:
    torch.manual_seed(0)
    m = MODULES[kind]()
    for n in names:
        WAYS[way](m, n)
    return m.eval()


@pytest.mark.parametrize("way", sorted(WAYS))
@pytest.mark.parametrize("kind", sorted(MODULES))
def test_verify_and_trace_read_the_parametrized_weights(kind: str, way: str) -> None:
    names = ("weight_hh_l0", "weight_ih_l1") if kind.endswith("2") else (
        "weight_ih_l0", "weight_hh_l0_reverse") if kind == "lstm_bi" else ("weight_hh_l0",)
    m = _wrapped(kind, way, names)
    x = torch.randn(2, 7, 3)
    with torch.no_grad():
        out = m(x)[0]
    tr = gatelens.trace(m, x)
    top = tr["layer1.h"] if kind.endswith("2") else tr["layer0.h"]
    if kind == "lstm_bi":
        top = torch.cat([tr["layer0.h"], tr["layer0.reverse.h"]], dim=-1)
    assert (top - out).abs().max() < 1e-6
    res = gatelens.verify(m, x, trace=tr)
    assert res.passed, res.explain()
    assert res.max_abs_diff_h < 1e-6 and res.trace_max_abs_diff_h < 1e-6


def test_the_weights_are_the_parametrization_not_the_stored_originals() -> None:
    """A read of original0 / weight_ih_l0_orig instead of the computed weight is caught."""
    m = _wrapped("lstm2", "weight_norm", ("weight_hh_l0",))
    fam = family_of(m)
    layer0 = fam.layer(0)
    assert torch.equal(layer0.weight_hh_l0, m.weight_hh_l0.detach())
    assert not torch.equal(layer0.weight_hh_l0,
                           m.parametrizations.weight_hh_l0.original1.detach())


def test_cells_with_parametrized_weights() -> None:
    torch.manual_seed(1)
    for cell in (nn.LSTMCell(3, 5), nn.GRUCell(3, 5)):
        _weight_norm(cell, "weight_ih")
        _prune(cell, "weight_hh")
        x = torch.randn(2, 6, 3)
        res = gatelens.verify(cell, x)
        assert res.passed and res.max_abs_diff_h < 1e-6, res.explain()


def test_spectral_norm_is_read_without_changing_its_vectors() -> None:
    """A training-mode spectral_norm updates u, v on each read; gatelens reads it in eval
    mode, so the module is left as it was."""
    torch.manual_seed(2)
    m = spectral_norm(nn.LSTM(3, 6, batch_first=True), "weight_hh_l0")  # training mode
    sn = m.parametrizations.weight_hh_l0[0]
    u, v = sn._u.clone(), sn._v.clone()
    res = gatelens.verify(m, torch.randn(2, 5, 3))
    assert res.passed
    assert torch.equal(sn._u, u) and torch.equal(sn._v, v) and sn.training


@pytest.mark.parametrize("way", sorted(WAYS))
def test_lens_opens_a_parametrized_lstm(way: str) -> None:
    torch.manual_seed(3)
    chars = list("abcdefgh")

    class LM(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.embed = nn.Embedding(8, 6)
            self.lstm = WAYS[way](nn.LSTM(6, 8, batch_first=True), "weight_hh_l0")
            self.head = nn.Linear(8, 8)

        def forward(self, ids: torch.Tensor) -> torch.Tensor:
            return self.head(self.lstm(self.embed(ids))[0])

    model = LM()  # training mode: a spectral_norm's read would update its vectors
    before = {k: v.clone() for k, v in model.state_dict().items()}
    result = gatelens.Lens(model, vocab=chars).analyze("abcdefghhgfedcbaacegbdfh" * 10, windows=2,
                                                      length=24, perturb_pos=4,
                                                      exponents=0, fixed_points=False)
    a = result.analyses["lstm"]
    assert a.verification.passed and a.verification.max_abs_diff_h < 1e-6
    assert all(torch.equal(v, before[k]) for k, v in model.state_dict().items())
