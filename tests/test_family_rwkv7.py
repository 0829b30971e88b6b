"""The RWKV-7 family (families/rwkv7.py) on the ``rwkv`` package's own ``RWKV_x070``.

A tiny random model (2 layers, n_embd 32, 2 heads of 16) is written here as a ``.pth`` of
tensors only (torch.save) and built by the package itself (``RWKV_x070(path, "cpu fp32")``,
its own torch.load: gatelens loads nothing). Its trace is checked against the package's
own one-token path (``forward(id, state)``, id by id), against an independent float64
recurrence written here from the saved tensors (S ← S (diag(w) − kk (kk ⊙ a)ᵀ) + v kᵀ as
explicit matrices) and against the state ``forward_seq`` leaves after the prompt. The
package's whole-window path (``forward_seq``) and its one-token path disagree by float32
rounding only (measured here: 5.3e-07 on the logits' scale, 1.1e-06 on the final state's).
The reference is ONE whole-window pass per layer in ``forward_seq``'s own arithmetic
(families/rwkv7_scan.py; tests/test_rwkv7_scan.py holds it against the package bit for bit).
One layer has no return path once the token shift's window has passed; ``Lens.analyze``
measures the model end to end through ``RWKV7LM``.

``RWKV_V7_ON=1`` must be set before ``rwkv.model`` is first imported (the package defines
``RWKV_x070`` at import time), so the package is imported only through tests/rwkv7_models.py,
which sets it first (this file and test_open_cells_families.py use it). The package scripts
its model with torch.jit (its default).
"""

from __future__ import annotations

import math
import sys
from pathlib import Path

import jsonschema
import pytest
import torch
import torch.nn.functional as F

import gatelens
from gatelens.analysis.common import pooled
from gatelens.errors import GatelensError
from gatelens.families.official import scaled_diff
from gatelens.families.registry import family_of
from gatelens.families.rwkv7 import RWKV7LM, W_SCALE, RWKV7Family, rwkv7_keep
from gatelens.report.json_report import check_report, schema

sys.path.insert(0, str(Path(__file__).parent))  # the shared builder (importlib mode)
from rwkv7_models import C, H, N, V, pkg, weights  # noqa: E402

B, T, P = 2, 24, 6
VOCAB = list("abcdefghij ")
TEXT = "abc def ghij jig fed cba " * 40
NAMES = ("r", "w", "k", "v", "a", "kk", "s", "y")
pytestmark = pytest.mark.filterwarnings("ignore:.*torch.jit.*:DeprecationWarning")


@pytest.fixture(autouse=True)
def _single_thread(one_thread):
    pass


@pytest.fixture(scope="module")
def built(tmp_path_factory):
    """{layers: (the saved tensors, the package's model built from them)}."""
    out = {}
    for layers in (1, 2):
        z = weights(layers)
        path = tmp_path_factory.mktemp("rwkv7") / f"tiny{layers}"
        torch.save(z, f"{path}.pth")
        out[layers] = (z, pkg.RWKV_x070(str(path), "cpu fp32"))
    return out


def _ids(seed: int = 1, length: int = T) -> torch.Tensor:
    return torch.randint(0, V, (B, length), generator=torch.Generator().manual_seed(seed))


