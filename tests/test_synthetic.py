"""The synthetic long-memory corpora: deterministic text, the gap distribution, the exact
memoryless and best losses against the ideal predictors scored on the text, bad specs, and
a run trained on one end to end.

Tolerances: an empirical mean over a generated text differs from its exact value by
sampling noise only. Its standard error is estimated by batch means (the text cut into 40
consecutive blocks, each much longer than a record or a bracket's span, so the block means
are nearly independent); agreement is asked within 5 standard errors, which a correct
generator misses with probability about 1e-6, while a wrong formula (a wrong key count,
filler count or depth law) is off by many.
"""

from __future__ import annotations

import hashlib
import math

import numpy as np
import pytest

from gatelens.cli import main
from gatelens.errors import GatelensError
from gatelens.lens.run import load_run as load_model
from gatelens.training.corpus import load_corpus
from gatelens.training.runs import read_config
from gatelens.training.synthetic import (
    bracket_gap_pmf,
    bracket_mean_gap,
    bracket_probs,
    bracket_stationary,
    describe_corpus,
    parse_spec,
    synthetic_text,
)
from gatelens.training.synthetic_score import char_losses, gaps

RECALL = "recall:gap=10-200,chars=300000"
BRACKETS = "brackets:chars=300000"
RECALL_SHA = "d915dc6b04ac4d258634629fcf1a3f41c94ded5a2d8299be5a6682dbcb314835"
BRACKETS_SHA = "896349e5a2498235e8cadffb63b8395906e1520f15fe19bc8909bddc00af58c8"


def sha(text: str) -> str:
    return hashlib.sha256(text.encode("utf-8")).hexdigest()


def fresh(spec: str) -> str:
    """Generated again, not from the cache."""
    return synthetic_text.__wrapped__(spec)


def batch_se(values: np.ndarray, batches: int = 40) -> float:
    """Standard error of the mean of ``values`` by batch means."""
    means = np.array([b.mean() for b in np.array_split(values.astype(float), batches)])
    return float(means.std(ddof=1) / math.sqrt(batches))


def test_determinism_and_pinned_text():
    for spec in ("recall:chars=20000", "brackets:chars=20000"):
        text = fresh(spec)
        assert text == fresh(spec) and sha(load_corpus(spec).text) == sha(text)
        other = fresh(spec + ",seed=1")
        assert other != text and len(other) == len(text)
    # The generator is pinned: a change here breaks every run trained on these corpora.
    assert sha(fresh("recall:chars=20000")) == RECALL_SHA
    assert sha(fresh("brackets:chars=20000")) == BRACKETS_SHA


def test_chars_parameter_and_prefix():
    for kind in ("recall", "brackets"):
        short, long = fresh(f"{kind}:chars=777"), fresh(f"{kind}:chars=5000")
        assert len(short) == 777 and len(long) == 5000 and long.startswith(short)
    assert len(synthetic_text("recall")) == 1_000_000  # the default
    assert parse_spec("brackets").name == "brackets:depth=16,types=4,seed=0,chars=1000000,fill=4"


def test_alphabets():
    assert set(fresh("recall:keys=3,fill=2,chars=5000")) == set("ABCab\n")
    assert set(fresh("brackets:types=2,fill=3,chars=5000")) == set("()[]abc")


def test_recall_gaps_match_the_stated_range():
    lo, hi = 10, 200
    d = gaps(RECALL)
    n = len(d)
    assert n > 2000 and d.min() == lo and d.max() == hi
    se = math.sqrt(((hi - lo + 1) ** 2 - 1) / 12 / n)  # the uniform's sd over sqrt(n)
    assert abs(d.mean() - (lo + hi) / 2) < 5 * se
    assert describe_corpus(RECALL)["gap"] == {"distribution": "uniform on the integers 10..200",
                                              "min": 10, "max": 200, "mean": 105.0}
    assert set(gaps("recall:gap=7,chars=3000")) == {7}


def test_bracket_gaps_match_the_exact_distribution():
    pmf = bracket_gap_pmf(16)
    assert abs(pmf.sum() - 1) < 1e-9 and pmf[0] == 0
    assert (pmf * np.arange(len(pmf))).sum() == pytest.approx(bracket_mean_gap(16), rel=1e-9)
    d = gaps(BRACKETS)
    assert d.min() == 1 and len(d) > 100_000
    gap = describe_corpus(BRACKETS)["gap"]
    assert gap["mean"] == pytest.approx(20.0)
    assert abs(d.mean() - gap["mean"]) < 5 * batch_se(d)
    assert abs(np.median(d) - gap["p50"]) <= 1 and abs(np.percentile(d, 90) - gap["p90"]) <= 3


def test_bracket_stationary_is_the_chains_eigenvector():
    for depth in (1, 3, 16):
        p = bracket_probs(depth)
        assert np.allclose(p.sum(1), 1)
        move = np.diag(p[:, 2]) + np.diag(p[:-1, 0], 1) + np.diag(p[1:, 1], -1)
        vals, vecs = np.linalg.eig(move.T)
        pi = np.real(vecs[:, np.argmin(abs(vals - 1))])
        assert np.allclose(bracket_stationary(depth), pi / pi.sum())


