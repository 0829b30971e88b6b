"""Per-token states of the hybrids' Mamba layers read from ONE whole-sequence forward: the
Mamba-2 mixers of Bamba, Zamba2, FalconH1 (μP multipliers; with and without its gated norm),
GraniteMoeHybrid and NemotronH (hf_mamba2.mamba2_replay on what in_proj returned), Jamba's
and FalconMamba's Mamba-1 mixers (the sequential scan replayed on what x_proj and the three
norms returned) and mambapy (its step's arithmetic on its forward's projections). Each
against the package's decode path state by state, its forward's output and final state."""

from __future__ import annotations

import sys
import warnings
from pathlib import Path

import pytest
import torch
import transformers

from gatelens.families.hf_falcon_mamba import HFFalconMambaFamily
from gatelens.families.hf_jamba import HFJambaFamily
from gatelens.families.hf_mamba2_mixers import HFMamba2MixerFamily
from gatelens.families.official import scaled_diff

sys.path.insert(0, str(Path(__file__).parent))  # the shared tiny models (importlib mode)
from official_models import (
    mambapy_stack,  # noqa: E402
    spread_decays,  # noqa: E402
)
from test_family_mamba2_hybrids import MODELS, _falcon_h1  # noqa: E402

D, B, T = 16, 2, 12


@pytest.fixture(autouse=True)
def _quiet(one_thread):
    transformers.utils.logging.set_verbosity_error()
    warnings.filterwarnings("ignore", message=".*deprecated.*")


def _x(length: int = T, seed: int = 1) -> torch.Tensor:
    return torch.randn(B, length, D, generator=torch.Generator().manual_seed(seed))


def _mixer(kind: str, **settings) -> torch.nn.Module:
    torch.manual_seed(0)
    model = spread_decays(_falcon_h1(**settings) if kind == "falcon_h1" else MODELS[kind][0]())
    path = MODELS[kind][1][0]
    return model.get_submodule(path)


def _checked(fam, call, final: bool = True):
    """The reference read from the forward, against the decode path and the forward."""
    ref = fam.reference(call)
    assert ref.extra["own"] is not None
    with torch.no_grad():
        decode, forward = fam._trajectory(call), fam._forward(call)
    assert torch.equal(ref.output, forward)  # the module's own output, its cache or not
    for k in range(fam.num_layers):
        for i in (0, 1):  # the conv buffer and s, state by state
            assert scaled_diff(ref.extra["parts"][k][i], decode["parts"][k][i])[1] <= 1e-5
    assert ref.extra["step_vs_forward"][1] <= 1e-5
    if final:
        assert ref.extra["final_vs_step"][1] <= 1e-5
    assert max(r.max_scaled_diff_h for r in fam.one_step(call, ref)) <= 1e-5
    return ref


@pytest.mark.parametrize("kind,settings", [
    ("bamba", {}), ("zamba2", {}), ("falcon_h1", {}), ("falcon_h1", {"mamba_rms_norm": False}),
    ("granitemoehybrid", {}), ("nemotron_h", {})])
def test_mamba2_mixer_states_from_the_forward_follow_the_decode_step(kind, settings):
    fam = HFMamba2MixerFamily(_mixer(kind, **settings))
    ref = _checked(fam, fam.check(_x()))
    assert ref.extra["step_vs_forward"][1] > 0  # the chunked scan, not the step's rounding


def _jamba_mixer() -> torch.nn.Module:
    torch.manual_seed(0)
    return spread_decays(transformers.JambaForCausalLM(transformers.JambaConfig(
        vocab_size=11, hidden_size=D, intermediate_size=2 * D, num_hidden_layers=2,
        num_attention_heads=2, num_key_value_heads=1, num_experts=1, attn_layer_period=2,
        attn_layer_offset=1, mamba_d_state=4, mamba_d_conv=3,
        mamba_dt_rank=2))).model.layers[0].mamba


def test_jamba_and_falcon_mamba_states_are_their_sequential_scans():
    torch.manual_seed(0)
    falcon = spread_decays(transformers.FalconMambaModel(transformers.FalconMambaConfig(
        vocab_size=11, hidden_size=D, state_size=4, num_hidden_layers=2, expand=2,
        conv_kernel=3, time_step_rank=2)))
    for fam in (HFJambaFamily(_jamba_mixer()), HFFalconMambaFamily(falcon)):
        ref = _checked(fam, fam.check(_x()))
        assert ref.extra["final_vs_step"] == (0.0, 0.0)  # the scan's own final state


def test_mambapy_states_from_its_forward_follow_its_step():
    fam, make = mambapy_stack(layers=2)
    ref = _checked(fam, make(0), final=False)
    assert ref.extra["step_vs_forward"][1] > 0  # its parallel scan, not the step's rounding