@torch.no_grad()
def independent(z: dict[str, torch.Tensor], layers: int, ids: torch.Tensor) -> dict:
    """RWKV-7 in float64 from the saved tensors, token by token, every product written out:
    S_h ← S_h (diag(w_h) − kk_h (kk_h ⊙ a_h)ᵀ) + v_h k_hᵀ per head."""
    d = {n: t.double().squeeze() if t.dim() == 3 else t.double() for n, t in z.items()}
    ln = lambda x, n: F.layer_norm(x, (C,), d[n + ".weight"], d[n + ".bias"])  # noqa: E731
    emb = ln(d["emb.weight"], "blocks.0.ln0")[ids]  # (B, T, C)
    S = [torch.zeros(B, H, N, N, dtype=torch.float64) for _ in range(layers)]
    prev = [[torch.zeros(B, C, dtype=torch.float64)] * 2 for _ in range(layers)]
    out: dict[str, list] = {f"layer{k}.{n}": [] for k in range(layers) for n in NAMES}
    out["logits"] = []
    for t in range(ids.shape[1]):
        x = emb[:, t]
        for k in range(layers):
            a_, f_ = f"blocks.{k}.att.", f"blocks.{k}.ffn."
            u = ln(x, f"blocks.{k}.ln1")
            mix = {n: u + (prev[k][0] - u) * d[a_ + "x_" + n] for n in "rwkvag"}
            r = mix["r"] @ d[a_ + "receptance.weight"].T
            key = mix["k"] @ d[a_ + "key.weight"].T
            v = mix["v"] @ d[a_ + "value.weight"].T
            w = torch.exp(-W_SCALE * torch.sigmoid(
                d[a_ + "w0"] + torch.tanh(mix["w"] @ d[a_ + "w1"]) @ d[a_ + "w2"]))
            a = torch.sigmoid(d[a_ + "a0"] + mix["a"] @ d[a_ + "a1"] @ d[a_ + "a2"])
            g = torch.sigmoid(mix["g"] @ d[a_ + "g1"]) @ d[a_ + "g2"]
            kk = key * d[a_ + "k_k"]
            kk = (kk.view(B, H, N) / kk.view(B, H, N).norm(dim=-1, keepdim=True)).view(B, C)
            key = key * (1 + (a - 1) * d[a_ + "k_a"])
            if k == 0:
                v_first = v
            else:
                v = v + (v_first - v) * torch.sigmoid(
                    d[a_ + "v0"] + mix["v"] @ d[a_ + "v1"] @ d[a_ + "v2"])
            heads = lambda x: x.view(B, H, N)  # noqa: E731
            A = torch.diag_embed(heads(w)) - heads(kk)[..., :, None] * heads(kk * a)[..., None, :]
            S[k] = S[k] @ A + heads(v)[..., :, None] * heads(key)[..., None, :]
            o = (S[k] @ heads(r)[..., None])[..., 0]  # (B, H, N)
            o = (o - o.mean(-1, keepdim=True)) / torch.sqrt(
                o.var(-1, unbiased=False, keepdim=True) + 64e-5)
            o = o.reshape(B, C) * d[a_ + "ln_x.weight"] + d[a_ + "ln_x.bias"]
            o = o + ((r * key * d[a_ + "r_k"].reshape(C)).view(B, H, N).sum(-1, keepdim=True)
                     * heads(v)).reshape(B, C)
            x = x + (o * g) @ d[a_ + "output.weight"].T
            fx = ln(x, f"blocks.{k}.ln2")
            fk = fx + (prev[k][1] - fx) * d[f_ + "x_k"]
            x = x + torch.relu(fk @ d[f_ + "key.weight"].T) ** 2 @ d[f_ + "value.weight"].T
            prev[k] = [u, fx]
            sig = {"r": r, "w": w, "k": key, "v": v, "a": a, "kk": kk,
                   "s": S[k].reshape(B, -1), "y": x}
            for n in NAMES:
                out[f"layer{k}.{n}"].append(sig[n])
        out["logits"].append(ln(x, "ln_out") @ d["head.weight"].T)
    return {n: torch.stack(v, dim=1) for n, v in out.items()}


def one_by_one(model, ids: torch.Tensor) -> tuple[torch.Tensor, list[torch.Tensor]]:
    """The package's own one-token path, id by id with its state: logits (B, T, V) and
    each layer's S after every token (B, T, H·N·N)."""
    logits, states = [], []
    for row in ids:
        state, outs, ss = None, [], []
        for i in row.tolist():
            o, state = model.forward(i, state)
            outs.append(o)
            ss.append([state[3 * k + 1].reshape(-1).clone() for k in range(model.n_layer)])
        logits.append(torch.stack(outs))
        states.append([torch.stack([s[k] for s in ss]) for k in range(model.n_layer)])
    return torch.stack(logits), [torch.stack([s[k] for s in states])
                                 for k in range(model.n_layer)]


