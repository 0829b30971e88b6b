"""The built wheel installs and works without the source tree (issue 30, part 4).

How, offline and in about a minute:

1. ``pyproject.toml``, ``README.md`` and ``src/`` are copied to a temporary directory and
   ``python -m build --no-isolation`` makes the sdist there and then the wheel *from the
   sdist* (so both carry the package data), with the test interpreter's setuptools: no
   download. ``check-wheel-contents`` then checks the wheel.
2. A fresh venv is made with ``python -m venv --without-pip`` (no pip download or copy). A
   ``.pth`` file in its site-packages appends the test interpreter's site-packages
   directories (those on its ``sys.path``), so the dependencies (torch, numpy, ...) import
   without being installed again. Directories holding a ``gatelens`` package (the source
   tree an editable install or ``PYTHONPATH`` puts there) are left out, and a path line of a
   ``.pth`` file only extends ``sys.path``: the ``.pth`` files *inside* that directory (the
   editable install's ``__editable__.gatelens-*.pth`` naming the source tree) are never
   processed, so the source tree cannot leak in. The venv's own site-packages comes first,
   so its gatelens (and its 0.2.0 metadata) wins over any other.
3. The wheel is installed with the outer pip (``pip --python VENV install --no-deps
   --no-index``), which also writes the ``gatelens`` console script into the venv.
4. Every command runs from a directory outside the tree with ``PYTHONPATH`` removed, and
   asserts that ``gatelens.__file__`` lies inside the venv.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
import sysconfig
import zipfile
from pathlib import Path

import pytest

pytestmark = pytest.mark.xdist_group("wheel")  # one build for the module's tests

ROOT = Path(__file__).resolve().parents[1]
#: Files read through importlib.resources or Path(__file__) that the wheel must carry.
PACKAGE_DATA = ["gatelens/py.typed", "gatelens/report/template.html", "gatelens/report/page.js",
                "gatelens/report/page.css", "gatelens/report/schema.json"]


def _env() -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "PYTHONHOME")}
    env["PYTHONNOUSERSITE"] = "1"
    return env


def _run(cmd: list[str], cwd: Path, timeout: float = 300) -> str:
    done = subprocess.run(cmd, cwd=cwd, env=_env(), capture_output=True, text=True,
                          timeout=timeout)
    assert done.returncode == 0, f"{cmd} exited {done.returncode}:\n{done.stdout}\n{done.stderr}"
    return done.stdout


@pytest.fixture(scope="module")
def built(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """dist/ holding the sdist and the wheel built from it."""
    src = tmp_path_factory.mktemp("src")
    for name in ("pyproject.toml", "README.md"):
        shutil.copy(ROOT / name, src / name)
    shutil.copytree(ROOT / "src", src / "src",
                    ignore=shutil.ignore_patterns("__pycache__", "*.egg-info"))
    dist = src / "dist"
    _run([sys.executable, "-m", "build", "--no-isolation", "--outdir", str(dist), str(src)], src)
    return dist


@pytest.fixture(scope="module")
def venv(built: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A fresh venv with only the wheel installed (dependencies through a .pth line)."""
    env_dir = tmp_path_factory.mktemp("venv") / "v"
    _run([sys.executable, "-m", "venv", "--without-pip", str(env_dir)], env_dir.parent)
    py = env_dir / "bin" / "python"
    site = Path(_run([str(py), "-c", "import sysconfig; print(sysconfig.get_path('purelib'))"],
                     env_dir).strip())
    (site / "outer_deps.pth").write_text("".join(f"{d}\n" for d in _dependency_dirs()))
    wheel = next(built.glob("gatelens-*.whl"))
    _run([sys.executable, "-m", "pip", "--python", str(py), "install", "--quiet", "--no-deps",
          "--no-index", str(wheel)], env_dir)
    return env_dir


