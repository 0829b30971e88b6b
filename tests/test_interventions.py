"""Interventions on nn.LSTM, nn.GRU and nn.RNN inside a model (issue 28, part 1): the exact
checks of docs/interventions.md on small stacks, batch first and not, plain and chaotic
(every weight x8, x16).

References are independent of gatelens: the model's own forward, the module's own forward
(PyTorch's kernel) from an edited state, and a float64 loop written here.
"""

from __future__ import annotations

import pytest
import torch
from torch import Tensor, nn

import gatelens
from gatelens.errors import GatelensError

pytestmark = pytest.mark.usefixtures("one_thread")

V, E, H, B, T = 7, 5, 8, 3, 20
KINDS = {"lstm": nn.LSTM, "gru": nn.GRU, "rnn": nn.RNN}


class Net(nn.Module):
    """embedding -> a recurrent stack (``rnn``) -> head: the module deep inside a model."""

    def __init__(self, kind: str = "lstm", layers: int = 2, batch_first: bool = True,
                 scale: float = 1.0, seed: int = 0, **kw) -> None:
        super().__init__()
        torch.manual_seed(seed)
        self.embed = nn.Embedding(V, E)
        self.rnn = KINDS[kind](E, H, num_layers=layers, batch_first=batch_first, **kw)
        self.head = nn.Linear(H * (2 if kw.get("bidirectional") else 1), V)
        with torch.no_grad():
            for n, p in self.rnn.named_parameters():
                if n.startswith("weight"):
                    p.mul_(scale)

    def features(self, ids: Tensor) -> Tensor:
        """What ``rnn`` reads, in its own layout."""
        x = self.embed(ids)
        return x if self.rnn.batch_first else x.transpose(0, 1)

    def forward(self, ids: Tensor) -> Tensor:
        y, _ = self.rnn(self.features(ids))
        return self.head(y if self.rnn.batch_first else y.transpose(0, 1))


def ids_of(seed: int = 1) -> Tensor:
    return torch.randint(0, V, (B, T), generator=torch.Generator().manual_seed(seed))


def state_after(res, path: str, layers: int, kind: str, t: int) -> Tensor | tuple:
    """The state every layer carried after step t in an edited run, as the module takes it."""
    h = torch.stack([res.trace[f"{path}.layer{k}.h"][:, t] for k in range(layers)])
    if kind != "lstm":
        return h
    return h, torch.stack([res.trace[f"{path}.layer{k}.c"][:, t] for k in range(layers)])


def own_forward_after(net: Net, ids: Tensor, state, t: int) -> Tensor:
    """The head on the module's OWN forward of the steps after t from ``state``."""
    x = net.features(ids)
    x = x[:, t + 1 :] if net.rnn.batch_first else x[t + 1 :]
    with torch.no_grad():
        y, _ = net.rnn(x, state)
        return net.head(y if net.rnn.batch_first else y.transpose(0, 1))


def diff(a: Tensor, b: Tensor) -> float:
    return float((a.double() - b.double()).abs().max()) if a.numel() else 0.0


CASES = [(kind, layers, bf) for kind in KINDS for layers, bf in ((1, True), (2, False))]


@pytest.mark.parametrize("kind,layers,bf", CASES)
def test_no_edit_is_the_models_own_forward(kind, layers, bf) -> None:
    net, ids = Net(kind, layers, bf), ids_of()
    with torch.no_grad():
        own = net(ids)
    lens = gatelens.Lens(net)
    assert torch.equal(lens.run(ids, edits=[]).output, own)
    t = 7  # an edit that changes nothing: bitwise before it, the one-step tolerance after
    res = lens.run(ids, edits=[gatelens.Add(f"rnn.layer{layers - 1}.h", 0.0, at=t)])
    assert torch.equal(res.output[:, :t], own[:, :t])
    assert diff(res.output, own) < 1e-5
    # and the steps after t are the module's own kernel from the state the run carried
    assert diff(res.output[:, t + 1 :],
                own_forward_after(net, ids, state_after(res, "rnn", layers, kind, t), t)) < 1e-6


