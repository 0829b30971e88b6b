"""xlstm's block stacks (``xlstm-mlstm``, ``xlstm-slstm``, ``xlstm-mixed``): ``gatelens.trace``
of every per-token state against the stack's own forward, with the states read from the
forward (families/xlstm_stack_scan.py) and, in the same process, from the whole stack's
step path (the read before it: ``scan_modules`` off).

Usage: ``python benchmarks/bench_xlstm_stack.py [--dim 96] [--heads 8] [--length 128]``
(B = 2, two blocks, the mixed stack's sLSTM block at 1; one thread; CPU seconds, best of
``--repeats``). Prints one JSON line per stack.
"""

from __future__ import annotations

import argparse
import json
import sys
import warnings
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))
import gatelens  # noqa: E402
from gatelens.families.xlstm_mixed import tiny_mixed_stack  # noqa: E402
from gatelens.families.xlstm_mlstm import tiny_mlstm_stack  # noqa: E402
from gatelens.families.xlstm_slstm import XLSTMStack, tiny_slstm_stack  # noqa: E402
from timing import best_cpu  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--dim", type=int, default=96)
    ap.add_argument("--heads", type=int, default=8)
    ap.add_argument("--length", type=int, default=128)
    ap.add_argument("--repeats", type=int, default=3)
    a = ap.parse_args()
    warnings.filterwarnings("ignore")
    torch.set_num_threads(1)
    common = dict(dim=a.dim, blocks=2, heads=a.heads, conv=4, context=a.length)
    stacks = {"xlstm-mlstm": tiny_mlstm_stack(**common),
              "xlstm-slstm": tiny_slstm_stack(**common),
              "xlstm-mixed": tiny_mixed_stack(**common, slstm_at=(1,))}
    x = torch.randn(2, a.length, a.dim, generator=torch.Generator().manual_seed(0))
    for name, stack in stacks.items():
        stack.eval()
        with torch.no_grad():
            forward = best_cpu(lambda s=stack: s(x), a.repeats)
        read = best_cpu(lambda s=stack: gatelens.trace(s, x), a.repeats)
        XLSTMStack.scan_modules = lambda self: None  # the step path, as before
        try:
            stepped = best_cpu(lambda s=stack: gatelens.trace(s, x), a.repeats)
        finally:
            del XLSTMStack.scan_modules  # the forward read's own again
        print(json.dumps({"stack": name, "dim": a.dim, "heads": a.heads, "length": a.length,
                          "forward_s": round(forward, 4),
                          "trace_x": round(read / forward, 2),
                          "step_path_trace_x": round(stepped / forward, 2)}), flush=True)


if __name__ == "__main__":
    main()
