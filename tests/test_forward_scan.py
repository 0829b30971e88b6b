"""Every per-token state from the module's own forward (families/forward_scan.py): the states
read from one whole-sequence forward are the module's own (its scan's output and final cache,
bit for bit where it scans sequentially), agree with the package's decode path (the
independent per-token reference), and a replay that is off shows."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

from gatelens.families.forward_scan import linear_scan
from gatelens.families.official import scaled_diff

sys.path.insert(0, str(Path(__file__).parent))  # the shared tiny models (importlib mode)
from official_models import hf_mamba, hf_mamba2  # noqa: E402


def test_linear_scan_is_the_loop():
    g = torch.Generator().manual_seed(0)
    a, b = torch.rand(7, 3, 5, generator=g), torch.randn(7, 3, 5, generator=g)
    s, want = linear_scan(a.transpose(0, 1).transpose(0, 1), b), []
    prev = torch.zeros(3, 5)
    for t in range(7):
        prev = a[t] * prev + b[t]
        want.append(prev)
    assert torch.equal(s, torch.stack(want))  # bit for bit, whatever the layout
    # written over b: the same bits, b's storage, a broadcast keep and a NaN kept
    a, b = torch.rand(7, 3, 1, generator=g) * 16, torch.randn(7, 3, 5, generator=g)
    a[0, 1] = float("inf")  # inf · 0 at the first step: NaN, as the package's loop gives
    want = linear_scan(a, b)
    got = linear_scan(a, b.transpose(0, 2).contiguous().transpose(0, 2), overwrite=True)
    same = linear_scan(a, b, overwrite=True)
    assert same.data_ptr() == b.data_ptr() and torch.equal(got.isnan(), want.isnan())
    assert torch.equal(got.nan_to_num(), want.nan_to_num())
    assert torch.equal(same.nan_to_num(), want.nan_to_num()) and bool(want.isnan().any())


def _final_states(fam, call) -> list[torch.Tensor]:
    """The state transformers' own whole-sequence scan leaves in its cache, per layer."""
    from transformers import DynamicCache

    cache = DynamicCache(config=fam.module.config)
    with torch.no_grad():
        fam.module(inputs_embeds=call.inputs, cache_params=cache, use_cache=True)
    return [cache.get_recurrent_state(k).reshape(call.batch, -1)
            for k in range(fam.num_layers)]


@pytest.mark.parametrize("mambapy", [False, True])
def test_mamba_states_from_the_forward_are_the_modules(mambapy):
    fam, make = hf_mamba(layers=2)
    for mixer in fam.mixers(fam.module):  # the pscan path computes the prompt in parallel
        mixer.use_mambapy = mambapy
    call = make(0)
    ref = fam.reference(call)
    with torch.no_grad():
        own = fam._forward_trajectory(call)
        decode = fam._trajectory(call)  # the package's one-token path, with its cache
        out = fam._forward(call)
    assert torch.equal(ref.output, out)  # the reference's output is the module's forward
    for k, final in enumerate(_final_states(fam, call)):
        s = own["parts"][k][1]  # (B, T, Din·N)
        if mambapy:  # the step path's arithmetic, not the parallel scan's rounding
            assert 0 < scaled_diff(s[:, -1:], final[:, None])[1] <= 1e-5
        else:  # the sequential scan's own states, bit for bit
            assert torch.equal(s[:, -1], final)
        # against the decode path, state by state (its Δ is formed one token at a time)
        assert scaled_diff(s, decode["parts"][k][1])[1] <= 1e-5
        assert torch.equal(own["parts"][k][0], decode["parts"][k][0]) or (
            scaled_diff(own["parts"][k][0], decode["parts"][k][0])[1] <= 1e-6)
    abs_gap, scaled_gap = ref.extra["step_vs_forward"]
    assert (scaled_gap > 0) == mambapy and scaled_gap <= 1e-5
    assert fam.one_step(call, ref)[0].max_scaled_diff_h <= 1e-5


