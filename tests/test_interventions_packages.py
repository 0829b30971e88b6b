"""Interventions on transformers' RWKV-4, the rwkv package's RWKV-7 and mingru-pytorch's
minLM (issue 28, "every family takes edits"): the model's own run before the first edit
(bitwise), a state set to itself changes nothing, a state edit at t equals the package's
OWN decode path (its state or cache argument) run on from the edited state, an edit inside
the step reaches the state through the cell's equations, and carry forward against this
position only."""

from __future__ import annotations

import sys
import tempfile
from pathlib import Path

import pytest
import torch
import transformers
from torch import Tensor

import gatelens

sys.path.insert(0, str(Path(__file__).parent))  # the shared builders (importlib mode)

pytestmark = [pytest.mark.usefixtures("one_thread"),
              pytest.mark.filterwarnings("ignore:.*torch.jit.*:DeprecationWarning")]

V, T, t0 = 11, 10, 4


def ids_of(B: int = 2, seed: int = 1) -> Tensor:
    return torch.randint(0, V, (B, T), generator=torch.Generator().manual_seed(seed))


def diff(a: Tensor, b: Tensor) -> float:
    return float((a.double() - b.double()).abs().max()) if a.numel() else 0.0


def logits(out) -> Tensor:
    return out if isinstance(out, Tensor) else out.logits


# ---- transformers' RWKV-4 --------------------------------------------------------------
def rwkv4(layers: int = 2) -> torch.nn.Module:
    """RwkvForCausalLM with its weights spread; one layer is two with the top dropped
    (transformers 5.23 cannot build one: tests/official_models.py)."""
    torch.manual_seed(4)
    cfg = transformers.RwkvConfig(vocab_size=V, hidden_size=16, num_hidden_layers=2,
                                  context_length=T, attention_hidden_size=16,
                                  intermediate_size=32)
    m = transformers.RwkvForCausalLM(cfg)
    if layers == 1:
        m.rwkv.blocks = m.rwkv.blocks[:1]
        m.rwkv.config.num_hidden_layers = m.config.num_hidden_layers = 1
    with torch.no_grad():
        for n, p in m.named_parameters():
            if "time_" not in n:
                p.add_(0.3 * torch.randn_like(p))
    return m.eval()


def rwkv4_decode(m, ids: Tensor, t: int, layer: int) -> Tensor:
    """The model's own recurrent path (``state=`` one token at a time, window by window:
    transformers 5.23 broadcasts a one-token batch), (num, den) of ``layer`` zeroed after
    step t: its logits (B, T, V)."""
    rows = []
    with torch.no_grad():
        for row in ids:
            state, out = None, []
            for j in range(ids.shape[1]):
                res = m(row[None, j:j + 1], state=state, use_cache=True)
                state, _ = res.state, out.append(res.logits)
                if j == t:
                    state[2][:, :, layer] = 0.0  # num (max-shifted) and den: s = 0
                    state[3][:, :, layer] = 0.0
            rows.append(torch.cat(out, dim=1))
    return torch.cat(rows)


def test_rwkv4_state_edits_are_its_own_recurrent_path_from_the_edited_state():
    m = rwkv4()
    lens, ids = gatelens.Lens(m, vocab=V), ids_of()
    with torch.no_grad():
        own = m(ids, use_cache=False).logits
    clean = lens.run(ids).trace
    s = clean["rwkv.layer1.s"]
    res = lens.run(ids, edits=[gatelens.Set("rwkv.layer1.s", s[:, t0], at=t0)])
    same = res.output.logits
    assert torch.equal(same[:, :t0], own[:, :t0]) and diff(same, own) < 1e-5
    # the trace: the unedited read before the first edit (read once), the edited steps after
    assert all(torch.equal(res.trace[k][:, :t0], clean[k][:, :t0]) for k in clean)
    assert diff(res.trace["rwkv.layer1.s"], s) < 1e-4 * float(s.abs().max())
    # position t reads the state before its step: zeroing s_t moves t + 1 on, in every layer
    # as the cache's edit does (so two layers compare exactly)
    got = lens.run(ids, edits=[gatelens.Zero("rwkv.layer0.s", at=t0)]).output.logits
    ref = rwkv4_decode(m, ids, t0, 0)
    assert torch.equal(got[:, :t0], own[:, :t0])
    assert diff(got, ref) < 1e-5 < diff(own, ref), (diff(got, ref), diff(own, ref))


