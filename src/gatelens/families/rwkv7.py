"""RWKV-7 "Goose" (x070) as the ``rwkv`` package (0.8.32) computes it: ``rwkv.model.RWKV_x070``,
the package's own model (a ``torch.jit.ScriptModule`` holding its weights in a dict ``z``),
defined when ``RWKV_V7_ON=1`` is set before ``import rwkv.model``. The user builds it with the
package (``RWKV_x070(path, "cpu fp32")`` loads the ``.pth`` itself); gatelens never loads or
unpickles a checkpoint, it reads the built model's ``z``.

Block k, per head h (H heads of N channels), with the token shift x_{t−1} of ln1(x):
  r, k, v = W_r·, W_k·, W_v· of their shifted mixes;  g = σ(x_g G1) G2;
  w_t = exp(−0.606531 · σ(w0 + tanh(x_w W1) W2))  (the keep per channel, in (0.545, 1));
  a_t = σ(a0 + x_a A1 A2)  (the in-context rate);  kk = normalize(k ⊙ k_k) per head;
  k ← k ⊙ (1 + (a − 1) ⊙ k_a);  v ← v + (v_first − v) ⊙ σ(v0 + x_v V1 V2)  (k > 0; v_first is
  layer 0's v at the same token);
  S_t = S_{t−1} (diag(w_t) − kk_t (kk_t ⊙ a_t)ᵀ) + v_t k_tᵀ,  S ∈ R^(N × N) (value × key);
  o = GroupNorm_h(S_t r_t) + (Σ_h r ⊙ k ⊙ r_k) v;  x ← x + W_o (o ⊙ g);
  then the channel mix: x ← x + W_v' relu(W_k' mix(ln2 x))².
The trace per layer: r, w, k (the written key), v (the written value), a, kk, s (S per head,
row by row, as the package holds it) and y (the block's output). The keep operator is
A_t(S) = S (diag(w_t) − kk_t (kk_t ⊙ a_t)ᵀ) (``rwkv7_keep``); the keep gate w_t per channel
(its key coordinate: w_j scales column j of every head's S). The input enters S through the
token shift: a window of 2 positions.

The module's own trajectory: ONE whole-window pass per layer in ``forward_seq``'s own
arithmetic (families/rwkv7_scan.py: the package's time and channel mix, every token's r, w,
k, v, a, g, kk a window at a time, then its per-t update on all B windows at once, S kept
after every token). Its logits and final state are ``forward_seq``'s bit for bit, so it IS
the forward: the package's jit-scripted functions cannot be hooked, and ``open_cells`` runs
the pass once after the user's forward. ``trace`` hands over the values it formed
(``method="own"``); the float64 hand cell below is the one-step check, and the free-running
re-run is the same pass in float64, a layer at a time. The package's own one-token step
(``RWKV_x070_TMix_one`` and ``RWKV_x070_CMix_one``, what ``forward_one`` runs, layer by
layer on its ``z``, ``_trajectory``) is the independent reference: every state agrees with
it within float32 rounding (tests/test_rwkv7_scan.py; its projections run one row at a
time), at T·L calls from Python: 8× ``forward_seq`` at RWKV-7 0.1B's width, where ``trace``
by the pass is 1.2× (BENCHMARKS.md).

The model reads token ids (no batch), so ``Lens`` takes it wrapped in ``RWKV7LM`` (ids (B, T)
-> logits (B, T, V), window by window through the package's ``forward``); ``trace`` and
``verify`` take the bare model and ids (B, T). ``--cell rwkv7``'s trained module
(families/rwkv7_train.py) is read through the package's model built from its weights.
Refused in one line: the fp16/bf16 strategies, ``RWKV_CUDA_ON=1`` (wkv7s CUDA kernel), DeepEmbed.

>>> sig = {"w": torch.tensor([[0.5, 1.0]]), "a": torch.tensor([[1.0, 1.0]]),
...        "kk": torch.tensor([[1.0, 0.0]])}
>>> rwkv7_keep(sig, torch.tensor([[1.0, 2.0, 3.0, 4.0]])).tolist()  # one head, N = 2
[[-0.5, 2.0, -1.5, 4.0]]
"""

from __future__ import annotations

