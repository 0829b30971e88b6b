"""Per-token states of the 2026 families read from ONE whole-sequence forward
(families/delta_scan.py: Gated DeltaNet and KDA): the replay is the package's own recurrent
step over the window (its final state and output, bit for bit, on the q, k, v, g, β the
forward itself handed to its chunked rule), agrees with the package's decode path state by
state (the independent per-token reference), the reference's output is the module's own
forward, a replay that is off shows, and a layer on a fused kernel is read on its decode
path."""

from __future__ import annotations

import functools
import sys
import types
import warnings
from pathlib import Path

import pytest
import torch
import transformers

import gatelens
from gatelens.families import delta_scan
from gatelens.families.hf_gated_deltanet import HFGatedDeltaNetFamily
from gatelens.families.hf_kda import HFKDAFamily
from gatelens.families.official import scaled_diff

sys.path.insert(0, str(Path(__file__).parent))  # the xLSTM tests' models (importlib mode)
from official_models import spread_decays  # noqa: E402
from test_family_hf_xlstm import _block as xlstm_block  # noqa: E402
from test_family_hf_xlstm import _x as _xl  # noqa: E402
from test_family_hf_xlstm import xlstm  # noqa: E402

D, B, T = 32, 2, 20
LINEAR = dict(linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=8,
              linear_value_head_dim=8, linear_conv_kernel_dim=3)
TYPES = ["linear_attention", "full_attention"]


@pytest.fixture(autouse=True)
def _quiet(one_thread):
    transformers.utils.logging.set_verbosity_error()
    warnings.filterwarnings("ignore", message=".*fall.*back.*")


def _layer(kind: str) -> torch.nn.Module:
    """The first recurrent layer of a small random hybrid of that kind."""
    torch.manual_seed(0)
    common = dict(vocab_size=11, hidden_size=D, num_hidden_layers=2, layer_types=TYPES)
    if kind == "kda":
        cfg = transformers.KimiLinearConfig(
            **common, intermediate_size=2 * D, num_attention_heads=2, num_key_value_heads=2,
            kv_lora_rank=8, qk_rope_head_dim=4, qk_nope_head_dim=8, v_head_dim=8,
            linear_num_heads=2, linear_head_dim=8, linear_conv_kernel_dim=3,
            mlp_layer_types=["dense", "dense"], pad_token_id=0)
        return _kept(spread_decays(transformers.KimiLinearForCausalLM(cfg)),
                     "model.layers.0.self_attn")
    if kind == "olmo_hybrid":
        cfg = transformers.OlmoHybridConfig(**common, **LINEAR, intermediate_size=2 * D,
                                            num_attention_heads=2, num_key_value_heads=1,
                                            pad_token_id=0)
        return _kept(spread_decays(transformers.OlmoHybridForCausalLM(cfg)),
                     "model.layers.0.linear_attn")
    config, model = {"qwen3_next": ("Qwen3NextConfig", "Qwen3NextForCausalLM"),
                     "qwen3_5": ("Qwen3_5TextConfig", "Qwen3_5ForCausalLM")}[kind]
    extra = {"num_experts": 0} if kind == "qwen3_next" else {}
    cfg = getattr(transformers, config)(**common, **LINEAR, **extra, intermediate_size=2 * D,
                                        num_attention_heads=2, num_key_value_heads=1,
                                        head_dim=16)
    return _kept(spread_decays(getattr(transformers, model)(cfg)), "model.layers.0.linear_attn")


#: each layer the builders return -> the whole model it sits in
WHOLE: dict[torch.nn.Module, torch.nn.Module] = {}


def _kept(model: torch.nn.Module, path: str) -> torch.nn.Module:
    """The layer at ``path``, its whole model kept in ``WHOLE``."""
    layer = model.get_submodule(path)
    WHOLE[layer] = model
    return layer


def _family(mod):
    return (HFKDAFamily if type(mod).__name__.startswith("Kimi") else HFGatedDeltaNetFamily)(mod)


def _x(length: int = T, seed: int = 1) -> torch.Tensor:
    return torch.randn(B, length, D, generator=torch.Generator().manual_seed(seed))


