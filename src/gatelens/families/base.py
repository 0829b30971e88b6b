"""The family interface: everything gatelens needs to know about one kind of recurrent module.

A *family* opens one kind of module (nn.LSTM, gatelens's minGRU, an ONNX LSTM with
peepholes, HF Mamba's mixer, ...). An instance is bound to one module and answers, in the
module's own terms:

- **facts**: its cell (the ``CellSpec`` of trace letters, gates, keep gate, carried state
  and what the cell writes), layers, directions and units per layer; its exact trace names;
- **a call**: how to read a forward call's input and state (``split_call``), checked and
  brought to one layout (``check`` -> ``Call``: batch-first (B, T, F));
- **the module's own trajectory** on that call (``reference``, computed once per analysis
  and shared by everything below);
- **the anchored read-out** (``read``): every signal of the trajectory the module took;
- **the free-running re-run** (``rerun``): the hand cell on its own outputs;
- **the one-step check** (``one_step``) and any read-out judged against the trajectory
  (``judge``), as ``LayerDiff`` rows;
- **the dynamics** (``dynamics``): the whole stack as one map s_t = F(s_{t−1}, x_t) along
  the trajectory, in float64, for the Jacobian-vector products of the divergence rate, the
  Lyapunov spectrum and the fixed points.

Every measurement is written once against this interface (``gatelens.analysis``); adding a
family is its own file and one line in ``gatelens.families.registry``.

>>> import torch
>>> d = Dynamics(step=lambda x, s: [0.5 * s[0] + x], inputs=torch.zeros(1, 3, 2),
...              trajectory=[torch.zeros(1, 3, 2)], initial=[torch.zeros(1, 2)],
...              order=[0, 1, 2], units=torch.tensor([0, 1]))
>>> d.size, [t.shape for t in d.step(torch.ones(1, 2), [torch.ones(1, 2)])]
(2, [torch.Size([1, 2])])
"""

from __future__ import annotations

import abc
import copy
import dataclasses
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, ClassVar

import torch
from torch import Tensor, nn

from gatelens.families.recipe import Recipe
from gatelens.families.spec import CellSpec, names_of
from gatelens.families.torch_ops import float64_bytes, no_embedding


@dataclass(frozen=True)
class LayerDiff:
    """Max differences of one layer and direction between a read-out and the trajectory."""

    layer: int
    reverse: bool
    max_abs_diff_h: float  # over every window, position and unit (and the final state)
    max_abs_diff_c: float | None  # a second state that is unbounded (LSTM c), else None
    max_scaled_diff_c: float | None = None  # max |Δc| / max(1, |c|)
    max_scaled_diff_h: float | None = None  # unbounded h: |Δh| / the unit's largest |h|
    #: the window (batch row) of the judged figure where the family says (the official
    #: families' state and output), else None: the float64 re-judgement reads it (depth.py)
    worst_window: int | None = None


@dataclass
class Call:
    """One trajectory of a module, checked and in the canonical layout.

    ``inputs`` is batch-first (B, T, F) whatever the module's own layout; ``state`` is the
    initial state in the family's own form, batched, or None for the module's default
    (zeros). ``layout`` holds whatever a family needs to give results back in the caller's
    layout (``batch_first``, ``unbatched``, packed lengths, ...).
    """

    inputs: Tensor  # (B, T, F)
    state: Any = None
    layout: dict = field(default_factory=dict)

    @property
    def batch(self) -> int:
        return int(self.inputs.shape[0])

    @property
    def length(self) -> int:
        return int(self.inputs.shape[1])