def _dependency_dirs() -> list[str]:
    """The test interpreter's site-packages directories, less any that hold gatelens."""
    dirs = [sysconfig.get_path("purelib")] + [p for p in sys.path if "-packages" in p]
    keep = []
    for d in dict.fromkeys(dirs):
        if Path(d).is_dir() and not (Path(d) / "gatelens").exists():
            keep.append(d)
    return keep


def _version() -> str:
    found = re.search(r'^version = "([^"]+)"$', (ROOT / "pyproject.toml").read_text("utf-8"), re.M)
    assert found, "pyproject.toml has no version line"
    return found.group(1)


def test_version_is_0_2_0_and_changelog_names_it() -> None:
    assert _version() == "0.2.0"
    assert "## 0.2.0" in (ROOT / "CHANGELOG.md").read_text("utf-8")


def test_sdist_and_wheel_carry_package_data(built: Path) -> None:
    wheel = next(built.glob(f"gatelens-{_version()}-*.whl"))
    assert list(built.glob(f"gatelens-{_version()}.tar.gz"))
    names = set(zipfile.ZipFile(wheel).namelist())
    presets = sorted(p.name for p in (ROOT / "src/gatelens/studies/presets").glob("*.toml"))
    assert presets
    for name in PACKAGE_DATA + [f"gatelens/studies/presets/{p}" for p in presets]:
        assert name in names, f"{name} missing from {wheel.name}"
    assert not [n for n in names if n.startswith(("tests/", "studies/", "docs/"))]
    _run([sys.executable, "-m", "check_wheel_contents", str(wheel)], built)


QUICK_START = """
import json, sys
from pathlib import Path
import torch, gatelens

class CharModel(torch.nn.Module):
    def __init__(self, V):
        super().__init__()
        self.embed = torch.nn.Embedding(V, 8)
        self.lstm = torch.nn.LSTM(8, 12, batch_first=True)
        self.head = torch.nn.Linear(12, V)
    def forward(self, ids):
        return self.head(self.lstm(self.embed(ids))[0])

torch.manual_seed(0)
Path("my_text.txt").write_text("the cat sat on the mat. " * 40, encoding="utf-8")
chars = sorted(set(Path("my_text.txt").read_text(encoding="utf-8")))
lens = gatelens.Lens(CharModel(len(chars)), vocab=chars)
result = lens.analyze("my_text.txt", windows=4, length=32, perturb_pos=8, out="lens_out")
report = result.reports["lstm"]
from gatelens.report.json_report import schema
from gatelens.studies.spec import PRESETS, load_preset
print(json.dumps({"file": gatelens.__file__, "version": gatelens.__version__,
                  "half_life": report["perturbation"]["half_life_measured"],
                  "schema_version": schema()["properties"]["version"],
                  "presets": {p: len(load_preset(p).trials) for p in PRESETS}}))
"""


def test_installed_wheel_runs_cli_quick_start_and_report(venv: Path, tmp_path: Path) -> None:
    bin_dir = venv / "bin"
    help_text = _run([str(bin_dir / "gatelens"), "--help"], tmp_path)
    assert "usage: gatelens" in help_text and "report" in help_text

    out = json.loads(_run([str(bin_dir / "python"), "-c", QUICK_START], tmp_path).splitlines()[-1])
    assert Path(out["file"]).resolve().is_relative_to(venv.resolve()), out["file"]
    assert out["version"] == _version()
    assert out["schema_version"]
    assert set(out["presets"]) >= {"cells", "dynamics", "forget-bias"}
    assert all(n > 0 for n in out["presets"].values())

    page = tmp_path / "lens_out" / "lstm" / "report.html"
    first = page.read_text("utf-8")
    page.unlink()
    printed = _run([str(bin_dir / "gatelens"), "report", "lens_out/lstm"], tmp_path)
    assert "report.html" in printed
    assert page.read_text("utf-8") == first  # the template from the wheel, rebuilt the same
