"""The variant cells (cells/variants.py) and their families (families/variants.py).

Held against PyTorch where the equations coincide (sigmoid/tanh, reset after), against hand
computations where they do not (peepholes, reset before, hard_sigmoid), and the families'
figures against the nn.RNNBase machinery on the same weights.
"""

from __future__ import annotations

import math

import pytest
import torch
from torch import nn

import gatelens
from gatelens.analysis.divergence import divergence_rate
from gatelens.analysis.measure import encoder_runner, measure
from gatelens.cells.variants import VariantGRU, VariantLSTM, gru_variant_step, lstm_variant_step
from gatelens.errors import GatelensError
from gatelens.families.base import Readout
from gatelens.families.registry import family_of
from gatelens.families.variants import VariantGRUFamily, VariantLSTMFamily


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("bi", [False, True])
def test_sigmoid_tanh_variants_are_pytorch_own_cells(dtype, bi):
    torch.manual_seed(0)
    x = torch.randn(3, 9, 4, dtype=dtype)
    for ref, cls in ((nn.LSTM(4, 5, batch_first=True, bidirectional=bi), VariantLSTM.from_lstm),
                     (nn.GRU(4, 5, batch_first=True, bidirectional=bi), VariantGRU.from_gru)):
        ref = ref.to(dtype)
        v = cls(ref).to(dtype)
        out, fin = v(x)
        want, want_fin = ref(x)
        tol = 1e-6 if dtype == torch.float32 else 1e-12
        assert (out - want).abs().max() < tol
        for a, b in zip(fin if isinstance(fin, tuple) else (fin,),
                        want_fin if isinstance(want_fin, tuple) else (want_fin,), strict=True):
            assert (a - b).abs().max() < tol


def _scalar_lstm(**kw):
    m = VariantLSTM(1, 1, **kw).double()  # float64: the hand values are exact in it
    with torch.no_grad():
        m.weight_ih.copy_(torch.tensor([[[0.5], [-0.3], [0.8], [0.2]]], dtype=torch.float64))
        m.weight_hh.copy_(torch.tensor([[[0.1], [0.4], [-0.6], [0.7]]], dtype=torch.float64))
        m.bias_ih.copy_(torch.tensor([[0.1, 0.2, 0.3, 0.4]], dtype=torch.float64))
        m.bias_hh.zero_()
        if m.peephole is not None:
            m.peephole.copy_(torch.tensor([[0.9, -0.5, 1.5]], dtype=torch.float64))  # p_i, p_f, p_o
    return m


def test_peephole_and_hard_sigmoid_by_hand():
    m = _scalar_lstm(peepholes=True, recurrent_activation="hard_sigmoid_v2")
    x, h, c = 2.0, 0.3, -1.2
    hs = lambda z: min(max(0.2 * z + 0.5, 0.0), 1.0)  # noqa: E731
    i = hs(0.5 * x + 0.1 * h + 0.1 + 0.9 * c)
    f = hs(-0.3 * x + 0.4 * h + 0.2 - 0.5 * c)
    g = math.tanh(0.8 * x - 0.6 * h + 0.3)
    c2 = f * c + i * g
    o = hs(0.2 * x + 0.7 * h + 0.4 + 1.5 * c2)  # the output gate peeks at the new c
    s = lstm_variant_step(m.weights(0, torch.float64), torch.tensor([x], dtype=torch.float64),
                          torch.tensor([h], dtype=torch.float64),
                          torch.tensor([c], dtype=torch.float64))
    for k, want in dict(i=i, f=f, g=g, o=o, c=c2, h=o * math.tanh(c2)).items():
        assert float(s[k]) == pytest.approx(want, abs=1e-12), k
    out, (h_n, c_n) = m.double()(torch.tensor([[[x]]], dtype=torch.float64),
                                 (torch.tensor([[[h]]], dtype=torch.float64),
                                  torch.tensor([[[c]]], dtype=torch.float64)))
    assert float(h_n) == pytest.approx(o * math.tanh(c2), abs=1e-12)


def test_gru_reset_before_by_hand():
    m = VariantGRU(1, 1, reset_after=False, recurrent_activation="hard_sigmoid").double()
    with torch.no_grad():  # chunk order r, z, n
        m.weight_ih.copy_(torch.tensor([[[0.5], [-0.3], [0.8]]], dtype=torch.float64))
        m.weight_hh.copy_(torch.tensor([[[0.1], [0.4], [-0.6]]], dtype=torch.float64))
        m.bias_ih.copy_(torch.tensor([[0.1, 0.2, 0.3]], dtype=torch.float64))
        m.bias_hh.copy_(torch.tensor([[0.0, 0.0, 0.25]], dtype=torch.float64))
    x, h = 1.5, -0.4
    hs = lambda z: min(max(z / 6 + 0.5, 0.0), 1.0)  # noqa: E731  Keras 3's hard_sigmoid
    r, z = hs(0.5 * x + 0.1 * h + 0.1), hs(-0.3 * x + 0.4 * h + 0.2)
    n = math.tanh(0.8 * x + 0.3 + (-0.6) * (r * h) + 0.25)  # R_h applied to r ⊙ h
    s = gru_variant_step(m.weights(0, torch.float64), torch.tensor([x], dtype=torch.float64),
                         torch.tensor([h], dtype=torch.float64))
    assert [float(s[k]) for k in "rznh"] == pytest.approx([r, z, n, (1 - z) * n + z * h],
                                                          abs=1e-12)


