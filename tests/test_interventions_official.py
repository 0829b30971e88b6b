"""Interventions on transformers' Mamba-1 and Mamba-2 (families/official_edit.py): the
module's own run before the first edit, the hand cell with the edit inside after it,
checked against the package's own decode path from the edited state."""

from __future__ import annotations

import pytest
import torch
import transformers

import gatelens

KINDS = {"mamba": (transformers.MambaConfig, transformers.MambaForCausalLM,
                   dict(state_size=8, expand=2, conv_kernel=4, time_step_min=0.1,
                        time_step_max=0.5)),
         "mamba2": (transformers.Mamba2Config, transformers.Mamba2ForCausalLM,
                    dict(num_heads=4, head_dim=8, state_size=8, expand=2, conv_kernel=4,
                         n_groups=1))}


def model(kind: str, layers: int = 2) -> torch.nn.Module:
    torch.manual_seed(0)
    cfg, cls, kw = KINDS[kind]
    return cls(cfg(vocab_size=20, hidden_size=16, num_hidden_layers=layers, **kw)).eval()


def own_logits(m, ids):
    with torch.no_grad():
        return m(ids, use_cache=False).logits


@pytest.mark.parametrize("kind", KINDS)
def test_before_the_edit_bitwise_and_a_state_set_to_itself_changes_nothing(kind):
    m = model(kind)
    lens, ids = gatelens.Lens(m, vocab=20), torch.randint(0, 20, (2, 12))
    own = own_logits(m, ids)
    s = lens.run(ids).trace["backbone.layer1.s"]
    res = lens.run(ids, edits=[gatelens.Set("backbone.layer1.s", s[:, 5], at=5)])
    assert torch.equal(res.output.logits[:, :5], own[:, :5])
    assert (res.output.logits - own).abs().max() < 1e-5


@pytest.mark.parametrize("kind", KINDS)
def test_a_state_edit_is_the_packages_own_decode_from_the_edited_state(kind):
    """Zero the state after step t: the package's own cached decode, its cache's state
    zeroed after step t, gives the same later logits (one layer: with two, the layer
    above also reads position t's edited output, which the cache's edit cannot give)."""
    m, t = model(kind, layers=1), 5
    lens, ids = gatelens.Lens(m, vocab=20), torch.randint(0, 20, (2, 12))
    res = lens.run(ids, edits=[gatelens.Zero("backbone.layer0.s", at=t)])
    cache, got = transformers.DynamicCache(config=m.config), []
    with torch.no_grad():
        for j in range(ids.shape[1]):
            got.append(m(ids[:, j:j + 1], cache_params=cache, use_cache=True).logits)
            if j == t:
                cache.get_recurrent_state(0).zero_()
    ref = torch.cat(got, dim=1)
    assert torch.equal(res.output.logits[:, :t], own_logits(m, ids)[:, :t])
    later = (res.output.logits[:, t + 1:] - ref[:, t + 1:]).abs().max()
    moved = (own_logits(m, ids)[:, t + 1:] - ref[:, t + 1:]).abs().max()
    assert later < 1e-5 < moved, (later, moved)


@pytest.mark.parametrize("kind", KINDS)
def test_carry_forward_and_this_position_only(kind):
    m = model(kind, layers=1)  # one layer: its conv reads the input, not the state
    lens, ids = gatelens.Lens(m, vocab=20), torch.randint(0, 20, (2, 12))
    own = own_logits(m, ids)
    key, t = "backbone.layer0.s", 4
    carried = lens.run(ids, edits=[gatelens.Scale(key, 3.0, at=t)]).output.logits
    here = lens.run(ids, edits=[gatelens.Scale(key, 3.0, at=t, carry=False)]).output.logits
    assert (carried[:, t + 1:] - own[:, t + 1:]).abs().max() > 1e-4  # later outputs change
    assert (here[:, t] - own[:, t]).abs().max() > 1e-4  # the position's own output changes
    assert (here[:, t + 1:] - own[:, t + 1:]).abs().max() < 1e-5  # the recurrence does not
    assert torch.allclose(here[:, t], carried[:, t])


@pytest.mark.parametrize("kind", KINDS)
def test_a_keep_edit_goes_through_the_cells_equations(kind):
    """a := 0 from t on: the state is only the step's write, s_t = Δ_t·B_t·x_t, so it
    depends on the conv window of inputs alone: the same as a run of the later text with
    a := 0 everywhere, once the windows coincide."""
    m = model(kind, layers=1)
    lens, ids = gatelens.Lens(m, vocab=20), torch.randint(0, 20, (2, 10))
    keep = "backbone.layer0.a"
    tr = lens.run(ids, edits=[gatelens.Zero(keep, at=slice(3, None))]).trace
    later = lens.run(ids[:, 3:], edits=[gatelens.Zero(keep, at=slice(0, None))]).trace
    assert (tr["backbone.layer0.s"][:, 6:] - later["backbone.layer0.s"][:, 3:]).abs().max() < 1e-6
    free = lens.run(ids[:, 3:]).trace["backbone.layer0.s"]  # without the edit it differs
    assert (later["backbone.layer0.s"][:, 3:] - free[:, 3:]).abs().max() > 1e-5
    assert not tr["backbone.layer0.a"][:, 3:].any()


def test_patching_a_mamba_with_its_attribution():
    m = model("mamba2")
    lens = gatelens.Lens(m, vocab=20)
    clean = torch.randint(0, 20, (1, 10))
    corrupt = clean.clone()
    corrupt[0, 3] = (clean[0, 3] + 1) % 20
    res = gatelens.patch_sweep(lens, clean, corrupt,
                               names=[("backbone.layer0.s", "backbone.layer1.s")],
                               metric="kl", attribution=False)
    assert abs(res.effect[0, :3]).max() < 1e-4  # before the change: nothing to patch
    # attribution through the edited steps (against a central difference: mambapy's Mamba
    # cell, tests/test_causal_official.py; transformers' norms round in float32): zero
    # before the change, and ranked like the real patching after it
    res = gatelens.patch_sweep(lens, clean, corrupt, names=["backbone.layer1.s"], metric="kl")
    assert not res.attribution[0, :3].any() and res.spearman > 0.9
    assert res.effect[0, 3:] == pytest.approx(res.attribution[0, 3:], rel=0.2, abs=1e-5)


def test_mambapy_edits_carry_and_this_position_only_does_not():
    import sys
    from pathlib import Path

    from gatelens.families.edit_plan import EditPlan, StepChange

    sys.path.insert(0, str(Path(__file__).parent))
    from official_models import mambapy_stack

    fam, make = mambapy_stack()
    call = make(0)
    with torch.no_grad():
        own = fam.module(call.inputs)

    def scaled(carry: bool):
        ch = StepChange("layer0", "s", frozenset({3}), carry, lambda t, v: 3 * v)
        return fam.intervene(call, EditPlan([ch]), own)[0]

    carried, here = scaled(True), scaled(False)
    assert torch.equal(carried[:, :3], own[:, :3])
    assert (carried[:, 4:] - own[:, 4:]).abs().max() > 1e-5
    tol = 1e-6 * float(own.abs().max())  # float32 rounding of outputs up to ~25
    assert (here[:, 4:] - own[:, 4:]).abs().max() < tol < (here[:, 3] - own[:, 3]).abs().max()