def _chunked_args(mod, x, monkeypatch) -> dict:
    """The q, k, v, g, β the layer's forward hands its chunked delta rule (recorded)."""
    hf = __import__(type(mod).__module__, fromlist=["_"])
    name = "chunk_kimi_delta_attention" if hasattr(mod, "forget_gate") else \
        "torch_chunk_gated_delta_rule"
    chunked, seen = getattr(hf, name), {}

    def record(query, key, value, g, beta, **kwargs):
        seen.update(q=query, k=key, v=value, g=g, beta=beta)
        return chunked(query, key, value, g=g, beta=beta, **kwargs)

    monkeypatch.setattr(hf, name, record)
    with torch.no_grad():
        mod(hidden_states=x)
    monkeypatch.setattr(hf, name, chunked)
    return seen


@pytest.mark.parametrize("kind", ["qwen3_next", "qwen3_5", "olmo_hybrid", "kda"])
def test_the_states_from_the_forward_are_the_packages_recurrent_step(kind, monkeypatch):
    mod = _layer(kind)
    fam = _family(mod)
    call = fam.check(_x())
    ref = fam.reference(call)
    assert ref.extra["own"] is not None  # read from the forward, not the decode path
    with torch.no_grad():
        decode = fam._trajectory(call)  # one token a call, through the package's cache
        forward = fam._forward(call)
    assert torch.equal(ref.output, forward)  # the module's own forward, its cache or not
    # the package's recurrent function over the whole window, on the forward's own inputs
    hf = __import__(type(mod).__module__, fromlist=["_"])
    a = _chunked_args(mod, call.inputs, monkeypatch)
    step = hf.recurrent_kimi_delta_attention if kind == "kda" else \
        hf.torch_recurrent_gated_delta_rule
    o, final = step(a["q"], a["k"], a["v"], g=a["g"], beta=a["beta"], initial_state=None,
                    output_final_state=True, use_qk_l2norm_in_kernel=True)
    s = ref.extra["parts"][0][1]  # (B, T, H·d_v·d_k)
    assert torch.equal(s[:, -1], final.transpose(-1, -2).flatten(1))  # bit for bit
    replay = delta_scan.kda_replay if kind == "kda" else delta_scan.gdn_replay
    s2, o2, _ = replay(a["q"], a["k"], a["v"], a["g"], a["beta"], hf.l2norm)
    assert torch.equal(s2, s) and torch.equal(o2, o.to(o2.dtype))  # every output, bit for bit
    # the decode path, state by state (its convolution runs one window at a time)
    assert scaled_diff(s, decode["parts"][0][1])[1] <= 1e-5
    assert torch.equal(ref.extra["parts"][0][0], decode["parts"][0][0]) or \
        scaled_diff(ref.extra["parts"][0][0], decode["parts"][0][0])[1] <= 1e-6
    assert 0 < ref.extra["step_vs_forward"][1] <= 1e-5  # the chunked output, not the replay
    assert ref.extra["final_vs_step"][1] <= 1e-5
    assert fam.one_step(call, ref)[0].max_scaled_diff_h <= 1e-5


def test_a_window_shorter_than_the_convolution():
    fam = _family(_layer("qwen3_next"))  # conv of 3 taps, 2 tokens
    call = fam.check(_x(2))
    ref = fam.reference(call)
    with torch.no_grad():
        decode, forward = fam._trajectory(call), fam._forward(call)
    assert ref.extra["own"] is not None
    assert scaled_diff(ref.output, forward)[1] <= 1e-6
    assert scaled_diff(ref.extra["parts"][0][1], decode["parts"][0][1])[1] <= 1e-5


def test_a_replay_that_is_off_is_seen(monkeypatch):
    """Every decay off by 1e-3 relative: the chunked output parts from the replay
    (step_vs_forward) and the one-step check fails."""
    steps = delta_scan.delta_steps

    def off(T, S, at):
        def at_off(t):
            q, k, v, decay, beta = at(t)
            return q, k, v, decay * (1 + 1e-3), beta
        return steps(T, S, at_off)

    monkeypatch.setattr(delta_scan, "delta_steps", off)
    for kind in ("qwen3_next", "kda"):
        fam = _family(_layer(kind))
        call = fam.check(_x())
        ref = fam.reference(call)
        assert ref.extra["step_vs_forward"][1] > 1e-4
        assert fam.one_step(call, ref)[0].max_scaled_diff_h > 1e-4


