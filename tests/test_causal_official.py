"""The return path cut, the state ablation and attribution patching on the official
families and the variant cells (issue 28, "attribution patching and the return path cut
for the official families"): the cut run's curve equals the forget-only curve of the
split, the state ablation's KL at p by hand, and attribution against a central finite
difference, each through the family's own edited step."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch
from torch import Tensor

import gatelens
from gatelens.interventions.metrics import metric_value
from gatelens.lens.lens import output_logits

sys.path.insert(0, str(Path(__file__).parent))  # the shared builders (importlib mode)
from test_open_cells_families import VOCAB, whole_model  # noqa: E402

pytestmark = [pytest.mark.usefixtures("one_thread"),
              pytest.mark.filterwarnings("ignore:.*torch.jit.*:DeprecationWarning")]

P = 3


def ids_of(B: int = 3, T: int = 10, seed: int = 0) -> Tensor:
    return torch.randint(0, VOCAB, (B, T), generator=torch.Generator().manual_seed(seed))


def lens_of(name: str, dtype: torch.dtype = torch.float32):
    model, path, _ = whole_model(name)
    return gatelens.Lens(model.to(dtype), vocab=VOCAB), path


#: transformers' Mamba-2 (its Mamba-1 is cut in tests/test_official_lens.py's analyze),
#: RWKV-4 and xLSTM, xlstm's mixed stack (an sLSTM's stabiliser), the delta rule (a keep
#: operator), RWKV-7, mingru-pytorch and a peephole LSTM
CUT = ["hf-mamba2", "hf-rwkv", "xlstm-mixed", "hf-gated-deltanet", "rwkv7", "mingru-pytorch",
       "variant_lstm", "hf-xlstm"]


@pytest.mark.parametrize("name", CUT)
def test_the_return_cut_is_the_forget_only_curve(name):
    """Every letter but the state and the output (and the write e_t = s_t − A_t(s_{t−1})) at
    its clean value from p + 1 on: δs evolves by the clean keep alone, so each layer's
    curve is its forget-only curve, to float rounding; the uncut run keeps its return
    path (two layers; one xLSTM block has none: its transition reads no state)."""
    lens, path = lens_of(name)
    cut = gatelens.return_cut(lens, ids_of(), p=P, path=path)
    assert cut.max_abs_diff < 1e-6 and cut.max_abs_residual < 1e-5, cut.to_dict()
    gap = max(abs(a - b) for a, b in zip(cut.pooled.uncut, cut.pooled.forget_only,
                                         strict=True))
    assert (gap < 1e-5) if name == "hf-xlstm" else (gap > 1e-3), gap


def test_the_state_ablation_of_an_official_family_by_hand():
    lens, path = lens_of("hf-mamba2")
    ids = ids_of(4)
    ab = gatelens.state_ablation(lens, ids, p=P, path=path)
    assert ab.parts == ["s"]
    keys = [f"{path}.layer{k}.s" for k in range(2)]
    clean = lens.run(ids)
    edits = [gatelens.Set(k, clean.trace[k][:, P].double().mean(0), at=P) for k in keys]
    a, b = (output_logits(r.output)[:, P].double() for r in (clean, lens.run(ids, edits)))
    kl = (a.softmax(-1) * (a.log_softmax(-1) - b.log_softmax(-1))).sum(-1).mean()
    assert ab.kl_at_p == pytest.approx(float(kl), rel=1e-6, abs=1e-12)
    assert ab.kl_at_p > 1e-9
    rwkv, path = lens_of("hf-rwkv")  # RWKV-4's output at p reads the state before p
    assert gatelens.state_ablation(rwkv, ids, p=P, path=path).kl_at_p < 1e-12


#: families whose whole forward is float64 once cast, one of each kind of step: the Mamba
#: cell (mambapy's; transformers' shares it, but its RMSNorm rounds in float32 even in a
#: float64 model), RWKV-4, the mLSTM's live stabiliser, the delta rule, a variant GRU (the
#: rwkv package holds its weights in float32)
EXACT = ["mambapy", "hf-rwkv", "xlstm-mlstm", "hf-gated-deltanet", "variant_gru"]


def _attribution_and_fd(name: str, eps: float, dtype: torch.dtype) -> list[tuple[float, float]]:
    """(attribution, central difference along a_clean − a_corrupt) of layer 0's state at
    three positions, the unit at 2 changed, metric: the clean loss."""
    lens, path = lens_of(name, dtype)
    key = f"{path}.layer0.{lens.families[path].spec.state}".lstrip(".")
    clean = ids_of(2, 8)
    corrupt = clean.clone()
    corrupt[:, 2] = (clean[:, 2] + 1) % VOCAB
    res = gatelens.patch_sweep(lens, clean, corrupt, [key], positions=[1, 3, 6],
                               metric="loss")
    ref, bad = lens.run(clean).trace, lens.run(corrupt).trace
    with torch.no_grad():
        target = output_logits(lens.model(clean))

    def m(edits) -> float:
        out = output_logits(lens.run(corrupt, edits).output)
        return metric_value(gatelens.loss, out, target, clean)

    span, out = res.m_clean - res.m_corrupt, []
    for j, t in enumerate(res.positions):
        d = ref[key][:, t] - bad[key][:, t]
        fd = (m([gatelens.Add(key, eps * d, at=t)]) - m([gatelens.Add(key, -eps * d, at=t)]))
        out.append((float(res.attribution[0, j]), fd / (2 * eps) / span))
    return out


@pytest.mark.parametrize("name", EXACT)
def test_attribution_is_the_gradient_times_the_difference(name):
    pairs = _attribution_and_fd(name, 1e-5, torch.float64)
    assert pairs[0] == (0.0, 0.0) or max(map(abs, pairs[0])) < 1e-12  # before the change
    assert max(abs(a) for a, _ in pairs[1:]) > 1e-4
    for a, fd in pairs:
        assert a == pytest.approx(fd, abs=1e-6 * max(1.0, abs(fd)))


@pytest.mark.parametrize("name", ["hf-mamba2", "hf-gated-deltanet", "xlstm-mixed"])
def test_the_cut_run_by_groups_of_layers_is_the_whole_cut(name, monkeypatch):
    """Above ``CUT_KEPT`` of states the cut runs once per group of layers, each keeping its
    own, and patches the write step by step (``entry_at``): the same rows as one run that
    keeps every layer, figure for figure; the write of one step is ``clean_entry``'s."""
    from gatelens.analysis import causal
    from gatelens.families.official_edit import clean_entry, entry_at

    lens, path = lens_of(name)
    fam, ids = lens.families[path], ids_of()
    chars = [str(i) for i in range(VOCAB)]

    def cut_of() -> dict:
        a = lens.measure(path, ids, chars, perturb_pos=P, exponents=0)
        return a.report["causal"]["return_cut"]

    whole = cut_of()
    groups: list[int] = []
    init = causal._CutStates.__init__
    monkeypatch.setattr(causal._CutStates, "__init__", lambda self, *a: groups.append(
        len(a[3])) or init(self, *a))
    monkeypatch.setattr(causal, "CUT_KEPT", 1)  # every layer a group of its own
    assert cut_of() == whole and groups and set(groups) == {fam.num_layers}
    cap = lens.runner(path)(ids)  # what the module received
    call = fam.check(cap.inputs, cap.state)
    from gatelens.readout.trace import read

    with torch.no_grad():
        clean = read(fam, call, fam.reference(call))
        for k in range(fam.num_layers):
            each = torch.stack([entry_at(fam, clean, k, t) for t in range(ids.shape[1])], 1)
            assert torch.allclose(each, clean_entry(fam, clean, k), rtol=1e-6, atol=1e-7), k