import sys
from collections.abc import Sequence
from types import ModuleType
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from gatelens.cells.names import layer_name
from gatelens.errors import GatelensError
from gatelens.families.base import Call, Dynamics, Readout, Reference
from gatelens.families.official import OfficialFamily
from gatelens.families.rwkv7_edit import RWKV7Edits
from gatelens.families.rwkv7_scan import TMIX, scan_block, scan_model, windows
from gatelens.families.rwkv7_train import (  # noqa: F401 - W_SCALE re-exported
    RWKV7_RECIPE,
    W_SCALE,
    RWKV7Trainable,
)
from gatelens.families.spec import SIGMOID, CellSpec

_PKG, _CLS = "rwkv.model", "RWKV_x070"
#: the signals the whole-window pass forms as the package does (s and y: its states)
_OWN = ("r", "w", "k", "v", "a", "kk")


def rwkv7_keep(signals: dict[str, Tensor], s: Tensor) -> Tensor:
    """The keep operator of one step: A_t(S) = S (diag(w_t) − kk_t (kk_t ⊙ a_t)ᵀ) per head
    (the package's ``state * w + state @ ab``, ab = (−kk)(kk ⊙ a)ᵀ). ``signals``: that step's
    ``w``, ``a``, ``kk`` (R, C); ``s`` (R, H·N·N), each head's S (value × key) row by row."""
    w, a, kk = signals["w"], signals["a"], signals["kk"]
    R, C = w.shape
    N = s.shape[-1] // C
    S = s.reshape(R, C // N, N, N)  # (R, H, N_v, N_k)
    w, kk, ka = (x.reshape(R, C // N, 1, N) for x in (w, kk, kk * a))
    Skk = (S * kk).sum(dim=-1, keepdim=True)  # (R, H, N_v, 1): S kk
    return (S * w - Skk * ka).reshape(R, -1)


RWKV7 = CellSpec(
    name="rwkv7", kind="rwkv7", chunks=("r", "k", "v"),
    signals=("r", "w", "k", "v", "a", "kk", "s", "y"), gates=("w", "a"), keep_gate="w",
    input_gate=None, state="s", output="y", bounds={"w": SIGMOID, "a": SIGMOID},
    keep_operator=rwkv7_keep,
    display={"w": "decay w_t per channel", "a": "in-context rate a_t",
             "kk": "removal key kk_t", "k": "written key k_t", "s": "state S per head"})


def is_rwkv7(model: object) -> bool:
    """Whether ``model`` is the package's ``rwkv.model.RWKV_x070`` (by class, no import)."""
    return (type(model).__module__, type(model).__name__) == (_PKG, _CLS)


class RWKV7LM(nn.Module):
    """The package's ``RWKV_x070`` as a model of ids: (B, T) int64 -> logits (B, T, V), each
    window through the package's own ``forward`` (its ``forward_seq``, full output) from the
    zero state. What ``Lens`` takes: ``Lens(RWKV7LM(model), vocab=...)``."""

    def __init__(self, model: nn.Module) -> None:
        super().__init__()
        if not is_rwkv7(model):
            raise GatelensError(f"RWKV7LM takes rwkv.model.RWKV_x070 (the rwkv package with "
                                f"RWKV_V7_ON=1); got {type(model).__name__}")
        self.rwkv = model

    @property
    def vocab_size(self) -> int:
        return int(self.rwkv.z["emb.weight"].shape[0])

    def forward(self, ids: Tensor) -> Tensor:
        return torch.stack([_window(self.rwkv, row)[0] for row in _ids(ids, "RWKV7LM")])


def _ids(inputs: Any, what: str) -> Tensor:
    """Token ids as (B, T) int64: a (B, T) or (T,) integer tensor, a list of ints, an int."""
    if isinstance(inputs, int) and not isinstance(inputs, bool):
        inputs = [inputs]
    if isinstance(inputs, (list, tuple)) and inputs and all(
            isinstance(i, int) and not isinstance(i, bool) for i in inputs):
        inputs = torch.tensor(inputs, dtype=torch.long)
    ok = (isinstance(inputs, Tensor) and not inputs.is_floating_point()
          and not inputs.is_complex() and inputs.ndim in (1, 2) and inputs.numel() > 0)
    if not ok:
        got = (f"{inputs.dtype} {tuple(inputs.shape)}" if isinstance(inputs, Tensor)
               else type(inputs).__name__)
        raise GatelensError(f"{what}: RWKV-7 reads token ids, (B, T) int64 or a list of ints; "
                            f"got {got}")
    return (inputs if inputs.ndim == 2 else inputs[None]).long()


def _zero_state(model: nn.Module) -> list[Tensor]:
    """The package's zero state ([att x_prev, att S (H, N, N) float32, ffn x_prev] per
    layer) in the model's own dtype and device, not the package's module-wide DTYPE."""
    emb = model.z["emb.weight"]
    C, H, N = int(model.n_embd), int(model.n_head), int(model.head_size)
    out = []
    for _ in range(int(model.n_layer)):
        out += [emb.new_zeros(C), torch.zeros(H, N, N, device=emb.device), emb.new_zeros(C)]
    return out


def _window(model: nn.Module, ids: Tensor) -> tuple[Tensor, list[Tensor]]:
    """The package's own forward on one window of ids (T,): logits (T, V), final state."""
    seq = [int(i) for i in ids]
    with torch.no_grad():
        out, state = model.forward(seq, _zero_state(model), full_output=True)
    return out.reshape(len(seq), -1), state


class RWKV7Family(RWKV7Edits, OfficialFamily):
    """The ``rwkv`` package's RWKV-7 (``RWKV_x070``), bare or in ``RWKV7LM``."""

    name = "rwkv7"
    opens_what = ("the rwkv package's RWKV_x070 (RWKV-7; bare, in gatelens's RWKV7LM, or "
                  "built from --cell rwkv7's weights)")
    cell_name = "rwkv7"
    specs = (RWKV7,)
    cpu_only = ("the rwkv package's RWKV_x070 is read in its 'cpu fp32' strategy; its "
                "CUDA strategy runs a fused kernel, which has no step path to read")
    recipe = RWKV7_RECIPE
    wraps = (RWKV7LM, RWKV7Trainable)  # models of ids, read through their package model
    uses_aux = True  # v_first: layer 0's v at the same token (a function of the input)
    output_is_logits = True  # the package's model ends in its own head

    @classmethod
    def opens(cls, module: nn.Module) -> bool:
        return type(module) in cls.wraps or is_rwkv7(module)

    @property
    def model(self) -> nn.Module:
        """The package's model itself."""
        return self.module.rwkv if type(self.module) in self.wraps else self.module

    @property
    def package(self) -> ModuleType:
        """``rwkv.model`` as the model was built from it (its own step functions)."""
        return sys.modules[type(self.model).__module__]

    # ---- facts ---------------------------------------------------------------------
    @property
    def num_layers(self) -> int:
        return int(self.model.n_layer)

    @property
    def hidden_size(self) -> int:
        return int(self.model.n_embd)

    @property
    def heads(self) -> tuple[int, int]:
        """(H, N): heads and channels per head."""
        return int(self.model.n_head), int(self.model.head_size)

    def describe(self) -> dict:
        H, N = self.heads
        return {**super().describe(), "implementation": f"{_PKG}.{_CLS}", "heads": H,
                "head_size": N, "vocab_size": int(self.model.z["emb.weight"].shape[0])}

    def state_units(self, k: int) -> Tensor:
        H, N = self.heads  # S[h, i, j] is kept by w[h·N + j]
        return torch.arange(H * N).view(H, 1, N).expand(H, N, N).reshape(-1)

    def part_units(self, k: int) -> list[Tensor]:
        none = torch.full((self.hidden_size,), -1, dtype=torch.int64)
        return [none, self.state_units(k), none]  # att shift, S, ffn shift

    def input_window(self) -> int:
        return 2

    def initial_parts(self, k: int, batch: int) -> list[Tensor]:
        (H, N), C, dev = self.heads, self.hidden_size, self.model.z["emb.weight"].device
        return [torch.zeros(batch, n, dtype=torch.float64, device=dev) for n in (C, H * N * N, C)]

    def state_of(self, k: int, parts: list[Tensor]) -> Tensor:
        return parts[1]

    # ---- a call ------------------------------------------------------------------
    def split_call(self, args: tuple, kwargs: dict) -> tuple[Any, Any]:
        if type(self.module) in self.wraps:
            return (args[0] if args else kwargs.get("ids")), None
        inputs = args[0] if args else kwargs.get("idx")
        return inputs, args[1] if len(args) > 1 else kwargs.get("state")

    def check(self, inputs: Any, state: Any = None) -> Call:
        z, pkg = self.model.z, self.package
        dtype = z["emb.weight"].dtype
        if dtype != torch.float32:
            raise GatelensError(f"{self.name}: RWKV_x070 holds its weights in {dtype} (an "
                                "fp16/bf16 strategy); gatelens opens the 'fp32' strategy only")
        if hasattr(pkg, "RWKV7_OP"):
            raise GatelensError(f"{self.name}: rwkv.model was imported with RWKV_CUDA_ON=1 "
                                "(forward_seq runs the wkv7s CUDA kernel, not opened); import "
                                "it with RWKV_CUDA_ON=0")
        if "blocks.0.ffn.s_emb.weight" in z:
            raise GatelensError(f"{self.name}: the DeepEmbed variant (ffn.s_emb, "
                                "RWKV_DE_VERSION=1) is not opened")
        if state is not None:
            raise GatelensError(f"{self.name}: an initial state is not supported (got "
                                f"{type(state).__name__}); the analysis runs from zeros")
        ids = _ids(inputs, self.name).to(z["emb.weight"].device)
        if int(ids.min()) < 0 or int(ids.max()) >= z["emb.weight"].shape[0]:
            raise GatelensError(f"{self.name}: ids {int(ids.min())}..{int(ids.max())} outside "
                                f"the vocabulary of {z['emb.weight'].shape[0]}")
        return Call(inputs=z["emb.weight"][ids], layout={"batch_first": True, "ids": ids})

    # ---- the module's own computation ----------------------------------------------
    def _forward(self, call: Call) -> Tensor:
        return torch.stack([_window(self.model, row)[0] for row in call.layout["ids"]])

    def _forward_trajectory(self, call: Call) -> dict:
        """Every layer's per-token states from ONE whole-window pass per layer, batched over
        the windows: ``forward_seq``'s own arithmetic (families/rwkv7_scan.py), its logits
        and final state bit for bit. The package's jit-scripted forward cannot be hooked,
        so this pass is the forward; "step_vs_forward" is None (no second path runs)."""
        (H, N), L = self.heads, self.num_layers
        got = scan_model(self.model.z, H, N, L, call.inputs)
        own = [{n: sig[n] for n in _OWN} for sig in got["sig"]]
        aux = [None] + [got["sig"][0]["v_first"]] * (L - 1)
        return {"x": got["x"], "u": got["x"], "y": got["xo"], "xo": got["xo"],
                "parts": got["parts"], "aux": aux, "output": got["output"], "own": own,
                "step_vs_forward": None}

    def _trajectory(self, call: Call) -> dict:
        m, pkg, L = self.model, self.package, self.num_layers
        z, C, (H, N) = m.z, self.hidden_size, self.heads
        args = [tuple(z[f"blocks.{k}.att.{n}"] for n in TMIX) for k in range(L)]
        rec: dict[str, list] = {n: [[] for _ in range(L)] for n in ("x", "xo", "v1", "p")}
        outs = []
        for b in range(call.batch):
            state = _zero_state(m)
            for t in range(call.length):
                x = call.inputs[b, t]
                v_first = torch.empty_like(x)
                for k in range(L):
                    blk = f"blocks.{k}."
                    rec["x"][k].append(x)
                    xx = F.layer_norm(x, (C,), weight=z[blk + "ln1.weight"],
                                      bias=z[blk + "ln1.bias"])
                    xx, state[3 * k], state[3 * k + 1], v_first = pkg.RWKV_x070_TMix_one(
                        k, H, N, xx, state[3 * k], v_first, state[3 * k + 1], *args[k])
                    x = x + xx
                    xx = F.layer_norm(x, (C,), weight=z[blk + "ln2.weight"],
                                      bias=z[blk + "ln2.bias"])
                    xx, state[3 * k + 2] = pkg.RWKV_x070_CMix_one(
                        xx, state[3 * k + 2], z[blk + "ffn.x_k"], z[blk + "ffn.key.weight"],
                        z[blk + "ffn.value.weight"])
                    x = x + xx
                    rec["xo"][k].append(x)
                    rec["v1"][k].append(v_first)
                    rec["p"][k].append([state[3 * k], state[3 * k + 1].reshape(-1),
                                        state[3 * k + 2]])
                x = F.layer_norm(x, (C,), weight=z["ln_out.weight"], bias=z["ln_out.bias"])
                outs.append(x @ z["head.weight"])
        B, T = call.batch, call.length

        def seq(ts: list[Tensor]) -> Tensor:  # window by window, then token by token
            return torch.stack(ts).reshape(B, T, -1)

        x, xo = [seq(v) for v in rec["x"]], [seq(v) for v in rec["xo"]]
        parts = [[seq([p[j] for p in rec["p"][k]]).double() for j in range(3)]
                 for k in range(L)]
        return {"x": x, "u": x, "y": xo, "xo": xo, "parts": parts, "output": seq(outs),
                "aux": [None] + [seq(rec["v1"][k]) for k in range(1, L)]}

    def reference(self, call: Call) -> Reference:
        ref = super().reference(call)
        # the state forward_seq leaves after the prompt (the pass's last S, bit for bit)
        ref.final = torch.cat([ref.extra["parts"][k][1][:, -1]
                               for k in range(self.num_layers)], -1)
        return ref

    def output_diff(self, readout: Readout, output: Any) -> float | None:
        """max |the package's head on the read-out's top y − the logits RWKV7LM returned|
        (the bare model's (logits, state) of one sequence: None)."""
        top = readout.signals.get(f"{layer_name(self.num_layers - 1)}.y")
        if top is None or not isinstance(output, Tensor) or output.shape[:2] != top.shape[:2]:
            return None
        z, C = self.model.z, self.hidden_size
        head = windows(lambda y: F.layer_norm(y, (C,), weight=z["ln_out.weight"],
                                              bias=z["ln_out.bias"]) @ z["head.weight"],
                       top.to(z["head.weight"].dtype))
        return float((head.double() - output.detach().double()).abs().max())

    # ---- the hand cell (families/rwkv7_edit.py), float64 on a float64 copy of z -----
    def float64(self) -> dict[str, Tensor]:  # type: ignore[override]
        """The package's weights ``z`` in float64 (made once per version of them)."""
        version = tuple((id(v), v._version) for v in self.model.z.values())
        cached = self.__dict__.get("_z64")
        if cached is None or cached[0] != version:
            cached = (version, {n: v.detach().double() for n, v in self.model.z.items()})
            self.__dict__["_z64"] = cached
        return cached[1]

    def pre(self, k, m, x):  # the cell is the whole block: u = x, its output the block's
        return x

    def post(self, k, m, x, y):
        return y

    def final(self, m, x):
        x = F.layer_norm(x, (self.hidden_size,), weight=m["ln_out.weight"],
                         bias=m["ln_out.bias"])
        return x @ m["head.weight"]

    # ---- the whole stack, v_first carried up from layer 0 ------------------------------
    def _stack_step(self, m: dict[str, Tensor], x: Tensor, parts: Sequence[list[Tensor]]
                    ) -> tuple[list[dict[str, Tensor]], list[list[Tensor]]]:
        """One token through every layer: each layer's signals (s, y too) and new parts."""
        sigs, new, v_first = [], [], None
        for k in range(self.num_layers):
            sig, p, x = self.step_cell(k, m, x, list(parts[k]), v_first)
            v_first = sig["v"] if k == 0 else v_first
            sigs.append({**sig, "s": p[1], "y": x})
            new.append(p)
        return sigs, new

    def rerun(self, call: Call) -> Readout:
        """The free-running re-run in float64, one pass per layer over the whole window
        (``scan_block``: the package's own arithmetic on the float64 weights), v_first
        carried up from layer 0: the hand cell's equations without T·L calls from Python."""
        m, (H, N) = self.float64(), self.heads
        x, v_first, signals = call.inputs.double(), None, {}
        with torch.no_grad():
            for k in range(self.num_layers):
                sig, parts, x = scan_block(k, m, H, N, x, v_first)
                v_first = sig["v_first"]
                sig = {**sig, "s": parts[1], "y": x}
                for letter in self.spec.signals:
                    signals[f"{layer_name(k)}.{letter}"] = sig[letter].to(call.inputs.dtype)
        return Readout(signals=signals, meta={"method": "free-running", "family": self.name})

    def dynamics(self, call: Call, ref: Reference) -> list[Dynamics]:
        m, L, C = self.float64(), self.num_layers, self.hidden_size

        def step(x: Tensor, flat: Sequence[Tensor]) -> list[Tensor]:
            parts = [list(flat[3 * k : 3 * k + 3]) for k in range(L)]
            return [p for layer in self._stack_step(m, x, parts)[1] for p in layer]

        units = torch.cat([torch.where(u >= 0, u + k * C, u) for k in range(L)
                           for u in self.part_units(k)])
        return [Dynamics(step=step, inputs=call.inputs.double(),
                         trajectory=[p.double() for k in range(L)
                                     for p in ref.extra["parts"][k]],
                         initial=[p for k in range(L) for p in self.initial_parts(k, call.batch)],
                         order=list(range(call.length)), units=units)]