def test_a_replay_that_is_off_is_seen(monkeypatch):
    """Each replay off by 1e-3 relative (the keep; the mixers' B): the module's own output
    parts from it (step_vs_forward) and the one-step check fails."""
    from gatelens.families import forward_scan, hf_mamba, hf_mamba2, mambapy

    def off(a, b, **kw):
        return forward_scan.linear_scan(a * (1 + 1e-3), b, **kw)

    heads = hf_mamba2._heads

    def heads_off(mix, xc):
        x, B, C = heads(mix, xc)
        return x, B * (1 + 1e-3), C

    for where in (hf_mamba, mambapy):
        monkeypatch.setattr(where, "linear_scan", off)
    monkeypatch.setattr(hf_mamba2, "_heads", heads_off)
    # Jamba's states are kept from its own loop (test_forward_scan.py); here its replay
    monkeypatch.setattr(HFJambaFamily, "scan_steps", lambda self: None)
    fam_py, make = mambapy_stack(layers=1)
    for fam, call in ((HFMamba2MixerFamily(_mixer("bamba")), None),
                      (HFJambaFamily(_jamba_mixer()), None), (fam_py, make(1))):
        call = call or fam.check(_x())
        ref = fam.reference(call)
        assert ref.extra["step_vs_forward"][1] > 1e-4
        assert fam.one_step(call, ref)[0].max_scaled_diff_h > 1e-4


def test_the_default_trace_is_the_modules_own():
    import gatelens

    for mod in (_mixer("bamba"), _jamba_mixer()):
        own = gatelens.trace(mod, _x())
        hand = gatelens.trace(mod, _x(), method="anchored")
        assert own.meta["method"] == "own" and list(own) == list(hand)
        for name in own:
            assert scaled_diff(own[name], hand[name])[1] <= 1e-5, name


def test_mamba2_replay_is_the_packages_step_function():
    """hf_mamba2.mamba2_replay against the file's own ``mamba2_selective_state_update``
    called token by token on the same in_proj and convolution outputs (the step path, as
    the decode path calls it): s, Δ, the keep and y agree to float32 rounding."""
    from transformers.models.bamba import modeling_bamba as hf

    from gatelens.families.delta_scan import prompt_conv
    from gatelens.families.hf_mamba2 import mamba2_replay

    mix = _mixer("bamba")
    NH, P, N, G = mix.num_heads, mix.head_dim, mix.ssm_state_size, mix.n_groups
    with torch.no_grad():
        zxbcdt = mix.in_proj(_x())
        xbc = zxbcdt.split([mix.intermediate_size, mix.conv_dim, NH], -1)[1]
        xc = prompt_conv(mix, xbc)
        sig, s, y = mamba2_replay(mix, zxbcdt, xc)
        Bn, T = zxbcdt.shape[:2]
        x, Bm, Cm = torch.split(xc, [mix.intermediate_size, G * N, G * N], dim=-1)
        A = (-torch.exp(mix.A_log.float()))[:, None, None].expand(-1, P, N)
        state = torch.zeros(Bn, NH, P, N)
        for t in range(T):
            out = hf.mamba2_selective_state_update(
                state, x[:, t].view(Bn, NH, P), zxbcdt[:, t, -NH:][..., None].expand(-1, -1, P),
                A, Bm[:, t].view(Bn, G, N), Cm[:, t].view(Bn, G, N),
                mix.D[:, None].expand(-1, P), dt_bias=mix.dt_bias[:, None].expand(-1, P),
                dt_softplus=True)
            assert scaled_diff(s[:, t : t + 1], state.reshape(Bn, 1, -1))[1] <= 1e-6, t
            assert scaled_diff(y[:, t : t + 1], out.reshape(Bn, 1, -1))[1] <= 1e-6, t
    assert sig["delta"].shape == sig["a"].shape == (Bn, T, NH)


def _users_forward_is_read(model, path: str, calls: list) -> None:
    """``open_cells`` on two calls of ``model``: the module at ``path`` runs once a call
    (its states read from the user's own forward, no second run), and each trace holds the
    values ``gatelens.trace`` of that module gives on the input it received, bit for bit."""
    import gatelens

    mod, seen = model.get_submodule(path), []

    def grab(m, args, kwargs):
        seen.append(args[0] if args else next(iter(kwargs.values())))
    h = mod.register_forward_pre_hook(grab, with_kwargs=True)
    try:
        with torch.no_grad(), gatelens.open_cells(model) as cache:
            for call in calls:
                call()
    finally:
        h.remove()
    assert len(seen) == len(calls) == len(cache.traces[path])
    for got, x in zip(cache.traces[path], seen, strict=True):
        want = gatelens.trace(mod, x)
        assert got.meta["method"] == "own" and list(got) == list(want)
        for name in want:
            assert torch.equal(got[name], want[name]), name


def test_open_cells_reads_the_users_own_forward():
    ids = [torch.randint(0, 11, (B, T), generator=torch.Generator().manual_seed(s))
           for s in (5, 6)]
    torch.manual_seed(0)
    bamba = spread_decays(MODELS["bamba"][0]())
    _users_forward_is_read(bamba, "model.layers.0.mamba",
                           [lambda i=i: bamba(i, use_cache=False) for i in ids])
    jamba = _jamba_mixer()
    _users_forward_is_read(jamba, "", [lambda s=s: jamba(_x(seed=s)) for s in (5, 6)])
    fam, make = mambapy_stack(layers=2)
    _users_forward_is_read(fam.module, "", [lambda s=s: fam.module(make(s).inputs)
                                            for s in (5, 6)])
    torch.manual_seed(0)
    falcon = spread_decays(transformers.FalconMambaForCausalLM(transformers.FalconMambaConfig(
        vocab_size=11, hidden_size=D, state_size=4, num_hidden_layers=2, expand=2,
        conv_kernel=3, time_step_rank=2)))
    _users_forward_is_read(falcon, "backbone",
                           [lambda i=i: falcon(i, use_cache=False) for i in ids])
