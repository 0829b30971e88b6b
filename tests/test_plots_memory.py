"""The memory plots draw what the measurements computed."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from matplotlib.figure import Figure
from torch import nn

from gatelens.analysis.context import context_used
from gatelens.analysis.saturation import gate_saturation
from gatelens.analysis.spectrum import lyapunov_spectrum
from gatelens.readout.trace import trace
from gatelens.report.plots_memory import (
    plot_saturation,
    plot_slow_modes,
    plot_spectrum,
    write_memory_plots,
)

pytestmark = pytest.mark.usefixtures("one_thread")


def test_plots_show_the_figures(tmp_path, dynamics_of) -> None:
    torch.manual_seed(0)
    V, H = 5, 6
    lstm, head = nn.LSTM(V, H, batch_first=True), nn.Linear(H, V)
    with torch.no_grad():
        lstm.bias_ih_l0[H : 2 * H] = 4.0  # a slow forget gate: slow modes
    ids = torch.randint(0, V, (3, 24), generator=torch.Generator().manual_seed(1))
    x = nn.functional.one_hot(ids, V).float()
    sp = lyapunov_spectrum(dynamics_of(lstm, x), k="all", burn_in=4, hidden=H)
    assert sp.slow_modes
    ctx = context_used(lambda i: head(lstm(nn.functional.one_hot(i, V).float())[0]), ids)
    sat = gate_saturation(trace(lstm, x))
    ax = Figure().subplots()
    plot_spectrum(ax, sp.to_dict()["exponents"])
    assert np.allclose(ax.lines[0].get_ydata(), sp.exponents)
    ax = Figure().subplots()
    modes = sp.slow_modes
    plot_slow_modes(ax, np.array([m.loadings for m in modes]), [m.exponent for m in modes], H)
    assert np.allclose(ax.images[0].get_array(), [m.loadings for m in modes])
    ax = Figure().subplots()
    plot_saturation(ax, sat.left["f"], sat.right["f"], "f")
    assert np.allclose(ax.collections[0].get_offsets(), np.c_[sat.left["f"], sat.right["f"]])
    report = {"lyapunov": sp.to_dict(), "context": ctx.to_dict(), "saturation": sat.to_dict(),
              "output_reach": {"curve": [0.0, 0.5, 0.25, 0.1]}, "perturbation": {"lags": [1, 2]}}
    paths = write_memory_plots(report, tmp_path, spectrum=sp)
    assert [p.name for p in paths] == ["lyapunov_spectrum.png", "context_used.png",
                                       "gate_saturation.png"]
    assert all(p.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" for p in paths)
    assert write_memory_plots({"lyapunov": None, "context": None, "saturation": {}}, tmp_path) == []