def test_a_fused_kernel_or_a_replaced_forward_is_read_on_the_decode_path(monkeypatch):
    mod = _layer("qwen3_next")
    assert delta_scan.torch_path(mod, delta_scan.GDN_PACKAGE.functions)
    hf = __import__(type(mod).__module__, fromlist=["_"])

    def installed(torch_function):  # transformers' wrapper, a package's kernel found
        implementation, is_new_implementation = torch_function, True

        @functools.wraps(torch_function)
        def wrapped(*args, **kwargs):
            assert is_new_implementation
            return implementation(*args, **kwargs)
        return wrapped

    with monkeypatch.context() as mp:
        mp.setattr(hf, "torch_chunk_gated_delta_rule",
                   installed(hf.torch_chunk_gated_delta_rule.__wrapped__))
        assert not delta_scan.torch_path(mod, delta_scan.GDN_PACKAGE.functions)
    mod.forward = types.MethodType(type(mod).forward, mod)  # a forward put in its place
    fam = HFGatedDeltaNetFamily(mod)
    call = fam.check(_x())
    ref = fam.reference(call)
    assert ref.extra["own"] is None and fam.one_step(call, ref)[0].max_scaled_diff_h <= 1e-5
    assert gatelens.trace(mod, call.inputs).meta["method"] == "anchored"


@pytest.mark.parametrize("kind", ["qwen3_next", "kda"])
def test_the_default_trace_is_the_modules_own(kind):
    mod = _layer(kind)
    x = _x()
    own = gatelens.trace(mod, x)
    hand = gatelens.trace(mod, x, method="anchored")
    assert own.meta["method"] == "own" and hand.meta["method"] == "anchored"
    assert list(own) == list(hand) == _family(mod).names()
    for name in own:
        assert scaled_diff(own[name], hand[name])[1] <= 1e-5, name


def test_the_free_running_rerun_by_layer_is_the_step_by_step_one():
    from gatelens.families.hf_gated_deltanet import GDN_RECIPE

    torch.manual_seed(0)
    stack = spread_decays(GDN_RECIPE.build(D, D, 2, settings=GDN_RECIPE.settings))
    for fam in (HFGatedDeltaNetFamily(stack), _family(_layer("kda"))):
        call = fam.check(_x(12))
        with torch.no_grad():
            by_layer, by_step = fam._rerun_by_layer(call), fam._rerun_by_step(call)
        for name, v in by_step.signals.items():
            assert scaled_diff(by_layer.signals[name], v)[1] <= 1e-6, name


# ---- RG-LRU (RecurrentGemma): its forward scans token by token ----------------------------
def _gemma_layer(lru_width: int | None = None) -> torch.nn.Module:
    cfg = transformers.RecurrentGemmaConfig(
        vocab_size=11, hidden_size=D, intermediate_size=2 * D, num_attention_heads=2,
        num_hidden_layers=2, block_types=["recurrent", "attention"], attention_window_size=8,
        conv1d_width=3, lru_width=lru_width, use_cache=False)
    torch.manual_seed(0)
    model = transformers.RecurrentGemmaForCausalLM(cfg)
    g = torch.Generator().manual_seed(0)
    with torch.no_grad():  # biases away from zero; the package's own decays (0.9-0.999)
        for name, p in model.named_parameters():
            if not name.endswith("recurrent_param"):
                p.add_((0.3 if "bias" in name or "norm" in name else 0.1)
                       * torch.randn(p.shape, generator=g))
    return _kept(model.eval(), "model.layers.0")


@pytest.mark.parametrize("lru_width", [None, 48])  # 48: the LRU wider than the model
def test_rglru_states_from_the_forward_are_its_scans(lru_width):
    from gatelens.families.hf_rglru import HFRGLRUFamily

    fam = HFRGLRUFamily(_gemma_layer(lru_width))
    call = fam.check(_x())
    ref = fam.reference(call)
    assert ref.extra["own"] is not None
    assert ref.extra["step_vs_forward"] == (0.0, 0.0)  # the forward's own states, bit for bit
    with torch.no_grad():
        decode, forward = fam._trajectory(call), fam._forward(call)
    assert torch.equal(ref.output, forward)
    for i in (0, 1):  # the decode path (its convolution one window at a time)
        assert scaled_diff(ref.extra["parts"][0][i], decode["parts"][0][i])[1] <= 1e-5
    assert torch.equal(ref.extra["aux"][0], decode["aux"][0])  # the reset at position 0
    assert fam.one_step(call, ref)[0].max_scaled_diff_h <= 1e-5
    own = gatelens.trace(fam.module, call.inputs)
    hand = gatelens.trace(fam.module, call.inputs, method="anchored")
    assert own.meta["method"] == "own" and list(own) == list(hand) == fam.names()
    for name in own:
        assert scaled_diff(own[name], hand[name])[1] <= 1e-5, name