@pytest.mark.parametrize("scale", [1.0, 8.0, 16.0])
@pytest.mark.parametrize("kind", list(KINDS))
def test_a_state_edit_at_t_is_the_modules_own_forward_from_that_state(kind, scale) -> None:
    layers, t = 2, 9
    net, ids = Net(kind, layers, batch_first=True, scale=scale, seed=3), ids_of(2)
    g = torch.Generator().manual_seed(5)
    edits, hs, cs = [], [], []
    for k in range(layers):  # every layer's carried state set after step t
        hs.append(torch.randn(B, H, generator=g).tanh())
        edits.append(gatelens.Set(f"rnn.layer{k}.h", hs[-1], at=t))
        if kind == "lstm":
            cs.append(2 * torch.randn(B, H, generator=g))
            edits.append(gatelens.Set(f"rnn.layer{k}.c", cs[-1], at=t))
    res = gatelens.Lens(net).run(ids, edits=edits)
    state = torch.stack(hs) if kind != "lstm" else (torch.stack(hs), torch.stack(cs))
    ref = own_forward_after(net, ids, state, t)
    assert diff(res.output[:, t + 1 :], ref) < 1e-6  # bitwise on this CPU (0.0)
    with torch.no_grad():
        assert torch.allclose(res.output[:, t], net.head(hs[-1]), atol=1e-6)
        assert torch.equal(res.output[:, :t], net(ids)[:, :t])
    assert torch.equal(res.trace["rnn.layer0.h"][:, t], hs[0])


@pytest.mark.parametrize("scale", [1.0, 8.0, 16.0])
@pytest.mark.parametrize("kind", list(KINDS))
def test_setting_a_state_to_its_own_value_changes_nothing(kind, scale) -> None:
    net, ids, t = Net(kind, 1, batch_first=True, scale=scale, seed=4), ids_of(3), 11
    x = net.features(ids)
    with torch.no_grad():
        own = net(ids)
        _, fin = net.rnn(x[:, : t + 1])  # the module's own state after step t
    h, c = (fin if kind == "lstm" else (fin, None))
    edits = [gatelens.Set("rnn.layer0.h", h[0], at=t)]
    if c is not None:
        edits.append(gatelens.Set("rnn.layer0.c", c[0], at=t))
    res = gatelens.Lens(net).run(ids, edits=edits)
    assert diff(res.output, own) < 1e-6


def lstm64(net: Net, ids: Tensor, t0: int, t1: int, u: list[int]) -> tuple[Tensor, Tensor]:
    """A float64 loop of the one-layer LSTM with f := 0.9 on units u, i += 0.05 and o
    scaled by 0.5 on every unit, at steps t0 .. t1 − 1; its h and c (B, T, H)."""
    w = {n: p.detach().double() for n, p in net.rnn.named_parameters()}
    x = net.embed(ids).detach().double()
    h, c, hs, cs = torch.zeros(B, H, dtype=torch.float64), torch.zeros(B, H,
                                                                       dtype=torch.float64), [], []
    for t in range(T):
        z = x[:, t] @ w["weight_ih_l0"].T + w["bias_ih_l0"] + h @ w["weight_hh_l0"].T \
            + w["bias_hh_l0"]
        i, f, g, o = z.sigmoid()[:, :H], z.sigmoid()[:, H : 2 * H], z[:, 2 * H : 3 * H].tanh(), \
            z.sigmoid()[:, 3 * H :]
        if t0 <= t < t1:
            f = f.clone()
            f[:, u] = 0.9
            i, o = i + 0.05, o * 0.5
        c = f * c + i * g
        h = o * c.tanh()
        hs.append(h)
        cs.append(c)
    return torch.stack(hs, 1), torch.stack(cs, 1)


def test_gate_edits_match_a_float64_loop() -> None:
    net, ids, u = Net("lstm", 1, seed=6), ids_of(4), [1, 6]
    res = gatelens.Lens(net).run(ids, edits=[
        gatelens.Set("rnn.layer0.f", 0.9, at=slice(5, 12), units=u),
        gatelens.Add("rnn.layer0.i", 0.05, at=slice(5, 12)),
        gatelens.Scale("rnn.layer0.o", 0.5, at=slice(5, 12))])
    h, c = lstm64(net, ids, 5, 12, u)
    assert diff(res.trace["rnn.layer0.h"], h) < 1e-5
    assert diff(res.trace["rnn.layer0.c"], c) < 1e-5
    with torch.no_grad():
        assert diff(res.output, net.head(h.float())) < 1e-5
    assert bool((res.trace["rnn.layer0.f"][:, 5:12, u] == 0.9).all())
    h_clean, _ = lstm64(net, ids, T, T, u)
    assert diff(h, h_clean) > 1e-2  # the edits did change the run


