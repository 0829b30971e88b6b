"""open_cells on every registered family, inside a whole model, and at depth.

The list of families is read from the registry (``gatelens.families()``), so a family added
there is opened here too: a family with a ``--cell`` recipe is built by it inside the
language model gatelens trains (CharLM / OfficialLM); one without a recipe needs an entry in
``NO_RECIPE`` below, and the test fails, naming it, until it has one.
"""

from __future__ import annotations

import sys
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from torch import Tensor, nn

import gatelens
from gatelens.cells.variants import VariantGRU, VariantLSTM
from gatelens.families.registry import check_build, family_classes
from gatelens.readout.hooks import open_cells
from gatelens.readout.trace import trace
from gatelens.training.model import CharLM, OfficialLM

VOCAB, HIDDEN, LAYERS, B, T = 7, 16, 2, 2, 5

pytestmark = pytest.mark.usefixtures("one_thread")


class Loop(nn.Module):
    """An embedding, a cell stepped in a Python loop by the model, a head."""

    def __init__(self, cell: nn.Module) -> None:
        super().__init__()
        self.embed, self.cell = nn.Embedding(VOCAB, 4), cell
        self.head = nn.Linear(HIDDEN, VOCAB)

    def features(self, ids: Tensor) -> Tensor:
        return self.embed(ids)

    def forward(self, ids: Tensor) -> Tensor:
        e, state, hs = self.embed(ids), None, []
        for t in range(ids.shape[1]):
            state = self.cell(e[:, t], state)
            hs.append(state[0] if isinstance(state, tuple) else state)
        return self.head(torch.stack(hs, 1))


class Whole(nn.Module):
    """An embedding, a whole-sequence module, a head."""

    def __init__(self, rnn: nn.Module) -> None:
        super().__init__()
        self.embed, self.rnn, self.head = nn.Embedding(VOCAB, 4), rnn, nn.Linear(HIDDEN, VOCAB)

    def features(self, ids: Tensor) -> Tensor:
        return self.embed(ids)

    def forward(self, ids: Tensor) -> Tensor:
        return self.head(self.rnn(self.embed(ids))[0])


class Gemma(nn.Module):
    """A small RecurrentGemmaForCausalLM (a recurrent block, then a local-attention block);
    its recurrent decoder layer reads the scaled embedding."""

    def __init__(self) -> None:
        super().__init__()
        import transformers

        self.lm = transformers.RecurrentGemmaForCausalLM(transformers.RecurrentGemmaConfig(
            vocab_size=VOCAB, hidden_size=HIDDEN, intermediate_size=2 * HIDDEN,
            num_attention_heads=2, num_hidden_layers=2, block_types=["recurrent", "attention"],
            attention_window_size=4, use_cache=False))

    def features(self, ids: Tensor) -> Tensor:
        m = self.lm.model
        return m.embed_tokens(ids) * m.normalizer.type(torch.float32)

    def forward(self, ids: Tensor) -> Tensor:
        return self.lm(ids).logits


class Bamba(nn.Module):
    """A small BambaForCausalLM (a Mamba-2 layer, then an attention layer); its mixer reads
    the first layer's RMSNorm of the embedding."""

    def __init__(self) -> None:
        super().__init__()
        import transformers

        self.lm = transformers.BambaForCausalLM(transformers.BambaConfig(
            vocab_size=VOCAB, hidden_size=HIDDEN, intermediate_size=2 * HIDDEN,
            num_hidden_layers=2, attn_layer_indices=[1], num_attention_heads=2,
            num_key_value_heads=1, mamba_n_heads=2, mamba_d_head=HIDDEN, mamba_d_state=4,
            mamba_d_conv=3, mamba_chunk_size=4))

    def features(self, ids: Tensor) -> Tensor:
        m = self.lm.model
        return m.layers[0].input_layernorm(m.embed_tokens(ids))

    def forward(self, ids: Tensor) -> Tensor:
        return self.lm(ids, use_cache=False).logits


class Kimi(nn.Module):
    """A small KimiLinearForCausalLM (a KDA layer, then an MLA attention layer); its KDA
    layer reads the first decoder layer's input norm of the embedding."""

    def __init__(self) -> None:
        super().__init__()
        import transformers

        self.lm = transformers.KimiLinearForCausalLM(transformers.KimiLinearConfig(
            vocab_size=VOCAB, hidden_size=HIDDEN, intermediate_size=2 * HIDDEN,
            num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=2,
            kv_lora_rank=4, qk_rope_head_dim=4, qk_nope_head_dim=4, v_head_dim=4,
            linear_num_heads=2, linear_head_dim=4, linear_conv_kernel_dim=3,
            layer_types=["linear_attention", "full_attention"],
            mlp_layer_types=["dense", "dense"], pad_token_id=0, use_cache=False))

    def features(self, ids: Tensor) -> Tensor:
        m = self.lm.model
        return m.layers[0].input_layernorm(m.embed_tokens(ids))

    def forward(self, ids: Tensor) -> Tensor:
        return self.lm(ids).logits