# ---- opened, and what it opens -------------------------------------------------------
def test_the_family_opens_the_package_model_and_its_wrapper(built):
    model = built[2][1]
    fam = family_of(model)
    assert isinstance(fam, RWKV7Family) and fam.cell == "rwkv7"
    assert (fam.num_layers, fam.hidden_size, fam.heads) == (2, C, (H, N))
    assert fam.names()[:8] == [f"layer0.{n}" for n in NAMES]
    info = fam.describe()
    assert info["implementation"] == "rwkv.model.RWKV_x070" and info["head_size"] == N
    # S[h, i, j] (value i, key j) is kept by channel h·N + j
    assert fam.state_units(0).view(H, N, N)[1, 3].tolist() == list(range(N, 2 * N))
    lens = gatelens.Lens(RWKV7LM(model), vocab=VOCAB)
    assert list(lens.families) == [""] and isinstance(lens.families[""], RWKV7Family)
    lm = RWKV7LM(model)
    assert lm.vocab_size == V and lm(_ids()).shape == (B, T, V)
    with gatelens.open_cells(lm) as cache:  # opened while it runs, keyed like a trace
        lm(_ids())
    assert torch.equal(cache["layer1.s"], gatelens.trace(model, _ids())["layer1.s"])


# ---- the trace against the package and against float64 --------------------------------
def test_the_trace_is_the_package_one_token_path_and_the_float64_recurrence(built):
    z, model = built[2]
    ids = _ids()
    tr = gatelens.trace(model, ids)
    assert tr.meta["method"] == "own"  # the whole-window pass's own values, no hand cell
    exact = independent(z, 2, ids)
    logits, states = one_by_one(model, ids)
    fam = RWKV7Family(model)
    call = fam.check(ids)
    decode = fam._trajectory(call)  # the package's one-token step, layer by layer
    for k in range(2):
        # the decode path as the family replays it is the package's own, bit for bit;
        # the trace (one pass per layer) agrees with it within float32 rounding
        assert torch.equal(decode["parts"][k][1].float(), states[k])
        assert scaled_diff(tr[f"layer{k}.s"], states[k])[1] < 1e-5
        for n in NAMES:
            assert scaled_diff(tr[f"layer{k}.{n}"], exact[f"layer{k}.{n}"])[1] < 1e-5, (k, n)
    assert torch.equal(decode["output"], logits)
    assert scaled_diff(logits, exact["logits"])[1] < 1e-5
    assert float(exact["layer1.s"].abs().max()) > 0.1  # the state is not negligible
    w = tr["layer0.w"]
    assert float(w.min()) > math.exp(-W_SCALE) and float(w.max()) < 1.0
    # the state forward_seq leaves after the prompt: the trace's last, bit for bit
    finals = [pkg.RWKV_x070.forward(model, row.tolist(), None)[1] for row in ids]
    final = torch.stack([torch.cat([s[1].reshape(-1), s[4].reshape(-1)]) for s in finals])
    assert torch.equal(fam.reference(call).final, final)
    assert torch.equal(torch.cat([tr["layer0.s"][:, -1], tr["layer1.s"][:, -1]], -1), final)
    last = torch.cat([states[0][:, -1], states[1][:, -1]], dim=-1)
    assert scaled_diff(final[:, None], last[:, None])[1] < 1e-5


def test_forward_seq_and_the_one_token_path_disagree_by_rounding_only(built):
    model = built[2][1]
    fam = RWKV7Family(model)
    call = fam.check(_ids(3, length=40))
    ref = fam.reference(call)
    seq = ref.output  # forward_seq's logits, full output: the pass's, bit for bit
    assert seq.shape == (B, 40, V) and torch.equal(seq, fam._forward(call))
    assert ref.extra["step_vs_forward"] is None  # the pass is the forward: no second path
    absolute, scaled = scaled_diff(fam._trajectory(call)["output"], seq)
    assert 0 < scaled < 1e-5 and absolute < 1e-4


def test_one_step_passes_and_a_weight_off_by_a_thousandth_fails_it(built):
    model = built[2][1]
    fam = RWKV7Family(model)
    call = fam.check(_ids())
    ref = fam.reference(call)
    rows = fam.one_step(call, ref)
    assert len(rows) == 2 and max(r.max_scaled_diff_h for r in rows) < 1e-5
    assert max(r.max_scaled_diff_h for r in fam.free_running(call, ref)) < 1e-5
    res = gatelens.verify(model, _ids())
    assert res.passed and res.one_step_max_scaled_diff_h < 1e-5
    for name, layer in (("blocks.1.att.w0", 1), ("head.weight", 1), ("blocks.0.att.a0", 0)):
        off = RWKV7Family(model)
        off.float64()[name].mul_(1.001)  # the float64 copy only, not the package's own
        got = off.one_step(call, ref)
        assert got[layer].max_scaled_diff_h > 1e-5, name
    assert RWKV7Family(model).one_step(call, ref)[1].max_scaled_diff_h < 1e-5


