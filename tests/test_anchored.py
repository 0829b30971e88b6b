"""The anchored read-out and the one-step check, on contracting and on chaotic models.

A chaotic model (every weight_ih / weight_hh × 16) is where the two verification figures
part: each step of the hand cell is right (one-step error ≤ 1e-5), yet the step-by-step
re-run run on its own outputs ends on another trajectory (free-running divergence ~1).
"""

from __future__ import annotations

import pytest
import torch
from torch import nn
from torch.nn.utils.rnn import pack_padded_sequence

import gatelens.families.lstm as lstm_family
from gatelens.families.registry import open_family
from gatelens.readout.trace import trace
from gatelens.readout.verify import verify

# oneDNN has no projected LSTM and warns once before using PyTorch's own path.
pytestmark = [pytest.mark.filterwarnings("ignore:LSTM with projections:UserWarning"),
              pytest.mark.usefixtures("one_thread")]
B, T, F, H = 8, 64, 64, 128


def _call(m: nn.RNNBase, x: torch.Tensor, state=None):
    """The family, call and reference of ``m`` on batch-first ``x`` (B, T, F)."""
    fam = open_family(m)
    call = fam.check(x if m.batch_first or not isinstance(x, torch.Tensor) or x.ndim != 3
                     else x.transpose(0, 1), state)
    return fam, call, fam.reference(call)


def anchored_signals(m: nn.RNNBase, x: torch.Tensor, state=None) -> dict[str, torch.Tensor]:
    fam, call, ref = _call(m, x, state)
    return fam.read(call, ref).signals


def module_states(m: nn.RNNBase, x: torch.Tensor, state=None) -> dict[str, torch.Tensor]:
    fam, call, ref = _call(m, x, state)
    st = fam.trajectory_states(call, ref)
    return {f"{n}.{p}": st[f"{n}.{p}"] for _, _, n, _ in fam.directions_of()
            for p in fam.state_parts}


def one_step_errors(m: nn.RNNBase, x: torch.Tensor, state=None):
    res = verify(m, x if m.batch_first or x.ndim != 3 else x.transpose(0, 1), state)
    fam, call, ref = _call(m, x, state)
    fam.trajectory_states(call, ref)
    return res, ref.extra.get("stepped_vs_sequence_max_abs_diff_h")


def free_running_divergence(m: nn.RNNBase, x: torch.Tensor, state=None) -> float:
    return verify(m, x if m.batch_first else x.transpose(0, 1), state).free_running_max_abs_diff_h


def hand_anchored_lstm(m: nn.LSTM, x: torch.Tensor) -> dict[str, torch.Tensor]:
    """An independent anchored read-out of a unidirectional nn.LSTM: the module's own h of
    each layer (a fresh one-layer nn.LSTM per layer, in the module's dtype, fed the layer
    below's h), then in float64 the gates written out by hand and c from PyTorch's own
    nn.LSTMCell, both fed that h_{t−1}."""
    out: dict[str, torch.Tensor] = {}
    below = x
    for k in range(m.num_layers):
        w = {n: getattr(m, f"{n}_l{k}").detach() for n in
             ("weight_ih", "weight_hh", "bias_ih", "bias_hh")}
        own = nn.LSTM(below.shape[-1], m.hidden_size, batch_first=True).to(x.dtype)
        cell = nn.LSTMCell(below.shape[-1], m.hidden_size).double()
        with torch.no_grad():
            for n, v in w.items():
                getattr(own, n + "_l0").copy_(v)
                getattr(cell, n).copy_(v.double())
            h_seq, _ = own(below)  # (B, T, H): the module's own h of layer k
            xd, hd = below.double(), h_seq.double()
            h_prev = torch.zeros(x.shape[0], m.hidden_size, dtype=torch.float64)
            c_prev = torch.zeros_like(h_prev)
            sig = {s: [] for s in "ifgoc"}
            for t in range(x.shape[1]):
                z = (xd[:, t] @ w["weight_ih"].double().T + w["bias_ih"].double()
                     + h_prev @ w["weight_hh"].double().T + w["bias_hh"].double())
                zi, zf, zg, zo = z.chunk(4, dim=-1)
                _, c_prev = cell(xd[:, t], (h_prev, c_prev))
                for s, v in zip("ifgoc", (zi.sigmoid(), zf.sigmoid(), zg.tanh(), zo.sigmoid(),
                                          c_prev), strict=True):
                    sig[s].append(v)
                h_prev = hd[:, t]
        out.update({f"layer{k}.{s}": torch.stack(v, dim=1) for s, v in sig.items()})
        out[f"layer{k}.h"] = hd
        below = h_seq
    return out


