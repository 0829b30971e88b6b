"""Files a user hands back are validated before use (issue: "every file a user hands in is
validated"): a config.json edited by hand, a Lens vocabulary, a trial.json, a
page_data.json. Each wrong type is one line naming the file and the key, exit 2."""

from __future__ import annotations

import json
import shutil
import sys
from pathlib import Path

import pytest
import torch

from gatelens import Lens, load_run
from gatelens.cli import main
from gatelens.errors import GatelensError
from gatelens.schema_check import check_chars, check_fields, describe, is_kind

sys.path.insert(0, str(Path(__file__).parent))  # the shared CLI helpers (importlib mode)
from cli_helpers import SMALL, one_line  # noqa: E402

TEXT = "\n".join(" ".join(("a", "bc", "de", "fgh")[(i + k) % 4] for k in range(9))
                 for i in range(200))


@pytest.fixture(scope="module")
def seed_run(tmp_path_factory):
    d = tmp_path_factory.mktemp("schemas")
    (d / "tiny.txt").write_text(TEXT, encoding="utf-8")
    assert main(["train", "--corpus", str(d / "tiny.txt"), *SMALL, "--out", str(d / "run")]) == 0
    return d / "run"


def edited(seed_run: Path, tmp_path: Path, edit) -> Path:
    run = tmp_path / "run"
    shutil.copytree(seed_run, run)
    cfg = json.loads((run / "config.json").read_text())
    edit(cfg)
    (run / "config.json").write_text(json.dumps(cfg))
    return run


def _set(block, key, value):
    def edit(cfg):
        (cfg if block is None else cfg[block])[key] = value
    return edit


@pytest.mark.parametrize("block, key, value, says", [
    ("train", "seed", None, '"train.seed" must be an integer, got None'),
    ("train", "seed", "x", '"train.seed" must be an integer, got \'x\''),
    ("train", "seed", 2**70, '"train.seed" must be an integer from -2**63'),
    ("train", "forget_bias", "x", '"train.forget_bias" must be a finite number or null'),
    ("train", "corpus", None, '"train.corpus" must be a string, got None'),
    (None, "corpus", None, '"corpus" must be an object, got None'),
    ("corpus", "name", 3, '"corpus.name" must be a string, got 3'),
    ("train", "lr", -1.0, '"train.lr" must be a positive finite number'),
    ("best", "val_loss", "low", '"best.val_loss" must be a finite number or null'),
    (None, "vocab", ["a", 5], "entry 1 is 5, not a single character"),
    # sizes no model has: a C++ stack as the message, or 2**70 layers built forever, before
    ("model", "hidden", 2**70, "--hidden must be at most 1048576, got 1180591620717411303424"),
    ("model", "layers", 2**70, "--layers must be at most 1024, got 1180591620717411303424"),
    ("model", "embed", 2**62, "--embed must be at most 1048576, got 4611686018427387904"),
])
def test_config_json_edited_by_hand(capsys, seed_run, tmp_path, block, key, value, says):
    run = edited(seed_run, tmp_path, _set(block, key, value))
    with pytest.raises(GatelensError) as e:
        load_run(run)
    assert str(e.value).startswith(str(run / "config.json") + ": ") and says in str(e.value)
    for cmd in (["analyze", str(run), "--out", str(tmp_path / "a")], ["sample", str(run)],
                ["verify", str(run)]):
        line = one_line(capsys, cmd)  # exit 2, one line, no traceback
        assert "config.json" in line and says in line, (cmd, line)
    assert not (tmp_path / "a").exists()


def test_config_json_as_written_loads(seed_run):
    run = load_run(seed_run)
    assert run.seed == 0 and len(run.vocab) > 3


def test_a_corpus_is_read_only_with_its_sha256(capsys, seed_run, tmp_path):
    """A config.json that names another file as its corpus and drops the hash it would have
    to match: gatelens reads no file it cannot check (its windows would be published)."""
    secret = tmp_path / "secret.txt"
    secret.write_text(TEXT.replace("a", "b"), encoding="utf-8")  # in the run's vocabulary

    def elsewhere(cfg):
        cfg["corpus"].update(name=str(secret), source=str(secret))
        del cfg["corpus"]["sha256"]
    run = edited(seed_run, tmp_path, elsewhere)
    line = one_line(capsys, ["analyze", run, "--windows", "2", "--length", "24",
                             "--perturb-pos", "8", "--out", tmp_path / "a"])
    assert f'{run / "config.json"}: "corpus.sha256" is missing' in line and "--text" in line
    assert not (tmp_path / "a").exists()


