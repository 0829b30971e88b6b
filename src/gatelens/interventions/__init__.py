"""Interventions: set, add, scale, zero- and mean-ablate, or patch any gate or state of a
recurrent module at chosen steps and units, carried forward through the recurrence and
everything downstream (``Lens.run``; docs/interventions.md).

>>> import torch, gatelens
>>> net = torch.nn.Sequential(torch.nn.Embedding(5, 4), torch.nn.LSTM(4, 6, batch_first=True))
>>> ids = torch.randint(0, 5, (2, 8))
>>> res = gatelens.Lens(net).run(ids, edits=[gatelens.Set("1.layer0.f", 1.0, at=slice(3, None),
...                                                       units=[2]),
...                                          gatelens.Zero("1.layer0.i", at=slice(3, None),
...                                                        units=[2])])
>>> c = res.trace["1.layer0.c"][:, 2:, 2]
>>> bool((c == c[:, :1]).all())  # f := 1, i := 0 from step 3 on: c holds, exactly
True
"""

from gatelens.interventions.edits import Add, Edit, Mean, Patch, Scale, Set, Zero
from gatelens.interventions.run import RunResult, run_edits

__all__ = ["Add", "Edit", "Mean", "Patch", "RunResult", "Scale", "Set", "Zero", "run_edits"]
