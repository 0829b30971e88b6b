"""Interventions on xlstm's sLSTM, mLSTM and mixed stacks and transformers' xLSTM blocks
(issue 28, "every family takes edits"): the module's own run before the first edit
(bitwise), a state set to itself changes nothing, a state edit at t equals the package's
OWN step path run on from the edited state, a forget-gate edit equals the package's own
step with that gate's pre-activation set to give it (the stabiliser m moving with it), a
keep of 1 holds the state exactly, and carry forward against this position only."""

from __future__ import annotations

import math

import pytest
import torch
import transformers
from torch import Tensor, nn

import gatelens
from gatelens.errors import GatelensError
from gatelens.families.xlstm_mixed import tiny_mixed_stack
from gatelens.families.xlstm_mlstm import tiny_mlstm_stack
from gatelens.families.xlstm_slstm import tiny_slstm_stack

pytestmark = pytest.mark.usefixtures("one_thread")

V, D, T, t0 = 11, 8, 10, 4
STACKS = {"slstm": lambda n: tiny_slstm_stack(dim=D, blocks=n),
          "mlstm": lambda n: tiny_mlstm_stack(dim=D, blocks=n),
          "mixed": lambda n: tiny_mixed_stack(dim=D, blocks=max(n, 2))}


class LM(nn.Module):
    """An embedding, an xLSTMBlockStack, a head."""

    def __init__(self, stack: nn.Module) -> None:
        super().__init__()
        torch.manual_seed(3)
        self.embed, self.stack, self.head = nn.Embedding(V, D), stack, nn.Linear(D, V)

    def forward(self, ids: Tensor) -> Tensor:
        return self.head(self.stack(self.embed(ids)))


def lm_of(kind: str, blocks: int = 2) -> LM:
    torch.manual_seed(5)
    return LM(STACKS[kind](blocks)).eval()


def ids_of(seed: int = 1) -> Tensor:
    return torch.randint(0, V, (2, T), generator=torch.Generator().manual_seed(seed))


def diff(a: Tensor, b: Tensor) -> float:
    return float((a.double() - b.double()).abs().max()) if a.numel() else 0.0


def zero_memory(state: dict) -> dict:
    """A block's step state with its memory zeroed (sLSTM: c, so s = c/n = 0, and the h it
    hands on, h = o c/n = 0; mLSTM: C and n, its raw-scale s), the normaliser and the
    stabiliser left."""
    if "slstm_state" in state:
        st = state["slstm_state"].clone()  # (h, c, n, m)
        st[:2] = 0.0
        return {**state, "slstm_state": st}
    C, n, m = state["mlstm_state"]
    return {**state, "mlstm_state": (torch.zeros_like(C), torch.zeros_like(n), m)}


def stack_decode(lm: LM, ids: Tensor, t: int | None = None, block: int = 0) -> Tensor:
    """The stack's own ``step`` path, token by token, ``block``'s memory zeroed after step
    t: the logits."""
    state, out = {}, []
    with torch.no_grad():
        x = lm.embed(ids)
        for j in range(ids.shape[1]):
            y, state = lm.stack.step(x[:, j:j + 1], state)
            out.append(lm.head(y))
            if j == t:
                state[f"block_{block}"] = zero_memory(state[f"block_{block}"])
    return torch.cat(out, dim=1)


@pytest.mark.parametrize("kind", list(STACKS))
def test_a_state_edit_is_the_stacks_own_step_from_the_edited_state(kind):
    lm = lm_of(kind)
    lens, ids = gatelens.Lens(lm, vocab=V), ids_of()
    with torch.no_grad():
        own = lm(ids)
    s = lens.run(ids).trace["stack.layer1.s"]
    same = lens.run(ids, edits=[gatelens.Set("stack.layer1.s", s[:, t0], at=t0)]).output
    assert torch.equal(same[:, :t0], own[:, :t0]) and diff(same, own) < 1e-5
    got = lens.run(ids, edits=[gatelens.Zero("stack.layer1.s", at=t0)]).output  # top block
    ref = stack_decode(lm, ids, t0, 1)
    later, moved = diff(got[:, t0 + 1:], ref[:, t0 + 1:]), diff(stack_decode(lm, ids), ref)
    assert later < 1e-5 < moved, (later, moved)