def test_gru_and_rnn_gate_edits_match_a_float64_loop() -> None:
    for kind in ("gru", "rnn"):
        net, ids = Net(kind, 1, seed=7), ids_of(5)
        letter = "z" if kind == "gru" else "pre"
        res = gatelens.Lens(net).run(ids, edits=[
            gatelens.Set(f"rnn.layer0.{letter}", 0.25, at=slice(4, 9), units=[0, 3])])
        w = {n: p.detach().double() for n, p in net.rnn.named_parameters()}
        x, h, hs = net.embed(ids).detach().double(), torch.zeros(B, H, dtype=torch.float64), []
        for t in range(T):
            xi = x[:, t] @ w["weight_ih_l0"].T + w["bias_ih_l0"]
            hh = h @ w["weight_hh_l0"].T + w["bias_hh_l0"]
            if kind == "gru":
                r = (xi[:, :H] + hh[:, :H]).sigmoid()
                z = (xi[:, H : 2 * H] + hh[:, H : 2 * H]).sigmoid()
                if 4 <= t < 9:
                    z[:, [0, 3]] = 0.25
                n = (xi[:, 2 * H :] + r * hh[:, 2 * H :]).tanh()
                h = (1 - z) * n + z * h
            else:
                pre = xi + hh
                if 4 <= t < 9:
                    pre[:, [0, 3]] = 0.25
                h = pre.tanh()
            hs.append(h)
        assert diff(res.trace["rnn.layer0.h"], torch.stack(hs, 1)) < 1e-5, kind


@pytest.mark.parametrize("scale", [1.0, 8.0, 16.0])
def test_f_one_i_zero_keeps_c_constant_exactly(scale) -> None:
    net, ids, t0 = Net("lstm", 2, batch_first=False, scale=scale, seed=8), ids_of(6), 6
    edits = [gatelens.Set(f"rnn.layer{k}.f", 1.0, at=slice(t0, None), units=[2, 5])
             for k in (0, 1)]
    edits += [gatelens.Zero(f"rnn.layer{k}.i", at=slice(t0, None), units=[2, 5]) for k in (0, 1)]
    res = gatelens.Lens(net).run(ids, edits=edits)
    for k in (0, 1):
        c = res.trace[f"rnn.layer{k}.c"][:, t0 - 1 :, [2, 5]]
        assert torch.equal(c, c[:, :1].expand_as(c))  # the c step t0 read, held exactly
    # a GRU's z := 1 holds its h the same way
    gru = Net("gru", 1, scale=scale, seed=8)
    res = gatelens.Lens(gru).run(ids, edits=[gatelens.Set("rnn.layer0.z", 1.0,
                                                          at=slice(t0, None), units=[4])])
    h = res.trace["rnn.layer0.h"][:, t0 - 1 :, 4]
    assert torch.equal(h, h[:, :1].expand_as(h))


@pytest.mark.parametrize("kind", list(KINDS))
def test_carry_forward_changes_later_outputs_and_this_position_only_does_not(kind) -> None:
    net, ids, t = Net(kind, 1, seed=9), ids_of(7), 8
    with torch.no_grad():
        own = net(ids)
    lens = gatelens.Lens(net)
    carried = lens.run(ids, edits=[gatelens.Zero("rnn.layer0.h", at=t)]).output
    local = lens.run(ids, edits=[gatelens.Zero("rnn.layer0.h", at=t, carry=False)]).output
    for out in (carried, local):
        assert torch.equal(out[:, :t], own[:, :t])
        assert diff(out[:, t], own[:, t]) > 1e-2  # position t's read-out changed
    assert diff(carried[:, t + 1 : t + 4], own[:, t + 1 : t + 4]) > 1e-3
    assert diff(local[:, t + 1 :], own[:, t + 1 :]) < 1e-5
    # a gate edit "this position only": its outputs change, the state handed on does not
    gate = {"lstm": "f", "gru": "z", "rnn": "pre"}[kind]
    res = lens.run(ids, edits=[gatelens.Set(f"rnn.layer0.{gate}", 0.0, at=t, carry=False)])
    assert diff(res.output[:, t + 1 :], own[:, t + 1 :]) < 1e-5
    assert diff(res.output[:, t], own[:, t]) > 1e-3


def test_an_edit_carries_up_the_stack_and_patch_and_mean() -> None:
    net, t = Net("lstm", 2, seed=10), 5
    ids, other = ids_of(8), ids_of(9)
    lens = gatelens.Lens(net)
    with torch.no_grad():
        own, theirs = net(ids), net(other)
    # patching every layer's h and c after step t from another input: later steps are the
    # other input's run from there on, given this input's tokens
    edits = [gatelens.Patch(f"rnn.layer{k}.{s}", source=other, at=t) for k in (0, 1)
             for s in "hc"]
    res = lens.run(ids, edits=edits)
    with gatelens.open_cells(net) as cache:
        net(other)
    assert torch.equal(res.trace["rnn.layer1.c"][:, t], cache["rnn.layer1.c"][:, t])
    assert diff(res.output[:, t], theirs[:, t]) < 1e-6
    assert diff(res.output[:, t + 1 :], own[:, t + 1 :]) > 1e-3
    # mean-ablation: the unit's mean over the windows and positions of the clean run
    res = lens.run(ids, edits=[gatelens.Mean("rnn.layer0.c", at=slice(3, 6), units=[1])])
    with gatelens.open_cells(net) as cache:
        net(ids)
    want = cache["rnn.layer0.c"][..., 1].double().mean().float()
    assert torch.allclose(res.trace["rnn.layer0.c"][:, 3:6, 1], want.expand(B, 3))
    # an edit of layer 0 changes layer 1 and the output from its position on, not before
    res = lens.run(ids, edits=[gatelens.Add("rnn.layer0.h", 0.5, at=t, units=[0])])
    assert torch.equal(res.output[:, :t], own[:, :t])
    clean = cache["rnn.layer1.h"]
    assert torch.equal(res.trace["rnn.layer1.h"][:, :t], clean[:, :t])
    assert diff(res.trace["rnn.layer1.h"][:, t], clean[:, t]) > 1e-3
    assert diff(res.output[:, t:], own[:, t:]) > 1e-3