@dataclass
class Reference:
    """The module's own trajectory on one call: what its own forward computed.

    ``states``: every state the module itself produced, by trace name, (B, T, ·) (e.g.
    ``layer0.h``; the LSTM's ``layer0.c`` from PyTorch's own cell); ``inputs``: what each
    layer read, by layer name (``layer1`` -> (B, T, F_1)); ``initial``: each layer's initial
    state parts; ``output``: the module's output as returned (batch first); ``final``: its
    final state as returned. A family may keep more in ``extra``.
    """

    states: dict[str, Tensor]
    inputs: dict[str, Tensor]
    initial: dict[str, tuple[Tensor, ...]]
    output: Tensor | None = None
    final: Any = None
    extra: dict = field(default_factory=dict)


@dataclass
class Readout:
    """A read-out: every signal by trace name, (B, T, ·), and the final state."""

    signals: dict[str, Tensor]
    h_n: Tensor | None = None  # (L·D, B, H_out) as the module returns it
    c_n: Tensor | None = None  # a second final state (LSTM c), else None
    meta: dict = field(default_factory=dict)


@dataclass
class Dynamics:
    """One causal recurrence s_t = F(s_{t−1}, x_t) of a module along its own trajectory.

    The carried state is a list of parts (LSTM: per layer h then c); a tangent vector is the
    parts side by side. ``step`` is F on a batch, (x (B, F), [s_i (B, n_i)]) -> [s'_i], pure
    and differentiable (``torch.func.jvp``), float64. ``inputs[:, t]`` is what step t reads
    (for a stack, layer 0's input; a family may pack more, e.g. fixed inputs of every layer).
    ``trajectory[i][:, t]`` is part i after step t (a float32 module's own, read in float64
    a step at a time: a 24-layer stack's float64 copy was 0.7 GB a window), ``initial`` the
    parts before the first
    step of ``order`` (the processing order: a reverse direction runs T − 1 … 0).
    ``units[j]`` is the unit (0 … L·H − 1, layers pooled) that coordinate j of the
    concatenated state belongs to, −1 where none does (a projected h).
    """

    step: Callable[[Tensor, Sequence[Tensor]], list[Tensor]]
    inputs: Tensor  # (B, T, F)
    trajectory: list[Tensor]  # (B, T, n_i) each
    initial: list[Tensor]  # (B, n_i) each
    order: list[int]
    units: Tensor  # (S,) int64, S = Σ n_i
    name: str = "forward"
    #: steps of the window before ``order[0]`` (they made ``initial``); the burn-in counts
    #: them, so λ is summed over the same window steps whatever a family starts from
    offset: int = 0
    #: (B, S) unit start tangents -> (B, T) ln of each step's growth, the whole window at
    #: once (a family whose state enters its step linearly: families/mamba_sweep.py), or
    #: None where it cannot say; None: the step-by-step JVP only
    sweep: Callable[[Tensor], Tensor | None] | None = None

    @property
    def size(self) -> int:
        """S, the dimension of the carried state."""
        return int(self.units.shape[0])

    def previous(self, j: int) -> list[Tensor]:
        """The parts step ``order[j]`` reads: ``initial`` first, then the step before's, as
        tensors of their own: ``torch.func.jvp`` makes a dual of a primal's whole storage,
        so a view into the (B, T, n) trajectory would cost a copy of all of it a step
        (measured: 228 ms against 1.9 ms for a (2, 24576) slice of T = 128)."""
        if j == 0:
            return list(self.initial)
        t = self.order[j - 1]
        return [p[:, t].to(torch.float64, copy=True) for p in self.trajectory]

    def first(self, n: int) -> Dynamics:
        """The same recurrence on its first ``n`` windows (the step is the same for any
        batch)."""
        if n >= self.inputs.shape[0]:
            return self
        return dataclasses.replace(self, inputs=self.inputs[:n],
                                   trajectory=[p[:n] for p in self.trajectory],
                                   initial=[p[:n] for p in self.initial], sweep=None)


