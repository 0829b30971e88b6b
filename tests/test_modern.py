"""gatelens's own cells (modern.py): equations, scan, trace names, analyses, CLI."""

from __future__ import annotations

import json
import math

import pytest
import torch
import torch.nn.functional as F

from gatelens import cli
from gatelens.analysis import perturb_windows, perturbation_decay
from gatelens.analysis.measure import encoder_runner, measure
from gatelens.cells.modern import SLSTM, MinGRU, MinLSTM
from gatelens.cells.scan import scan, scan_sequential
from gatelens.readout.trace import trace
from gatelens.readout.verify import verify

pytestmark = pytest.mark.usefixtures("one_thread")


def _block(m, k, h, below):
    """The LM block of modern.py's docstring, written out: y = u + MLP(LN(u))."""
    u = h if below is None else below + h
    n, lin1, lin2 = m.norm_mlp[k], m.mlp[k][0], m.mlp[k][2]
    v = F.layer_norm(u, (u.shape[-1],), n.weight.double(), n.bias.double(), n.eps)
    v = F.gelu(v @ lin1.weight.double().T + lin1.bias.double())
    return u + v @ lin2.weight.double().T + lin2.bias.double()


def _reference(m, x, m0: float = -math.inf):
    """Every signal of every layer, float64, one step at a time (docs/methods.md); sLSTM's
    stabiliser starts at ``m0`` (the module's is −∞ for the empty zero state)."""
    x = x.double()
    H, out, below = m.hidden_size, {}, None
    for k in range(m.num_layers):
        if k == 0:
            inp = x
        else:
            n = m.norm_in[k - 1]
            inp = F.layer_norm(below, (H,), n.weight.double(), n.bias.double(), n.eps)
        pre = inp @ m.proj[k].weight.double().T + m.proj[k].bias.double()  # (B, T, G·H)
        B, T = x.shape[:2]
        sig = {}
        h = torch.zeros(B, H, dtype=torch.float64)
        if m.cell == "slstm":
            c, nn_ = (torch.zeros(B, H, dtype=torch.float64) for _ in range(2))
            mm = torch.full((B, H), m0, dtype=torch.float64)
            R = torch.block_diag  # R h: one (4·d × d) block per head
            Rk = m.R[k].double()  # (4, heads, d, d)
        rows = []
        for t in range(T):
            p = pre[:, t]
            if m.cell == "mingru":
                z = torch.sigmoid(p[:, :H])
                cand = p[:, H:]
                h = (1 - z) * h + z * cand
                rows.append(dict(z=z, cand=cand, keep=1 - z, h=h))
            elif m.cell == "minlstm":
                f, i, cand = torch.sigmoid(p[:, :H]), torch.sigmoid(p[:, H:2 * H]), p[:, 2 * H:]
                h = f / (f + i) * h + i / (f + i) * cand
                rows.append(dict(f=f, i=i, cand=cand, keep=f / (f + i), h=h))
            else:
                rec = torch.cat([h @ R(*[Rk[g, j] for j in range(m.heads)]) for g in range(4)], 1)
                zt, it, ft, ot = (p + rec).chunk(4, dim=1)
                z, o, logf = torch.tanh(zt), torch.sigmoid(ot), F.logsigmoid(ft)
                m_new = torch.maximum(logf + mm, it)
                i, f = torch.exp(it - m_new), torch.exp(logf + mm - m_new)
                c_new, n_new = f * c + i * z, f * nn_ + i
                kappa = f * nn_ / n_new
                c, nn_, mm = c_new, n_new, m_new
                h = o * c / nn_
                rows.append(dict(z=z, i=i, f=f, o=o, c=c, n=nn_, m=mm, kappa=kappa,
                                 s=c / nn_, h=h))
        for name in rows[0]:
            sig[name] = torch.stack([r[name] for r in rows], dim=1)  # (B, T, H)
        below = _block(m, k, sig["h"], below)
        sig["y"] = below
        out.update({f"layer{k}.{n}": v for n, v in sig.items()})
    return out


NAMES = {
    "mingru": ["layer0.z", "layer0.cand", "layer0.keep", "layer0.h", "layer0.y"],
    "minlstm": ["layer0.f", "layer0.i", "layer0.cand", "layer0.keep", "layer0.h", "layer0.y"],
    "slstm": ["layer0.z", "layer0.i", "layer0.f", "layer0.o", "layer0.c", "layer0.n",
              "layer0.m", "layer0.kappa", "layer0.s", "layer0.h", "layer0.y"],
}


