"""NX-AI's ``xlstm`` (2.0.6): an ``xLSTMBlockStack`` (also inside ``xLSTMLMModel``) that
mixes mLSTM and sLSTM blocks (``slstm_at``; the xLSTM paper's [7:1] models), read block by
block, each block with its own kind's cell.

Each block k is stepped by the family of its kind, bound to the same stack and reading only
the blocks of that kind (families/xlstm_mlstm.py for an mLSTM block, families/xlstm_slstm.py
for an sLSTM block, on the vanilla backend): the module's own trajectory is the stack's
``step`` path block by block, and every piece of the hand cell (its parts, state, units and
signals) is that family's own. The trace names layer k's signals by its kind: an mLSTM
block's ``layerK.{i, f, s, h, y}``, an sLSTM block's ``layerK.{z, i, f, o, kappa, s, h, y}``.

The measurements read one keep gate for all layers, so every layer also holds ``kappa``, the
factor that scales its carried state: an sLSTM block's own κ = f n / n', an mLSTM block's
head keep σ(f̃) (its ``f``, once more under the common name). The ``xlstm_mixed`` cell's
letters are the ones every layer holds (i, f, kappa, s, h, y); a layer's keep gate has its
own width (an mLSTM block's heads, an sLSTM block's channels), and its write is read from
its own states, e_t = s_t − κ_t ⊙ s_{t−1} (exactly an sLSTM's (1 − κ) z).

>>> import torch
>>> fam = XLSTMMixedFamily(tiny_mixed_stack())
>>> call = fam.check(torch.randn(2, 6, 8))
>>> max(d.max_scaled_diff_h for d in fam.one_step(call, fam.reference(call))) < 1e-5
True
>>> [n for n in fam.names() if n.endswith(".kappa")]
['layer0.kappa', 'layer1.kappa']
"""

from __future__ import annotations

import math

import torch
from torch import Tensor, nn

from gatelens.errors import GatelensError
from gatelens.families.delta_edit import no_edit
from gatelens.families.recipe import Recipe
from gatelens.families.spec import SIGMOID, CellSpec
from gatelens.families.xlstm_mlstm import MLSTM_RECIPE, XLSTMMLSTMFamily, mlstm_block
from gatelens.families.xlstm_slstm import (
    _STACK,
    SLSTM_RECIPE,
    XLSTMSLSTMFamily,
    XLSTMStack,
    _kind,
    slstm_block,
    xlstm_stack,
)

XLSTM_MIXED = CellSpec(
    name="xlstm_mixed", kind="xlstm", chunks=("i", "f"),
    signals=("i", "f", "kappa", "s", "h", "y"), gates=("i", "f", "kappa"), keep_gate="kappa",
    input_gate="i", state="s", bounds={"i": SIGMOID, "f": SIGMOID, "kappa": SIGMOID},
    display={"kappa": "keep: sLSTM f n / n', mLSTM σ(f̃) per head", "f": "forget σ(f̃)",
             "i": "input exp(ĩ − m')", "s": "state: sLSTM c/n, mLSTM (C, n)·e^m per head"})

_KINDS = {"mLSTMLayer": XLSTMMLSTMFamily, "sLSTMLayer": XLSTMSLSTMFamily}


def _build_mixed(n_in: int, hidden: int, layers: int, *, heads: int = 1, settings: dict,
                 **_: object) -> nn.Module:
    at = [k for k in settings["slstm_at"] if 0 <= k < layers]
    if not at or len(at) == layers:
        raise GatelensError(f"xlstm-mixed: slstm_at {settings['slstm_at']} in {layers} blocks "
                            "leaves no sLSTM or no mLSTM block")
    block = {"mlstm_block": mlstm_block(settings, heads),
             "slstm_block": slstm_block(settings, heads), "slstm_at": at}
    return xlstm_stack(block, hidden, layers, settings["context_length"])


def _check_mixed(hidden: int, layers: int, heads: int) -> str | None:
    return None if layers >= 2 else "xlstm-mixed needs --layers 2 or more (mLSTM and sLSTM)"


#: ``--cell xlstm-mixed``: the [7:1] pattern scaled down, one sLSTM block (at 1) among the
#: mLSTM blocks; each kind's settings as ``--cell xlstm-mlstm`` / ``xlstm-slstm`` set them
MIXED_RECIPE = Recipe(
    "xlstm-mixed", "xlstm's xLSTMBlockStack of mLSTM blocks with an sLSTM block at 1 (--heads)",
    _build_mixed, reads="embedded", flags=frozenset({"heads"}), package=("xlstm", "xlstm"),
    settings={**MLSTM_RECIPE.settings, **SLSTM_RECIPE.settings, "slstm_at": [1]},
    multiple=lambda heads: math.lcm(heads, MLSTM_RECIPE.size_multiple(heads)),
    check=_check_mixed, keep_words="xlstm's sLSTM κ and mLSTM head f")


def _view(cls: type[XLSTMStack], module: nn.Module, blocks: list[int]) -> XLSTMStack:
    """``cls`` bound to ``module``, reading only ``blocks`` (its own kind's) for its facts."""
    view = type(f"{cls.__name__}Blocks", (cls,), {
        "layers": property(lambda self: [module.blocks[k].xlstm for k in blocks])})
    return view(module)


