"""A model nothing in is opened gets one line naming why (families/unopened.py): a known
recurrence gatelens does not open yet (its path and class), a fused kernel with no CPU
path, short convolutions only, or nothing recurrent at all."""

from __future__ import annotations

import subprocess
import sys

import pytest
import torch
import transformers
from torch import nn

import gatelens
from gatelens.errors import GatelensError

VOCAB = list("abcdefghij ")


def _one_line(e: pytest.ExceptionInfo) -> str:
    msg = str(e.value)
    assert "\n" not in msg and len(msg) < 600, msg
    return msg


def test_a_plain_transformer_has_nothing_gatelens_opens():
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(transformers.LlamaConfig(
        vocab_size=11, hidden_size=16, intermediate_size=32, num_hidden_layers=1,
        num_attention_heads=2, num_key_value_heads=1))
    with pytest.raises(GatelensError) as e:
        gatelens.Lens(model, vocab=VOCAB)
    msg = _one_line(e)
    assert msg.startswith("LlamaForCausalLM: nothing in it is a recurrence gatelens opens")
    # where to look instead: every family it opens (those with no --cell of their own too)
    assert all(name in msg for name in gatelens.families())
    assert "hf-kda" in msg and "hf-mamba2-mixer" in msg and "hf-xlstm" in msg


def test_short_convolutions_are_said_to_be_no_recurrence():
    torch.manual_seed(0)
    model = transformers.Lfm2ForCausalLM(transformers.Lfm2Config(
        vocab_size=11, hidden_size=16, intermediate_size=32, num_hidden_layers=2,
        num_attention_heads=2, num_key_value_heads=1, layer_types=["conv", "full_attention"]))
    with pytest.raises(GatelensError) as e:
        gatelens.Lens(model, vocab=VOCAB)
    assert "its Lfm2ShortConv layers are short convolutions" in _one_line(e)


def test_a_known_recurrence_not_opened_yet_is_named_with_its_path_and_class():
    torch.manual_seed(0)
    model = transformers.MiniMaxForCausalLM(transformers.MiniMaxConfig(
        vocab_size=11, hidden_size=16, intermediate_size=32, num_hidden_layers=2,
        num_attention_heads=2, num_key_value_heads=1, head_dim=8, num_local_experts=2,
        num_experts_per_tok=1, layer_types=["linear_attention", "full_attention"]))
    with pytest.raises(GatelensError) as e:
        gatelens.Lens(model, vocab=VOCAB)
    msg = _one_line(e)
    assert msg.startswith("MiniMaxForCausalLM: model.layers.0.self_attn "
                          "(MiniMaxLightningAttention) is MiniMax's lightning attention")


def test_a_fused_kernel_layer_is_refused_for_its_missing_cpu_path():
    layer = type("GatedDeltaNet", (nn.Module,), {"__module__": "fla.layers.gated_deltanet"})
    model = nn.Sequential(nn.Embedding(5, 4))
    model.add_module("attn", layer())
    with pytest.raises(GatelensError) as e:
        gatelens.Lens(model)
    assert _one_line(e).startswith(
        "Sequential: attn (GatedDeltaNet) is flash-linear-attention's layers run its Triton "
        "kernels, which have no CPU path")


def test_a_hugging_face_directory_with_no_recurrence_exits_2_in_one_line(tmp_path):
    torch.manual_seed(0)
    transformers.LlamaForCausalLM(transformers.LlamaConfig(
        vocab_size=11, hidden_size=16, intermediate_size=32, num_hidden_layers=1,
        num_attention_heads=2, num_key_value_heads=1)).save_pretrained(tmp_path / "llama")
    (tmp_path / "t.txt").write_text("abc def " * 20, encoding="utf-8")
    p = subprocess.run([sys.executable, "-m", "gatelens", "analyze", "--model",
                        str(tmp_path / "llama"), "--text", str(tmp_path / "t.txt"),
                        "--out", str(tmp_path / "a")],
                       capture_output=True, text=True)
    assert p.returncode == 2, p.stderr
    lines = p.stderr.strip().splitlines()
    assert len(lines) == 1 and "LlamaForCausalLM: nothing in it is a recurrence" in lines[0]
    assert not (tmp_path / "a").exists()