def test_bidirectional_and_projected() -> None:
    net, ids, t = Net("lstm", 2, seed=11, bidirectional=True), ids_of(10), 6
    with torch.no_grad():
        own = net(ids)
    lens = gatelens.Lens(net)
    res = lens.run(ids, edits=[gatelens.Add("rnn.layer1.reverse.h", 0.0, at=t)])
    assert diff(res.output, own) < 1e-5
    res = lens.run(ids, edits=[gatelens.Set("rnn.layer0.reverse.f", 1.0, at=slice(None, t)),
                               gatelens.Zero("rnn.layer0.reverse.i", at=slice(None, t))])
    c = res.trace["rnn.layer0.reverse.c"][:, : t + 1]  # the reverse runs T−1 … 0
    assert torch.equal(c, c[:, -1:].expand_as(c))
    assert diff(res.output[:, :t], own[:, :t]) > 1e-3
    proj = Net("lstm", 1, seed=12, proj_size=4)
    proj.head = nn.Linear(4, V)
    res = gatelens.Lens(proj).run(ids, edits=[gatelens.Zero("rnn.layer0.m", at=3)])
    assert bool((res.trace["rnn.layer0.h"][:, 3] == 0).all())


def test_bad_edits_are_one_line_errors_listing_what_is_valid() -> None:
    net, ids = Net("lstm", 2), ids_of()
    lens = gatelens.Lens(net)
    cases = [
        (gatelens.Set("rnn.layer2.f", 1.0, at=3), "rnn.layer1.f"),
        (gatelens.Set("rnn.layer0.f", 1.0, at=T), f"outside the {T} positions"),
        (gatelens.Set("rnn.layer0.f", 1.0, at=slice(T, None)), "names no position"),
        (gatelens.Set("rnn.layer0.f", 1.0, at=3, units=[H]), f"outside the {H} units"),
        (gatelens.Set("rnn.layer0.f", 1.0, at=3, units=[]), "non-empty list"),
        (gatelens.Set("rnn.layer0.f", torch.ones(B + 1, H), at=3), "does not broadcast"),
        (gatelens.Patch("rnn.layer0.h", source=ids[:, :3], at=5), "the source has 3"),
        (gatelens.Set("rnn.layer0.f", "one", at=3), "number or a tensor"),
        (gatelens.Set("rnn.layer0.f", 1.0, at=2.5), "at must be"),
    ]
    for edit, words in cases:
        with pytest.raises(GatelensError) as e:
            lens.run(ids, edits=[edit])
        assert words in str(e.value) and "\n" not in str(e.value), (edit, str(e.value))
    with pytest.raises(GatelensError, match="list of gatelens.Set"):
        lens.run(ids, edits=gatelens.Zero("rnn.layer0.h", at=1))
    # the model is left as it was: no hook remains, the forward is the model's own
    with torch.no_grad():
        assert torch.equal(lens.run(ids, edits=[]).output, net(ids))
    assert not net.rnn._forward_hooks


@pytest.mark.parametrize("kind", ["lstm", "gru"])
def test_the_trace_before_the_first_edit_is_the_unedited_read(kind) -> None:
    # read once (the edit reads each stretch of the kernel, open_cells leaves the module
    # alone): before the first edit the edited trace is the unedited read, bit for bit, the
    # carried state one step before it the kernel's own, and the edited steps after (a
    # layer below's edit reaches the layer above there)
    net, ids, t = Net(kind, 2), ids_of(5), 9
    lens = gatelens.Lens(net)
    clean = lens.run(ids).trace
    state = "c" if kind == "lstm" else "h"
    res = lens.run(ids, edits=[gatelens.Zero(f"rnn.layer0.{state}", at=t)])
    assert all(torch.equal(res.trace[k][:, :t - 1], clean[k][:, :t - 1]) for k in clean)
    assert all((res.trace[k][:, t - 1] - clean[k][:, t - 1]).abs().max() < 1e-6 for k in clean)
    assert (res.trace["rnn.layer1.h"][:, t:] - clean["rnn.layer1.h"][:, t:]).abs().max() > 1e-3
