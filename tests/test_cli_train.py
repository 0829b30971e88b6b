"""The train and sample commands end to end, and every bad input's one-line error."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import pytest
from safetensors.torch import load_file

from gatelens.cli import main
from gatelens.training.runs import read_config

SMALL = ["--hidden", "8", "--steps", "4", "--batch", "4", "--seq", "16", "--eval-every", "2",
         "--val-windows", "2", "--quiet"]


def run_cli(capsys, *argv) -> tuple[int, str, str]:
    code = main([str(a) for a in argv])
    out, err = capsys.readouterr()
    return code, out, err


def test_train_then_sample(capsys, tiny_text, tmp_path):
    code, out, _ = run_cli(capsys, "train", "--corpus", tiny_text, *SMALL, "--out",
                           tmp_path / "r")
    assert code == 0 and "best validation loss" in out
    code, out, _ = run_cli(capsys, "sample", tmp_path / "r", "--length", "40", "--prime", "the",
                           "--seed", "3")
    assert code == 0 and out.startswith("the") and len(out.rstrip("\n")) >= 40
    code, again, _ = run_cli(capsys, "sample", tmp_path / "r", "--length", "40", "--prime",
                             "the", "--seed", "3")
    assert again == out
    cfg = read_config(tmp_path / "r")
    assert cfg["train"]["hidden"] == 8 and cfg["versions"]["torch"]
    assert cfg["vocab"] == sorted(set(tiny_text.read_text()))


def one_line_error(capsys, *argv, match: str) -> None:
    code, out, err = run_cli(capsys, *argv)
    assert code == 2, (out, err)
    lines = err.strip().splitlines()
    assert len(lines) == 1 and "Traceback" not in err, err
    assert match in lines[0], lines[0]


def test_bad_inputs(capsys, tiny_text, tmp_path):
    empty = tmp_path / "empty.txt"
    empty.write_text("")
    short = tmp_path / "short.txt"
    short.write_text("abc" * 10)
    val_short = tmp_path / "val_short.txt"
    val_short.write_text("ab" * 60)  # 120 chars: train 108 >= 17, validation 12 < 17
    latin = tmp_path / "latin1.txt"
    latin.write_bytes("caf\u00e9".encode("latin-1"))
    out = tmp_path / "o"
    one_line_error(capsys, "train", "--corpus", empty, *SMALL, "--out", out, match="empty corpus")
    one_line_error(capsys, "train", "--corpus", short, "--seq", "64", "--out", out,
                   match="corpus too short")
    one_line_error(capsys, "train", "--corpus", val_short, *SMALL, "--out", out,
                   match="validation")
    one_line_error(capsys, "train", "--corpus", latin, *SMALL, "--out", out,
                   match="byte offset 3")
    one_line_error(capsys, "train", "--corpus", tmp_path / "nope.txt", *SMALL, "--out", out,
                   match="nope.txt: no such file")
    one_line_error(capsys, "train", "--corpus", tiny_text, "--hidden", "-3", "--out", out,
                   match="--hidden")
    one_line_error(capsys, "train", "--corpus", tiny_text, "--steps", "0", "--out", out,
                   match="--steps")
    one_line_error(capsys, "train", "--corpus", tiny_text, "--lr", "-1", "--out", out,
                   match="--lr")
    one_line_error(capsys, "train", "--corpus", tiny_text, "--cell", "rnn", "--forget-bias", "1",
                   "--out", out, match="--forget-bias needs a gated cell")
    one_line_error(capsys, "train", "--corpus", tiny_text, "--cell", "rnn", "--chrono", "10",
                   "--out", out, match="--chrono needs a gated cell")
    assert not out.exists()  # nothing was written for a bad input
    one_line_error(capsys, "sample", tmp_path / "missing-run", match="no such run directory")


def test_out_holding_another_run_is_kept(capsys, tiny_text, tmp_path):
    out = tmp_path / "r"
    assert run_cli(capsys, "train", "--corpus", tiny_text, *SMALL, "--out", out)[0] == 0
    before = {p: p.read_bytes() for p in out.rglob("*") if p.is_file()}
    one_line_error(capsys, "train", "--corpus", tiny_text, *SMALL, "--out", out,
                   match="holds another run")
    one_line_error(capsys, "train", "--resume", "--hidden", "9", "--out", out,
                   match="--hidden 9 differs")
    after = {p: p.read_bytes() for p in out.rglob("*") if p.is_file()}
    assert before == after
    one_line_error(capsys, "train", "--resume", "--out", tmp_path / "none", match="--resume")
    one_line_error(capsys, "sample", out, "--prime", "Q", match="'Q' at position 0")


def test_ctrl_c_leaves_a_run_that_resumes_exactly(capsys, tiny_text, tmp_path):
    """A real SIGINT to a real process, then --resume: the same weights as no interruption."""
    args = ["train", "--corpus", str(tiny_text), "--hidden", "16", "--steps", "800", "--batch",
            "8", "--seq", "32", "--eval-every", "200", "--val-windows", "2", "--quiet"]
    cut = tmp_path / "cut"
    env = dict(os.environ, PYTHONWARNINGS="error")
    # a suite started in the background of a shell without job control inherits an ignored
    # SIGINT, which gatelens leaves ignored (stops.may_take); Ctrl-C reaches a terminal's job
    proc = subprocess.Popen([sys.executable, "-m", "gatelens.cli", *args, "--out", str(cut)],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env,
                            preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
    deadline = time.time() + 120
    while not (cut / "checkpoints" / "step-000000.safetensors").exists():
        assert proc.poll() is None and time.time() < deadline, proc.communicate()
        time.sleep(0.05)
    time.sleep(0.5)
    proc.send_signal(signal.SIGINT)
    _, err = proc.communicate(timeout=120)
    if proc.returncode == 0:  # finished before the signal landed: nothing to resume
        pytest.fail("training finished before SIGINT; make the run longer")
    assert proc.returncode == 130, err
    assert "Traceback" not in err and "--resume" in err
    stopped = read_config(cut)["steps_done"]
    assert 0 < stopped < 800
    assert run_cli(capsys, "train", "--resume", "--out", cut, "--quiet")[0] == 0
    assert run_cli(capsys, *args, "--out", tmp_path / "full")[0] == 0
    a = load_file(str(cut / "model.safetensors"))
    b = load_file(str(tmp_path / "full" / "model.safetensors"))
    assert all((a[k] == b[k]).all() for k in a)


def test_no_cuda_is_a_usage_error(capsys, tiny_text, tmp_path):
    import torch
    if torch.cuda.is_available():  # on a GPU machine the flag is valid; check it trains
        assert run_cli(capsys, "train", "--corpus", tiny_text, *SMALL, "--device", "cuda",
                       "--out", tmp_path / "g")[0] == 0
    else:
        one_line_error(capsys, "train", "--corpus", tiny_text, *SMALL, "--device", "cuda",
                       "--out", tmp_path / "g", match="no CUDA device")