def test_the_dynamics_step_reproduces_the_trajectory(built):
    fam = RWKV7Family(built[2][1])
    call = fam.check(_ids())
    ref = fam.reference(call)
    (dyn,) = fam.dynamics(call, ref)
    assert dyn.size == 2 * (C + H * N * N + C)
    parts = list(dyn.initial)
    for t in range(T):
        parts = dyn.step(dyn.inputs[:, t], parts)
        for got, want in zip(parts, dyn.trajectory, strict=True):
            assert scaled_diff(got[:, None], want[:, t : t + 1])[1] < 1e-5


# ---- the keep operator and the invariant -------------------------------------------------
def test_the_keep_operator_is_the_matrix_product():
    g = torch.Generator().manual_seed(3)
    R, h, n = 4, 2, 3
    w, a = torch.rand(R, h * n, generator=g).double(), torch.rand(R, h * n, generator=g).double()
    kk = F.normalize(torch.randn(R, h, n, generator=g, dtype=torch.float64), dim=-1)
    S = torch.randn(R, h, n, n, generator=g, dtype=torch.float64)
    A = torch.diag_embed(w.view(R, h, n)) - kk[..., :, None] * (kk * a.view(R, h, n))[..., None, :]
    got = rwkv7_keep({"w": w, "a": a, "kk": kk.reshape(R, -1)}, S.reshape(R, -1))
    assert torch.allclose(got, (S @ A).reshape(R, -1), rtol=0, atol=1e-14)


def _keep_gap(model, layer: int, start_lag: int, how: str = "operator") -> float:
    """max over t of |δS_t − A_t(δS_{t−1})| rolled from lag ``start_lag`` after P, relative
    to |δS| there: the package's own states and the clean read-out's w, a, kk (``how``:
    "operator", "sqrt" (a wrong decay) or "elementwise" (w alone, no removal))."""
    fam = RWKV7Family(model)
    ids = _ids(4)
    idp = ids.clone()
    idp[:, P] = (idp[:, P] + 1 + torch.arange(B)) % V
    clean, pert = fam.check(ids), fam.check(idp)
    ref_c, ref_p = fam.reference(clean), fam.reference(pert)
    sig = fam.read(clean, ref_c).signals
    name = f"layer{layer}.s"
    ds = (ref_p.states[name] - ref_c.states[name]).double()
    rolled = ds[:, P + start_lag]
    norm = rolled.abs().amax(dim=-1)
    assert float(norm.min()) > 0
    worst = 0.0
    for t in range(P + start_lag + 1, T):
        step = {n: sig[f"layer{layer}.{n}"][:, t].double() for n in ("w", "a", "kk")}
        if how == "sqrt":
            step["w"] = step["w"].sqrt()
        if how == "elementwise":
            rolled = step["w"][..., fam.state_units(layer)] * rolled
        else:
            rolled = rwkv7_keep(step, rolled)
        worst = max(worst, float(((ds[:, t] - rolled).abs().amax(-1) / norm).max()))
    return worst


def test_one_layer_has_no_return_path_once_the_token_shift_has_passed(built):
    one, two = built[1][1], built[2][1]
    assert RWKV7Family(one).input_window() == 2
    assert _keep_gap(one, 0, 1) < 2e-5  # the package's float32 steps
    assert _keep_gap(one, 0, 0) > 1e-3  # the token shift still reads the changed id at lag 1
    assert _keep_gap(one, 0, 1, "sqrt") > 1e-2
    assert _keep_gap(one, 0, 1, "elementwise") > 1e-2  # the removal term matters
    assert _keep_gap(two, 0, 1) < 2e-5  # the bottom layer of two has none either
    assert _keep_gap(two, 1, 1) > 1e-3  # the top layer's input reads the bottom's state


