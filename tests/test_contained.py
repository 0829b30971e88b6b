"""Every path stays inside what the user named (issue 26, part 4): ``gatelens report``
embeds only PNG plots under the analysis, ``study --reuse`` and a study's merge never
follow a trial.json's report path out, a module registered under a hostile name is
written inside Lens.analyze's ``out``, and a study says when its corpus lies outside the
SPEC's directory. Each case checks that nothing outside was read or written."""

from __future__ import annotations

import base64
import json
import os
from pathlib import Path

import pytest
import torch
from torch import Tensor, nn

import gatelens
from gatelens.cli import main
from gatelens.errors import GatelensError
from gatelens.report.html_data import MAX_PLOT_BYTES, PNG_SIGNATURE
from gatelens.report.write import write_analysis
from gatelens.studies.merge import trial_figures
from gatelens.studies.spec import load_spec, parse_spec
from gatelens.studies.study import new_record, plan

pytestmark = pytest.mark.usefixtures("one_thread")


def _tree(root: Path) -> dict[str, float]:
    """Every path under ``root`` with its modification time."""
    return {str(p): p.lstat().st_mtime_ns for p in root.rglob("*")}


def test_report_embeds_only_png_plots_inside_the_analysis(tmp_path, analysis_of, capsys):
    out = tmp_path / "analysis"
    a = write_analysis(analysis_of("gru", windows=2, length=24, hidden=6, perturb_pos=4), out)
    secret = tmp_path / "secret.txt"
    secret.write_bytes(b"the ssh key")
    outside = tmp_path / "outside.png"  # a real PNG signature, but not the analysis's
    outside.write_bytes(PNG_SIGNATURE + b"outside")
    (out / "plots" / "text.png").write_bytes(b"not a png at all")
    (out / "plots" / "link.png").symlink_to(outside)
    with (out / "plots" / "huge.png").open("wb") as f:  # sparse: big on paper only
        f.write(PNG_SIGNATURE)
        f.truncate(MAX_PLOT_BYTES + 1)
    data = json.loads((out / "page_data.json").read_text())
    own = list(data["plot_files"])
    data["plot_files"] = own + [str(secret), "../outside.png", "../../../../etc/hostname",
                                "plots/text.png", "plots/link.png", "plots/huge.png",
                                "report.json", "plots/missing.png"]
    (out / "page_data.json").write_text(json.dumps(data))
    assert main(["report", str(out)]) == 0
    err = capsys.readouterr().err.splitlines()
    assert len(err) == 8 and all(line.startswith("gatelens: note: plot ") for line in err)
    for why in ("an absolute path", "outside the analysis directory", "not a PNG",
                "over 16 MiB", "not a .png file", "missing"):
        assert any(line.endswith(why) for line in err), why
    page = (out / "report.html").read_text()
    assert page.count("data:image/png;base64,") == len(own) == len(a.plots) >= 4
    for leaked in (b"the ssh key", PNG_SIGNATURE + b"outside"):
        assert base64.b64encode(leaked).decode()[:12] not in page


def test_report_refuses_plot_files_that_are_not_a_list(tmp_path, analysis_of, capsys):
    out = tmp_path / "a"
    write_analysis(analysis_of("rnn_tanh", windows=2, length=24, hidden=4, perturb_pos=4),
                   out, plots=False)
    for bad in ("/etc/hostname", [1, 2], {"a": "b"}):
        data = json.loads((out / "page_data.json").read_text())
        (out / "page_data.json").write_text(json.dumps({**data, "plot_files": bad}))
        assert main(["report", str(out)]) == 2
        err = capsys.readouterr().err
        assert err.count("\n") == 1 and "page_data.json: plot_files must be a list" in err
    (out / "page_data.json").write_text("[1]")
    assert main(["report", str(out)]) == 2
    assert "page_data.json: expected a JSON object" in capsys.readouterr().err


TRAIN = {"hidden": 8, "steps": 4, "eval_every": 2, "batch": 4, "seq": 24, "val_windows": 4}


def _finished_elsewhere(tmp_path: Path, report: object) -> tuple:
    spec = parse_spec({"grid": {"seed": [0]}, "train": TRAIN})
    other = tmp_path / "other"
    tdir = other / "trials" / spec.trials[0].id
    (tdir / "run").mkdir(parents=True)
    rec = {**new_record(spec.trials[0]), "status": "done",
           "checkpoints": [{"step": 4, "val_loss": 1.0, "report": report}]}
    (tdir / "trial.json").write_text(json.dumps(rec))
    return spec, other


@pytest.mark.parametrize("report", ["trials/seed-0/../../../secret/report.json",
                                    "/etc/hostname", "../../secret/report.json", 7])