def _make(cell: str, layers: int = 1, F_in: int = 5, H: int = 6, dtype=torch.float32):
    torch.manual_seed(1)
    m = {"mingru": MinGRU, "minlstm": MinLSTM}.get(cell)
    m = m(F_in, H, layers) if m else SLSTM(F_in, H, layers, heads=2)
    return m.to(dtype)


@pytest.mark.parametrize("cell", sorted(NAMES))
def test_trace_names_and_reference(cell):
    m = _make(cell, layers=2)
    x = torch.randn(3, 20, 5)
    tr = trace(m, x)
    two = NAMES[cell] + [n.replace("layer0", "layer1") for n in NAMES[cell]]
    assert list(tr) == two and tr.cell == cell
    ref = _reference(m, x)
    for name in two:
        assert (tr[name].double() - ref[name]).abs().max() < 2e-5, name
    out, _ = m(x)
    assert (tr["layer1.y"] - out).abs().max() < 1e-5
    assert verify(m, x, trace=tr).passed
    assert list(trace(m, x, names=["layer1.h"])) == ["layer1.h"]


@pytest.mark.parametrize("cell", ["mingru", "minlstm"])
@pytest.mark.parametrize(("dtype", "tol"), [(torch.float32, 1e-5), (torch.float64, 1e-10)])
def test_parallel_scan_matches_sequential_step(cell, dtype, tol):
    m = _make(cell, layers=2, dtype=dtype)
    x = torch.randn(4, 128, 5, dtype=dtype)
    h0 = torch.randn(2, 4, 6, dtype=dtype)
    par, par_n, _ = m.run(x, h0, parallel=True)
    seq, seq_n, _ = m.run(x, h0, parallel=False)
    assert (par - seq).abs().max() < tol and (par_n - seq_n).abs().max() < tol
    a = torch.rand(2, 128, 3, dtype=dtype)
    b, s0 = torch.randn(2, 128, 3, dtype=dtype), torch.randn(2, 3, dtype=dtype)
    assert (scan(a, b, s0) - scan_sequential(a, b, s0)).abs().max() < tol


@pytest.mark.parametrize("cell", ["mingru", "minlstm"])
def test_forward_takes_the_scan_its_mode_names(cell):
    """On CPU "auto" is the sequential step; "parallel" forces the scan; both train."""
    m = _make(cell, layers=2)
    x = torch.randn(3, 40, 5, requires_grad=True)
    seq, _, _ = m.run(x, parallel=False)
    par, _, _ = m.run(x, parallel=True)
    assert not torch.equal(seq, par)  # two algorithms: they differ in rounding
    assert m.scan_mode == "auto" and torch.equal(m(x)[0], seq)
    m.scan_mode = "parallel"
    assert torch.equal(m(x)[0], par)
    m.scan_mode = "sequential"
    out = m(x)[0]
    assert torch.equal(out, seq)
    out.sum().backward()
    assert x.grad is not None and torch.isfinite(x.grad).all()


@pytest.mark.parametrize("cell", ["mingru", "minlstm"])
def test_forget_path_is_exact_in_one_layer_only(cell):
    """No return path inside one layer: r(k) = a(k) at every lag; two layers part."""
    ids = torch.randint(0, 5, (4, 48), generator=torch.Generator().manual_seed(0))
    ids2 = perturb_windows(ids, 8, 5, seed=0)
    ratios = {}
    for layers in (1, 2):
        m = _make(cell, layers=layers, dtype=torch.float64)
        tr, tr2 = (trace(m, F.one_hot(i, 5).double()) for i in (ids, ids2))
        d = perturbation_decay(tr, tr2, 8)
        r, a = d.curves["measured"][1:], d.curves["forget_path"][1:]
        ratios[layers] = float(max(abs(r / a - 1)))
    assert ratios[1] < 1e-6
    assert ratios[2] > 1e-2