# ---- Lens end to end ------------------------------------------------------------------
def test_lens_analyze_measures_the_model_and_the_split_is_the_operators(built):
    model = built[2][1]
    LW, PW = 24, 6
    result = gatelens.Lens(RWKV7LM(model), vocab=VOCAB).analyze(
        TEXT, windows=2, length=LW, perturb_pos=PW, exponents=1)
    (a,) = result.analyses.values()
    rep = a.report
    check_report(rep)
    jsonschema.validate(rep, schema())
    assert rep["model"]["family"] == "rwkv7" and rep["verification"]["passed"] is True
    assert rep["units"]["gate"] == "w" and rep["units"]["n_units"] == 2 * C
    assert all(math.exp(-W_SCALE) < rep["gates"]["w"][q] < 1 for q in ("p5", "p50", "p95"))
    assert all(math.isfinite(v) for v in rep["units"]["half_life"].values())
    assert rep["lyapunov"] is not None
    pert = rep["perturbation"]
    assert pert["n"] == 2 and pert["lags"] == [1, 2, 4, 8, 16]
    assert a.reach_note is None or "logits" not in a.reach_note
    # the forget path by hand: the clean run's operators as explicit matrices, per layer
    tr, tr2 = a.trace, a.trace_perturbed
    ds = (pooled(tr2, "s") - pooled(tr, "s")).double()  # (2, T, 2·H·N·N)
    rolled, by_hand = ds[:, PW].reshape(2, 2, H, N, N), {}
    for lag in range(1, LW - PW):
        t = PW + lag
        A = []
        for k in range(2):
            w, av, kk = (tr[f"layer{k}.{n}"][:, t].double().reshape(2, H, N)
                         for n in ("w", "a", "kk"))
            A.append(torch.diag_embed(w) - kk[..., :, None] * (kk * av)[..., None, :])
        rolled = torch.stack([rolled[:, k] @ A[k] for k in range(2)], dim=1)
        by_hand[lag] = (rolled.flatten(1).norm(dim=-1) / ds[:, PW].norm(dim=-1)).mean()
    assert pert["forget_only"] == pytest.approx([float(by_hand[k]) for k in pert["lags"]],
                                                rel=1e-6, abs=1e-14)
    dec = a.decomposition
    scale = max(float(dec["measured"].abs().max()), 1.0)
    assert float((dec["measured"] - dec["forget_path"] - dec["return_path"]).abs().max()) \
        < 1e-9 * scale


# ---- refusals ---------------------------------------------------------------------------
def test_what_is_not_opened_is_refused_in_one_line(built, monkeypatch, tmp_path):
    z, model = built[2]
    fam = RWKV7Family(model)
    with pytest.raises(GatelensError, match="reads token ids"):
        fam.check(torch.randn(B, T, C))
    with pytest.raises(GatelensError, match="initial state is not supported"):
        fam.check(_ids(), model.generate_zero_state())
    with pytest.raises(GatelensError, match="outside the vocabulary of 11"):
        fam.check(torch.full((1, 3), V))
    assert fam.check([1, 2, 3]).inputs.shape == (1, 3, C)  # the package's own call form
    with pytest.raises(GatelensError, match="RWKV_x070"):  # it reads ids only through RWKV7LM
        gatelens.Lens(model, vocab=VOCAB).analyze(TEXT, windows=1, length=12, perturb_pos=3)
    monkeypatch.setattr(pkg, "RWKV7_OP", lambda *a: None, raising=False)
    with pytest.raises(GatelensError, match="RWKV_CUDA_ON=1"):
        fam.check(_ids())
    monkeypatch.delattr(pkg, "RWKV7_OP")
    # the package keeps its dtype in module globals: restored after this test
    monkeypatch.setattr(pkg, "DTYPE", pkg.DTYPE)
    monkeypatch.setattr(pkg, "DEVICE", pkg.DEVICE)
    torch.save({**z, "blocks.0.ffn.s_emb.weight": torch.zeros(V, 32)}, tmp_path / "de.pth")
    with pytest.raises(GatelensError, match="DeepEmbed variant"):
        RWKV7Family(pkg.RWKV_x070(str(tmp_path / "de"), "cpu fp32")).check(_ids())
    torch.save(z, tmp_path / "half.pth")
    half = pkg.RWKV_x070(str(tmp_path / "half"), "cpu bf16")
    with pytest.raises(GatelensError, match="bfloat16 .*'fp32' strategy only"):
        RWKV7Family(half).check(_ids())
    with pytest.raises(GatelensError, match="RWKV7LM takes rwkv.model.RWKV_x070"):
        RWKV7LM(torch.nn.Linear(2, 2))