class XLSTM(nn.Module):
    """A small transformers xLSTMForCausalLM of one mLSTM block; the block reads the
    embedding."""

    def __init__(self) -> None:
        super().__init__()
        import transformers

        self.lm = transformers.xLSTMForCausalLM(transformers.xLSTMConfig(
            vocab_size=VOCAB, hidden_size=HIDDEN, num_hidden_layers=1, num_heads=2,
            qk_dim_factor=1.0, ffn_round_up_to_multiple_of=16, use_cache=False))

    def features(self, ids: Tensor) -> Tensor:
        return self.lm.backbone.embeddings(ids)

    def forward(self, ids: Tensor) -> Tensor:
        return self.lm(ids).logits


class Falcon(nn.Module):
    """A small FalconMambaForCausalLM; its backbone reads the ids."""

    def __init__(self) -> None:
        super().__init__()
        import transformers

        self.lm = transformers.FalconMambaForCausalLM(transformers.FalconMambaConfig(
            vocab_size=VOCAB, hidden_size=HIDDEN, state_size=4, num_hidden_layers=2,
            conv_kernel=3, use_cache=False))

    def features(self, ids: Tensor) -> Tensor:
        return ids

    def forward(self, ids: Tensor) -> Tensor:
        return self.lm(ids).logits


class Jamba(nn.Module):
    """A small JambaForCausalLM (a Mamba layer, then an attention layer); its mixer reads
    the normed embedding."""

    def __init__(self) -> None:
        super().__init__()
        import transformers

        self.lm = transformers.JambaForCausalLM(transformers.JambaConfig(
            vocab_size=VOCAB, hidden_size=HIDDEN, intermediate_size=2 * HIDDEN,
            num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=1, num_experts=1,
            attn_layer_period=2, attn_layer_offset=1, mamba_d_state=4, mamba_d_conv=3,
            mamba_dt_rank=2, use_cache=False))

    def features(self, ids: Tensor) -> Tensor:
        m = self.lm.model
        return m.layers[0].input_layernorm(m.embed_tokens(ids))

    def forward(self, ids: Tensor) -> Tensor:
        return self.lm(ids).logits


def rwkv7() -> tuple[nn.Module, str]:
    """The rwkv package's RWKV-7 (tests/rwkv7_models.py) in ``RWKV7LM``, which the family
    opens itself (path ""); it reads the ids."""
    import tempfile

    from gatelens.families.rwkv7 import RWKV7LM

    sys.path.insert(0, str(Path(__file__).parent))  # the shared builder (importlib mode)
    from rwkv7_models import build

    with tempfile.TemporaryDirectory() as d:
        _, model = build(Path(d) / "tiny", layers=2)
    lm = RWKV7LM(model)
    lm.features = lambda ids: ids
    return lm, ""  # the family opens the wrapper itself


#: the families that have no recipe: (the model, the path of the module in it)
NO_RECIPE: dict[str, Callable[[], tuple[nn.Module, str]]] = {
    "lstm_cell": lambda: (Loop(nn.LSTMCell(4, HIDDEN)), "cell"),
    "gru_cell": lambda: (Loop(nn.GRUCell(4, HIDDEN)), "cell"),
    "rnn_cell": lambda: (Loop(nn.RNNCell(4, HIDDEN)), "cell"),
    "variant_lstm": lambda: (Whole(VariantLSTM(4, HIDDEN, peepholes=True)), "rnn"),
    "variant_gru": lambda: (Whole(VariantGRU(4, HIDDEN, reset_after=False)), "rnn"),
    "hf-rglru": lambda: (Gemma(), "lm.model.layers.0"),
    "hf-mamba2-mixer": lambda: (Bamba(), "lm.model.layers.0.mamba"),
    "hf-kda": lambda: (Kimi(), "lm.model.layers.0.self_attn"),
    "hf-xlstm": lambda: (XLSTM(), "lm.backbone.blocks.0"),
    "rwkv7": rwkv7,
    "hf-falcon-mamba": lambda: (Falcon(), "lm.backbone"),
    "hf-jamba": lambda: (Jamba(), "lm.model.layers.0.mamba"),
}


def whole_model(name: str) -> tuple[nn.Module, str, Callable[[Tensor], object]]:
    """The family's module inside a whole model: (model, its path, ids -> what the module
    itself reads: its features or the ids)."""
    cls = next(c for c in family_classes() if c.name == name)
    torch.manual_seed(0)
    r = cls.recipe
    if r is None:
        assert name in NO_RECIPE, f"family {name!r} has no recipe: add it to NO_RECIPE"
        model, path = NO_RECIPE[name]()
        return model.eval(), path, model.features
    if not r.official:
        model = CharLM(VOCAB, hidden=HIDDEN, layers=LAYERS, cell=r.name, embed=4)
        return model.eval(), "rnn", model.encode
    assert check_build(r, HIDDEN, LAYERS, 1) is None
    model = OfficialLM(VOCAB, r.name, HIDDEN, LAYERS).eval()
    return model, "rnn", (lambda ids: ids) if model.embed is None else model.embed