def test_reuse_never_follows_a_report_path_out_of_the_other_study(tmp_path, report):
    secret = tmp_path / "secret"
    secret.mkdir()
    (secret / "report.json").write_text("{}")
    spec, other = _finished_elsewhere(tmp_path, report)
    out = tmp_path / "study"
    out.mkdir()
    with pytest.raises(GatelensError, match=r"^--reuse .*trial.json: checkpoints\[0\]\.report "
                                            r".* is not a path inside "):
        plan(spec, out, reuse=[other])
    assert list(out.iterdir()) == []  # nothing copied


def test_reuse_copies_no_symbolic_link(tmp_path):
    spec, other = _finished_elsewhere(tmp_path, "trials/seed-0/analysis/step-000004/report.json")
    (tmp_path / "secret.txt").write_text("the ssh key")
    run = other / "trials" / "seed-0" / "run"
    (run / "config.json").write_text("{}")
    (run / "key").symlink_to(tmp_path / "secret.txt")
    out = tmp_path / "study"
    reused, todo = plan(spec, out, reuse=[other])
    assert todo == [] and reused[0]["how"] == "copied"
    copied = out / "trials" / "seed-0" / "run"
    assert (copied / "config.json").is_file() and not os.path.lexists(copied / "key")


@pytest.mark.parametrize("report", ["../../etc/hostname", "/etc/hostname", None])
def test_the_merge_reads_no_report_outside_the_study(tmp_path, report):
    rec = {"id": "seed-0", "checkpoints": [{"step": 4, "report": report}]}
    with pytest.raises(GatelensError, match=r"seed-0/trial.json: checkpoints\[0\]\.report "):
        trial_figures(rec, tmp_path / "study")


CHARS = list("ab c")


class Hostile(nn.Module):
    """Two LSTMs registered under names no add_module would take: an absolute path and a
    path climbing out of ``out`` (``_modules`` is a plain dict)."""

    def __init__(self, names: list[str]) -> None:
        super().__init__()
        self.names = names
        self.embed = nn.Embedding(len(CHARS), 4)
        for name in names:
            self._modules[name] = nn.LSTM(4, 4, batch_first=True)
        self.head = nn.Linear(4, len(CHARS))

    def forward(self, ids: Tensor) -> Tensor:
        h = self.embed(ids)
        for name in self.names:
            h = self._modules[name](h)[0]
        return self.head(h)


def test_lens_writes_hostile_module_names_inside_out(tmp_path):
    absolute, up = str(tmp_path / "abs" / "x"), "../../up"
    torch.manual_seed(0)
    ids = torch.randint(0, len(CHARS), (2, 24), generator=torch.Generator().manual_seed(0))
    out, before = tmp_path / "o", _tree(tmp_path)
    result = gatelens.Lens(Hostile([absolute, up, "a/b"]), vocab=CHARS).analyze(
        ids, perturb_pos=6, out=out)
    assert {k for k in _tree(tmp_path) if not k.startswith(str(out))} == set(before)
    dirs = sorted(p.name for p in out.iterdir() if p.is_dir())
    assert len(dirs) == 3 and all("/" not in d and not d.startswith(".") for d in dirs)
    assert all((out / d / "report.json").is_file() for d in dirs)
    index = (out / "index.html").read_text()
    assert all(f'href="{d}/report.html"' in index for d in dirs)
    assert set(result.analyses) == {absolute, up, "a/b"}


def _spec_file(tmp_path: Path, corpus: Path) -> Path:
    spec = tmp_path / "spec" / "s.toml"
    spec.parent.mkdir(exist_ok=True)
    train = "".join(f"{k} = {v}\n" for k, v in TRAIN.items())
    spec.write_text(f'[grid]\nseed = [0]\n[train]\ncorpus = "{corpus}"\n{train}'
                    '[analysis]\nwindows = 2\nlength = 24\nperturb_pos = 8\n')
    return spec


@pytest.mark.parametrize("quiet", [False, True])
def test_a_corpus_outside_the_spec_directory_is_said_at_start_up(tmp_path, tiny_text,
                                                                 monkeypatch, capsys, quiet):
    import gatelens.studies.study as study

    monkeypatch.setattr(study, "_import_ray", lambda: None)
    monkeypatch.setattr(study, "_estimate", lambda todo, workers, out: "about 1 s")
    monkeypatch.setattr(study, "run_ray", lambda todo, out, **kw: [
        {**new_record(t), "status": "failed", "error": "not run"} for t in todo])
    inside = tmp_path / "spec" / "corpus.txt"
    for corpus, said in ((tiny_text, True), (inside, False)):
        inside.parent.mkdir(exist_ok=True)
        inside.write_text(tiny_text.read_text())
        spec = load_spec(_spec_file(tmp_path, corpus))
        study.run_study(spec, tmp_path / f"study-{said}", workers=1, progress=not quiet)
        err = capsys.readouterr().err
        line = f"corpus {tiny_text} is outside {tmp_path / 'spec'}/ (its windows are published"
        assert (line in err) == said, err
        if said and quiet:
            assert err.startswith(f"gatelens study: note: {line}")