def tiny_mixed_stack(dim: int = 8, blocks: int = 2, slstm_at: tuple[int, ...] = (1,),
                     heads: int = 2, conv: int = 2, context: int = 32) -> nn.Module:
    """A small random mixed xLSTMBlockStack: mLSTM blocks with sLSTM blocks at ``slstm_at``
    (vanilla backend), every block's weights randomised as ``tiny_mlstm_stack`` and
    ``tiny_slstm_stack`` do (xlstm initialises R and the mLSTM gates at zero)."""
    from xlstm import (
        FeedForwardConfig,
        mLSTMBlockConfig,
        mLSTMLayerConfig,
        sLSTMBlockConfig,
        sLSTMLayerConfig,
        xLSTMBlockStack,
        xLSTMBlockStackConfig,
    )

    cfg = xLSTMBlockStackConfig(
        mlstm_block=mLSTMBlockConfig(mlstm=mLSTMLayerConfig(
            conv1d_kernel_size=conv, qkv_proj_blocksize=2, num_heads=heads)),
        slstm_block=sLSTMBlockConfig(slstm=sLSTMLayerConfig(
            backend="vanilla", num_heads=heads, conv1d_kernel_size=conv,
            bias_init="powerlaw_blockdependent"),
            feedforward=FeedForwardConfig(proj_factor=1.3, act_fn="gelu")),
        context_length=context, num_blocks=blocks, embedding_dim=dim, slstm_at=list(slstm_at))
    return spread_gates(xLSTMBlockStack(cfg))


def spread_gates(stack: nn.Module) -> nn.Module:
    """The stack (an xLSTMBlockStack) with each block's recurrent weights and gates
    randomised, in place, as ``tiny_slstm_stack`` and ``tiny_mlstm_stack`` do (xlstm starts
    R and the mLSTM gate weights at zero, which would leave a check blind); returned."""
    with torch.no_grad():
        for block in stack.blocks:
            if _kind(block) == "sLSTMLayer":
                cell = block.xlstm.slstm_cell
                cell._recurrent_kernel_.normal_(0.0, 0.5)
                cell._bias_.add_(torch.randn_like(cell._bias_))
            else:
                cell = block.xlstm.mlstm_cell
                for gate in (cell.igate, cell.fgate):
                    gate.weight.normal_(0.0, 0.3)
                cell.igate.bias.normal_(0.0, 1.0)
    return stack.eval()


class XLSTMMixedFamily(XLSTMStack):
    """xlstm's xLSTMBlockStack mixing mLSTM and sLSTM blocks, each read by its own kind."""

    name = "xlstm-mixed"
    state_dtype = torch.float64  # an mLSTM block's raw-scale memory (xlstm_mlstm.py)
    opens_what = ("xlstm's xLSTMBlockStack / xLSTMLMModel mixing mLSTM and sLSTM blocks "
                  "(slstm_at; NX-AI, 2.0.6)")
    cell_name = "xlstm_mixed"
    specs = (XLSTM_MIXED,)
    units_name = "head (mLSTM blocks), channel (sLSTM blocks)"
    recipe = MIXED_RECIPE

    @classmethod
    def opens(cls, module: nn.Module) -> bool:
        t = type(module)
        return (t.__module__, t.__name__) == _STACK and {
            _kind(b) for b in module.blocks} == set(_KINDS)

    def __init__(self, module: nn.Module) -> None:
        self.module = module
        kinds = [_kind(b) for b in module.blocks]
        #: per kind, its family reading only its own blocks (its checks run here)
        self.views = {kind: _view(cls, module, [k for k, x in enumerate(kinds) if x == kind])
                      for kind, cls in _KINDS.items()}
        self.kinds = kinds

    def view(self, k: int) -> XLSTMStack:
        """The family of block k's kind."""
        return self.views[self.kinds[k]]

    def letters(self, k: int) -> tuple[str, ...]:
        own = self.view(k).spec.signals
        if "kappa" in own:
            return own
        at = own.index("f") + 1
        return own[:at] + ("kappa",) + own[at:]

    @property
    def hidden_size(self) -> int:
        """The widest layer's units (each layer's own: ``unit_count``)."""
        return max(self.unit_count(k) for k in range(self.num_layers))

    def unit_count(self, k: int) -> int:
        return self.view(k).hidden_size

    def describe(self) -> dict:
        return {**super().describe(), "blocks": list(self.kinds),  # "hidden": the widest
                "hidden_per_block": [self.unit_count(k) for k in range(self.num_layers)]}

    def input_window(self) -> int:
        return max(v.input_window() for v in self.views.values())

    # ---- each block by its own kind ---------------------------------------------------
    def _step_state(self, k: int, st: dict, B: int) -> list[Tensor]:
        return self.view(k)._step_state(k, st, B)

    def state_units(self, k: int) -> Tensor:
        return self.view(k).state_units(k)

    def part_units(self, k: int) -> list[Tensor]:
        return self.view(k).part_units(k)

    def initial_parts(self, k: int, batch: int) -> list[Tensor]:
        return self.view(k).initial_parts(k, batch)

    def initial_stabiliser(self, k: int, batch: int) -> Tensor:
        return self.view(k).initial_stabiliser(k, batch)

    def step_cell(self, k, m, u, parts, aux, edit=no_edit, prev=None):
        view, own = self.view(k), edit
        if "kappa" not in view.spec.signals:  # an mLSTM block: its keep f is also "kappa"
            def own(letter: str, value: Tensor) -> Tensor:
                return edit("kappa", edit("f", value)) if letter == "f" else edit(letter, value)
        sig, new, y = view.step_cell(k, m, u, parts, aux, edit=own, prev=prev)
        return {"kappa": sig["f"], **sig}, new, y  # an sLSTM block's own κ wins

    def state_of(self, k: int, parts: list[Tensor]) -> Tensor:
        return self.view(k).state_of(k, parts)

    def carried_parts(self, k: int, parts: list[Tensor], dtype: torch.dtype) -> list[Tensor]:
        return self.view(k).carried_parts(k, parts, dtype)  # mLSTM memory: float64


__all__ = ["XLSTM_MIXED", "XLSTMMixedFamily", "spread_gates", "tiny_mixed_stack"]