def test_a_replay_that_is_off_is_seen(monkeypatch):
    """A replay whose keep is off by 1e-3 relative: its states part from the module's own
    output (step_vs_forward) and the one-step check fails. The same for states kept from
    the module's own loop (SequentialScanStates) that are off."""
    import gatelens.families.hf_mamba as hm
    from gatelens.families.forward_scan import SequentialScanStates

    fam, make = hf_mamba(layers=1)
    call = make(1)
    with monkeypatch.context() as mp:  # the replay (no states kept from the loop)
        mp.setattr(hm.HFMambaFamily, "scan_steps", lambda self: None)
        mp.setattr(hm, "linear_scan", lambda a, b, **kw: linear_scan(a * (1 + 1e-3), b, **kw))
        ref = fam.reference(call)
    assert ref.extra["step_vs_forward"][1] > 1e-4
    assert fam.one_step(call, ref)[0].max_scaled_diff_h > 1e-4
    keep = SequentialScanStates._state
    monkeypatch.setattr(SequentialScanStates, "_state", lambda self, s: keep(self, s * 1.001))
    ref = fam.reference(call)
    assert ref.extra["step_vs_forward"][1] > 1e-4
    assert fam.one_step(call, ref)[0].max_scaled_diff_h > 1e-4


@pytest.mark.parametrize("falcon", [False, True])
def test_states_kept_from_the_scans_own_loop_are_the_replays(monkeypatch, falcon):
    """Mamba-1's sequential scan (transformers' MambaModel and FalconMambaModel): the states
    its loop formed, kept as it formed them (SequentialScanStates), are the replay's bit for
    bit, in trace and in open_cells (the user's own forward), and were the ones used."""
    import transformers

    import gatelens
    from gatelens.families import forward_scan
    from gatelens.families import hf_mamba as hm

    if falcon:
        torch.manual_seed(0)
        model = transformers.FalconMambaModel(transformers.FalconMambaConfig(
            vocab_size=11, hidden_size=8, state_size=4, num_hidden_layers=2, expand=2,
            conv_kernel=3, time_step_rank=2)).eval()
    else:
        model = hf_mamba(layers=2)[0].module
    ids = torch.randint(0, 11, (2, 9), generator=torch.Generator().manual_seed(3))
    used, scan = [], forward_scan.SequentialScanStates.scan
    monkeypatch.setattr(forward_scan.SequentialScanStates, "scan",
                        lambda self: used.append(scan(self)) or used[-1])
    kept = gatelens.trace(model, ids)
    with gatelens.open_cells(model) as cache:  # a forward that records a graph
        model(input_ids=ids).last_hidden_state.sum().backward()
    (opened,) = cache.traces[""]
    assert not any(v.requires_grad for v in opened.values())  # no graph kept in the trace
    assert len(used) == 4 and all(u is not None for u in used)  # 2 layers, twice
    with monkeypatch.context() as mp:
        mp.setattr(hm.HFMambaFamily, "scan_steps", lambda self: None)
        replayed = gatelens.trace(model, ids)
    assert len(used) == 4  # the replay kept nothing
    assert set(kept) == set(replayed) == set(opened)
    for name in kept:
        assert torch.equal(kept[name], replayed[name]), name
        assert torch.equal(opened[name], replayed[name]), name


def test_jambas_states_kept_from_its_loop_are_the_replays(monkeypatch):
    """Jamba's Mamba mixer (its own copy of the sequential scan): the states kept from its
    loop are the replay's bit for bit, and were the ones used."""
    import gatelens
    from gatelens.families import forward_scan
    from gatelens.families.hf_jamba import HFJambaFamily
    from test_forward_scan_hybrids import _jamba_mixer, _x

    mixer = _jamba_mixer().eval()
    used, scan = [], forward_scan.SequentialScanStates.scan
    monkeypatch.setattr(forward_scan.SequentialScanStates, "scan",
                        lambda self: used.append(scan(self)) or used[-1])
    kept = gatelens.trace(mixer, _x())
    assert len(used) == 1 and used[0] is not None
    monkeypatch.setattr(HFJambaFamily, "scan_steps", lambda self: None)
    replayed = gatelens.trace(mixer, _x())
    assert len(used) == 1 and set(kept) == set(replayed)
    for name in kept:
        assert torch.equal(kept[name], replayed[name]), name