@pytest.mark.parametrize("name", list(gatelens.families()))
def test_open_cells_opens_every_registered_family_inside_a_whole_model(name):
    model, path, reads = whole_model(name)
    module = model.get_submodule(path)
    ids = torch.randint(0, VOCAB, (B, T), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        expected = model(ids)
        with open_cells(model) as cache:
            got = model(ids)
        x = reads(ids)
    assert torch.equal(got[0] if isinstance(got, tuple) else got,
                       expected[0] if isinstance(expected, tuple) else expected)
    # one trace, of the one recurrent module (an inner layer is read as the outer's layerK)
    assert list(cache.traces) == [path] and len(cache.traces[path]) == 1
    direct = trace(module, x)
    assert list(cache.traces[path][0]) == list(direct)
    key = (lambda n: f"{path}.{n}") if path else (lambda n: n)  # the root: bare names
    assert sorted(cache) == sorted(key(n) for n in direct)
    for n in direct:
        a, b = cache[key(n)], direct[n]
        assert a.shape[:2] == (B, T)
        assert torch.allclose(a, b, rtol=0, atol=1e-6), (n, float((a - b).abs().max()))


def count_calls(modules: dict[str, nn.Module]) -> tuple[dict[str, int], list]:
    calls = dict.fromkeys(modules, 0)
    handles = [m.register_forward_pre_hook(
        lambda *_, k=k: calls.__setitem__(k, calls[k] + 1)) for k, m in modules.items()]
    return calls, handles


def test_open_cells_at_depth_runs_each_reference_once_per_forward(monkeypatch):
    """An 8-layer HF Mamba and an 8-layer minLM (whose minGRU layers are opened too): one
    reference per forward, and every layer runs as often as at the bottom (linear in
    depth): Mamba's reference is read from the user's own forward (its mixers' projections
    recorded, families/forward_scan.py), so each layer runs once; minLM's runs its own
    forward, the reference's and its T decode steps."""
    transformers = pytest.importorskip("transformers")
    from minGRU_pytorch.minLM import minLM

    from gatelens.families.hf_mamba import HFMambaFamily
    from gatelens.families.mingru_pytorch import MinGRUPytorchFamily

    depth = 8
    torch.manual_seed(0)
    mamba = transformers.MambaForCausalLM(transformers.MambaConfig(
        vocab_size=VOCAB, hidden_size=8, state_size=2, num_hidden_layers=depth, expand=2,
        conv_kernel=2, time_step_rank=2, use_cache=False)).eval()
    lm = minLM(num_tokens=VOCAB, dim=8, depth=depth).eval()
    ids = torch.randint(0, VOCAB, (B, T))
    for model, fam, layers, path, runs in [
            (mamba, HFMambaFamily, [b.mixer for b in mamba.backbone.layers], "backbone", 1),
            (lm, MinGRUPytorchFamily, [layer[2] for layer in lm.layers], "", 2 + T)]:
        refs = {"n": 0}
        original = fam.reference

        def reference(self, call, original=original, refs=refs):
            refs["n"] += 1
            return original(self, call)

        monkeypatch.setattr(fam, "reference", reference)
        if fam is HFMambaFamily:
            recorded = fam.reference_recorded

            def reference_recorded(self, call, rec, out, recorded=recorded, refs=refs):
                refs["n"] += 1
                return recorded(self, call, rec, out)

            monkeypatch.setattr(fam, "reference_recorded", reference_recorded)
        calls, handles = count_calls({f"layer{k}": m for k, m in enumerate(layers)})
        try:
            with torch.no_grad(), open_cells(model) as cache:
                model(ids)
        finally:
            for h in handles:
                h.remove()
        assert refs["n"] == 1
        assert calls == {f"layer{k}": runs for k in range(depth)}
        assert list(cache.traces) == [path]
        prefix = f"{path}." if path else ""
        assert cache[f"{prefix}layer{depth - 1}.h" if fam is MinGRUPytorchFamily
                     else f"{prefix}layer{depth - 1}.s"].shape[:2] == (B, T)


def test_an_inner_module_called_on_its_own_is_traced_also_after_a_forward_raised():
    """A minGRU layer of a minLM called directly (not through the minLM) is read on its
    own; a forward that raised inside the minLM leaves nothing behind that would hide it."""
    pytest.importorskip("minGRU_pytorch")
    from minGRU_pytorch.minLM import minLM

    torch.manual_seed(0)
    lm = minLM(num_tokens=VOCAB, dim=8, depth=2).eval()
    layer = lm.layers[1][2]
    x = torch.randn(B, T, 8)
    with torch.no_grad(), open_cells(lm) as cache:
        with pytest.raises(IndexError):
            lm(torch.full((B, T), VOCAB + 3))  # out of the embedding's range
        layer(x)
    assert list(cache.traces) == ["layers.1.2"]
    assert torch.allclose(cache["layers.1.2.layer0.h"], trace(layer, x)["layer0.h"],
                          rtol=0, atol=1e-6)
