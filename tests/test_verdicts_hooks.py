"""trace and verify on a module with forward hooks or pre-hooks: read on the module's own
call, hooks included, or refused in one line naming the hook; never a false pass."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import gatelens
from gatelens.errors import GatelensError
from gatelens.readout.own_call import user_hooks

pytestmark = pytest.mark.usefixtures("one_thread")


def triple(module: nn.Module, args: tuple) -> tuple:
    return (3 * args[0],) + args[1:]


def replace_output(module: nn.Module, args: tuple, output: tuple) -> tuple:
    return (2 * output[0], output[1])


def edit_in_place(module: nn.Module, args: tuple, output: tuple) -> None:
    output[0].add_(0.5)


def observe(module: nn.Module, args: tuple, output: tuple) -> None:
    observe.calls += 1  # type: ignore[attr-defined]


def _lstm(layers: int = 1) -> nn.LSTM:
    torch.manual_seed(0)
    return nn.LSTM(3, 8, num_layers=layers, batch_first=True).eval()


def _top(tr: gatelens.Trace) -> torch.Tensor:
    return tr[f"layer{tr.num_layers - 1}.h"]


@pytest.mark.parametrize("layers", [1, 2])
def test_a_pre_hook_is_run_as_the_module_runs_it(layers: int) -> None:
    lstm, x = _lstm(layers), torch.randn(2, 6, 3)
    lstm.register_forward_pre_hook(triple)
    with torch.no_grad():
        out, (h_n, c_n) = lstm(x)
    tr = gatelens.trace(lstm, x)
    assert (_top(tr) - out).abs().max() < 1e-6 and (tr.c_n - c_n).abs().max() < 1e-6
    assert tr.meta["hooks"] == [f"forward pre-hook {__name__}.triple"]
    assert tr.meta["own_call_max_abs_diff"] < 1e-6
    res = gatelens.verify(lstm, x, trace=tr)
    assert res.passed and res.trace_max_abs_diff_h < 1e-6
    assert "own call, its hooks run (forward pre-hook" in res.explain()


def test_a_trace_of_the_bare_forward_fails_against_the_hooked_call() -> None:
    """The issue's case: a trace that is not what lstm(x) computes is never passed."""
    lstm, x = _lstm(), torch.randn(2, 6, 3)
    bare = gatelens.trace(lstm, x)
    lstm.register_forward_pre_hook(triple)
    res = gatelens.verify(lstm, x, trace=bare)
    assert not res.passed and res.trace_max_abs_diff_h > 0.1
    assert "it is not the module's trajectory (FAILED)" in res.explain()


def test_a_pre_hook_that_hands_a_state() -> None:
    lstm, x = _lstm(), torch.randn(2, 5, 3)
    h0, c0 = torch.randn(1, 2, 8), torch.randn(1, 2, 8)
    lstm.register_forward_pre_hook(lambda m, a: (a[0], (h0, c0)))
    with torch.no_grad():
        out = lstm(x)[0]
    tr = gatelens.trace(lstm, x)
    assert (tr["layer0.h"] - out).abs().max() < 1e-6
    assert gatelens.verify(lstm, x, trace=tr).passed


@pytest.mark.parametrize("hook", [replace_output, edit_in_place],
                         ids=["replaces", "in-place"])
@pytest.mark.parametrize("fn", ["trace", "verify", "trace_chunked"])
def test_a_forward_hook_that_changes_the_output_is_refused(hook, fn: str) -> None:
    lstm, x = _lstm(), torch.randn(2, 6, 3)
    lstm.register_forward_hook(hook)
    with pytest.raises(GatelensError) as e:
        getattr(gatelens, fn)(lstm, x)
    msg = str(e.value)
    assert "\n" not in msg and f"forward hook {__name__}.{hook.__name__}" in msg
    assert msg.startswith(f"{fn}(): ") and "changes what its call returns" in msg


def test_a_hook_that_only_observes_is_run_once_and_passes() -> None:
    lstm, x = _lstm(), torch.randn(2, 6, 3)
    observe.calls = 0  # type: ignore[attr-defined]
    lstm.register_forward_hook(observe)
    res = gatelens.verify(lstm, x, trace=gatelens.trace(lstm, x))
    assert res.passed and observe.calls == 2  # type: ignore[attr-defined]
    assert res.meta["inputs"].startswith("as given")


