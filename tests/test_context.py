"""Context used by truncation: a memoryless model, a copy model worked by hand, and an LSTM
against a one-sequence-at-a-time loop."""

from __future__ import annotations

import json
import math

import pytest
import torch
from torch import nn

from gatelens.analysis.context import ContextAccumulator, context_lengths, context_used
from gatelens.errors import GatelensError

pytestmark = pytest.mark.usefixtures("one_thread")


class Memoryless(nn.Module):
    """Logits from the current character only."""

    def __init__(self, V: int) -> None:
        super().__init__()
        self.table = nn.Embedding(V, V)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.table(ids)  # (N, d, V)


class Copy(nn.Module):
    """Logits a·onehot(x_{t−d0}) at t ≥ d0 of its own input, zeros (uniform) before."""

    def __init__(self, V: int, d0: int, a: float) -> None:
        super().__init__()
        self.V, self.d0, self.a = V, d0, a

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        out = torch.zeros(*ids.shape, self.V, dtype=torch.float64)
        out[:, self.d0 :] = self.a * nn.functional.one_hot(ids[:, : -self.d0], self.V)
        return out


def test_a_memoryless_model_uses_one_character() -> None:
    ids = torch.randint(0, 7, (4, 64), generator=torch.Generator().manual_seed(1))
    c = context_used(Memoryless(7), ids)
    assert c.lengths == [1, 2, 4, 8, 16, 32] and c.excess_loss == [0.0] * 6
    assert c.effective_context == 1
    assert c.positions == [4 * (64 - 1 - d) for d in c.lengths]
    assert c.to_dict() == {"lengths": c.lengths, "excess_loss": c.excess_loss,
                           "effective_context": 1}