def test_rglru_a_replay_that_is_off_is_seen(monkeypatch):
    from gatelens.families import forward_scan, hf_rglru

    monkeypatch.setattr(hf_rglru, "linear_scan",
                        lambda a, b: forward_scan.linear_scan(a * (1 + 1e-3), b))
    fam = hf_rglru.HFRGLRUFamily(_gemma_layer())
    call = fam.check(_x())
    ref = fam.reference(call)
    assert ref.extra["step_vs_forward"][1] > 1e-4
    assert fam.one_step(call, ref)[0].max_scaled_diff_h > 1e-4


def test_rglru_rerun_by_layer_is_the_step_by_step_one():
    from gatelens.families.hf_rglru import RGLRU_RECIPE, HFRGLRUFamily

    torch.manual_seed(0)
    stack = RGLRU_RECIPE.build(D, D, 2, settings=RGLRU_RECIPE.settings)
    for fam in (HFRGLRUFamily(stack), HFRGLRUFamily(_gemma_layer(48))):
        call = fam.check(_x(12))
        with torch.no_grad():
            by_layer, by_step = fam._rerun_by_layer(call), fam._rerun_by_step(call)
        for name, v in by_step.signals.items():
            assert scaled_diff(by_layer.signals[name], v)[1] <= 1e-6, name


def test_open_cells_reads_the_users_own_forward():
    """``open_cells`` on two calls of each hybrid: each opened layer runs once a call (its
    states read from the user's own forward, no second run), and its traces hold what
    ``gatelens.trace`` of that layer gives on the input it received, bit for bit."""
    for layer in (_layer("qwen3_next"), _layer("kda"), _gemma_layer()):
        model = WHOLE[layer]
        path = next(p for p, m in model.named_modules() if m is layer)
        ids = [torch.randint(0, 11, (B, T), generator=torch.Generator().manual_seed(s))
               for s in (5, 6)]
        seen: list = []
        h = layer.register_forward_pre_hook(
            lambda m, a, kw, seen=seen: seen.append(a[0] if a else next(iter(kw.values()))),
            with_kwargs=True)
        try:
            with torch.no_grad(), gatelens.open_cells(model) as cache:
                for i in ids:
                    model(i, use_cache=False)
        finally:
            h.remove()
        assert len(seen) == 2 and len(cache.traces[path]) == 2
        for got, x in zip(cache.traces[path], seen, strict=True):
            want = gatelens.trace(layer, x)
            assert got.meta["method"] == "own" and list(got) == list(want)
            for name in want:
                assert torch.equal(got[name], want[name]), (path, name)