def test_slstm_kappa_identity():
    m = _make("slstm", dtype=torch.float64)
    x = torch.randn(3, 30, 5, dtype=torch.float64) * 3
    tr = trace(m, x)
    L0 = tr.layer(0)
    # raw recurrence: i = exp ĩ, f = σ(f̃), n' = f n + i (no stabiliser); κ = f n / n'
    log_i = torch.log(L0["i"]) + L0["m"]  # ĩ = ln i_stab + m'
    m_prev = torch.cat([torch.zeros_like(L0["m"][:, :1]), L0["m"][:, :-1]], 1)
    log_f = torch.log(L0["f"]) + L0["m"] - m_prev  # ln σ(f̃)
    n_raw, kappa_raw = torch.zeros(3, 6, dtype=torch.float64), []
    for t in range(30):
        n_new = log_f[:, t].exp() * n_raw + log_i[:, t].exp()
        kappa_raw.append(log_f[:, t].exp() * n_raw / n_new)
        n_raw = n_new
    assert (torch.stack(kappa_raw, 1) - L0["kappa"]).abs().max() < 1e-6
    s, k, z = L0["s"], L0["kappa"], L0["z"]
    s_prev = torch.cat([torch.zeros_like(s[:, :1]), s[:, :-1]], 1)
    assert (k * s_prev + (1 - k) * z - s).abs().max() < 1e-6
    assert (L0["o"] * s - L0["h"]).abs().max() < 1e-12
    assert float(L0["kappa"].min()) >= 0 and float(L0["kappa"].max()) < 1


@pytest.mark.parametrize("cell", sorted(NAMES))
def test_measure_runs_on_modern_cells(cell):
    m = _make(cell, layers=2)
    ids = torch.randint(0, 5, (3, 40), generator=torch.Generator().manual_seed(2))
    a = measure(m, encoder_runner(lambda i: F.one_hot(i, 5).float()), ids, list("abcde"),
                perturb_pos=6)
    assert a.verification.passed and a.perturbation.state == a.trace.state_name
    assert a.perturbation.max_abs_residual < 1e-5
    assert math.isfinite(a.divergence.lyapunov_per_char)
    assert a.units.n_units == 12


def test_train_and_analyze_cli(tmp_path, tiny_text):
    run = tmp_path / "run"
    args = ["train", "--corpus", tiny_text, "--cell", "slstm", "--heads", "2", "--hidden", "6",
            "--layers", "2", "--steps", "4", "--batch", "4", "--seq", "24", "--eval-every", "2",
            "--val-windows", "2", "--forget-bias", "1", "--out", run, "--quiet"]
    assert cli.main([str(a) for a in args]) == 0
    cfg = json.loads((run / "config.json").read_text())
    assert cfg["model"]["cell"] == "slstm" and cfg["model"]["heads"] == 2
    assert cli.main(["analyze", str(run), "--windows", "3", "--length", "40",
                     "--perturb-pos", "6"]) == 0
    rep = json.loads((run / "analysis" / "report.json").read_text())
    assert rep["verification"]["passed"] and rep["perturbation"]["state"] == "s"


@pytest.mark.parametrize("cell", ["mingru", "minlstm"])
def test_train_min_cells(tmp_path, tiny_text, cell):
    args = ["train", "--corpus", tiny_text, "--cell", cell, "--hidden", "6", "--steps", "2",
            "--batch", "2", "--seq", "16", "--eval-every", "2", "--val-windows", "2",
            "--chrono", "8", "--out", tmp_path / cell, "--quiet"]
    assert cli.main([str(a) for a in args]) == 0


@pytest.mark.parametrize("extra", [["--cell", "slstm", "--heads", "4", "--hidden", "6"],
                                   ["--cell", "gru", "--heads", "2"],
                                   ["--cell", "rnn", "--forget-bias", "1"]])
def test_bad_settings_exit_2(tmp_path, tiny_text, extra, capsys):
    code = cli.main(["train", "--corpus", str(tiny_text), *extra, "--out", str(tmp_path / "r")])
    assert code == 2
    assert len(capsys.readouterr().err.strip().splitlines()) == 1


def test_keep_bias_sets_the_keep_gate():
    from gatelens.training.model import CharLM, set_forget_bias

    for cell in ("mingru", "minlstm"):
        model = CharLM(4, hidden=3, cell=cell)
        set_forget_bias(model, 2.0)
        with torch.no_grad():
            model.rnn.proj[0].weight.zero_()
        tr = trace(model.rnn, torch.zeros(1, 2, 4))
        assert torch.allclose(tr["layer0.keep"], torch.full((1, 2, 3), 1 / (1 + math.exp(-2))))


def test_minlstm_keep_gate_is_finite_where_f_and_i_underflow():
    """f/(f + i) is 0/0 in float32 when both pre-activations are below about −104; f* is
    computed as σ(ln σ(f̃) − ln σ(ĩ)), the same number, finite there."""
    m = MinLSTM(3, 4)
    with torch.no_grad():
        m.bias_of(0, "f").fill_(-200.0)
        m.bias_of(0, "i").fill_(-201.0)
    tr = trace(m, torch.zeros(2, 5, 3))
    assert (tr["layer0.f"] == 0).all() and (tr["layer0.i"] == 0).all()
    expect = 1 / (1 + math.exp(-1.0))  # σ(f̃) / (σ(f̃) + σ(ĩ)) → e^f̃ / (e^f̃ + e^ĩ) = σ(1)
    assert torch.allclose(tr["layer0.keep"], torch.full_like(tr["layer0.keep"], expect))
    assert torch.isfinite(m(torch.zeros(2, 5, 3))[0]).all()


