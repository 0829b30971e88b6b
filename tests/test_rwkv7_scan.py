"""RWKV-7's whole-window pass (families/rwkv7_scan.py) against the ``rwkv`` package itself.

The family reads every per-token state from one pass per layer over B windows at once, in
the package's own ``forward_seq`` arithmetic. Held here: its logits and every carried part
after the prompt equal ``forward_seq``'s bit for bit (window by window, B = 1 a call),
whatever the other windows of the batch; each state agrees with the package's one-token
decode path within float32 rounding; a replay with a wrong constant or no token shift is
caught by the one-step check and by the decode path; the free-running re-run (the pass
in float64, one layer at a time) is the float64 hand cell stepped token by token; and
``open_cells`` runs the package's forward once (the user's) and the pass once, no more.
Tiny model (2 layers, n_embd 32, 2 heads of 16): the file runs in about a second.
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

import gatelens
import gatelens.families.rwkv7 as rwkv7_family
import gatelens.families.rwkv7_scan as rwkv7_scan
from gatelens.families.official import scaled_diff
from gatelens.families.rwkv7 import RWKV7LM, RWKV7Family
from gatelens.families.rwkv7_scan import scan_model

sys.path.insert(0, str(Path(__file__).parent))  # the shared builder (importlib mode)
from rwkv7_models import V, build, pkg  # noqa: E402

pytestmark = pytest.mark.filterwarnings("ignore:.*torch.jit.*:DeprecationWarning")
B, T = 3, 17


@pytest.fixture(autouse=True)
def _single_thread(one_thread):
    pass


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    return build(tmp_path_factory.mktemp("rwkv7scan") / "tiny", layers=2, seed=5)[1]


def _ids(seed: int = 2, batch: int = B, length: int = T) -> torch.Tensor:
    return torch.randint(0, V, (batch, length), generator=torch.Generator().manual_seed(seed))


def test_the_pass_is_forward_seq_bit_for_bit_whatever_the_batch(model):
    ids = _ids()
    H, N, L = int(model.n_head), int(model.head_size), int(model.n_layer)
    got = scan_model(model.z, H, N, L, model.z["emb.weight"][ids])
    for b in range(B):
        logits, state = model.forward(ids[b].tolist(), None, full_output=True)
        assert torch.equal(got["output"][b], logits)
        for k in range(L):  # att x_prev, S (H, N, N), ffn x_prev after the last token
            for j in range(3):
                assert torch.equal(got["parts"][k][j][b, -1], state[3 * k + j].reshape(-1))
        alone = scan_model(model.z, H, N, L, model.z["emb.weight"][ids[b : b + 1]])
        for k in range(L):
            assert torch.equal(alone["parts"][k][1][0], got["parts"][k][1][b])


def test_every_state_is_the_decode_paths_and_a_wrong_replay_is_caught(model, monkeypatch):
    fam = RWKV7Family(model)
    call = fam.check(_ids(3))
    decode = fam._trajectory(call)  # the package's one-token step, token by token

    def worst(ref) -> float:
        return max(scaled_diff(ref.states[f"layer{k}.s"], decode["parts"][k][1])[1]
                   for k in range(2))

    ref = fam.reference(call)
    assert worst(ref) < 1e-5
    assert max(r.max_scaled_diff_h for r in fam.one_step(call, ref)) < 1e-5
    assert gatelens.verify(model, _ids(3)).passed
    for name, wrong in (("W_SCALE", 0.6), ("token_shift", torch.zeros_like)):
        with monkeypatch.context() as m:
            m.setattr(rwkv7_scan, name, wrong)
            bad = fam.reference(call)
            assert worst(bad) > 1e-3, name
            assert max(r.max_scaled_diff_h for r in fam.one_step(call, bad)) > 1e-3, name
            assert not gatelens.verify(model, _ids(3)).passed, name


def test_the_free_running_rerun_by_layer_is_the_float64_hand_cell_stepped(model):
    fam = RWKV7Family(model)
    call = fam.check(_ids(4))
    got = fam.rerun(call).signals  # one pass per layer, float64
    m, L = fam.float64(), fam.num_layers
    parts = [fam.initial_parts(k, B) for k in range(L)]
    by_step: dict[str, list] = {}
    with torch.no_grad():
        for t in range(T):  # the hand cell (families/rwkv7_edit.py), every layer a step
            sigs, parts = fam._stack_step(m, call.inputs[:, t].double(), parts)
            for k, sig in enumerate(sigs):
                for n in fam.spec.signals:
                    by_step.setdefault(f"layer{k}.{n}", []).append(sig[n])
    for name, seq in by_step.items():
        assert scaled_diff(got[name], torch.stack(seq, 1).float())[1] < 1e-6, name
    assert max(r.max_scaled_diff_h for r in fam.free_running(call, fam.reference(call))) < 1e-5


def test_open_cells_runs_the_package_forward_once_and_the_pass_once(model, monkeypatch):
    calls = {"forward_seq": 0, "pass": 0}
    window, scan = rwkv7_family._window, rwkv7_family.scan_model

    def counted_window(*a):
        calls["forward_seq"] += 1
        return window(*a)

    def counted_scan(*a):
        calls["pass"] += 1
        return scan(*a)

    monkeypatch.setattr(rwkv7_family, "_window", counted_window)
    monkeypatch.setattr(rwkv7_family, "scan_model", counted_scan)
    lm, ids = RWKV7LM(model), _ids(5)
    with gatelens.open_cells(lm) as cache:
        out = lm(ids)
    assert calls == {"forward_seq": B, "pass": 1}  # the user's windows, then one pass
    assert cache.max_abs_diff[""] == 0.0  # the pass's logits are what the forward returned
    assert out.shape == (B, T, V) and cache["layer1.s"].shape[:2] == (B, T)
    assert pkg.RWKV_x070 is type(model)