def test_kept_states_that_do_not_fit_are_refused():
    """SequentialScanStates hands states over only where the loop gave exactly one state of
    the keep's shape and dtype a step: fewer, more, another shape or dtype, or no keep is
    None (the caller replays). The mode stack is as before also when the module raised."""
    from torch.overrides import _get_current_function_mode_stack

    from gatelens.families.forward_scan import SequentialScanStates
    from gatelens.families.records import Recorder

    def run(states, keep_shape=(1, 2, 3, 4)):
        cap = SequentialScanStates()
        with cap:
            if keep_shape:
                torch.exp(torch.zeros(keep_shape))
            for s in states:
                torch.matmul(s, torch.ones(s.shape[-1], 1, dtype=s.dtype))
        return cap.scan()

    good = [torch.randn(1, 2, 4) for _ in range(3)]
    s, keep = run(good)
    assert keep.shape == (1, 3, 2, 4) and torch.equal(s, torch.stack(good, dim=1))
    assert run(good[:2]) is None and run(good + good[:1]) is None
    assert run(good, None) is None and run([g.double() for g in good]) is None
    assert run([torch.randn(1, 2, 5) for _ in range(3)]) is None

    class Fails(torch.nn.Module):
        def forward(self, x):
            raise ValueError("no")

    before = len(_get_current_function_mode_stack())
    mod = Fails().eval()
    with Recorder({}, {"m": (mod, SequentialScanStates)}) as rec, pytest.raises(ValueError):
        mod(torch.zeros(1))
    assert len(_get_current_function_mode_stack()) == before
    assert [type(m) for m in rec.taken("m")] == [SequentialScanStates]
    assert rec.taken("m") == []
    with Recorder({}, {"m": (mod.train(), SequentialScanStates)}) as rec, \
            pytest.raises(ValueError):
        mod(torch.zeros(1))  # training: read by a run of its own, nothing kept
    assert rec.captured["m"] == [None] and rec.held("m") is None and rec.held("other") is None


def test_mamba2_states_from_the_forward_follow_its_step_path():
    """Mamba-2's chunked forward holds no per-token state: the replay of its decode step on
    what the forward computed agrees with the decode path itself state by state, and with
    the state the chunked scan leaves in its cache; the chunked output against the replay
    is reported (step_vs_forward), small and not zero."""
    from transformers import DynamicCache

    fam, make = hf_mamba2(layers=2)
    call = make(0)
    ref = fam.reference(call)
    with torch.no_grad():
        decode = fam._trajectory(call)
        cache = DynamicCache(config=fam.module.config)
        fam.module(inputs_embeds=call.inputs, cache_params=cache, use_cache=True)
    for k in range(2):
        s = ref.extra["parts"][k][1]
        assert scaled_diff(s, decode["parts"][k][1])[1] <= 1e-5
        final = cache.get_recurrent_state(k).reshape(call.batch, 1, -1)
        assert scaled_diff(s[:, -1:], final)[1] <= 1e-5
    assert 0 < ref.extra["step_vs_forward"][1] <= 1e-5
    assert fam.one_step(call, ref)[0].max_scaled_diff_h <= 1e-5


@pytest.mark.parametrize("build", [hf_mamba, hf_mamba2])
def test_the_default_trace_is_the_modules_own(build):
    """trace() gives the module's own gates and states (method "own"), at the cost of its
    forward; "anchored" still runs the hand cell, and agrees with them to rounding."""
    import gatelens

    fam, make = build(layers=2)
    ids = make(3).layout["ids"]
    own = gatelens.trace(fam.module, ids)
    hand = gatelens.trace(fam.module, ids, method="anchored")
    assert own.meta["method"] == "own" and hand.meta["method"] == "anchored"
    assert list(own) == list(hand) == fam.names()
    for name in own:
        assert scaled_diff(own[name], hand[name])[1] <= 1e-5, name
    ref = fam.reference(fam.check(ids))
    assert torch.equal(own["layer1.s"], ref.states["layer1.s"])  # its own, not a copy of ours
    with pytest.raises(ValueError, match="method='own'"):
        gatelens.trace(torch.nn.LSTM(2, 3), torch.randn(1, 4, 2), method="own")


