"""Steering (issue 28, part 3; docs/methods.md "Interventions"): a vector added to a carried
state at t, the KL of the next-unit distributions from unit t + 1 on and the units that rise
and fall, checked against a hand ``Lens.run`` Add edit and softmax; the contrastive vector
against a hand mean."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch
from torch import Tensor, nn

import gatelens
from gatelens.errors import GatelensError
from gatelens.interventions.steering import contrastive_vector, steer

sys.path.insert(0, str(Path(__file__).parent))  # the shared model (importlib mode)
from edit_models import H, Net, V  # noqa: E402

pytestmark = pytest.mark.usefixtures("one_thread")

B, T = 3, 16
CHARS = "abcdefg"


def ids_of(seed: int = 1, n: int = B, length: int = T) -> Tensor:
    return torch.randint(0, V, (n, length), generator=torch.Generator().manual_seed(seed))


def test_a_zero_vector_changes_nothing() -> None:
    """To the one-step tolerance: from t on the family's step runs, not PyTorch's kernel."""
    lens = gatelens.Lens(Net(), vocab=CHARS)
    s = steer(lens, ids_of(), "rnn.layer0.c", torch.zeros(H), at=5, scale=3.0)
    assert len(s.kl) == T - 5 and max(s.kl) < 1e-12
    assert max(abs(d) for _, _, d in s.rise + s.fall) < 1e-7
    moved = steer(lens, ids_of(), "rnn.layer0.c", torch.full((H,), 1e-3), at=5, scale=3.0)
    assert max(moved.kl) > 1e-9  # the check can fail: a small vector is seen


@pytest.mark.parametrize("scale", [1.0, 16.0])
@pytest.mark.parametrize("name", ["rnn.layer0.c", "rnn.layer1.h"])
def test_kl_and_top_units_against_a_hand_add_edit(name, scale) -> None:
    lens, ids, t = gatelens.Lens(Net(scale=scale), vocab=CHARS), ids_of(), 6
    v = torch.linspace(-1.0, 1.0, H)
    s = steer(lens, ids, name, v, at=t, scale=0.5, top=3)
    clean = lens.run(ids).output
    steered = lens.run(ids, edits=[gatelens.Add(name, 0.5 * v, at=t)]).output
    lp, lq = (torch.log_softmax(x.double(), dim=-1) for x in (clean, steered))
    kl = (lp.exp() * (lp - lq)).sum(-1).mean(0)  # (T,)
    assert s.kl[0] == pytest.approx(float(kl[t]), rel=1e-9, abs=1e-12)  # unit t + 1
    assert s.kl == pytest.approx(kl[t:].tolist(), rel=1e-9, abs=1e-12)
    assert s.kl[0] > 0 and float(kl[:t].abs().max()) == 0.0  # nothing before t moves
    change = lq[:, t].exp().mean(0) - lp[:, t].exp().mean(0)  # (V,)
    up = torch.argsort(change, descending=True)[:3].tolist()
    assert [i for i, _, _ in s.rise] == up
    assert [c for _, c, _ in s.rise] == [CHARS[i] for i in up]
    assert [i for i, _, _ in s.fall] == torch.argsort(change)[:3].tolist()
    assert s.rise[0][2] == pytest.approx(float(change.max())) and s.fall[0][2] < 0
    assert s.to_dict()["rise"][0]["text"] == CHARS[up[0]]


def test_a_gru_state_and_no_texts_without_a_vocabulary() -> None:
    lens = gatelens.Lens(Net(nn.GRU))
    s = steer(lens, ids_of(), "rnn.layer1.h", torch.ones(H), at=T - 1)
    assert len(s.kl) == 1 and s.kl[0] > 0
    assert all(text is None for _, text, _ in s.rise)


def test_the_contrastive_vector_is_the_mean_last_state_difference() -> None:
    net = Net()
    lens = gatelens.Lens(net)
    a = ids_of(2, n=3, length=9)
    b = [ids_of(3, n=1, length=5)[0], ids_of(4, n=2, length=12)]  # texts of several lengths
    v = contrastive_vector(lens, a, b, "rnn.layer1.h")
    with torch.no_grad():
        last = lambda x: net.rnn(net.embed(x))[0][:, -1].double()  # noqa: E731
        want = last(a).mean(0) - torch.cat([last(b[0][None]), last(b[1])]).mean(0)
    assert v.dtype == torch.float32 and tuple(v.shape) == (H,)
    assert torch.allclose(v.double(), want, atol=1e-6)
    s = steer(lens, a, "rnn.layer1.h", v, at=4, scale=2.0)
    assert s.kl[0] > 0


def test_bad_input_is_one_line() -> None:
    lens, ids = gatelens.Lens(Net()), ids_of()
    with pytest.raises(GatelensError, match="no trace key 'rnn.layer0.x'"):
        steer(lens, ids, "rnn.layer0.x", torch.zeros(H), at=2)
    with pytest.raises(GatelensError, match=r"vector must be a float tensor of shape \(8,\)"):
        steer(lens, ids, "rnn.layer0.c", torch.zeros(3), at=2)
    with pytest.raises(GatelensError, match=r"got torch.int64 \(8,\)"):
        steer(lens, ids, "rnn.layer0.c", torch.zeros(H, dtype=torch.long), at=2)
    with pytest.raises(GatelensError, match="at must be a position in 0..15"):
        steer(lens, ids, "rnn.layer0.c", torch.zeros(H), at=T)
    with pytest.raises(GatelensError, match="NaN or infinity"):
        steer(lens, ids, "rnn.layer0.c", torch.full((H,), float("nan")), at=2)
    with pytest.raises(GatelensError, match=r"texts_b\[0\] must be a non-empty int64"):
        contrastive_vector(lens, ids, [ids.float()], "rnn.layer0.c")
    with pytest.raises(GatelensError, match="no trace key 'h'"):
        contrastive_vector(lens, ids, ids, "h")


class Pieces:
    """A tokenizer of one character a token (encode, decode: what Lens needs)."""

    def encode(self, text: str) -> list[int]:
        return [CHARS.index(ch) for ch in text]

    def decode(self, ids: list[int]) -> str:
        return "".join("<" + CHARS[i] + ">" for i in ids)

    def __len__(self) -> int:
        return V


def test_top_tokens_read_the_tokenizer() -> None:
    lens = gatelens.Lens(Net(), tokenizer=Pieces())
    s = steer(lens, ids_of(), "rnn.layer1.h", torch.linspace(-2, 2, H), at=3)
    assert [text for _, text, _ in s.rise] == [f"<{CHARS[i]}>" for i, _, _ in s.rise]