def test_recall_exact_losses_by_the_chain_rule():
    """Per record, the best predictor's total loss is -ln P(record) = ln K + ln(HI - LO + 1)
    + (d - 1) ln F; per character, its mean over the mean record length d + 2."""
    for lo, hi, k, f in ((10, 200, 8, 4), (1, 1, 2, 1), (3, 9, 5, 7)):
        desc = describe_corpus(f"recall:gap={lo}-{hi},keys={k},fill={f}")
        length = (lo + hi) / 2 + 2
        best = (math.log(k) + math.log(hi - lo + 1) + ((lo + hi) / 2 - 1) * math.log(f)) / length
        assert desc["best_loss"] == pytest.approx(best, rel=1e-12)
        assert desc["memoryless_loss"] == pytest.approx(best + math.log(k) / length, rel=1e-12)


@pytest.mark.parametrize("spec", [RECALL, BRACKETS, "recall:gap=1-3,keys=3,fill=2,chars=100000",
                                  "brackets:depth=2,types=3,fill=1,seed=5,chars=100000"])
def test_exact_and_empirical_losses_agree(spec):
    memoryless, best = char_losses(spec)
    assert np.isfinite(best).all()  # every character is one the generator could write there
    desc = describe_corpus(spec)
    assert desc["memoryless_loss"] > desc["best_loss"] > 0
    for values, exact in ((memoryless, desc["memoryless_loss"]), (best, desc["best_loss"])):
        assert abs(values.mean() - exact) < 5 * batch_se(values), (spec, values.mean(), exact)


def test_scorer_rejects_texts_the_generator_cannot_write():
    assert np.isinf(char_losses("recall:gap=2-3", "AaB\n")[1][2])  # the wrong key recalled
    assert np.isinf(char_losses("recall:gap=2-3", "Aaaaa")[1]).any()  # the gap past HI
    assert np.isinf(char_losses("brackets", "([)]")[1][2])  # crossed brackets
    assert np.isinf(char_losses("brackets", "a)")[1][1])  # closing at depth 0


def test_describe_corpus():
    d = describe_corpus("recall")
    assert d["name"] == "recall:gap=10-200,seed=0,chars=1000000,keys=8,fill=4"
    assert d["parameters"]["gap"] == [10, 200] and "PCG64(seed=0)" in d["generator"]
    assert set(d) == {"name", "kind", "parameters", "generator", "gap", "memoryless_loss",
                      "best_loss", "units"}
    assert describe_corpus("shakespeare") is None and describe_corpus("notes.txt") is None


def test_a_file_named_like_a_corpus_wins(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "recall").write_text("a text file", encoding="utf-8")
    assert load_corpus("recall").text == "a text file" and describe_corpus("recall") is None


@pytest.mark.parametrize("spec, message", [
    ("recall:gap=300-10", "recall:gap=300-10: gap LO must be <= HI"),
    ("recall:gap=0-10", "recall:gap=0-10: gap=0-10: must be between 1 and"),
    ("recall:gap=0", "recall:gap=0: gap=0: must be between 1 and"),
    ("recall:gap=a-9", "recall:gap=a-9: gap=a-9: not an integer"),
    ("recall:seed=-1", "recall:seed=-1: seed=-1: must be between 0 and"),
    ("recall:seed=1.5", "recall:seed=1.5: seed=1.5: not an integer"),
    ("recall:chars=0", "recall:chars=0: chars=0: must be between 1 and"),
    ("recall:keys=1", "recall:keys=1: keys=1: must be between 2 and 26"),
    ("recall:depth=3", "recall:depth=3: unknown parameter 'depth'"),
    ("brackets:types=5", "brackets:types=5: types=5: must be between 1 and 4"),
    ("brackets:depth=0", "brackets:depth=0: depth=0: must be between 1 and"),
    ("brackets:gap=3", "brackets:gap=3: unknown parameter 'gap'"),
    ("brackets:seed", "brackets:seed: 'seed': expected key=value"),
    ("brackets:seed=1,seed=2", "brackets:seed=1,seed=2: parameter 'seed' given twice"),
])
def test_bad_specs(spec, message):
    with pytest.raises(GatelensError) as err:
        load_corpus(spec)
    assert str(err.value).startswith(message) and "\n" not in str(err.value)


def test_train_on_recall_end_to_end(capsys, tmp_path, monkeypatch, one_thread):
    monkeypatch.chdir(tmp_path)
    spec = "recall:gap=5-20,chars=20000"
    code = main(["train", "--corpus", spec, "--hidden", "8", "--steps", "3", "--batch", "4",
                 "--seq", "16", "--eval-every", "3", "--val-windows", "2", "--quiet",
                 "--out", "run"])
    assert code == 0, capsys.readouterr()
    corpus = read_config("run")["corpus"]
    assert corpus["name"] == spec and corpus["sha256"] == sha(synthetic_text(spec))
    assert corpus["synthetic"] == describe_corpus(spec)
    assert corpus["synthetic"]["best_loss"] < corpus["synthetic"]["memoryless_loss"]
    ids, source = load_model("run").windows(2, 32)  # the sha256 check passes
    assert ids.shape == (2, 32) and source == f"{spec} validation split (2 windows evenly spaced)"
    assert main(["train", "--corpus", "brackets:depth=0", "--out", "bad"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err == ["gatelens: error: brackets:depth=0: depth=0: must be between 1 and 10000"]