@pytest.mark.parametrize("kind, says", [
    ("bytes", "not UTF-8 (invalid byte 0xff"),
    ("step", 'line 3: "step" must be an integer, got \'x\''),
    ("loss", 'line 2: "val_loss" must be a number, got \'low\''),
    ("field", "not a gatelens history.csv (field larger than field limit"),
    ("device", "not a regular file (a device, FIFO or socket)"),
])
def test_history_csv_edited_by_hand(capsys, seed_run, tmp_path, kind, says):
    """history.csv is checked before any work: a device was read forever (memory), bad
    UTF-8 or a 200 kB field were tracebacks, a bad step one after the analysis."""
    run = tmp_path / "run"
    shutil.copytree(seed_run, run)
    path = run / "history.csv"
    rows = path.read_text().splitlines()
    path.unlink()
    if kind == "device":
        path.symlink_to("/dev/zero")
    else:
        bad = {"bytes": "2,\udcff,,0.1", "step": "x,1.0,,0.1", "loss": "0,,low,0.1",
               "field": "3," + "9" * 200_000}[kind]
        rows[2 if kind in ("step", "bytes", "field") else 1] = bad
        path.write_bytes("\n".join(rows).encode("utf-8", "surrogateescape"))
    with pytest.raises(GatelensError) as e:
        load_run(run)
    assert str(e.value).startswith(f"{path}: ") and says in str(e.value), str(e.value)
    if kind == "step":
        line = one_line(capsys, ["analyze", run, "--out", tmp_path / "a"])
        assert line == f"gatelens: error: {e.value}"
        assert not (tmp_path / "a").exists()


@pytest.mark.parametrize("vocab, says", [
    (["a", "b", 5], "Lens(vocab=...): entry 2 is 5, not a single character"),
    (["a", "b", "a"], "Lens(vocab=...): character 'a' appears twice (entries 0 and 2)"),
    (["a", ""], "Lens(vocab=...): entry 1 is '', not a single character"),
    ("abca", "Lens(vocab=...): character 'a' appears twice (entries 0 and 3)"),
    ({"a": 0}, "Lens(vocab=...) takes a list of characters or their number; got dict"),
])
def test_lens_vocabulary_is_the_cli_rule(vocab, says):
    lstm = torch.nn.LSTM(3, 4, batch_first=True)
    with pytest.raises(GatelensError) as e:
        Lens(lstm, vocab)
    assert str(e.value) == says


def test_lens_vocabulary_in_tokens_takes_strings():
    lstm = torch.nn.LSTM(3, 4, batch_first=True)
    assert Lens(lstm, ["the", " cat", "the"], unit="tokens").vocab == ["the", " cat", "the"]
    with pytest.raises(GatelensError, match=r"entry 1 is 7, not a non-empty string"):
        Lens(lstm, ["the", 7], unit="tokens")
    with pytest.raises(GatelensError, match=r"entry 2 is '', not a non-empty string"):
        Lens(lstm, ["the", "a", ""])
    lens = Lens(lstm, ["a", "bc"])  # a longer entry: a token vocabulary, said as tokens
    assert lens.unit == "tokens" and lens.vocab == ["a", "bc"]
    with pytest.raises(GatelensError, match=r"entry 1 is 'bc', not a single character"):
        Lens(lstm, ["a", "bc"], unit="characters")


def test_the_rule_itself():
    assert is_kind(3, "int") and not is_kind(True, "int") and not is_kind(3.0, "int")
    assert is_kind(2.5, "number") and not is_kind(float("inf"), "number")
    assert is_kind("sgd", ("adam", "sgd")) and not is_kind("x", ("adam", "sgd"))
    assert describe(("int", None)) == "an integer or null"
    check_fields({"a": 1, "other": object()}, {"a": ("int",), "b": ("str",)}, "f.json")
    with pytest.raises(GatelensError, match=r'^f.json: "b" is missing$'):
        check_fields({}, {"b": ("str",)}, "f.json", required=("b",))
    with pytest.raises(GatelensError, match=r"^v: expected a non-empty list"):
        check_chars([], "v")