@pytest.mark.parametrize("kind", list(STACKS))
def test_a_keep_of_one_holds_the_state_exactly(kind):
    lm = lm_of(kind, blocks=1)
    lens, ids = gatelens.Lens(lm, vocab=V), ids_of()
    letters = lens.families["stack"].letters(0)
    hold = ([gatelens.Set("stack.layer0.kappa", 1.0, at=slice(t0, None))] if "kappa" in letters
            else [gatelens.Set("stack.layer0.f", 1.0, at=slice(t0, None))])
    if "z" not in letters:  # an mLSTM block: nothing written either (i = 0)
        hold.append(gatelens.Zero("stack.layer0.i", at=slice(t0, None)))
    tr = lens.run(ids, edits=hold).trace
    s = tr["stack.layer0.s"][:, t0:]
    assert torch.equal(s, s[:, :1].expand_as(s))
    assert diff(s, lens.run(ids).trace["stack.layer0.s"][:, t0:]) > 1e-3


def test_a_forget_gate_edit_is_the_packages_step_with_that_gate():
    """f := 0.9 at t on an mLSTM block against the package's own step path with its fgate's
    pre-activation logit(0.9) at that step: its stabiliser m' = max(ln f + m, ĩ) moves, and
    the edited run carries that m on."""
    lm = lm_of("mlstm", blocks=2)
    lens, ids, v = gatelens.Lens(lm, vocab=V), ids_of(), 0.9
    got = lens.run(ids, edits=[gatelens.Set("stack.layer0.f", v, at=slice(t0, t0 + 3))]).output
    calls = []

    def hook(mod, args, out):
        calls.append(None)
        return torch.full_like(out, math.log(v / (1 - v))) if t0 <= len(calls) - 1 < t0 + 3 \
            else out

    handle = lm.stack.blocks[0].xlstm.mlstm_cell.fgate.register_forward_hook(hook)
    try:
        ref = stack_decode(lm, ids)
    finally:
        handle.remove()
    assert diff(got, ref) < 1e-5 < diff(got, stack_decode(lm, ids))


def test_carry_forward_and_this_position_only():
    lm = lm_of("slstm", blocks=1)
    lens, ids = gatelens.Lens(lm, vocab=V), ids_of()
    own = lens.run(ids).output
    v = torch.randn(D, generator=torch.Generator().manual_seed(2))  # (a scaled s is normalised
    carried = lens.run(ids, edits=[gatelens.Add("stack.layer0.s", v, at=t0)]).output  # away)
    here = lens.run(ids, edits=[gatelens.Add("stack.layer0.s", v, at=t0, carry=False)]).output
    assert diff(carried[:, t0 + 1:], own[:, t0 + 1:]) > 1e-3
    assert diff(here[:, t0], own[:, t0]) > 1e-3 and torch.equal(here[:, t0], carried[:, t0])
    assert diff(here[:, t0 + 1:], own[:, t0 + 1:]) < 1e-5


# ---- transformers' xLSTM (each block opened on its own) ---------------------------------
def hf_xlstm() -> nn.Module:
    """One block; 64 wide, so transformers 5.23's xLSTMCache (its head dims rounded up to a
    multiple of 64 in all) has the block's own shapes."""
    torch.manual_seed(7)
    return transformers.xLSTMForCausalLM(transformers.xLSTMConfig(
        vocab_size=V, hidden_size=64, num_hidden_layers=1, num_heads=4, qk_dim_factor=1.0,
        v_dim_factor=1.0, ffn_round_up_to_multiple_of=16, use_cache=False)).eval()


def hf_decode(m: nn.Module, ids: Tensor, t: int | None = None) -> Tensor:
    """The model's own decode path (its xLSTMCache, one token at a time), the block's memory
    C and n zeroed after step t (its raw-scale s = 0): the logits."""
    cache = transformers.models.xlstm.modeling_xlstm.xLSTMCache(m.config, ids.shape[0],
                                                                dtype=torch.float32)
    out = []
    with torch.no_grad():
        for j in range(ids.shape[1]):
            out.append(m(ids[:, j:j + 1], cache_params=cache, use_cache=True).logits)
            if j == t:
                for part in cache.rnn_state[0][:2]:
                    part.zero_()
    return torch.cat(out, dim=1)


