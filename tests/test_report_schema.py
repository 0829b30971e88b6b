"""report.json read back (``gatelens report``, a study's merge) is held to its own schema
(report/schema.json) by gatelens's small validator, which must agree with the jsonschema
package on every variant; a hand-edited nested value is one line naming its dotted key
(before: 60 of 96 nested edits were tracebacks in the page's tables)."""

from __future__ import annotations

import copy
import json
import random
import shutil
import sys
from pathlib import Path

import jsonschema
import pytest

from gatelens.cli import main
from gatelens.errors import GatelensError
from gatelens.report.json_report import read_report, schema
from gatelens.schema_check import check_schema

sys.path.insert(0, str(Path(__file__).parent))  # the shared CLI helpers (importlib mode)
from cli_helpers import one_line  # noqa: E402

VALUES = [None, "x", -1, 0, 0.5, 2.5, [], {}, True, [None], ["x"], {"a": 1}]


@pytest.fixture(scope="module")
def analysis_dir(analysis_of, tmp_path_factory):
    from gatelens.report.write import write_analysis

    out = tmp_path_factory.mktemp("schema") / "a"
    write_analysis(analysis_of("lstm", windows=2, length=24, hidden=6), out, plots=False)
    return out


def _paths(node, path=()):
    yield path
    items = node.items() if isinstance(node, dict) else enumerate(node[:2]) \
        if isinstance(node, list) else ()
    for k, v in items:
        yield from _paths(v, (*path, k))


def _set(report: dict, path: tuple, value) -> dict:
    out = copy.deepcopy(report)
    node = out
    for k in path[:-1]:
        node = node[k]
    node[path[-1]] = value
    return out


def test_the_validator_agrees_with_jsonschema(analysis_dir):
    report = json.loads((analysis_dir / "report.json").read_text())
    full = schema()
    check_schema(report, full, "r")  # as written
    reference = jsonschema.Draft202012Validator(full)
    cases = [(p, v) for p in list(_paths(report))[1:] for v in VALUES]
    refused = 0
    for path, value in random.Random(0).sample(cases, 400):  # all 5,054: 0 disagree
        variant = _set(report, path, value)
        try:
            check_schema(variant, full, "r")
            got = True
        except GatelensError:
            got, refused = False, refused + 1
        assert reference.is_valid(variant) == got, (path, value)
    assert 100 < refused < 400  # both verdicts were tried


@pytest.mark.parametrize("path, value, says", [
    (("perturbation", "lags"), -1, '"perturbation.lags" must be a list, got -1'),
    (("perturbation", "lags", 0), 0, '"perturbation.lags[0]" must be at least 1, got 0'),
    (("causal",), "x", '"causal" must be an object or null, got \'x\''),
    (("verification", "passed"), [None], '"verification.passed" must be true or false'),
    (("units", "half_life"), {"min": 1}, '"units.half_life.median" is missing'),
])
def test_report_json_edited_by_hand_is_one_line(capsys, analysis_dir, tmp_path, path, value,
                                                says):
    out = tmp_path / "a"
    shutil.copytree(analysis_dir, out)
    report = json.loads((out / "report.json").read_text())
    (out / "report.json").write_text(json.dumps(_set(report, path, value)))
    page = (out / "report.html").read_bytes()
    line = one_line(capsys, ["report", out])
    assert line == f"gatelens: error: {out / 'report.json'}: {says}" or (
        line.startswith(f"gatelens: error: {out / 'report.json'}: ") and says in line), line
    assert (out / "report.html").read_bytes() == page
    with pytest.raises(GatelensError, match=f"^{out / 'report.json'}: "):
        read_report(out / "report.json")


def test_an_older_report_that_does_not_render_is_one_line(capsys, analysis_dir, tmp_path):
    out = tmp_path / "a"
    shutil.copytree(analysis_dir, out)
    report = json.loads((out / "report.json").read_text())
    old = _set(_set(report, ("version",), 3), ("causal",), "x")  # no schema holds a v3 here
    (out / "report.json").write_text(json.dumps(old))
    line = one_line(capsys, ["report", out])
    assert line.startswith(f"gatelens: error: {out / 'report.json'}: not a report gatelens "
                           "can render (AttributeError: ")
    assert main(["report", str(analysis_dir)]) == 0


@pytest.mark.parametrize("text, says", [
    ("{", "not a gatelens report (JSONDecodeError)"),
    ("[]", "not a gatelens report (not a JSON object)"),
    ('{"version": 3, "control_losses": {"best_loss": 1}}',
     '"control_losses.memoryless_loss" is missing'),
    ('{"version": 3, "units": {"per_unit": 3}}', '"units.per_unit" must be a list or null'),
])
def test_a_study_reads_its_trials_reports_checked(tmp_path, text, says):
    path = tmp_path / "report.json"
    path.write_text(text)
    with pytest.raises(GatelensError) as e:
        read_report(path)
    assert str(e.value).startswith(f"{path}: ") and says in str(e.value)