@pytest.mark.parametrize("key, value, says", [
    ("status", 3, '"status" must be one of "pending", "running", "done", "failed", got 3'),
    ("status", "finished", '"status" must be one of'),
    ("checkpoints", {"step": 0}, '"checkpoints" must be a list'),
    ("checkpoints", [{"step": "0", "report": "r.json"}], '"checkpoints[0].step" must be an '
     "integer, got '0'"),
    ("checkpoints", [{"report": "r.json"}], '"checkpoints[0].step" is missing'),
    ("checkpoints", ["r.json"], '"checkpoints[0]" must be an object'),
    ("spec", None, '"spec" must be an object, got None'),
    ("seconds", "fast", '"seconds" must be a finite number or null'),
])
def test_trial_json_edited_by_hand(tiny_text, tmp_path, key, value, says):
    from gatelens.studies.spec import parse_spec
    from gatelens.studies.study import new_record, plan

    spec = parse_spec({"grid": {"seed": [0]}, "train": {"corpus": str(tiny_text), "hidden": 4},
                       "analysis": {"windows": 2, "length": 24, "perturb_pos": 8}})
    rec = {**new_record(spec.trials[0]), "status": "done",
           "checkpoints": [{"step": 0, "val_loss": 1.5, "report": "trials/x/r.json"}],
           key: value}
    path = tmp_path / "trials" / rec["id"] / "trial.json"
    path.parent.mkdir(parents=True)
    path.write_text(json.dumps(rec))
    with pytest.raises(GatelensError) as e:
        plan(spec, tmp_path)
    assert str(e.value).startswith(f"{path}: ") and says in str(e.value)
    path.write_text("[1, 2]")
    with pytest.raises(GatelensError, match=r"not a trial record \(not a JSON object\)"):
        plan(spec, tmp_path)


@pytest.fixture(scope="module")
def analysis_dir(seed_run, tmp_path_factory):
    out = tmp_path_factory.mktemp("page") / "a"
    assert main(["analyze", str(seed_run), "--windows", "2", "--length", "24",
                 "--perturb-pos", "8", "--exponents", "0", "--out", str(out), "--quiet"]) == 0
    return out


@pytest.mark.parametrize("name, key, value, says", [
    ("page_data.json", "title", ["x"], '"title" must be a string'),
    ("page_data.json", "meta", None, '"meta" must be an object, got None'),
    ("page_data.json", "texts", None, '"texts" must be a list'),
    ("report.json", "model", [], '"model" must be an object, got []'),
    ("report.json", "gates", 1.5, '"gates" must be an object or null'),
])
def test_page_files_edited_by_hand(capsys, analysis_dir, tmp_path, name, key, value, says):
    out = tmp_path / "a"
    shutil.copytree(analysis_dir, out)
    data = json.loads((out / name).read_text())
    assert key in data, sorted(data)  # the key a reader uses is there as written
    data[key] = value
    (out / name).write_text(json.dumps(data))
    page = (out / "report.html").read_bytes()
    line = one_line(capsys, ["report", out])
    assert line.startswith(f"gatelens: error: {out / name}: ") and says in line, line
    assert (out / "report.html").read_bytes() == page  # nothing written over


def test_page_files_as_written_rebuild(capsys, analysis_dir, tmp_path):
    out = tmp_path / "a"
    shutil.copytree(analysis_dir, out)
    assert main(["report", str(out)]) == 0


def test_run_windows_that_overlap_are_said_and_too_many_refused(capsys, seed_run, tmp_path):
    run = load_run(seed_run)
    ids, source = run.windows(2, 24)
    assert ids.shape == (2, 24) and "overlap" not in source
    ids, source = run.windows(40, 24)  # more than the validation split holds side by side
    assert ids.shape == (40, 24) and "; the windows overlap: " in source
    assert len({tuple(r) for r in ids.tolist()}) > 1
    line = one_line(capsys, ["analyze", seed_run, "--windows", str(2**70), "--out",
                             tmp_path / "a"])
    assert "distinct windows of 128, not 1180591620717411303424" in line
    assert not (tmp_path / "a").exists()