def test_family_names_checks_and_errors():
    m = VariantLSTM(3, 4, directions=("forward", "reverse"), peepholes=True)
    fam = family_of(m)
    assert isinstance(fam, VariantLSTMFamily)
    assert fam.names() == [f"layer0{d}.{s}" for d in ("", ".reverse") for s in "ifgoch"]
    rev = VariantGRUFamily(VariantGRU(3, 4, directions=("reverse",)))
    assert rev.names() == [f"layer0.reverse.{s}" for s in "rznh"]
    assert not isinstance(family_of(nn.LSTM(3, 4)), VariantLSTMFamily)
    x = torch.randn(2, 8, 3)
    call = fam.check(x)
    ref = fam.reference(call)
    ro, free = fam.read(call, ref), fam.rerun(call)
    for n in fam.names():
        assert (ro.signals[n] - free.signals[n]).abs().max() < 1e-6, n
    assert all(d.max_abs_diff_h < 1e-6 and d.max_scaled_diff_c < 1e-6
               for d in fam.one_step(call, ref))
    bad = dict(ro.signals)
    bad["layer0.reverse.h"] = bad["layer0.reverse.h"] + 1e-3  # a read-out off the trajectory
    assert max(d.max_abs_diff_h for d in fam.judge(Readout(bad), ref)) > 9e-4
    with pytest.raises(ValueError, match=r"batch-first \(B, T, F\) with F = 3"):
        fam.check(torch.randn(2, 8, 5))
    with pytest.raises(ValueError, match=r"state is \(h0, c0\) of shape \(2, 2, 4\)"):
        fam.check(x, (torch.zeros(1, 2, 4), torch.zeros(1, 2, 4)))
    with pytest.raises(GatelensError, match="activation 'softmax' is not one gatelens"):
        VariantGRU(3, 4, recurrent_activation="softmax")
    with pytest.raises(GatelensError, match="directions must be one of"):
        VariantGRU(3, 4, directions=("reverse", "forward"))


def test_variant_figures_equal_the_nn_lstm_ones():
    torch.manual_seed(1)
    lstm = nn.LSTM(3, 6, batch_first=True)
    with torch.no_grad():
        lstm.weight_hh_l0.mul_(3)  # livelier dynamics than the default init
    v = VariantLSTM.from_lstm(lstm)
    x = torch.randn(3, 30, 3)
    mine, want = divergence_rate(v, x, 4, 5), divergence_rate(lstm, x, 4, 5)
    assert mine.lyapunov_per_char == pytest.approx(want.lyapunov_per_char, abs=1e-6)
    tr, ref_tr = gatelens.trace(v, x), gatelens.trace(lstm, x)
    assert list(tr) == list(ref_tr) and tr.cell == "lstm_variant"
    assert all((tr[n] - ref_tr[n]).abs().max() < 1e-5 for n in tr)
    res = gatelens.verify(v, x, trace=tr)
    assert res.passed and res.one_step_max_scaled_diff_h is None  # tanh: h judged absolutely
    relu = gatelens.verify(VariantGRU(3, 4, activation="relu"), x)
    assert relu.one_step_max_scaled_diff_h is not None  # unbounded h: judged on its scale


def test_measure_on_a_variant_and_the_exact_perturbation_split():
    torch.manual_seed(2)
    m = VariantLSTM(4, 6, peepholes=True, recurrent_activation="hard_sigmoid")
    with torch.no_grad():
        m.peephole.uniform_(-0.5, 0.5)
    ids = torch.randint(0, 4, (3, 40))
    a = measure(m, encoder_runner(lambda i: nn.functional.one_hot(i, 4).float()), ids,
                list("abcd"), perturb_pos=8)
    assert a.verification.passed and a.trace.cell == "lstm_variant"
    assert a.verification.meta["family"] == "variant_lstm"
    d = a.decomposition
    assert (d["forget_path"] + d["return_path"] - d["measured"]).abs().max() < 1e-6
    with gatelens.open_cells(nn.Sequential(m)) as cache:  # the hooks read a variant too
        m(torch.randn(2, 5, 4))
    assert cache["0.layer0.f"].shape == (2, 5, 6) and cache.max_abs_diff["0"] < 1e-6
    with pytest.raises(GatelensError, match="reverse-only recurrent module cannot be measured"):
        measure(VariantGRU(4, 3, directions=("reverse",)),
                encoder_runner(lambda i: nn.functional.one_hot(i, 4).float()), ids,
                list("abcd"), perturb_pos=8)
