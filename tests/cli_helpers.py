"""What the command-line tests share (imported by path: the suite runs in importlib mode)."""

from __future__ import annotations

from gatelens.cli import main

#: a tiny training run: 8 units, 4 steps, checkpoints at 0, 2 and 4
SMALL = ["--hidden", "8", "--steps", "4", "--batch", "4", "--seq", "16", "--eval-every", "2",
         "--val-windows", "2", "--quiet"]


def one_line(capsys, argv, code: int = 2) -> str:
    """Run the CLI; assert its exit code and that stderr is one line, no traceback: that
    line."""
    got = main([str(a) for a in argv])
    out, err = capsys.readouterr()
    assert got == code, (out, err)
    lines = err.strip().splitlines()
    assert len(lines) == 1 and "Traceback" not in err, err
    return lines[0]