def test_hf_xlstm_block_edits_against_its_own_decode_path():
    m = hf_xlstm()
    lens, ids = gatelens.Lens(m, vocab=V), ids_of()
    key = "backbone.blocks.0.layer0"
    with torch.no_grad():
        own = m(ids).logits
    s = lens.run(ids).trace[f"{key}.s"]
    same = lens.run(ids, edits=[gatelens.Set(f"{key}.s", s[:, t0], at=t0)]).output.logits
    assert torch.equal(same[:, :t0], own[:, :t0]) and diff(same, own) < 1e-5
    got = lens.run(ids, edits=[gatelens.Zero(f"{key}.s", at=t0)]).output.logits
    ref = hf_decode(m, ids, t0)
    assert diff(got[:, t0 + 1:], ref[:, t0 + 1:]) < 1e-5 < diff(hf_decode(m, ids), ref)
    # f := 0.9 at t: the block's own step with its forget pre-activation set to give it
    layer, cap = m.backbone.blocks[0].mlstm_layer, m.config.gate_soft_cap
    pre = cap * math.atanh(math.log(0.9 / 0.1) / cap)  # soft_cap(pre) = logit(0.9)
    calls = []

    def hook(mod, args, out):
        calls.append(None)
        return torch.full_like(out, pre) if len(calls) - 1 == t0 else out

    gated = lens.run(ids, edits=[gatelens.Set(f"{key}.f", 0.9, at=t0)]).output.logits
    handle = layer.fgate_preact.register_forward_hook(hook)
    try:
        ref = hf_decode(m, ids)
    finally:
        handle.remove()
    assert diff(gated, ref) < 1e-5 < diff(gated, own)
    with pytest.raises(GatelensError, match="bookkeeping"):
        lens.run(ids, edits=[gatelens.Zero(f"{key}.m", at=t0)])


def _large_input_gate(kind: str, bias: float) -> LM:
    """``lm_of(kind)`` with every mLSTM block's input gate pre-activation raised by ``bias``:
    the package's stabiliser m follows ĩ, so the raw-scale memory e^m·C reaches e^{bias}."""
    lm = lm_of(kind)
    with torch.no_grad():
        for block in lm.stack.blocks:
            cell = getattr(block.xlstm, "mlstm_cell", None)
            if cell is not None:
                cell.igate.bias.add_(bias)
    return lm


@pytest.mark.parametrize("kind", ["mlstm", "mixed"])
def test_a_memory_past_float32s_range_is_read_and_edited(kind) -> None:
    """m ≈ 100 > 88: e^m·C passes float32's range. The trace holds the memory in float64
    (finite), verify passes, and an edited run carries it in float64: a state set to itself
    and a keep scaled by 1 give the module's own output (before: s was inf, every edit NaN)."""
    lm, ids = _large_input_gate(kind, 100.0), ids_of()
    lens = gatelens.Lens(lm, vocab=V)
    name = next(iter(lens.families))
    with torch.no_grad():
        own = lm(ids)
    tr = gatelens.trace(lm.stack, lm.embed(ids).detach())
    s = tr["layer0.s"]
    assert s.dtype == torch.float64 and bool(torch.isfinite(s).all())
    assert float(s.abs().max()) > 1e38  # beyond float32's largest number
    assert gatelens.verify(lm.stack, lm.embed(ids).detach()).passed
    set_own = lens.run(ids, edits=[gatelens.Set(f"{name}.layer0.s", s[:, t0], at=t0)])
    keep = lens.run(ids, edits=[gatelens.Scale(f"{name}.layer0.f", 1.0, at=slice(1, T))])
    for run in (set_own, keep):
        assert bool(torch.isfinite(run.output).all())
        assert diff(run.output, own) <= 1e-5 * float(own.abs().max())


def test_a_memory_past_float64s_range_fails_verify_and_says_why() -> None:
    """m ≈ 800 > 709: e^m·C passes float64's range too. The read-out cannot be checked there:
    verify says FAILED and why (the module's own output is finite), never passes on the NaN
    figures (Python's max would drop a NaN placed after a number)."""
    lm, ids = _large_input_gate("mlstm", 800.0), ids_of()
    x = lm.embed(ids).detach()
    with torch.no_grad():
        assert bool(torch.isfinite(lm.stack(x)).all())
    v = gatelens.verify(lm.stack, x)
    assert not v.passed and v.nonfinite
    assert "outgrows the range of the dtype it is read in" in v.explain()