@pytest.mark.parametrize("build", [hf_mamba, hf_mamba2])
def test_the_free_running_rerun_by_layer_is_the_step_by_step_one(build):
    fam, make = build(layers=2)
    call = make(4)
    with torch.no_grad():
        by_layer, by_step = fam._rerun_by_layer(call), fam._rerun_by_step(call)
    for name, v in by_step.signals.items():
        assert scaled_diff(by_layer.signals[name], v)[1] <= 1e-6, name


@pytest.mark.parametrize("build", [hf_mamba, hf_mamba2])
def test_open_cells_reads_the_users_own_forward(build):
    """open_cells records the mixers' projections during the user's own forward and reads
    every state from it (no second run): the same values trace() gives, call after call."""
    import gatelens

    fam, make = build(layers=2)
    ids = [make(5).layout["ids"], make(6).layout["ids"]]
    with torch.no_grad(), gatelens.open_cells(fam.module) as cache:
        for i in ids:
            fam.module(input_ids=i)
    assert len(cache.traces[""]) == 2
    for n, i in enumerate(ids):
        tr = gatelens.trace(fam.module, i)
        got = cache.traces[""][n]
        assert got.meta["method"] == "own"
        for name in tr:
            assert torch.equal(got[name], tr[name]), name


@pytest.mark.parametrize("build", [hf_mamba, hf_mamba2])
def test_open_cells_keeps_and_reads_only_the_layers_named(monkeypatch, build):
    """open_cells(names=...) on a stack: only the layers the names pick are read from the
    user's forward (``layers_read``), and only theirs are kept from the scan's own loop
    (Mamba-1; Mamba-2 keeps none), with the same values as the whole read; a short name
    ("s") picks it in every layer. A layer whose names skip the keep gate a keeps its states
    without a copy of the keep (0.6 GB at 24 layers of mamba-130m's width)."""
    import gatelens
    from gatelens.families import forward_scan

    fam, make = build(layers=3)
    ids = make(7).layout["ids"]
    made = []
    init = forward_scan.SequentialScanStates.__init__
    monkeypatch.setattr(forward_scan.SequentialScanStates, "__init__",
                        lambda self, keep=True: made.append(self) or init(self, keep))
    with torch.no_grad(), gatelens.open_cells(fam.module) as whole:
        fam.module(input_ids=ids)
    every = len(made)
    with torch.no_grad(), gatelens.open_cells(fam.module, names=["layer1.s", "layer1.y"]) as one:
        fam.module(input_ids=ids)
    with torch.no_grad(), gatelens.open_cells(fam.module, names=["s"]) as short:
        fam.module(input_ids=ids)
    kept = 1 if fam.scan_steps() else 0
    assert every == 3 * kept  # each of the 3 layers
    assert len(made) == every + kept + every  # layer 1's alone, then each layer's for "s"
    (all_,), (got,), (s,) = whole.traces[""], one.traces[""], short.traces[""]
    assert set(got) == {"layer1.s", "layer1.y"} and got.meta["layers_read"] == [1]
    assert set(s) == {f"layer{k}.s" for k in range(3)} and s.meta["layers_read"] == [0, 1, 2]
    for tr in (got, s):
        for name in tr:
            assert torch.equal(tr[name], all_[name]), name
    # the keep was copied for the whole read, and for none of the reads that skip it
    assert [m.keep is not None for m in made] == [True] * every + [False] * (kept + every)
    with torch.no_grad(), gatelens.open_cells(fam.module, names=["layer2.a", "s"]) as both:
        fam.module(input_ids=ids)
    assert [m.keep is not None for m in made[-every:]] == [False, False, True][:every]
    (tr,) = both.traces[""]
    assert set(tr) == {"layer2.a"} | {f"layer{k}.s" for k in range(3)}
    for name in tr:
        assert torch.equal(tr[name], all_[name]), name
