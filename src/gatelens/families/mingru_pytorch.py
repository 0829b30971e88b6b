"""lucidrains' ``mingru-pytorch`` (0.2.1): its ``minGRU`` and ``minLSTM`` layers, and its
language model ``minLM`` (a stack of them), read in the package's own equations.

The package's cells have no bias and put its activation g(x) = x + 0.5 (x ≥ 0), σ(x)
(x < 0) on the candidate, so h stays positive and the forward runs a log-space scan:

- minGRU: ``hidden, gate = to_hidden_and_gate(u).chunk(2)``; z = σ(gate), h̃ = g(hidden),
  h' = (1 − z) ⊙ h + z ⊙ h̃ (its ``torch.lerp``); keep 1 − z;
- minLSTM: ``hidden, f, i = to_hidden_and_f_i_gate(u).chunk(3)``; f′ = σ(f)/(σ(f) + σ(i)),
  h' = f′ ⊙ h + (1 − f′) ⊙ g(hidden); keep f′;

and the layer's output is ``to_out(h)``. ``minLM`` runs block k as
u = RMSNorm(x), x ← x + rnn(u), x ← x + FF(RMSNorm(x)), logits = to_logits(RMSNorm(x)).
The module's own trajectory is its own sequential path (one position a call, ``prev_hidden``
passed along: the package's ``seq_len == 1`` branch), h read where ``to_out`` receives it;
each hand step fed its h_{t−1} lands on its h_t at rounding level (the one-step check). The
whole-sequence forward (the log-space scan in float32) parts from it by about T × 4e-8 of the
unit's scale; the reference reports that figure as ``step_vs_forward``.
``enable_conv=True`` (a convolution before each layer, with no step form in the package)
is refused.

>>> import torch
>>> from minGRU_pytorch.minLM import minLM
>>> fam = MinGRUPytorchFamily(minLM(num_tokens=5, dim=8, depth=2))
>>> call = fam.check(torch.randint(0, 5, (2, 6)))
>>> [round(d.max_scaled_diff_h, 5) for d in fam.one_step(call, fam.reference(call))]
[0.0, 0.0]
"""

from __future__ import annotations

import torch
from torch import Tensor, nn

from gatelens.errors import GatelensError
from gatelens.families.base import Call
from gatelens.families.buffers import zeros64
from gatelens.families.delta_edit import StepEdits, no_edit
from gatelens.families.official import OfficialFamily, Recorder
from gatelens.families.recipe import Recipe
from gatelens.families.spec import SIGMOID, CellSpec

_PKG = "minGRU_pytorch"

MINGRU_PT_GRU = CellSpec(
    name="mingru_pt_gru", kind="mingru-pytorch", chunks=("cand", "z"),
    signals=("z", "cand", "keep", "h", "y"), gates=("z", "keep"), keep_gate="keep",
    input_gate=None, state="h", candidate="cand", bounds={"z": SIGMOID, "keep": SIGMOID},
    display={"keep": "keep 1 − z", "cand": "candidate g(h̃)"})
MINGRU_PT_LSTM = CellSpec(
    name="mingru_pt_lstm", kind="mingru-pytorch", chunks=("cand", "f", "i"),
    signals=("f", "i", "cand", "keep", "h", "y"), gates=("f", "i", "keep"),
    keep_gate="keep", input_gate="i", state="h", candidate="cand",
    bounds={"f": SIGMOID, "i": SIGMOID, "keep": SIGMOID},
    display={"keep": "keep f′ = f/(f + i)", "cand": "candidate g(h̃)"})


def _build_minlm(n_in: int, hidden: int, layers: int, *, vocab_size: int, settings: dict,
                 **_: object) -> nn.Module:
    from minGRU_pytorch.minLM import minLM

    return minLM(num_tokens=vocab_size, dim=hidden, depth=layers, **settings)


#: ``--cell mingru-pytorch`` (earlier ``mingru-lm``): the package's whole minLM (minGRU,
#: expansion 1.5, FFN 4); its own embedding and head (token_emb, to_logits) stand for ours
MINLM_RECIPE = Recipe(
    "mingru-pytorch", "mingru-pytorch's minLM of minGRU layers (its own embedding and head)",
    _build_minlm, reads="lm", flags=frozenset(), package=(_PKG, "mingru-pytorch"),
    settings={"ff_mult": 4, "expansion": 1.5, "use_lstm": False},
    keep_words="mingru-pytorch's minGRU 1 − z", aliases=("mingru-lm",))


def _is(module: nn.Module, file: str, name: str) -> bool:
    cls = type(module)
    return cls.__module__ == f"{_PKG}.{file}" and cls.__name__ == name


def g(x: Tensor) -> Tensor:
    """The package's candidate activation: x + 0.5 for x ≥ 0, σ(x) below."""
    return torch.where(x >= 0, x + 0.5, torch.sigmoid(x))