def test_slstm_zero_state_is_finite_where_the_input_gate_underflows():
    """From the zero state, m₀ = 0 made i₁ = exp(ĩ₁ − max(ln σ(f̃₁), ĩ₁)) underflow to 0 in
    float32 when ĩ₁ ≪ ln σ(f̃₁), so c₁/n₁ = 0/0. The empty state enters with m = −∞ instead;
    the scale-free signals (h, s, κ) must equal the float64 reference with the old m₀ = 0,
    which does not underflow here: h does not depend on m₀."""
    m = _make("slstm")
    with torch.no_grad():
        m.bias_of(0, "i").fill_(-200.0)
    x = torch.randn(3, 12, 5)
    tr = trace(m, x)
    ref = _reference(m.double(), x, m0=0.0)
    m.float()
    for name in ("h", "s", "kappa", "y"):
        got = tr[f"layer0.{name}"]
        assert torch.isfinite(got).all(), name
        assert (got.double() - ref[f"layer0.{name}"]).abs().max() < 1e-5, name
    L0 = tr.layer(0)
    assert (L0["m"][:, 0] == m.proj[0](x)[:, 0].chunk(4, -1)[1]).all()  # m₁ = ĩ₁
    assert (L0["i"][:, 0] == 1).all() and (L0["f"][:, 0] == 0).all()
    assert (L0["kappa"][:, 0] == 0).all()  # nothing kept from an empty state
    assert torch.isfinite(m(x)[0]).all()


def test_slstm_weights_times_16_stay_finite():
    """A chaotic sLSTM (every weight ×16) from the zero state: its forward, its trace and
    verify are finite, and the trace is the module's own trajectory."""
    m = _make("slstm", layers=2)
    with torch.no_grad():
        for p in m.parameters():
            p.mul_(16)
    x = torch.randn(4, 40, 5)
    out, _ = m(x)
    assert torch.isfinite(out).all()
    tr = trace(m, x)
    assert all(torch.isfinite(v).all() for _, v in tr.items())
    res = verify(m, x, trace=tr)
    assert res.passed, res.explain()


@pytest.mark.parametrize("cell", ["mingru", "minlstm"])
def test_verify_judges_unbounded_h_by_its_scale(cell):
    """Weights ×16 put h in the hundreds and y in the thousands: the scan and the step then
    part by ~1e-3 absolutely, which is float32 rounding of terms that large. The verdict
    (each layer's step fed the scan's own input) is judged scaled by the unit's largest
    |value| in the window and passes; a trace of other inputs, or a step that is wrong by
    1e-4 of that scale, fails."""
    m = _make(cell, layers=2, H=16)
    with torch.no_grad():
        for p in m.parameters():
            p.mul_(16)
    x = torch.randn(4, 64, 5)
    res = verify(m, x, trace=trace(m, x))
    assert float(trace(m, x)["layer1.y"].abs().max()) > 100
    assert res.max_abs_diff_h > 1e-5  # absolute rounding at this scale
    assert res.one_step_max_scaled_diff_h < 1e-5 and res.passed, res.explain()
    assert "parallel form (passed)" in res.explain()
    assert res.to_report()["one_step_max_scaled_diff_h"] == res.one_step_max_scaled_diff_h
    other = verify(m, x, trace=trace(m, x + 0.01))
    assert not other.passed and other.trace_max_scaled_diff_h > 1e-3
    assert "not the module's trajectory (FAILED)" in other.explain()

    layer = type(m).layer

    def wrong(self, k, inp, init, parallel):  # the step 1e-4 off, relative to h's scale
        sig, final = layer(self, k, inp, init, parallel)
        if not parallel:
            bump = 1e-4 * sig["h"].abs().amax(dim=1, keepdim=True)
            sig = {**sig, "h": sig["h"] + bump}
        return sig, final

    m.layer = wrong.__get__(m)
    bad = verify(m, x)
    assert not bad.passed and 5e-5 < bad.one_step_max_scaled_diff_h, bad.explain()
    assert "(FAILED)" in bad.explain()