def test_cells_and_other_families_with_hooks_are_refused() -> None:
    cell = nn.GRUCell(3, 4)
    cell.register_forward_pre_hook(lambda m, a: (3 * a[0],) + a[1:])
    with pytest.raises(GatelensError, match=r"^verify\(\): GRUCell has a forward pre-hook"):
        gatelens.verify(cell, torch.randn(2, 5, 3))


def test_a_global_forward_hook_is_refused() -> None:
    lstm, x = _lstm(), torch.randn(1, 4, 3)
    handle = nn.modules.module.register_module_forward_hook(observe)
    try:
        with pytest.raises(GatelensError, match="global forward hook"):
            gatelens.trace(lstm, x)
    finally:
        handle.remove()


def _only_lstms(module: nn.Module, args: tuple) -> tuple | None:
    return (3 * args[0],) + args[1:] if isinstance(module, nn.LSTM) else None


def test_a_global_pre_hook_is_refused_in_trace_verify_and_lens() -> None:
    """A global pre-hook also runs on the one-layer modules gatelens runs to check the
    read-out: verify said FAILED (0.28) of a trace equal to lstm(x), Lens's verdict too."""
    lstm, x = _lstm(), torch.randn(2, 4, 3)
    model = nn.Sequential(nn.Embedding(6, 3), lstm)
    handle = nn.modules.module.register_module_forward_pre_hook(_only_lstms)
    try:
        for call in (lambda: gatelens.trace(lstm, x), lambda: gatelens.verify(lstm, x),
                     lambda: gatelens.Lens(model, vocab=6).analyze(
                         torch.randint(0, 6, (2, 12)), perturb_pos=2, exponents=0)):
            with pytest.raises(GatelensError) as e:
                call()
            assert (f"a global forward pre-hook {__name__}._only_lstms runs on every "
                    "module's call") in str(e.value)
    finally:
        handle.remove()
    assert gatelens.verify(lstm, x).passed  # removed: read as before


def test_a_verdict_on_a_stack_that_drops_units_at_random_is_refused() -> None:
    """In training mode with dropout between layers the call is random: verify said
    "passed ... stays on the module's trajectory" while lstm(x) was 0.07 away."""
    torch.manual_seed(0)
    lstm, x = nn.LSTM(3, 8, num_layers=2, dropout=0.5, batch_first=True), torch.randn(2, 6, 3)
    with torch.no_grad():
        assert (lstm(x)[0] - lstm.eval()(x)[0]).abs().max() > 1e-2
    lstm.train()
    with pytest.raises(GatelensError, match=r"^verify\(\): LSTM is in training mode with "
                                            r"dropout 0.5 between its 2 layers"):
        gatelens.verify(lstm, x)
    assert gatelens.verify(lstm.eval(), x).passed
    one = nn.LSTM(3, 8, num_layers=1, batch_first=True).train()  # no dropout applies
    assert gatelens.verify(one, x).passed


def test_no_hook_no_own_call_and_gatelens_hooks_are_not_users() -> None:
    lstm, x = _lstm(), torch.randn(2, 4, 3)
    assert "hooks" not in gatelens.trace(lstm, x).meta
    with gatelens.open_cells(lstm):
        assert user_hooks(lstm) == []


def test_lens_on_a_pre_hooked_module_measures_what_the_forward_received() -> None:
    """Lens already runs the model (hooks fire); its captured call is not hooked twice."""
    torch.manual_seed(4)

    class LM(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.embed = nn.Embedding(6, 5)
            self.lstm = nn.LSTM(5, 8, batch_first=True)
            self.head = nn.Linear(8, 6)

        def forward(self, ids: torch.Tensor) -> torch.Tensor:
            return self.head(self.lstm(self.embed(ids))[0])

    model = LM()
    model.lstm.register_forward_pre_hook(triple)
    ids = torch.randint(0, 6, (2, 20))
    a = gatelens.Lens(model, vocab=6).analyze(ids, perturb_pos=4, exponents=0,
                                                  fixed_points=False).analyses["lstm"]
    with torch.no_grad():
        out = model.lstm(model.embed(ids))[0]
    assert a.verification.passed
    assert (a.trace["layer0.h"] - out).abs().max() < 1e-6
