"""gatelens's own cells (cells/modern.py: minGRU, minLSTM, sLSTM) as families.

They are traced by construction: the read-out is the module's sequential step with every
signal recorded. The module's own trajectory (the reference) is what its forward computes
(``ModernRNN.scan_mode``: the sequential step on CPU, the parallel scan on CUDA). The
one-step check holds each layer's sequential step, fed the scan's own input to that layer,
against the scan (an independent algorithm for the same recurrence); h and y are unbounded,
so each difference is judged scaled by the unit's largest |value| in the window, at least 1
(which on h within (−1, 1) is the absolute rule).

>>> import torch
>>> from gatelens.cells.modern import MinGRU
>>> from gatelens.families.registry import family_of
>>> fam = family_of(MinGRU(3, 4, num_layers=2))
>>> call = fam.check(torch.randn(2, 6, 3)); ref = fam.reference(call)
>>> fam.name, max(d.max_scaled_diff_h for d in fam.one_step(call, ref)) < 1e-5
('mingru', True)
"""

from __future__ import annotations

import copy
from typing import Any, ClassVar

import torch
from torch import Tensor, nn

from gatelens.cells.modern import SLSTM, MinGRU, MinLSTM, ModernRNN
from gatelens.families.base import Call, Dynamics, Family, LayerDiff, Readout, Reference
from gatelens.families.recipe import Recipe
from gatelens.families.spec import SIGMOID, TANH, CellSpec, layer_name

# y is the block's output, the next layer's input.
MINGRU = CellSpec(
    name="mingru", kind="mingru", chunks=("z", "cand"),
    signals=("z", "cand", "keep", "h", "y"), gates=("z", "keep"), keep_gate="keep",
    input_gate=None, state="h", candidate="cand", bounds={"z": SIGMOID, "keep": SIGMOID},
    display={"keep": "keep (the state's retention)", "cand": "candidate h̃"},
    return_path=("z", "keep", "cand"), carried=("h",))
MINLSTM = CellSpec(
    name="minlstm", kind="minlstm", chunks=("f", "i", "cand"),
    signals=("f", "i", "cand", "keep", "h", "y"), gates=("f", "i", "keep"),
    keep_gate="keep", input_gate="i", state="h", candidate="cand",
    bounds={"f": SIGMOID, "i": SIGMOID, "keep": SIGMOID}, display={"cand": "candidate h̃"},
    return_path=("f", "i", "keep", "cand"), carried=("h",))
SLSTM_SPEC = CellSpec(
    name="slstm", kind="slstm", chunks=("z", "i", "f", "o"),
    signals=("z", "i", "f", "o", "c", "n", "m", "kappa", "s", "h", "y"),
    gates=("z", "i", "f", "o", "kappa"), keep_gate="kappa", input_gate="i", state="s",
    candidate="z",
    bounds={"z": TANH, "i": SIGMOID, "f": SIGMOID, "o": SIGMOID, "kappa": SIGMOID,
            "s": TANH, "h": TANH},
    display={"kappa": "keep κ = f n / n'", "s": "state c/n"}, carried=("h", "c", "n", "m"))


@torch.no_grad()
def keep_bias(rnn: nn.Module, draw, chrono: bool) -> None:
    """``Recipe.keep_init`` of a gatelens cell, b = draw(H) per layer: minGRU b_z = −b
    (keep 1 − z = σ(−z̃) starts at σ(b)); minLSTM b_f = b, b_i = −b (f* = σ(b)/(σ(b) +
    σ(−b)) = σ(b) before the weights act); sLSTM b_f = b (its forget gate; κ has no bias
    of its own), with chrono b_i = −b too."""
    for layer in range(rnn.num_layers):
        b_f = draw(rnn.hidden_size).to(rnn.weight_ih_l0.dtype)
        if rnn.cell == "mingru":
            rnn.bias_of(layer, "z").copy_(-b_f)
            continue
        rnn.bias_of(layer, "f").copy_(b_f)
        if rnn.cell == "minlstm" or chrono:
            rnn.bias_of(layer, "i").copy_(-b_f)


def modern_recipe(name: str, cls: type, keep_words: str, help: str,
                  has_heads: bool = False) -> Recipe:
    """The recipe of a gatelens cell: one-hot or embedded characters in, its state
    carried; ``--heads`` for the sLSTM (blocks of its recurrent weights)."""

    def build(n_in: int, hidden: int, layers: int, *, heads: int = 1, **_: object):
        return cls(n_in, hidden, num_layers=layers, **({"heads": heads} if has_heads else {}))

    flags = {"embed", "bias_init", "keep"} | ({"heads"} if has_heads else set())
    return Recipe(name, help, build, flags=frozenset(flags), keep_init=keep_bias,
                  keep_words=keep_words)


