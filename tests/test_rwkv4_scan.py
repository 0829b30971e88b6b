"""transformers' RWKV-4 read from ONE whole-sequence forward (families/rwkv4_scan.py).

The family records each attention's key, value and receptance Linear in the forward and
replays the package's CPU wkv loop on them. Held here: the states are the forward's own
(the model's returned state after the window, bit for bit; r ⊙ wkv is what the attention's
output Linear received, bit for bit) and the package's one-token decode path's state by
state within float32 rounding; a replay without the bonus time_first, or with a decay off,
is caught; a replaced forward is read on the decode path; trace's default is the module's
own values; the free-running re-run a layer at a time is the float64 hand cell stepped
token by token; ``open_cells`` runs the model once a call (its state on or off).
Tiny model (2 layers, hidden 32, T = 20, B = 3): the file runs in about 2 s.
"""

from __future__ import annotations

import pytest
import torch

import gatelens
from gatelens.families import rwkv4_scan
from gatelens.families.hf_rwkv import HFRwkvFamily
from gatelens.families.official import scaled_diff

pytest.importorskip("transformers")
V, D, B, T = 11, 32, 3, 20


@pytest.fixture(autouse=True)
def _single_thread(one_thread):
    pass


@pytest.fixture(scope="module")
def model():
    from transformers import RwkvConfig, RwkvModel
    from transformers.utils import logging

    logging.set_verbosity_error()
    torch.manual_seed(0)
    cfg = RwkvConfig(vocab_size=V, hidden_size=D, num_hidden_layers=2, context_length=T,
                     attention_hidden_size=D, intermediate_size=2 * D, use_cache=False)
    m = RwkvModel(cfg)
    g = torch.Generator().manual_seed(1)
    with torch.no_grad():  # weights off their init (zero Linear weights would hide a lot)
        for name, p in m.named_parameters():
            if "time_" not in name:
                p.add_(0.3 * torch.randn(p.shape, generator=g))
    return m.eval()


def _ids(seed: int = 2) -> torch.Tensor:
    return torch.randint(0, V, (B, T), generator=torch.Generator().manual_seed(seed))


def _decode_gap(ref, decode) -> float:
    """The worst scaled gap of the carried parts (token shift, num, den, ffn shift)."""
    return max(scaled_diff(p, q)[1] for k in range(2)
               for p, q in zip(ref.extra["parts"][k], decode["parts"][k], strict=True))


def test_the_states_are_the_forwards_own_and_the_decode_paths(model):
    fam = HFRwkvFamily(model)
    call = fam.check(_ids())
    ref = fam.reference(call)
    assert ref.extra["own"] is not None and ref.extra["step_vs_forward"] == (0.0, 0.0)
    with torch.no_grad():
        out = model(inputs_embeds=call.inputs, use_cache=True)  # its state after the window
        decode = fam._trajectory(call)  # one token a call, the state passed along
    assert torch.equal(ref.output, out.last_hidden_state)
    for k in range(2):
        shift, num, den, ffn_shift = (p[:, -1] for p in ref.extra["parts"][k])
        scale = torch.exp(out.state[4][:, :, k].double())  # back from the max shift
        assert torch.equal(shift, out.state[1][:, :, k].double())
        assert torch.equal(num, out.state[2][:, :, k].double() * scale)
        assert torch.equal(den, out.state[3][:, :, k].double() * scale)
        assert torch.equal(ffn_shift, out.state[0][:, :, k].double())
    assert _decode_gap(ref, decode) < 1e-5  # float32 rounding of one-row products
    assert max(r.max_scaled_diff_h for r in fam.one_step(call, ref)) < 1e-5


@pytest.mark.parametrize("wrong", ["time_first", "time_decay"])
def test_a_replay_that_is_off_is_caught(model, monkeypatch, wrong):
    """Without the bonus e^{u + k} (time_first zero): the read-out wkv is off, not the
    states (they never read it); a decay 10% off: the states too, against the decode path."""
    fam = HFRwkvFamily(model)
    call = fam.check(_ids(3))
    with torch.no_grad():
        decode = fam._trajectory(call)

    replay = rwkv4_scan.wkv_replay

    def off(td, tf, k, v):
        if wrong == "time_first":
            return replay(td, torch.zeros_like(tf), k, v)
        return replay(td + 0.1, tf, k, v)

    monkeypatch.setattr(rwkv4_scan, "wkv_replay", off)
    bad = fam.reference(call)
    assert bad.extra["step_vs_forward"][1] > 1e-3  # r ⊙ wkv is not what the forward formed
    assert max(r.max_scaled_diff_h for r in fam.one_step(call, bad)) > 1e-3
    assert not gatelens.verify(model, _ids(3)).passed
    if wrong == "time_first":
        assert _decode_gap(bad, decode) < 1e-5
    else:
        assert _decode_gap(bad, decode) > 1e-3


def test_a_replaced_forward_is_read_on_the_decode_path(model):
    att = model.blocks[1].attention
    att.forward = type(att).forward.__get__(att)  # a forward put in its place
    try:
        fam = HFRwkvFamily(model)
        assert fam.scan_modules() is None
        ref = fam.reference(fam.check(_ids()))
    finally:
        del att.forward
    assert ref.extra["own"] is None and ref.extra["step_vs_forward"][1] < 1e-5
    assert HFRwkvFamily(model).scan_modules() is not None


def test_the_default_trace_is_the_modules_own(model):
    ids = _ids(4)
    own, hand = gatelens.trace(model, ids), gatelens.trace(model, ids, method="anchored")
    assert own.meta["method"] == "own" and hand.meta["method"] == "anchored"
    assert list(own) == list(hand) == HFRwkvFamily(model).names()
    for name in own:
        assert scaled_diff(own[name], hand[name])[1] < 1e-5, name


def test_the_rerun_by_layer_is_the_step_by_step_one(model):
    fam = HFRwkvFamily(model)
    call = fam.check(_ids(5))
    by_layer, by_step = fam.rerun(call), fam._rerun_by_step(call)
    assert list(by_layer.signals) == list(by_step.signals) == fam.names()
    for name, v in by_step.signals.items():
        assert scaled_diff(by_layer.signals[name], v)[1] <= 1e-6, name


@pytest.mark.parametrize("use_cache", [False, True])
def test_open_cells_reads_the_users_own_forward(model, use_cache):
    calls = []
    h = model.blocks[0].attention.register_forward_pre_hook(lambda m, a: calls.append(1))
    ids = _ids(6)
    try:
        with torch.no_grad(), gatelens.open_cells(model) as cache:
            model(ids, use_cache=use_cache)
    finally:
        h.remove()
    assert len(calls) == 1  # the user's forward, no second run
    want = gatelens.trace(model, ids)
    got = cache.traces[""][0]
    assert got.meta["method"] == "own" and list(got) == list(want)
    for name in want:
        assert torch.equal(got[name], want[name]), name