# ---- xLSTM (transformers; xLSTM-7B's mLSTM): the backend's own step kernel, replayed ------
def test_xlstm_states_from_the_forward_are_its_step_kernels():
    """The replay is the backend's own one-token path on the q, k, v, ĩ, f̃ the block formed,
    bit for bit; it agrees with the decode path (the whole block one token at a time) on the
    head's scale; the prompt path's h and final state are compared with it."""
    from gatelens.families.hf_xlstm import HFXLSTMFamily, head_scaled_diff

    block = xlstm_block()
    fam = HFXLSTMFamily(block)
    call = fam.check(_xl())
    ref = fam.reference(call)
    assert ref.extra["own"] is not None
    with torch.no_grad():
        decode, forward = fam._trajectory(call), fam._forward(call)
    assert torch.equal(ref.output, forward)
    units = fam.state_units(0)
    s, s_dec = (torch.cat(p[0], dim=-1) for p in (ref.extra["parts"], decode["parts"]))
    assert head_scaled_diff(s, s_dec, units)[1] <= 1e-5
    assert scaled_diff(ref.extra["aux"][0], decode["aux"][0])[0] <= 1e-5  # m
    assert 0 < ref.extra["step_vs_forward"][1] <= 1e-5 and ref.extra["final_vs_step"][1] <= 1e-5
    assert fam.one_step(call, ref)[0].max_scaled_diff_h <= 1e-5
    # the backend module itself called one token at a time (its S = 1 branch, the decode
    # path's) on the inputs the block's forward handed it: the same states, bit for bit
    backend, seen = block.mlstm_layer.mlstm_backend, {}
    h = backend.register_forward_pre_hook(lambda m, a, kw: seen.update(kw), with_kwargs=True)
    with torch.no_grad():
        fam._forward(call)
    h.remove()
    state = None
    with torch.no_grad():
        for t in range(call.length):
            one = {n: seen[n][:, :, t : t + 1] for n in "qkvif"}
            c0, n0, m0 = state if state is not None else (None, None, None)
            _, state = backend(**one, c_initial=c0, n_initial=n0, m_initial=m0)
    C, n, m = fam._raw(state)  # float64
    assert torch.equal(m[:, 0], ref.extra["aux"][0][:, -1])
    # the raw scale e^m C, e^m n formed in float32 (the soft cap keeps |m| ≤ 15): the exact
    # product of the same float32 C, n and m, rounded twice (e^m, then the product)
    assert s.dtype == torch.float32
    raw = torch.cat([C, n], dim=-1)[:, 0]
    assert bool(((s[:, -1].double() - raw).abs() <= 2.0**-22 * raw.abs()).all())


def test_xlstm_raw_states_past_the_bound_are_formed_in_float64(monkeypatch):
    """A stabiliser beyond ``RAW_M_MAX`` (here the bound set below every |m|): the raw-scale
    states are formed in float64, the float32 ones' values within their rounding."""
    from gatelens.families import xlstm_scan
    from gatelens.families.hf_xlstm import HFXLSTMFamily

    fam = HFXLSTMFamily(xlstm_block())
    call = fam.check(_xl())
    narrow = fam.reference(call).extra["parts"][0]
    monkeypatch.setattr(xlstm_scan, "RAW_M_MAX", -1.0)  # below every |m|
    wide = fam.reference(call).extra["parts"][0]
    for a, b in zip(narrow, wide, strict=True):
        assert a.dtype == torch.float32 and b.dtype == torch.float64
        assert bool(((a.double() - b).abs() <= 2.0**-22 * b.abs()).all())


def test_xlstm_a_replay_that_is_off_is_seen_and_open_cells_reads_the_users_forward(
        monkeypatch):
    from gatelens.families import hf_xlstm, xlstm_scan

    model = xlstm(2)
    ids = [torch.randint(0, 11, (B, T), generator=torch.Generator().manual_seed(s))
           for s in (5, 6)]
    blocks, seen = list(model.backbone.blocks), []
    hooks = [b.register_forward_pre_hook(
        lambda m, a, kw, seen=seen: seen.append((m, a[0])), with_kwargs=True) for b in blocks]
    try:
        with torch.no_grad(), gatelens.open_cells(model) as cache:
            for i in ids:
                model(i)
    finally:
        for h in hooks:
            h.remove()
    assert len(seen) == 4  # each block once a call: read from the user's own forward
    for n, (block, x) in enumerate(seen):
        got = cache.traces[f"backbone.blocks.{n % 2}"][n // 2]
        want = gatelens.trace(block, x)
        assert got.meta["method"] == "own"
        for name in want:
            assert torch.equal(got[name], want[name]), name
    replay = xlstm_scan.mlstm_replay  # ĩ off by 1e-3: its states part from the prompt path's
    monkeypatch.setattr(xlstm_scan, "mlstm_replay",
                        lambda b, q, k, v, i, f: replay(b, q, k, v, i + 1e-3, f))
    fam = hf_xlstm.HFXLSTMFamily(blocks[0])
    call = fam.check(_xl())
    ref = fam.reference(call)
    assert ref.extra["step_vs_forward"][1] > 1e-4
    assert fam.one_step(call, ref)[0].max_scaled_diff_h > 1e-4