class Family(abc.ABC):
    """One opened recurrent module (see the module docstring for the contract)."""

    #: the registry name (``gatelens.families()`` lists them)
    name: ClassVar[str] = ""
    #: a reader's description of what the family opens
    opens_what: ClassVar[str] = ""
    #: the CellSpec of every cell this family opens (``registry.cell_spec`` finds them)
    specs: ClassVar[tuple[CellSpec, ...]] = ()
    #: how ``gatelens train --cell NAME`` builds this kind of module (families/recipe.py);
    #: None for a family that is opened but not trained
    recipe: ClassVar[Recipe | None] = None
    #: every call of the module is one step of the recurrence (a cell stepped by the
    #: caller), so a forward's calls are stitched into trajectories (readout/stitch.py)
    stepped: ClassVar[bool] = False
    #: the module's output is the model's logits (a family that opens a whole language
    #: model, e.g. mingru-pytorch's minLM); otherwise it is h, which Lens never takes for
    #: the logits (lens/logits.py)
    output_is_logits: bool = False
    #: ``intervene`` reads a whole call's every position itself, stretch by stretch of the
    #: module's own kernel, so a traced edited run reads the module once (interventions/run.py)
    edit_reads_whole: ClassVar[bool] = False
    #: why the family computes on the CPU only (its package's own code has no other path
    #: that it reads); None: wherever the module's weights are (``Lens(..., device=)``)
    cpu_only: ClassVar[str | None] = None

    def __init__(self, module: nn.Module) -> None:
        self.module = module

    @classmethod
    @abc.abstractmethod
    def opens(cls, module: nn.Module) -> bool:
        """Whether this family opens ``module`` (a class test, no side effect)."""

    # ---- facts -----------------------------------------------------------------------
    @property
    @abc.abstractmethod
    def spec(self) -> CellSpec:
        """The cell's facts (letters, gates, keep gate, carried state, what it writes)."""

    @property
    def cell(self) -> str:
        return self.spec.name

    @property
    @abc.abstractmethod
    def num_layers(self) -> int: ...

    @property
    def bidirectional(self) -> bool:
        return False

    @property
    @abc.abstractmethod
    def hidden_size(self) -> int:
        """Units per layer (of the keep gate and the carried state)."""

    @property
    def proj(self) -> bool:
        """Whether h is a projection of the cell's output (an LSTM's proj_size)."""
        return False

    def names(self) -> list[str]:
        """The exact trace names, in order."""
        return names_of(self.spec, self.num_layers, self.bidirectional, proj=self.proj)

    def describe(self) -> dict:
        """report.json's "model" facts of this module."""
        return {"cell": self.spec.kind, "family": self.name, "hidden": self.hidden_size,
                "layers": self.num_layers}

    # ---- a call ----------------------------------------------------------------------
    def split_call(self, args: tuple, kwargs: dict) -> tuple[Any, Any]:
        """(inputs, state) of one forward call, as a forward hook sees it."""
        inputs = args[0] if args else kwargs.get("input", kwargs.get("x"))
        state = args[1] if len(args) > 1 else kwargs.get("hx", kwargs.get("state"))
        return inputs, state

    def step_call(self, inputs: Any) -> bool:
        """Whether a call with these inputs is one step, to be stitched with the calls
        around it (every call of a ``stepped`` family; an nn.LSTM call with T = 1)."""
        return self.stepped

    def step_of(self, inputs: Any, state: Any, output: Any) -> Any:
        """One step call as a ``families.stepped.Step`` (its input, the state it received
        and returned, as (L, B, ·) parts); a family whose calls can be one step says how."""
        raise NotImplementedError(f"{type(self).__name__} does not stitch one-step calls")

    @abc.abstractmethod
    def check(self, inputs: Any, state: Any = None) -> Call:
        """Validate a call (clear errors naming what was expected) and bring it to a Call."""

    # ---- the module's own trajectory, read-outs, checks ---------------------------------
    @abc.abstractmethod
    def reference(self, call: Call) -> Reference:
        """What the module itself computed on ``call`` (once per analysis)."""

    @abc.abstractmethod
    def read(self, call: Call, ref: Reference) -> Readout:
        """The anchored read-out: every signal of the trajectory the module took."""

    def scan_modules(self) -> dict[str, nn.Module] | None:
        """Submodules whose calls during the module's own whole-sequence forward give its
        whole reference (``reference_recorded``), so ``open_cells`` reads the user's own
        forward instead of running the module again; None (the default) where it cannot."""
        return None

    def scan_steps(self) -> dict[str, tuple[nn.Module, type]] | None:
        """Submodules (with a TorchFunctionMode class) whose own loop's tensors the recorded
        forward keeps besides ``scan_modules``' calls (families/records.py's Recorder,
        forward_scan.SequentialScanStates); None (the default): none."""
        return None

    def reference_recorded(self, call: Call, rec: Any, returned: Any) -> Reference:
        """``reference`` of a call the module already ran with ``scan_modules`` recorded by
        ``rec`` (families/official.py's Recorder); ``returned``: what it returned."""
        return self.reference(call)

    def read_own(self, call: Call, ref: Reference) -> Readout | None:
        """Every signal as the module itself computed it, where the reference holds them all
        (a family whose states and gates are read from the module's own forward); None
        where a hand cell must compute the gates (``read``)."""
        return None

    def rerun(self, call: Call) -> Readout:
        """The hand cell from the initial state on its own outputs (free-running)."""
        return self.read(call, self.reference(call))

    @abc.abstractmethod
    def one_step(self, call: Call, ref: Reference) -> list[LayerDiff]:
        """Each step of the hand cell fed the trajectory's state at t − 1, against its
        state at t: the read-out's own error, per layer and direction."""

    @abc.abstractmethod
    def judge(self, readout: Readout, ref: Reference) -> list[LayerDiff]:
        """A read-out against the trajectory, per layer and direction."""

    def free_running(self, call: Call, ref: Reference) -> list[LayerDiff]:
        """The free-running divergence: the re-run judged against the trajectory."""
        return self.judge(self.rerun(call), ref)

    def output_diff(self, readout: Readout, output: Any) -> float | None:
        """max |read-out − what the module returned| (its output and final state), when the
        family can tell; ``open_cells`` reports it for free."""
        return None

    @abc.abstractmethod
    def dynamics(self, call: Call, ref: Reference) -> list[Dynamics]:
        """The recurrence of each causal direction along the trajectory (float64)."""

    #: the ``deepcopy`` memo of the family's float64 copy of its module, from the module
    #: (what the copy leaves out or puts in place of a part): the input embedding table (an
    #: official family's copy leaves it out; the estimate counts every family's so), a Mamba
    #: family's also widens its largest Linears at each call (upcast.py)
    float64_memo: ClassVar[Callable[[nn.Module], dict[int, Any]]] = staticmethod(no_embedding)

    def float64_bytes(self) -> int:
        """The bytes of this family's float64 copy of its module (analysis/estimate.py)."""
        return float64_bytes(self.module, self.float64_memo(self.module))

    def family64(self) -> Family:
        """This family on a float64 copy of its module (the module itself is left as it is):
        the float64 re-judgement's (readout/depth.py)."""
        return type(self)(copy.deepcopy(self.module).double())

    # ---- interventions -----------------------------------------------------------------
    def intervene(self, call: Call, plan: Any, output: Any, offset: int = 0
                  ) -> tuple[Any, dict[str, Tensor]]:
        """The module's output on ``call`` with ``plan``'s edits (families/edit_plan.py)
        inside its steps, as the module returns it, and every signal of the edited
        trajectory by trace name (B, T, ·). ``output``: what the module itself returned;
        ``offset``: the window position of the call's first step. A family that cannot
        yet says so in one line."""
        from gatelens.errors import GatelensError

        raise GatelensError(f"interventions do not support the {self.name} family "
                            f"({type(self.module).__name__}) yet")