def scaled(module: nn.RNNBase, factor: float, dtype: torch.dtype) -> nn.RNNBase:
    """``module`` with every weight_ih / weight_hh multiplied by ``factor`` (eval, ``dtype``)."""
    with torch.no_grad():
        for name, p in module.named_parameters():
            if name.startswith(("weight_ih", "weight_hh")):
                p.mul_(factor)
    return module.to(dtype).eval()


def chaotic(kind: str, factor: float, dtype: torch.dtype, seed: int = 0) -> nn.RNNBase:
    torch.manual_seed(seed)
    m = {"lstm": lambda: nn.LSTM(F, H, num_layers=2, batch_first=True),
         "gru": lambda: nn.GRU(F, H, num_layers=2, batch_first=True),
         "bilstm": lambda: nn.LSTM(F, H, num_layers=2, batch_first=True, bidirectional=True),
         }[kind]()
    return scaled(m, factor, dtype)


def inputs(dtype: torch.dtype, one_hot: bool, seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    if one_hot:
        return nn.functional.one_hot(torch.randint(0, F, (B, T), generator=g), F).to(dtype)
    return torch.randn(B, T, F, generator=g, dtype=dtype)


CHAOTIC = [("lstm", 16, True), ("lstm", 8, False), ("gru", 16, False), ("bilstm", 16, True)]


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("kind,factor,one_hot", CHAOTIC)
def test_one_step_passes_where_free_running_parts(kind: str, factor: float, one_hot: bool,
                                                  dtype: torch.dtype, seeded_rerun) -> None:
    """The free-running re-run starts one ulp off (``seeded_rerun``): where the hand cell is
    bitwise the CPU's kernel its figure would be 0, and chaos is shown on every CPU."""
    m = chaotic(kind, factor, dtype)
    x = inputs(dtype, one_hot)
    err, gap = one_step_errors(m, x)
    assert err.passed, err.to_dict()
    assert err.one_step_max_abs_diff_h <= 1e-5
    assert len(err.layers) == (4 if kind == "bilstm" else 2)
    if kind != "gru":
        assert err.one_step_max_scaled_diff_c <= 1e-5
        assert err.one_step_max_abs_diff_c is not None
        # the step calls that gave c sat on the module's own trajectory
        assert gap <= 1e-12
    if factor == 16:
        free = err.free_running_max_abs_diff_h
        if dtype == torch.float32:
            assert free > 1e-3, free
        else:  # float64 rounding starts 1e9 times smaller, and has 64 steps to grow
            assert free > 1e5 * err.one_step_max_abs_diff_h, free


@pytest.mark.parametrize("kind", ["lstm", "gru", "bilstm"])
def test_plain_random_models_anchored_equals_trace(kind: str) -> None:
    m = chaotic(kind, 1, torch.float32)  # × 1: PyTorch's own initialisation, contracting
    x = inputs(torch.float32, one_hot=False)
    sig, tr = anchored_signals(m, x), trace(m, x, method="step")
    assert max(float((sig[n] - tr[n]).abs().max()) for n in tr) <= 1e-5
    assert free_running_divergence(m, x) <= 1e-5


def test_only_the_anchored_read_out_follows_a_chaotic_module(seeded_rerun) -> None:
    m = chaotic("lstm", 16, torch.float32)
    x = inputs(torch.float32, one_hot=True)
    with torch.no_grad():
        out, (h_n, c_n) = m(x)
    sig = anchored_signals(m, x)
    with pytest.warns(UserWarning, match="left the module's trajectory"):  # said, not silent
        tr = trace(m, x, method="step")
    assert (sig["layer1.h"] - out).abs().max() <= 1e-5  # the module's own trajectory
    assert (tr["layer1.h"] - out).abs().max() > 1e-3  # another one, each step right
    assert tr.meta["free_running_max_abs_diff_h"] > 1e-3
    default = trace(m, x)  # the default read-out follows the module
    assert default.meta["method"] == "anchored"
    hand = hand_anchored_lstm(m, x)  # an independent float64 computation of the same
    for n in hand:
        scale = hand[n].abs().clamp(min=1.0) if n.endswith(".c") else 1.0
        assert ((default[n].double() - hand[n]).abs() / scale).max() <= 2e-5, n
    res = verify(m, x)  # passes: every step is right; the large free-running figure is said
    assert res.passed and res.chaotic and "chaotic" in res.explain()
    c_scale = c_n[1].abs().clamp(min=1.0)
    assert ((sig["layer1.c"][:, -1] - c_n[1]).abs() / c_scale).max() <= 1e-5


CONTRACTING = {
    "lstm2": lambda: nn.LSTM(5, 16, num_layers=2, batch_first=True),
    "lstm_tm": lambda: nn.LSTM(5, 16, num_layers=2),  # batch_first=False, fed (B, T, F)
    "gru2": lambda: nn.GRU(5, 16, num_layers=2, batch_first=True),
    "bilstm2": lambda: nn.LSTM(5, 16, num_layers=2, bidirectional=True, batch_first=True),
    "bigru": lambda: nn.GRU(5, 16, bidirectional=True, batch_first=True),
    "rnn_relu": lambda: nn.RNN(5, 16, nonlinearity="relu", num_layers=2, batch_first=True),
    "rnn_tanh_nobias": lambda: nn.RNN(5, 16, bias=False, batch_first=True),
    "proj": lambda: nn.LSTM(5, 16, proj_size=6, num_layers=2, bidirectional=True,
                            batch_first=True),
}


def _state(m: nn.RNNBase, gen: torch.Generator, Bn: int) -> torch.Tensor | tuple:
    LD = m.num_layers * (2 if m.bidirectional else 1)
    h0 = torch.randn(LD, Bn, getattr(m, "proj_size", 0) or m.hidden_size, generator=gen)
    return (h0, torch.randn(LD, Bn, m.hidden_size, generator=gen)) if isinstance(
        m, nn.LSTM) else h0


@pytest.mark.parametrize("with_state", [False, True])
@pytest.mark.parametrize("name", list(CONTRACTING))
def test_anchored_equals_trace_on_contracting_models(name: str, with_state: bool) -> None:
    torch.manual_seed(0)
    m = CONTRACTING[name]().eval()
    gen = torch.Generator().manual_seed(1)
    x = torch.randn(4, 20, 5, generator=gen)  # (B, T, F) whatever m.batch_first
    state = _state(m, gen, 4) if with_state else None
    sig = anchored_signals(m, x, state)
    tr = trace(m, x if m.batch_first else x.transpose(0, 1), state)
    assert list(sig) == list(tr)  # the same names, in the same order
    for n in sig:
        assert sig[n].shape == tr[n].shape, n
        assert (sig[n] - tr[n]).abs().max() <= 1e-5, n
    err, _ = one_step_errors(m, x, state)
    assert err.passed and err.one_step_max_abs_diff_h <= 1e-6
    assert free_running_divergence(m, x, state) <= 1e-5


def test_module_states_are_pytorchs_own() -> None:
    """h is the module's output; the last c is the module's c_n (forward end, reverse start)."""
    torch.manual_seed(2)
    m = nn.LSTM(5, 16, num_layers=2, bidirectional=True, batch_first=True).eval()
    x = torch.randn(3, 12, 5)
    st = module_states(m, x)
    assert list(st) == ["layer0.h", "layer0.c", "layer0.reverse.h", "layer0.reverse.c",
                        "layer1.h", "layer1.c", "layer1.reverse.h", "layer1.reverse.c"]
    with torch.no_grad():
        out, (h_n, c_n) = m(x)
    assert torch.equal(torch.cat([st["layer1.h"], st["layer1.reverse.h"]], -1), out)
    assert (st["layer1.c"][:, -1] - c_n[2]).abs().max() <= 1e-6
    assert (st["layer1.reverse.c"][:, 0] - c_n[3]).abs().max() <= 1e-6
    assert (st["layer0.reverse.c"][:, 0] - c_n[1]).abs().max() <= 1e-6


def test_one_step_check_can_fail(monkeypatch: pytest.MonkeyPatch) -> None:
    """A hand cell off by 1e-4 in h fails; off in c only, the c figure catches it."""
    m = nn.LSTM(5, 8).eval()
    x = torch.randn(2, 6, 5)
    real = lstm_family.step

    def off(key: str):
        def stepped(*args):
            sig = real(*args)
            sig[key] = sig[key] + 1e-4
            return sig
        return stepped

    monkeypatch.setattr(lstm_family, "step", off("h"))
    bad, _ = one_step_errors(m, x)
    assert not bad.passed and bad.one_step_max_abs_diff_h == pytest.approx(1e-4, rel=1e-2)
    monkeypatch.setattr(lstm_family, "step", off("c"))
    bad, _ = one_step_errors(m, x)
    assert not bad.passed and bad.one_step_max_abs_diff_h < 1e-6
    assert bad.to_dict()["passed"] is False and bad.one_step_max_scaled_diff_c > 1e-5


def test_inputs_are_checked() -> None:
    m = nn.GRU(5, 8, batch_first=True)
    x = torch.randn(2, 6, 5)
    packed = pack_padded_sequence(x, torch.tensor([6, 4]), batch_first=True)
    with pytest.raises(ValueError, match="PackedSequence"):
        trace(m, packed, method="anchored")
    with pytest.raises(ValueError, match=r"\(B, T, F\)"):
        trace(m, torch.randn(2, 6, 4))
    with pytest.raises(TypeError, match="dtype"):
        module_states(m, x.double())
    with pytest.raises(ValueError, match="h0 must have shape"):
        anchored_signals(m, x, torch.zeros(1, 3, 8))
    with pytest.raises(ValueError, match="c0 must have shape"):
        anchored_signals(nn.LSTM(5, 8), x, (torch.zeros(1, 2, 8), torch.zeros(2, 2, 8)))
    with pytest.raises(TypeError, match="nn.LSTM"):
        verify(nn.Linear(5, 8), x)  # type: ignore[arg-type]


@pytest.mark.parametrize("name", ["lstm2", "gru2", "bilstm2", "proj", "rnn_relu"])
def test_a_stack_run_layer_by_layer_is_the_modules_own_output(name: str) -> None:
    """The reference runs a stack one layer at a time (each layer's own tensors fed the layer
    below's output); on the CPU its top layer is bitwise the module's output, h_n and c_n."""
    torch.manual_seed(0)
    m = CONTRACTING[name]().eval()
    x = torch.randn(4, 20, 5)
    fam = open_family(m)
    ref = fam.reference(fam.check(x))
    with torch.no_grad():
        out, final = m(x)
    assert torch.equal(ref.output, out)
    for got, want in zip(ref.final if isinstance(ref.final, tuple) else (ref.final,),
                         final if isinstance(final, tuple) else (final,), strict=True):
        assert torch.equal(got, want)