def test_rwkv4_keep_and_key_edits_hold_the_state_and_carry():
    m = rwkv4(layers=1)
    lens, ids = gatelens.Lens(m, vocab=V), ids_of()
    own = lens.run(ids).output.logits
    held = lens.run(ids, edits=[gatelens.Set("rwkv.layer0.keep", 1.0, at=slice(t0, None)),
                                gatelens.Set("rwkv.layer0.k", -1e4, at=slice(t0, None))])
    s = held.trace["rwkv.layer0.s"]  # e^{−w} = 1, e^k = 0: (num, den) neither fades nor grows
    assert torch.equal(s[:, t0:], s[:, t0:t0 + 1].expand_as(s[:, t0:]))
    carried = lens.run(ids, edits=[gatelens.Scale("rwkv.layer0.k", 3.0, at=t0)]).output.logits
    here = lens.run(ids, edits=[gatelens.Scale("rwkv.layer0.k", 3.0, at=t0,
                                               carry=False)]).output.logits
    assert diff(carried[:, t0 + 1:], own[:, t0 + 1:]) > 1e-3  # the written e^k carries
    assert diff(here[:, t0], own[:, t0]) > 1e-3 and torch.equal(here[:, t0], carried[:, t0])
    assert diff(here[:, t0 + 1:], own[:, t0 + 1:]) < 1e-5  # the recurrence does not


# ---- mingru-pytorch's minLM -------------------------------------------------------------
def minlm(lstm: bool, layers: int = 2) -> torch.nn.Module:
    from minGRU_pytorch.minLM import minLM

    torch.manual_seed(1)
    return minLM(num_tokens=V, dim=16, depth=layers, use_lstm=lstm).eval()


def minlm_decode(m, ids: Tensor, t: int, layer: int) -> Tensor:
    """minLM's own decoding (``prev_hiddens``, one token at a time), the hidden state of
    ``layer`` zeroed after step t: its logits."""
    out, prev = [], None
    with torch.no_grad():
        for j in range(ids.shape[1]):
            res, prev = m(ids[:, : j + 1], prev_hiddens=prev, return_prev_hiddens=True)
            out.append(res[:, -1:])
            if j == t:
                prev[layer] = torch.zeros_like(prev[layer])
    return torch.cat(out, dim=1)


@pytest.mark.parametrize("lstm", [False, True])
def test_minlm_state_edit_is_its_own_decoding_and_keep_one_holds(lstm):
    m = minlm(lstm)
    lens, ids = gatelens.Lens(m, vocab=V), ids_of()
    with torch.no_grad():
        own = m(ids)
    h = lens.run(ids).trace["layer1.h"]
    same = lens.run(ids, edits=[gatelens.Set("layer1.h", h[:, t0], at=t0)]).output
    assert torch.equal(same[:, :t0], own[:, :t0]) and diff(same, own) < 1e-5
    got = lens.run(ids, edits=[gatelens.Zero("layer1.h", at=t0)]).output  # the top layer
    ref = minlm_decode(m, ids, t0, 1)
    assert diff(got[:, t0 + 1:], ref[:, t0 + 1:]) < 1e-5 < diff(own[:, t0 + 1:], ref[:, t0 + 1:])
    held = lens.run(ids, edits=[gatelens.Set("layer0.keep", 1.0, at=slice(t0, None))]).trace
    h0 = held["layer0.h"][:, t0 - 1:]  # keep := 1 (its write 1 − keep = 0): h stays h_{t−1}
    assert diff(h0, h0[:, :1].expand_as(h0)) < 1e-6
    assert torch.equal(h0[:, 1:], h0[:, 1:2].expand_as(h0[:, 1:]))


def test_minlm_carry_forward_and_this_position_only():
    m = minlm(False, layers=1)
    lens, ids = gatelens.Lens(m, vocab=V), ids_of()
    own = lens.run(ids).output
    carried = lens.run(ids, edits=[gatelens.Scale("layer0.h", 3.0, at=t0)]).output
    here = lens.run(ids, edits=[gatelens.Scale("layer0.h", 3.0, at=t0, carry=False)]).output
    assert diff(carried[:, t0 + 1:], own[:, t0 + 1:]) > 1e-3
    assert diff(here[:, t0], own[:, t0]) > 1e-3 and torch.equal(here[:, t0], carried[:, t0])
    assert diff(here[:, t0 + 1:], own[:, t0 + 1:]) < 1e-5


