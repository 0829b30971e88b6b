"""``import gatelens`` never imports the official implementations (gatelens[modern]): a
family imports its package only inside its methods, so every family file imports with the
packages blocked, and each still tells its module apart by class path."""

from __future__ import annotations

import subprocess
import sys

BLOCKED = ("xlstm", "mlstm_kernels", "minGRU_pytorch", "transformers", "mambapy", "einops")

SCRIPT = f"""
import sys
for name in {BLOCKED!r}:
    sys.modules[name] = None  # any import of it raises ImportError
import torch
import gatelens
import gatelens.families.registry as registry
for entry in registry.FAMILIES:
    mod, cls = entry.split(":")
    if "official" in mod or mod.rsplit(".", 1)[1] in (
            "xlstm_slstm", "xlstm_mlstm", "mingru_pytorch", "hf_mamba", "hf_mamba2", "mambapy",
            "hf_rwkv", "hf_rglru", "hf_mamba2_mixers", "hf_kda", "rwkv7", "hf_xlstm",
            "hf_falcon_mamba", "hf_jamba"):
        family = getattr(__import__(mod, fromlist=[cls]), cls)
        assert not family.opens(torch.nn.Linear(2, 2)), cls
print(sorted(n for n in {BLOCKED!r} if sys.modules.get(n) is not None))
"""


def test_import_gatelens_with_the_modern_packages_blocked():
    out = subprocess.run([sys.executable, "-c", SCRIPT], capture_output=True, text=True,
                         timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "[]"