def test_a_copy_model_by_hand() -> None:
    V, d0, a, T, B = 6, 5, 3.0, 40, 3
    g = torch.Generator().manual_seed(2)
    period = torch.randint(0, V, (B, d0 + 1), generator=g)
    ids = period.repeat(1, T // (d0 + 1) + 1)[:, :T]  # x_{t+1} = x_{t−d0}
    c = context_used(Copy(V, d0, a), ids)
    lost = math.log(V) - -math.log(math.exp(a) / (math.exp(a) + V - 1))  # uniform vs the copy
    for d, e in zip(c.lengths, c.excess_loss, strict=True):
        # positions d ≤ t ≤ T − 2; the whole window knows x_{t−d0} from t = d0 on, the
        # truncated one only when d ≥ d0 + 1
        want = 0.0 if d > d0 else (T - 1 - max(d, d0)) / (T - 1 - d) * lost
        assert abs(e - want) <= 1e-12, (d, e, want)
    assert c.effective_context == 8  # the first d ≥ d0 + 1
    assert c.describe().startswith("the prediction uses 8 characters of context")
    assert json.loads(json.dumps(c.to_dict())) == c.to_dict()


class CharLSTM(nn.Module):
    def __init__(self, V: int, H: int) -> None:
        super().__init__()
        self.V = V
        self.lstm, self.head = nn.LSTM(V, H, batch_first=True), nn.Linear(H, V)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        x = nn.functional.one_hot(ids, self.V).to(self.head.weight.dtype)
        return self.head(self.lstm(x)[0])


def test_an_lstm_equals_one_sequence_at_a_time() -> None:
    torch.manual_seed(0)
    V, T = 5, 20
    model = CharLSTM(V, 8).double()
    with torch.no_grad():
        model.lstm.weight_hh_l0.mul_(3)
    ids = torch.randint(0, V, (3, T), generator=torch.Generator().manual_seed(3))
    acc = ContextAccumulator(lambda i: model(i), T, max_chars=7)  # chunks of 7 // d sequences
    acc.update(ids[:1])
    acc.update(ids[1:])
    c = acc.result()
    with torch.no_grad():
        full = -torch.log_softmax(model(ids), -1)  # (B, T, V)
        for d, e in zip(c.lengths, c.excess_loss, strict=True):
            total, n = 0.0, 0
            for b in range(3):
                for t in range(d, T - 1):
                    alone = -torch.log_softmax(model(ids[b : b + 1, t - d + 1 : t + 1]), -1)
                    total += float(alone[0, -1, ids[b, t + 1]] - full[b, t, ids[b, t + 1]])
                    n += 1
            assert abs(e - total / n) <= 1e-12 and c.positions[c.lengths.index(d)] == n
    assert c.excess_loss[0] > 0.01  # it has memory


def test_lengths_and_bad_input() -> None:
    assert context_lengths(128) == [1, 2, 4, 8, 16, 32, 64] and context_lengths(3) == [1]
    m = Memoryless(4)
    with pytest.raises(GatelensError, match=r"\[1, T − 2 = 8\]"):
        ContextAccumulator(m, 10, lengths=[9])
    with pytest.raises(GatelensError, match=r"ids must be \(B, 10\)"):
        ContextAccumulator(m, 10).update(torch.zeros(2, 9, dtype=torch.long))
    with pytest.raises(GatelensError, match=r"\(N, d, V\) logits"):
        context_used(lambda i: torch.zeros(i.shape[0], 4), torch.zeros(2, 10, dtype=torch.long))


def test_the_logits_bound_chunks_and_changes_nothing(monkeypatch: pytest.MonkeyPatch) -> None:
    """A 50k-token vocabulary's logits are bounded by MAX_LOGITS, not only by max_chars:
    with the bound set to 4 vocabularies' worth, no call past the first (the whole windows)
    sees more than 4 positions, and the result equals the unbounded one to the last bit."""
    import gatelens.analysis.context as ctx

    V, T = 5, 16
    model = Memoryless(V).double()
    ids = torch.randint(0, V, (2, T), generator=torch.Generator().manual_seed(1))
    free = ContextAccumulator(lambda i: model(i), T)
    free.update(ids)
    seen: list[tuple[int, int]] = []

    def logged(i: torch.Tensor) -> torch.Tensor:
        seen.append(tuple(i.shape))
        return model(i)

    monkeypatch.setattr(ctx, "MAX_LOGITS", 4 * V)
    bounded = ContextAccumulator(logged, T)
    bounded.update(ids)
    assert seen[0] == (2, T)  # the whole windows, once
    assert all(n * d <= 4 or n == 1 for n, d in seen[1:])  # then ≤ 4 positions, or 1 run
    assert len(seen) > 1 + len(context_lengths(T))  # so it did chunk
    assert bounded.result().excess_loss == free.result().excess_loss


def test_each_start_is_run_once_to_its_longest_context() -> None:
    """The runs: one per start s, as long as the longest context it begins; a model that pads
    (pad_to) is given at most MAX_PADDED padded units a call."""
    import gatelens.analysis.context as ctx

    V, T = 5, 20
    model = Memoryless(V).double()
    ids = torch.randint(0, V, (1, T), generator=torch.Generator().manual_seed(2))
    runs: list[tuple[int, int]] = []

    def logged(i: torch.Tensor) -> torch.Tensor:
        runs.append(tuple(i.shape))
        return model(i)

    acc = ContextAccumulator(logged, T)  # d = 1, 2, 4, 8
    acc.update(ids)
    starts = {d: n for n, d in runs[1:]}
    # s = 1 … T − 9 run 8 units; then 4 (s up to T − 5), 2, 1
    assert starts == {8: T - 9, 4: 4, 2: 2, 1: 1} and sum(starts.values()) == T - 2
    padded = ContextAccumulator(logged, T, pad_to=16)
    runs.clear()
    padded.update(ids)
    assert padded.result().excess_loss == acc.result().excess_loss
    assert all(n * 16 <= ctx.MAX_PADDED for n, d in runs[1:])


def test_a_causal_lm_runs_its_head_on_the_positions_read_only() -> None:
    """A transformers causal LM's truncated runs compute their head on the positions the
    measure reads (``logits_to_keep``): the same curve as reading them off whole runs."""
    transformers = pytest.importorskip("transformers")
    from transformers.utils import logging

    from gatelens.lens.logits import logits_at_of, pads_to

    logging.set_verbosity_error()
    torch.manual_seed(0)
    model = transformers.MambaForCausalLM(transformers.MambaConfig(
        vocab_size=13, hidden_size=8, state_size=2, num_hidden_layers=2, expand=2,
        conv_kernel=2, time_step_rank=2, use_cache=False)).eval()
    ids = torch.randint(0, 13, (2, 20), generator=torch.Generator().manual_seed(1))

    def whole(i):
        return model(i, use_cache=False).logits

    at, calls = logits_at_of(model, 13), []
    assert at is not None and logits_at_of(nn.LSTM(2, 3), 13) is None
    assert pads_to(model) is None and pads_to(transformers.Mamba2ForCausalLM(
        transformers.Mamba2Config(vocab_size=13, hidden_size=8, state_size=2, num_heads=2,
                                  head_dim=8, num_hidden_layers=1, chunk_size=16))) == 16

    def counted(i, positions):
        calls.append(len(positions))
        return at(i, positions)

    ref = context_used(whole, ids)
    acc = ContextAccumulator(whole, 20, logits_at=counted)
    acc.update(ids)
    got = acc.result()
    assert calls and max(calls) == len(ref.lengths)
    assert got.lengths == ref.lengths and got.positions == ref.positions
    assert all(abs(a - b) <= 1e-6 for a, b in zip(got.excess_loss, ref.excess_loss, strict=True))
    # a model whose output holds no such logits falls back to the whole runs' positions
    acc = ContextAccumulator(whole, 20, logits_at=lambda i, p: None)
    acc.update(ids)
    assert acc.result().excess_loss == ref.excess_loss


def test_a_wide_layer_bounds_the_tokens_of_a_call(monkeypatch):
    """At a layer of 4,096 units and more, a call of the context used reads at most
    STATE_PER_CALL of its state numbers (1,365 tokens at mamba-130m's 24,576 units a layer,
    where 95 runs of 65 tokens took 1.2 GB of the sequential scan's tensors)."""
    transformers = pytest.importorskip("transformers")
    import gatelens
    from gatelens.analysis import context as ctx
    from gatelens.analysis import measurements

    seen = []
    real = ctx.ContextAccumulator

    def spy(*a, **k):
        seen.append(k.get("max_chars"))
        return real(*a, **k)

    monkeypatch.setattr(measurements, "ContextAccumulator", spy)
    torch.manual_seed(0)
    for hidden in (16, 64):  # 32 × 16 = 512 units a layer; 128 × 32 = 4,096
        m = transformers.MambaForCausalLM(transformers.MambaConfig(
            vocab_size=9, hidden_size=hidden, state_size=hidden // 2, num_hidden_layers=1,
            expand=2, use_cache=False)).eval()
        lens = gatelens.Lens(m, vocab=9)
        (path,) = lens.families
        ids = torch.randint(0, 9, (1, 12), generator=torch.Generator().manual_seed(1))
        a = lens.measure(path, ids, [f"<{i}>" for i in range(9)], perturb_pos=3,
                         exponents=0)
        assert a.context is not None
    assert seen == [ctx.MAX_CHARS, ctx.chars_per_call(4096)] and seen[1] == 8192