# ---- the rwkv package's RWKV-7 ----------------------------------------------------------
@pytest.fixture(scope="module")
def rwkv7():
    """{layers: the package's RWKV_x070 in gatelens's RWKV7LM} (built by the package)."""
    from gatelens.families.rwkv7 import RWKV7LM
    from rwkv7_models import build

    out = {}
    with tempfile.TemporaryDirectory() as d:
        for layers in (1, 2):
            out[layers] = RWKV7LM(build(Path(d) / f"tiny{layers}", layers=layers)[1])
    return out


def rwkv7_decode(lm, ids: Tensor, t: int, layer: int) -> Tensor:
    """The package's own ``forward(idx, state)`` one token at a time from its zero state,
    S of ``layer`` zeroed after step t: its logits (B, T, V)."""
    from gatelens.families.rwkv7 import _zero_state

    rows = []
    with torch.no_grad():
        for row in ids:
            state, out = _zero_state(lm.rwkv), []
            for j, i in enumerate(row.tolist()):
                res, state = lm.rwkv.forward(i, state)
                out.append(res.reshape(-1))
                if j == t:
                    state[3 * layer + 1] = torch.zeros_like(state[3 * layer + 1])
            rows.append(torch.stack(out))
    return torch.stack(rows)


def test_rwkv7_state_edit_is_the_packages_own_step_from_the_edited_state(rwkv7):
    lm = rwkv7[2]
    lens, ids = gatelens.Lens(lm, vocab=V), ids_of()
    with torch.no_grad():
        own = lm(ids)
    s = lens.run(ids).trace["layer1.s"]
    same = lens.run(ids, edits=[gatelens.Set("layer1.s", s[:, t0], at=t0)]).output
    assert torch.equal(same[:, :t0], own[:, :t0]) and diff(same, own) < 1e-5
    got = lens.run(ids, edits=[gatelens.Zero("layer1.s", at=t0)]).output  # the top layer
    ref = rwkv7_decode(lm, ids, t0, 1)
    # position t's output reads the edited S, and the channel mix's token shift hands that
    # output to t + 1, which the package's state edit (S alone) cannot give: from t + 2 on
    assert diff(got[:, t0 + 2:], ref[:, t0 + 2:]) < 1e-5 < diff(own[:, t0 + 2:], ref[:, t0 + 2:])
    assert torch.equal(got[:, :t0], own[:, :t0])


def test_rwkv7_keep_edits_hold_the_state_and_a_first_value_edit_reaches_above(rwkv7):
    lm = rwkv7[2]
    lens, ids = gatelens.Lens(lm, vocab=V), ids_of()
    hold = [gatelens.Set("layer0.w", 1.0, at=slice(t0, None)),  # diag(w) = I
            gatelens.Zero("layer0.a", at=slice(t0, None)),  # no removal: kk (kk ⊙ a)ᵀ = 0
            gatelens.Zero("layer0.k", at=slice(t0, None))]  # no write: v kᵀ = 0
    s = lens.run(ids, edits=hold).trace["layer0.s"][:, t0:]
    assert torch.equal(s, s[:, :1].expand_as(s))
    # layer 0's v is the v_first layer 1 mixes in: edited there, layer 1 moves at t itself
    clean = lens.run(ids).trace
    moved = lens.run(ids, edits=[gatelens.Scale("layer0.v", 2.0, at=t0, carry=False)]).trace
    assert diff(moved["layer1.v"][:, t0], clean["layer1.v"][:, t0]) > 1e-3
    assert diff(moved["layer0.s"][:, t0 + 1:], clean["layer0.s"][:, t0 + 1:]) < 1e-5


def test_rwkv7_carry_forward_and_this_position_only(rwkv7):
    lm = rwkv7[1]
    lens, ids = gatelens.Lens(lm, vocab=V), ids_of()
    own = lens.run(ids).output
    # a random push (S scaled, or every entry shifted alike, is normalised away by the
    # read-out's GroupNorm per head)
    v = torch.randn(lens.run(ids).trace["layer0.s"].shape[-1],
                    generator=torch.Generator().manual_seed(2))
    carried = lens.run(ids, edits=[gatelens.Add("layer0.s", v, at=t0)]).output
    here = lens.run(ids, edits=[gatelens.Add("layer0.s", v, at=t0, carry=False)]).output
    assert diff(carried[:, t0 + 1:], own[:, t0 + 1:]) > 1e-3
    assert diff(here[:, t0], own[:, t0]) > 1e-3 and torch.equal(here[:, t0], carried[:, t0])
    assert diff(here[:, t0 + 2:], own[:, t0 + 2:]) < 1e-5  # t + 1: the token shift of t's output