def _scale(ref: Tensor) -> Tensor:
    """max(1, max_t |ref|) per window and unit: (B, T, H) -> (B, 1, H)."""
    return ref.double().abs().amax(dim=1, keepdim=True).clamp(min=1.0)


def layer_diff(k: int, got: dict[str, Tensor], got_final: Tensor, ref: dict[str, Tensor],
               ref_final: Any) -> LayerDiff:
    """One layer's h, y and final h against a reference trajectory: absolute and scaled."""
    h_n = (ref_final if isinstance(ref_final, Tensor) else ref_final[0])[k]  # (B, H)
    h, y = ref[f"{layer_name(k)}.h"], ref[f"{layer_name(k)}.y"]  # (B, T, H)
    abs_, scaled = 0.0, 0.0
    for a, b, scale in ((got["h"], h, _scale(h)), (got["y"], y, _scale(y)),
                        (got_final, h_n, _scale(h)[:, 0])):
        diff = (a.double() - b.double()).abs()
        abs_, scaled = max(abs_, float(diff.max())), max(scaled, float((diff / scale).max()))
    return LayerDiff(k, False, abs_, None, max_scaled_diff_h=scaled)


class ModernFamily(Family):
    """A gatelens cell (cells/modern.py)."""

    edit_reads_whole = True  # its edited run reads every stretch (families/base.py)

    module_class: ClassVar[type] = ModernRNN

    @classmethod
    def opens(cls, module: nn.Module) -> bool:
        return isinstance(module, cls.module_class)

    @property
    def spec(self) -> CellSpec:
        return self.specs[0]

    @property
    def num_layers(self) -> int:
        return self.module.num_layers

    @property
    def hidden_size(self) -> int:
        return self.module.hidden_size

    def check(self, inputs: Any, state: Any = None) -> Call:
        w = self.module.weight_ih_l0
        if not isinstance(inputs, Tensor):
            raise TypeError(f"inputs must be a Tensor (B, T, F); got {type(inputs).__name__}")
        if inputs.dtype != w.dtype or inputs.device != w.device:
            raise TypeError(f"inputs must have the module's dtype {w.dtype} and device "
                            f"{w.device}; got {inputs.dtype} on {inputs.device}")
        if inputs.ndim != 3 or 0 in inputs.shape[:2]:
            raise ValueError(f"inputs must be (B, T, {self.module.input_size}) with B, T >= 1; "
                             f"got shape {tuple(inputs.shape)}")
        self.module._states(state, inputs)  # raises on a wrong shape
        return Call(inputs, state, {"batch_first": True, "unbatched": False})

    @property
    def parallel_forward(self) -> bool:
        return self.module.scan_mode == "parallel"

    def _run(self, call: Call, parallel: bool) -> tuple[dict[str, Tensor], Any]:
        with torch.no_grad():
            _, final, sig = self.module.run(call.inputs, call.state, parallel=parallel,
                                            signals=True)
        return sig, final

    def reference(self, call: Call) -> Reference:
        """The trajectory the module's forward takes (scan_mode: "auto" takes the scan on
        CUDA, the sequential step on CPU)."""
        mode = self.module.scan_mode
        parallel = mode == "parallel" or (mode == "auto" and call.inputs.is_cuda)
        sig, final = self._run(call, parallel)
        inputs = {layer_name(k): call.inputs if k == 0 else sig[f"{layer_name(k - 1)}.y"]
                  for k in range(self.num_layers)}
        return Reference(sig, inputs, {}, sig[f"{layer_name(self.num_layers - 1)}.y"], final,
                         {"parallel": parallel})

    def _readout(self, sig: dict[str, Tensor], final: Any, method: str) -> Readout:
        parts = (final,) if isinstance(final, Tensor) else final
        return Readout({n: sig[n] for n in self.names()}, parts[0],
                       parts[1] if len(parts) > 1 else None, {"method": method})

    def read(self, call: Call, ref: Reference) -> Readout:
        """The sequential step's signals (the module's own when its forward is sequential)."""
        if not ref.extra["parallel"]:
            return self._readout(ref.states, ref.final, "step")
        return self.rerun(call)

    def rerun(self, call: Call) -> Readout:
        return self._readout(*self._run(call, parallel=False), "step")

    def _scan(self, call: Call, ref: Reference) -> tuple[dict[str, Tensor], Any]:
        """The parallel form (the scan; sLSTM's own step), computed once."""
        if "scan" not in ref.extra:
            ref.extra["scan"] = (ref.states, ref.final) if ref.extra["parallel"] else \
                self._run(call, parallel=True)
        return ref.extra["scan"]

    def one_step(self, call: Call, ref: Reference) -> list[LayerDiff]:
        """Each layer's sequential step, fed the scan's own input to that layer (x, or LN of
        the scan's y below), against the scan's h, y and h_n."""
        m = self.module
        sig, final = self._scan(call, ref)
        rows = []
        with torch.no_grad():
            init = m._states(call.state, call.inputs)
            for k in range(self.num_layers):
                below = None if k == 0 else sig[f"{layer_name(k - 1)}.y"]
                inp = call.inputs if k == 0 else m.norm_in[k - 1](below)
                out, fin = m.layer(k, inp, init[k], parallel=False)
                y = m.block(k, out["h"], below)
                rows.append(layer_diff(k, {"h": out["h"], "y": y}, fin[0], sig, final))
        return rows

    def free_running(self, call: Call, ref: Reference) -> list[LayerDiff]:
        """The whole sequential stack against the scan: rounding carried up the layers."""
        mine = self.read(call, ref)
        return self._judge(mine, *self._scan(call, ref))

    def judge(self, readout: Readout, ref: Reference) -> list[LayerDiff]:
        return self._judge(readout, ref.states, ref.final)

    def _judge(self, readout: Readout, states: dict[str, Tensor], final: Any) -> list[LayerDiff]:
        return [layer_diff(k, {s: readout.signals[f"{layer_name(k)}.{s}"] for s in ("h", "y")},
                           readout.h_n[k], states, final) for k in range(self.num_layers)]

    def output_diff(self, readout: Readout, output: Any) -> float:
        out = output[0]
        top = readout.signals[f"{layer_name(self.num_layers - 1)}.y"]
        return float((top.double() - out.detach().double()).abs().max())

    def intervene(self, call: Call, plan: Any, output: Any, offset: int = 0
                  ) -> tuple[Any, dict[str, Tensor]]:
        """Edits inside the layers' steps (families/modern_edit.py)."""
        from gatelens.families.modern_edit import intervene

        return intervene(self, call, plan, output, offset)

    def dynamics(self, call: Call, ref: Reference) -> list[Dynamics]:
        """The stack's step on its own state coordinates (``ModernRNN.stack_step``: per
        layer h; sLSTM h, s, ℓ = m + ln n), along the module re-run in float64. Step 0 makes
        the state from the initial one (ℓ is −∞ there), so the dynamics start after it."""
        m64 = copy.deepcopy(self.module).double().eval()
        x = call.inputs.detach().double()  # (B, T, F)
        st = call.state
        if st is not None:
            st = st.double() if isinstance(st, Tensor) else tuple(p.double() for p in st)
        with torch.no_grad():
            _, _, sig = m64.run(x, st, parallel=False, signals=True)
        traj = [p.detach() for p in m64.free_states(sig)]  # (B, T, H) each
        per = len(traj) // self.num_layers
        units = torch.cat([torch.arange(p.shape[-1]) + (j // per) * self.hidden_size
                           for j, p in enumerate(traj)])
        T = x.shape[1]
        return [Dynamics(lambda x_t, s: m64.stack_step(x_t, list(s)), x, traj,
                         [p[:, 0] for p in traj], list(range(1, T)), units, offset=1)]


class MinGRUFamily(ModernFamily):
    name, opens_what, module_class = "mingru", "gatelens's MinGRU", MinGRU
    specs = (MINGRU,)
    recipe = modern_recipe("mingru", MinGRU, "minGRU 1 − z",
                           "gatelens's minGRU (Feng et al. 2024)")


class MinLSTMFamily(ModernFamily):
    name, opens_what, module_class = "minlstm", "gatelens's MinLSTM", MinLSTM
    specs = (MINLSTM,)
    recipe = modern_recipe("minlstm", MinLSTM, "minLSTM f* = f/(f + i)",
                           "gatelens's minLSTM (Feng et al. 2024)")


class SLSTMFamily(ModernFamily):
    name, opens_what, module_class = "slstm", "gatelens's SLSTM", SLSTM
    specs = (SLSTM_SPEC,)
    recipe = modern_recipe("slstm", SLSTM, "sLSTM κ",
                           "gatelens's sLSTM (Beck et al. 2024; --heads)", has_heads=True)
