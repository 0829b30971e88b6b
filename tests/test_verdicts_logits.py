"""The output-level reach is computed only on logits: probabilities converted with a note,
a tuple's logits found by shape (not position), (h, logits) with H = V decided by the
recurrent module's own output or refused with a note, a dict's / ModelOutput's 'logits'."""

from __future__ import annotations

import pytest
import torch
from torch import Tensor, nn

import gatelens
from gatelens.lens.logits import find_logits, is_probabilities
from gatelens.report.markdown import render_markdown

pytestmark = pytest.mark.usefixtures("one_thread")

V = H = 7  # H = V: (h, logits) cannot be told apart by shape alone
KW = dict(perturb_pos=4, exponents=0, fixed_points=False)


class Base(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.embed = nn.Embedding(V, 5)
        self.lstm = nn.LSTM(5, H, batch_first=True)
        self.head = nn.Linear(H, V)

    def parts(self, ids: Tensor) -> tuple[Tensor, Tensor]:
        h = self.lstm(self.embed(ids))[0]
        return h, self.head(h)


class Logits(Base):
    def forward(self, ids: Tensor) -> Tensor:
        return self.parts(ids)[1]


class Probs(Base):
    def forward(self, ids: Tensor) -> Tensor:
        return torch.softmax(self.parts(ids)[1], dim=-1)


class HThenLogits(Base):
    def forward(self, ids: Tensor) -> tuple[Tensor, Tensor]:
        return self.parts(ids)


class LogitsThenH(Base):
    def forward(self, ids: Tensor) -> tuple[Tensor, Tensor]:
        h, logits = self.parts(ids)
        return logits, h


class NormedHThenLogits(Base):
    """(tanh(2h), logits): neither is the LSTM's own output; no telling which is logits."""

    def forward(self, ids: Tensor) -> tuple[Tensor, Tensor]:
        h, logits = self.parts(ids)
        return torch.tanh(2 * h), logits


class Dict(Base):
    def forward(self, ids: Tensor) -> dict:
        h, logits = self.parts(ids)
        return {"hidden": torch.tanh(2 * h), "logits": logits}


class HFOutput(Base):
    def forward(self, ids: Tensor):
        from transformers.modeling_outputs import CausalLMOutput

        h, logits = self.parts(ids)
        return CausalLMOutput(logits=logits, hidden_states=(torch.tanh(2 * h),))


def _ids() -> Tensor:
    return torch.randint(0, V, (3, 24), generator=torch.Generator().manual_seed(5))


def _analysis(cls: type[nn.Module]):
    return gatelens.Lens(cls(), vocab=V).analyze(_ids(), **KW).analyses["lstm"]


@pytest.fixture(scope="module")
def reference():
    """The reach of the same weights returning plain logits."""
    a = _analysis(Logits)
    assert a.reach is not None and a.reach_note is None
    return a


def test_probabilities_are_read_as_log_probabilities_with_a_note(reference) -> None:
    a = _analysis(Probs)
    assert a.reach is not None
    assert a.reach.kl == pytest.approx(reference.reach.kl, rel=1e-5, abs=1e-9)
    assert "returns probabilities" in a.reach_note and "log-probabilities" in a.reach_note
    assert "Note: the model returns probabilities" in render_markdown(a.report)
    assert a.report["output_reach_note"] == a.reach_note


@pytest.mark.parametrize("cls", [HThenLogits, LogitsThenH, Dict, HFOutput],
                         ids=["h-logits", "logits-h", "dict", "ModelOutput"])
def test_the_logits_are_found_whatever_their_position(cls, reference) -> None:
    a = _analysis(cls)
    assert a.reach is not None and a.reach_note is None
    assert a.reach.kl == pytest.approx(reference.reach.kl, rel=1e-9, abs=1e-12)


def test_two_candidates_neither_the_modules_output_are_refused_with_a_note() -> None:
    result = gatelens.Lens(NormedHThenLogits(), vocab=V).analyze(_ids(), **KW)
    a = result.analyses["lstm"]
    assert a.reach is None and a.context is None
    assert "cannot tell which is the logits" in a.reach_note
    assert "element 0, its element 1" in a.reach_note
    assert result.notes["lstm"] == a.reach_note


def test_find_logits_rules() -> None:
    torch.manual_seed(1)
    logits = torch.randn(2, 4, 5)
    p = torch.softmax(logits, -1)
    assert is_probabilities(p) and not is_probabilities(logits)
    assert not is_probabilities(torch.log_softmax(logits, -1))  # log-probs are logits
    assert not is_probabilities(torch.sigmoid(logits))  # rows do not sum to 1
    lp = torch.log_softmax(logits, -1)
    got = find_logits(lp, 2, 4, 5)
    assert got.logits is lp and got.note is None
    # the vocabulary decides: (B, T, 4) is not logits of V = 5
    got = find_logits((torch.randn(2, 4, 4), logits), 2, 4, 5)
    assert got.logits is logits
    # ambiguous, then decided by the recurrent module's own output
    h = torch.randn(2, 4, 5)
    assert find_logits((h, logits), 2, 4, 5).logits is None
    assert find_logits((h, logits), 2, 4, 5, avoid=[h]).logits is logits
    assert find_logits({"logits": logits, "x": h}, 2, 4, 5).logits is logits
    # nothing of the windows' shape: the first tensor, for measure's shape note
    wrong = torch.randn(4, 2, 5)
    assert find_logits(wrong, 2, 4, 5).logits is wrong


def test_find_logits_variants() -> None:
    """Variants of the issue's class: nested outputs, h alone with H = V, logits that are
    no distribution, integer outputs; before, ((logits,), h) had its reach computed on h,
    NaN logits a KL of 0 at every lag."""
    torch.manual_seed(2)
    logits, h = torch.randn(2, 4, 5), torch.randn(2, 4, 5)
    assert find_logits(((logits,), h), 2, 4, 5, avoid=[h]).logits is logits
    assert find_logits({"out": {"logits": logits}, "h": h}, 2, 4, 5, avoid=[h]).logits \
        is logits
    got = find_logits((h, (h, h)), 2, 4, 5, avoid=[h])
    assert got.logits is None and "is a recurrent module's own output, not logits" in got.note
    for bad in (logits * float("nan"), logits.clone().index_fill_(2, torch.tensor([0]),
                                                                  float("inf"))):
        got = find_logits(bad, 2, 4, 5)
        assert got.logits is None and "hold NaN or +inf" in got.note
    lp = torch.log_softmax(logits, -1).index_fill(2, torch.tensor([1]), -float("inf"))
    assert find_logits(lp, 2, 4, 5).logits is lp  # log-probabilities of a zero: logits
    got = find_logits(logits.round().long(), 2, 4, 5)
    assert got.logits is None and "no floating-point tensor" in got.note


class NestedLogits(Base):
    def forward(self, ids: Tensor) -> tuple:
        h, logits = self.parts(ids)
        return (logits,), h


def test_nested_logits_are_found_not_the_modules_h(reference) -> None:
    a = _analysis(NestedLogits)
    assert a.reach is not None and a.reach_note is None
    assert a.reach.kl == pytest.approx(reference.reach.kl, rel=1e-9, abs=1e-12)


def test_a_bare_module_with_h_as_wide_as_the_vocabulary_has_no_reach() -> None:
    """Lens on an nn.LSTM alone, H = V: its h was read as logits (a reach of 1.2e-4 at lag
    1 computed on softmax(h)); a recurrent module's output is never the logits."""
    torch.manual_seed(0)
    lstm = nn.LSTM(5, 5, batch_first=True)
    a = gatelens.Lens(lstm, vocab=5, encode=lambda i: nn.functional.one_hot(i, 5).float()
                      ).analyze(_ids().clamp(max=4), **KW).analyses[""]
    assert a.reach is None and a.context is None
    assert "(its element 0) is a recurrent module's own output, not logits" in a.reach_note
