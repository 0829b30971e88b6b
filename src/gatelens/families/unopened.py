"""What gatelens says of a model in which no family opens anything: one line, naming the
layer that stops it where it knows the layer's kind.

Three cases, in this order:

- a layer of a kind that is a recurrence gatelens knows but does not open yet (``KNOWN``:
  MiniMax's lightning attention, Zamba's Mamba-1 mixer) or whose only code is a fused
  kernel with no CPU path (flash-linear-attention's layers): the layer's path, its class
  and why;
- short convolutions (LFM2's ``Lfm2ShortConv`` and their kin: a window over the last few
  tokens, no carried state) and nothing else: nothing in the model is a recurrence;
- anything else (a plain transformer): nothing in it is a recurrence gatelens opens, and
  where the list of what it opens is.

>>> from torch import nn
>>> nothing_opened(nn.Sequential(nn.Linear(2, 2)))  # doctest: +ELLIPSIS
'Sequential: nothing in it is a recurrence gatelens opens (its modules: Linear); ...'
"""

from __future__ import annotations

from torch import nn

#: (module path, class name) -> why gatelens does not open it (yet)
KNOWN: dict[tuple[str, str], str] = {
    ("transformers.models.minimax.modeling_minimax", "MiniMaxLightningAttention"):
        "MiniMax's lightning attention (a linear attention with a fixed decay per head), "
        "a recurrence gatelens does not open yet",
    ("transformers.models.zamba.modeling_zamba", "ZambaMambaMixer"):
        "Zamba's Mamba-1 mixer (Zamba v1), a recurrence gatelens does not open yet "
        "(Zamba2's Mamba-2 mixers are opened: hf-mamba2-mixer)",
}
#: packages whose layers run only as fused GPU kernels (no PyTorch path on the CPU)
FUSED = {"fla": "flash-linear-attention's layers run its Triton kernels, which have no "
                "CPU path; gatelens opens transformers' and the packages' own PyTorch layers "
                "(e.g. Qwen3-Next's Gated DeltaNet, Kimi-Linear's KDA)"}


def _kind(m: nn.Module) -> str | None:
    """Why the module is a known recurrence gatelens does not open, or None."""
    cls = type(m)
    why = KNOWN.get((cls.__module__, cls.__name__))
    if why is None:
        why = FUSED.get(cls.__module__.split(".", 1)[0])
    return why


def _short_conv(m: nn.Module) -> bool:
    return "ShortConv" in type(m).__name__


def nothing_opened(model: nn.Module) -> str:
    """The one line for a model no family opens anything in (module docstring)."""
    from gatelens.families.registry import family_classes

    name = type(model).__name__
    for path, m in model.named_modules():
        why = _kind(m)
        if why is not None:
            where = path or "the model itself"
            return f"{name}: {where} ({type(m).__name__}) is {why}"
    convs = sorted({type(m).__name__ for m in model.modules() if _short_conv(m)})
    opened = ", ".join(dict.fromkeys(cls.name for cls in family_classes()))
    what = f"gatelens opens {opened} (gatelens.families() says what each is)"
    if convs:
        return (f"{name}: nothing in it is a recurrence gatelens opens: its "
                f"{', '.join(convs)} layers are short convolutions (a window over the last "
                f"few tokens, no carried state) and the rest attention and MLPs; {what}")
    kinds = sorted({type(m).__name__ for m in model.children()}) or ["none"]
    return (f"{name}: nothing in it is a recurrence gatelens opens (its modules: "
            f"{', '.join(kinds)}); {what}")