class MinGRUPytorchFamily(StepEdits, OfficialFamily):
    """mingru-pytorch's minGRU / minLSTM layer, or its minLM stack of them."""

    name = "mingru-pytorch"
    opens_what = "mingru-pytorch's minGRU, minLSTM and minLM (lucidrains, 0.2.1)"
    specs = (MINGRU_PT_GRU, MINGRU_PT_LSTM)
    recipe = MINLM_RECIPE

    @classmethod
    def opens(cls, module: nn.Module) -> bool:
        return (_is(module, "minLM", "minLM") or _is(module, "minGRU", "minGRU")
                or _is(module, "minLSTM", "minLSTM"))

    def __init__(self, module: nn.Module) -> None:
        super().__init__(module)
        self.lm = _is(module, "minLM", "minLM")
        self.output_is_logits = self.lm  # minLM's own head: its output is the logits
        if self.lm and not module.can_cache:
            raise GatelensError("mingru-pytorch minLM(enable_conv=True): its convolution "
                                "before each layer has no step form; not supported")
        self.rnns = [layer[2] for layer in module.layers] if self.lm else [module]
        self.lstm = _is(self.rnns[0], "minLSTM", "minLSTM")
        self.cell_name = "mingru_pt_lstm" if self.lstm else "mingru_pt_gru"

    @property
    def num_layers(self) -> int:
        return len(self.rnns)

    @property
    def hidden_size(self) -> int:
        lin = self._lin(self.rnns[0])
        return lin.out_features // (3 if self.lstm else 2)

    def _lin(self, rnn: nn.Module) -> nn.Linear:
        return rnn.to_hidden_and_f_i_gate if self.lstm else rnn.to_hidden_and_gate

    def state_units(self, k: int) -> Tensor:
        return torch.arange(self.hidden_size)

    # ---- a call ------------------------------------------------------------------
    def split_call(self, args: tuple, kwargs: dict):
        return (args[0] if args else kwargs.get("x")), (
            kwargs.get("prev_hiddens") if self.lm else
            (args[1] if len(args) > 1 else kwargs.get("prev_hidden")))

    def check(self, inputs, state=None) -> Call:
        if not self.lm:
            return super().check(inputs, state)
        if state is not None:
            raise GatelensError("mingru-pytorch minLM: prev_hiddens is not supported; the "
                                "analysis runs from zeros")
        if not isinstance(inputs, Tensor) or inputs.ndim != 2 or inputs.is_floating_point():
            got = tuple(inputs.shape) if isinstance(inputs, Tensor) else type(inputs).__name__
            raise GatelensError(f"mingru-pytorch minLM: inputs must be token ids (B, T); got {got}")
        with torch.no_grad():
            emb = self.module.token_emb(inputs)  # (B, T, D)
        return Call(inputs=emb, layout={"batch_first": True, "ids": inputs})

    def _forward(self, call: Call) -> Tensor:
        return self.module(call.layout["ids"]) if self.lm else self.module(call.inputs)

    def _steps(self, call: Call) -> Tensor:
        """The module's own sequential path: one position a call, its state passed along."""
        outs, prev = [], None
        for t in range(call.length):
            if self.lm:
                out, prev = self.module(call.layout["ids"][:, t : t + 1], prev_hiddens=prev,
                                        return_prev_hiddens=True)
            else:
                out, prev = self.module(call.inputs[:, t : t + 1], prev,
                                        return_next_prev_hidden=True)
            outs.append(out)
        return torch.cat(outs, dim=1)  # (B, T, ·)

    def _trajectory(self, call: Call) -> dict:
        mods = {f"rnn{k}": r for k, r in enumerate(self.rnns)}
        mods.update({f"out{k}": r.to_out for k, r in enumerate(self.rnns)})
        if self.lm:
            mods.update({f"norm{k}": layer[1] for k, layer in enumerate(self.module.layers)})
            mods["final"] = self.module.norm
        with Recorder(mods) as rec:
            output = self._steps(call)
        L = self.num_layers
        u = [rec.stacked(f"rnn{k}") for k in range(L)]
        y = [rec.stacked(f"rnn{k}", outputs=True) for k in range(L)]
        h = [rec.stacked(f"out{k}") for k in range(L)]  # the scan's h, before to_out
        if self.lm:
            x = [rec.stacked(f"norm{k}") for k in range(L)]
            xo = x[1:] + [rec.stacked("final")]
        else:
            x, xo = u, y
        return {"x": x, "u": u, "y": y, "xo": xo, "parts": [[p] for p in h],
                "aux": [None] * L, "output": output}

    # ---- the hand cell -----------------------------------------------------------
    def initial_parts(self, k: int, batch: int) -> list[Tensor]:
        return zeros64(self.module, batch, self.hidden_size)

    def step_cell(self, k, m, u, parts, aux, edit=no_edit):
        rnn = m.layers[k][2] if self.lm else m
        (h,) = parts
        if self.lstm:
            hidden, pf, pi = self._lin(rnn)(u).chunk(3, dim=-1)  # (N, H) each
            f, i = edit("f", torch.sigmoid(pf)), edit("i", torch.sigmoid(pi))
            cand = edit("cand", g(hidden))
            keep0 = f / (f + i)
            keep = edit("keep", keep0)  # an edited keep: its write 1 − keep follows it
            write = i / (f + i) if keep is keep0 else 1 - keep
            new = h * keep + cand * write  # as the package writes it: f′ h + i′ g(h̃)
            sig = {"f": f, "i": i, "cand": cand, "keep": keep}
        else:
            hidden, gate = self._lin(rnn)(u).chunk(2, dim=-1)  # (N, H) each
            z, cand = edit("z", torch.sigmoid(gate)), edit("cand", g(hidden))
            keep0 = 1 - z
            keep = edit("keep", keep0)
            z = z if keep is keep0 else 1 - keep
            new = torch.lerp(h, cand, z)  # (1 − z) h + z h̃, as the package writes it
            sig = {"z": z, "cand": cand, "keep": keep}
        new = edit("h", new)
        return {**sig, "h": new}, [new], rnn.to_out(new)

    def state_of(self, k: int, parts: list[Tensor]) -> Tensor:
        return parts[0]

    def pre(self, k, m, x):
        return m.layers[k][1](x) if self.lm else x

    def post(self, k, m, x, y):
        if not self.lm:
            return y
        _, _, _, ff_norm, ff, _ = m.layers[k]
        x = x + y
        return x + ff(ff_norm(x))

    def final(self, m, x):
        return m.to_logits(m.norm(x)) if self.lm else x

