"""transformers' RWKV-4 (``RwkvModel``, inside ``RwkvForCausalLM``; 5.23).

Block k (layer 0 first applies ``pre_ln``): a = ln1(x), with the token shift a_{t−1}:
  k_t = W_k (μ_k a_t + (1 − μ_k) a_{t−1}), v_t and r_t = σ(W_r ·) likewise;
  wkv_t = (num_{t−1} + e^{u + k_t} v_t) / (den_{t−1} + e^{u + k_t}),  u = time_first;
  num_t = e^{−w} num_{t−1} + e^{k_t} v_t,  den_t = e^{−w} den_{t−1} + e^{k_t},  w = exp(time_decay);
  x ← x + W_o (r ⊙ wkv);  then the channel mix with its own token shift of ln2(x).
Per channel the carried state is the PAIR (num, den) (METHODS), kept by the package in a
max-shifted form (num·e^{−p}, den·e^{−p}, p) and brought back here to one scale,
(num, den) = e^{p}·(its num, its den); the keep is e^{−w}, constant in time. The ratio
num/den (``wkv``, what the layer reads out) is not the carried state: its own mixing
factor e^{−w} den_{t−1}/den_t reads den, so it has a return path even inside one layer.
The input enters (num, den) through the token shift: a window of 2 positions.

The module's own trajectory, from ONE whole-sequence forward (``scan_modules``,
``trajectory_recorded``): its CPU path forms key, value and receptance for the whole window
with its Linear modules, which are recorded, then loops over t for the max-shifted state,
returning only the last; that loop is replayed on what they returned, the package's own
operations in its order (rwkv4_scan.wkv_replay), so every state is the one its loop held
(the returned state after the window, bit for bit) and its wkv the forward's (r ⊙ wkv is
what the output Linear received: ``step_vs_forward``, zero; the one-step check holds the
read-out wkv against it, as the states never read time_first). ``trace`` reads these values
themselves (method "own"); ``open_cells`` records the user's own forward. At rwkv-4-169m's
config (B = 2, T = 128; 2 and 12 layers) the trace costs 1.4–1.7× the backbone's forward,
the decode path 19–23× (BENCHMARKS.md, 2026-12-06). The free-running re-run goes a layer at a
time (``scan_layer``). A module on the decode path instead (a forward put in place of the
attention's, or transformers' CUDA kernel): the model run one token at a time with ``state``
passed along, every state after every step, one window at a time: in transformers
5.23 a one-token call with a state and a batch of B > 1 broadcasts the token shift to
(B, B, C) (``extract_key_value``: the shifted (B, C) against hidden (B, 1, C)), so a batch is
stepped window by window. transformers 5.23 cannot build a 1-layer
RWKV (``_init_weights`` divides by num_hidden_layers − 1); tests build two layers.

>>> import torch
>>> from transformers import RwkvConfig, RwkvModel
>>> cfg = RwkvConfig(vocab_size=7, hidden_size=8, num_hidden_layers=2, context_length=16,
...                  attention_hidden_size=8, intermediate_size=16)
>>> fam = HFRwkvFamily(RwkvModel(cfg))
>>> call = fam.check(torch.randint(0, 7, (2, 6)))
>>> max(d.max_scaled_diff_h for d in fam.one_step(call, fam.reference(call))) < 1e-5
True
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor, nn

from gatelens.families.base import Call
from gatelens.families.buffers import zeros64
from gatelens.families.delta_edit import StepEdits, no_edit
from gatelens.families.hf_mamba import hf_check, hf_forward, hf_model, hf_split
from gatelens.families.official import OfficialFamily, Recorder
from gatelens.families.recipe import Recipe
from gatelens.families.rwkv4_scan import RwkvForward, token_shift, wkv_scan
from gatelens.families.spec import SIGMOID, CellSpec

_HF = "transformers.models.rwkv.modeling_rwkv"

RWKV4 = CellSpec(
    name="rwkv4", kind="rwkv", chunks=("k", "v", "r"),
    signals=("r", "k", "v", "keep", "s", "wkv", "y"), gates=("r", "keep"),
    keep_gate="keep", input_gate=None, state="s", output="y",
    bounds={"r": SIGMOID, "keep": SIGMOID},
    display={"keep": "keep e^{−w} per channel", "s": "state (num, den)",
             "wkv": "num/den read-out"})


def _build_rwkv(n_in: int, hidden: int, layers: int, *, vocab_size: int, settings: dict,
                **_: object) -> nn.Module:
    return hf_model("RwkvModel", "RwkvConfig", vocab_size=vocab_size, hidden_size=hidden,
                    num_hidden_layers=layers, attention_hidden_size=hidden,
                    intermediate_size=settings["intermediate_factor"] * hidden,
                    context_length=settings["context_length"])


def _check_rwkv(hidden: int, layers: int, heads: int) -> str | None:
    if layers < 2:
        return ("--cell hf-rwkv needs --layers 2 or more (transformers 5.23 cannot build a "
                "one-layer RWKV: ZeroDivisionError in its _init_weights)")
    return None


#: ``--cell hf-rwkv``: RWKV-4 with an FFN of 4 d, two layers at least
RWKV_RECIPE = Recipe(
    "hf-rwkv", "transformers' RwkvModel (RWKV-4; --layers 2 or more)", _build_rwkv,
    reads="ids", flags=frozenset(), package=("transformers", "transformers"),
    settings={"intermediate_factor": 4, "context_length": 2048}, check=_check_rwkv,
    keep_words="RWKV-4 e^(−w)", forward=hf_forward)


class HFRwkvFamily(RwkvForward, StepEdits, OfficialFamily):
    """transformers' ``RwkvModel`` (``RwkvForCausalLM.rwkv``)."""

    name = "hf-rwkv"
    opens_what = "transformers' RwkvModel / RwkvForCausalLM (RWKV-4)"
    cell_name = "rwkv4"
    specs = (RWKV4,)
    recipe = RWKV_RECIPE

    @classmethod
    def opens(cls, module: nn.Module) -> bool:
        return type(module).__module__ == _HF and type(module).__name__ == "RwkvModel"

    @property
    def num_layers(self) -> int:
        return len(self.module.blocks)

    @property
    def hidden_size(self) -> int:
        return int(self.module.blocks[0].attention.time_decay.shape[0])

    @property
    def width(self) -> int:
        return int(self.module.config.hidden_size)

    def state_units(self, k: int) -> Tensor:
        return torch.arange(self.hidden_size).repeat(2)  # num then den

    def part_units(self, k: int) -> list[Tensor]:
        none = torch.full((self.width,), -1, dtype=torch.int64)
        units = torch.arange(self.hidden_size)
        return [none, units, units, none]  # token shift, num, den, channel-mix shift

    def input_window(self) -> int:
        return 2

    def split_call(self, args, kwargs):
        return hf_split(args, kwargs, "state")

    def check(self, inputs, state=None) -> Call:
        return hf_check(self, inputs, state)

    def _forward(self, call: Call) -> Tensor:
        return self.own_output(call).last_hidden_state

    def own_output(self, call: Call) -> Any:
        """What the module returns for the call (a ModelOutput), its state off."""
        return self.module(inputs_embeds=call.inputs, use_cache=False)

    def _trajectory(self, call: Call) -> dict:
        L = self.num_layers
        mods = {f"block{k}": b for k, b in enumerate(self.module.blocks)}
        B, T, outs = call.batch, call.length, []
        parts: list[list[list[Tensor]]] = [[[] for _ in range(4)] for _ in range(L)]
        with Recorder(mods) as rec:
            for b in range(B):  # one window at a time: see the module docstring
                state = None
                for t in range(T):
                    out = self.module(inputs_embeds=call.inputs[b : b + 1, t : t + 1],
                                      state=state, use_cache=True)
                    state = out.state  # ffn_x, att_x, num, den, p: (1, C, L) each
                    outs.append(out.last_hidden_state)
                    for k in range(L):
                        scale = torch.exp(state[4][:, :, k].double())  # back from the shift
                        vals = (state[1][:, :, k], state[2][:, :, k].double() * scale,
                                state[3][:, :, k].double() * scale, state[0][:, :, k])
                        for j, v in enumerate(vals):
                            parts[k][j].append(v.double().clone())

        def seq(ts: list[Tensor]) -> Tensor:  # calls row by row, then step by step
            return torch.cat(ts, dim=0).reshape(B, T, -1)

        rec_x = {n: rec.stacked(n).reshape(B, T, -1) for n in mods}
        rec_y = {n: rec.stacked(n, outputs=True).reshape(B, T, -1) for n in mods}
        x = [rec_x[f"block{k}"] for k in range(L)]
        y = [rec_y[f"block{k}"] for k in range(L)]
        xo = [self.post(k, self.module, x[k], y[k]) for k in range(L)]
        return {"x": x, "u": x, "y": y, "xo": xo,
                "parts": [[seq(p) for p in parts[k]] for k in range(L)],
                "aux": [None] * L, "output": seq(outs)}

    def initial_parts(self, k: int, batch: int) -> list[Tensor]:
        C, Ca = self.width, self.hidden_size
        return zeros64(self.module, batch, C, Ca, Ca, C)

    def step_cell(self, k, m, u, parts, aux, edit=no_edit):
        blk = m.blocks[k]
        att, ffn = blk.attention, blk.feed_forward
        a_prev, num, den, f_prev = parts
        h = blk.pre_ln(u) if k == 0 else u
        a = blk.ln1(h)  # (R, C): the token shift's next state, the layer's input alone

        def mix(cur, prev, mu):
            mu = mu.reshape(-1)
            return cur * mu + prev * (1 - mu)

        key = edit("k", att.key(mix(a, a_prev, att.time_mix_key)))  # (R, Ca)
        value = edit("v", att.value(mix(a, a_prev, att.time_mix_value)))
        r = edit("r", torch.sigmoid(att.receptance(mix(a, a_prev, att.time_mix_receptance))))
        keep = edit("keep", torch.exp(-torch.exp(att.time_decay)).expand_as(key))  # e^{−w}
        bonus = torch.exp(att.time_first + key)
        # position t reads the state before its step (and its own key and value)
        wkv = edit("wkv", (num + bonus * value) / (den + bonus))
        ek = torch.exp(key)
        s_new = edit("s", torch.cat([keep * num + ek * value, keep * den + ek], dim=-1))
        num_new, den_new = s_new.chunk(2, dim=-1)
        h = h + att.output(r * wkv)
        f = blk.ln2(h)
        fk = torch.square(torch.relu(ffn.key(mix(f, f_prev, ffn.time_mix_key))))
        fr = torch.sigmoid(ffn.receptance(mix(f, f_prev, ffn.time_mix_receptance)))
        y = h + fr * ffn.value(fk)
        sig = {"r": r, "k": key, "v": value, "keep": keep, "wkv": wkv}
        return sig, [a, num_new, den_new, f], y

    def scan_layer(self, k: int, m: nn.Module, u: Tensor
                   ) -> tuple[dict[str, Tensor], list[Tensor], Tensor]:
        """Layer k's hand cell over whole windows ``u`` (B, T, C) from the zero state, in
        ``m``'s dtype: the token shifts and every projection at once (none reads the state),
        then (num, den) along time (rwkv4_scan.wkv_scan). ``step_cell``'s equations;
        (signals, parts, y), each (B, T, ·)."""
        blk = m.blocks[k]
        att, ffn = blk.attention, blk.feed_forward
        h = blk.pre_ln(u) if k == 0 else u
        a = blk.ln1(h)

        def mix(cur, mu):
            mu = mu.reshape(-1)
            return cur * mu + token_shift(cur) * (1 - mu)

        key, value = att.key(mix(a, att.time_mix_key)), att.value(mix(a, att.time_mix_value))
        r = torch.sigmoid(att.receptance(mix(a, att.time_mix_receptance)))
        keep = torch.exp(-torch.exp(att.time_decay)).expand_as(key)
        wkv, num, den = wkv_scan(keep, torch.exp(att.time_first + key), key, value)
        h = h + att.output(r * wkv)
        f = blk.ln2(h)
        fk = torch.square(torch.relu(ffn.key(mix(f, ffn.time_mix_key))))
        y = h + torch.sigmoid(ffn.receptance(mix(f, ffn.time_mix_receptance))) * ffn.value(fk)
        sig = {"r": r, "k": key, "v": value, "keep": keep, "wkv": wkv}
        return sig, [a, num, den, f], y

    def state_of(self, k: int, parts: list[Tensor]) -> Tensor:
        return torch.cat([parts[1], parts[2]], dim=-1)  # (R, 2 Ca): num, den

    def pre(self, k, m, x):
        return x

    def post(self, k, m, x, y):
        every = m.config.rescale_every
        if getattr(m, "layers_are_rescaled", False) and every > 0 and (k + 1) % every == 0:
            return y / 2  # the model halves the hidden state every rescale_every blocks
        return y

    def final(self, m, x):
        return m.ln_out(x)
