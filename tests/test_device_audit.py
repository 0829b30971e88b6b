"""What a GPU run would leave on the CPU, found on the CPU (tests/device_audit.py).

No GPU is lent to the test machines. ``DeviceAudit`` marks every tensor made on the CPU
(``torch.zeros(n)`` with no device, ``.cpu()``, ``torch.from_numpy``) and lists each operation
that would read one beside a tensor on the model's device: what CUDA refuses with "Expected
all tensors to be on the same device". Every registered family's analysis, edited runs and
activation patching run under it, inside a whole model; a family that computes on the CPU
only (``Family.cpu_only``) refuses another device in one line instead.
"""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np
import pytest
import torch

import gatelens
from gatelens.errors import GatelensError
from gatelens.families.registry import family_classes
from gatelens.families.spec import layer_name

sys.path.insert(0, str(Path(__file__).parent))  # the shared helpers (importlib mode)
from device_audit import DeviceAudit  # noqa: E402
from test_open_cells_families import VOCAB, whole_model  # noqa: E402

pytestmark = pytest.mark.usefixtures("one_thread")

ELSEWHERE = [c.name for c in family_classes() if c.cpu_only is None]
CPU_ONLY = [c.name for c in family_classes() if c.cpu_only is not None]


def test_the_audit_finds_what_cuda_would_refuse_and_nothing_else() -> None:
    w = torch.randn(3, 3)  # made before: on the device
    with DeviceAudit() as audit:
        w @ torch.ones(3, device=w.device)  # beside w
        w @ torch.ones(3).to(audit.device)  # moved there
        w * torch.tensor(2.0)  # a 0-dimensional CPU tensor is a scalar to CUDA
        w[torch.tensor([0, 2])] = torch.zeros(2, 3)  # indexing and writes cross devices
        w.cpu()[0] + torch.ones(3)  # both on the CPU
        w @ torch.ones(3)  # 1: a factory with no device
        w + w.cpu()  # 2: .cpu()
        w[0] - torch.from_numpy(np.ones(3, dtype=np.float32))  # 3: from numpy
        torch.cat([w, torch.zeros_like(w.cpu())])  # 4: beside a CPU tensor
        w @ torch.ones(3, device="cpu")  # 5: "cpu" said
        w.cpu().numpy(), w.numpy(force=True)  # numpy of a CPU tensor, or copied there
        w.numpy(), np.asarray(w)  # 6, 7: numpy of the device's
        gen = torch.Generator().manual_seed(0)
        torch.randn(3, generator=gen).to(w.device)  # drawn on the CPU, then moved
        torch.randn(3, generator=gen, device=w.device)  # 8: a CPU generator on the device
    assert [m.op for m in audit.mixes] == ["matmul", "add", "sub", "cat", "matmul", "numpy",
                                           "__array__", "randn"]
    here = Path(__file__).name
    assert all(m.at.startswith(here) for m in audit.mixes)
    assert all(m.made_at.startswith(here) for m in audit.mixes[:5])
    assert str(audit.mixes[-2]).endswith("reads a tensor on the device as a numpy array")
    assert str(audit.mixes[-1]).endswith("draws on the device with a CPU generator")
    assert "reads a CPU tensor made at" in str(audit.mixes[0])
    assert audit.on_cpu(torch.from_numpy(np.ones(2))) is None  # torch.from_numpy is restored


@pytest.mark.parametrize("name", ELSEWHERE)
def test_every_family_s_analysis_and_edits_stay_on_the_model_s_device(name: str,
                                                                      tmp_path) -> None:
    """A token model's analysis (the verification, every measurement, the context used, the
    report and its page), five kinds of edit with values made on the CPU by the user, and
    activation patching, each inside the whole model: no operation reads a CPU tensor
    beside the device's."""
    from gatelens.interventions.patching import patch_sweep

    model, path, _ = whole_model(name)
    lens = gatelens.Lens(model, vocab=VOCAB, unit="tokens", device="cpu")
    key = (f"{path}." if path else "") + f"{layer_name(0)}.{lens.families[path].spec.state}"
    audit = DeviceAudit()
    lens.device = audit.device  # the Lens's device, told apart from the CPU
    with audit:
        ids = torch.randint(0, VOCAB, (2, 12), generator=torch.Generator().manual_seed(1))
        other = torch.randint(0, VOCAB, (2, 12), generator=torch.Generator().manual_seed(2))
        result = lens.analyze(ids, perturb_pos=3, exponents=2, out=tmp_path)
        width = lens.run(ids).trace[key].shape[-1]
        for edit in (gatelens.Zero(key, at=slice(2, 4)), gatelens.Patch(key, source=other, at=5),
                     gatelens.Add(key, value=torch.ones(width), at=7),
                     gatelens.Mean(key, at=8, over=other),
                     gatelens.Scale(key, value=0.5, at=9, units=[0, 1])):
            lens.run(ids, [edit])
        patch_sweep(lens, ids, other, names=[key], positions=[3, 6])
    assert result.reports[path]["verification"]["passed"] is True
    assert audit.on_cpu(ids) is not None  # the user's ids were made on the CPU, and moved
    assert not audit.mixes, "\n".join(sorted({str(m) for m in audit.mixes}))


def test_a_character_model_s_analysis_with_fixed_points_stays_on_the_device(tmp_path) -> None:
    """A character LSTM read from a text (its windows encoded on the CPU), with the fixed
    points, which only the classic cells have, and its report, plots and page written."""
    model, path, _ = whole_model("lstm")
    chars = [chr(ord("a") + i) for i in range(VOCAB)]
    lens = gatelens.Lens(model, vocab=chars, device="cpu")
    audit = DeviceAudit()
    lens.device = audit.device
    with audit:
        result = lens.analyze("abcdefg" * 6, windows=2, length=20, perturb_pos=4,
                              exponents=2, fixed_points=True, out=tmp_path)
    assert result.reports[path]["verification"]["passed"] is True
    assert (tmp_path / path / "report.json").is_file() and (tmp_path / "index.html").is_file()
    assert not audit.mixes, "\n".join(sorted({str(m) for m in audit.mixes}))


@pytest.mark.parametrize("name", CPU_ONLY)
def test_a_family_that_computes_on_the_cpu_only_refuses_another_device(name, monkeypatch):
    model, path, _ = whole_model(name)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    with pytest.raises(GatelensError, match=r"runs on the CPU only: .+; use device cpu"):
        gatelens.Lens(model, vocab=VOCAB, device="cuda")
    assert all(p.device.type == "cpu" for p in model.parameters())  # not moved
