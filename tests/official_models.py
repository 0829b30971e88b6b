"""Tiny random models of the official implementations, for the families' tests.

Each builder returns (family, make_call) where make_call(seed, perturb_at=None) gives a
call on random input (token ids, or input vectors), the same input with position
``perturb_at`` changed when asked. Weights are randomised beyond the packages' own
initialisation where it would leave a test blind (xlstm's zero R and gate weights,
Mamba's tiny out_proj).
"""

from __future__ import annotations

import importlib
import warnings

import torch

VOCAB, DIM, T, B = 11, 16, 24, 3


def _quiet() -> None:
    warnings.filterwarnings("ignore", message=".*falling back to its reference PyTorch.*")
    try:
        from transformers.utils import logging

        logging.set_verbosity_error()
    except ImportError:  # pragma: no cover - the extra is installed by make
        pass


def spread_decays(model: torch.nn.Module, seed: int = 0) -> torch.nn.Module:
    """A transformers model's weights beyond its package's small initialisation (outputs
    of order one), its A_log drawn so decays (Gated DeltaNet's α, KDA's, a Mamba-2 mixer's
    a = exp(Δ·A)) lie around 0.6-0.98 and its dt_bias near −1: states and a perturbation of
    them worth measuring. In eval mode."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("A_log"):
                p.copy_(torch.empty(p.shape).uniform_(0.05, 0.5, generator=g).log())
            elif name.endswith("dt_bias"):
                p.copy_(-1.0 + 0.5 * torch.randn(p.shape, generator=g))
            elif "norm" not in name:
                p.add_(0.2 * torch.randn(p.shape, generator=g))
    return model.eval()


def _ids_call(fam, dtype):
    def make(seed: int, perturb_at: int | None = None):
        g = torch.Generator().manual_seed(seed)
        ids = torch.randint(0, VOCAB, (B, T), generator=g)
        if perturb_at is not None:
            ids[:, perturb_at] = (ids[:, perturb_at] + 1 + torch.randint(
                0, VOCAB - 1, (B,), generator=g)) % VOCAB
        return fam.check(ids)
    return make


def _vec_call(fam, dtype):
    def make(seed: int, perturb_at: int | None = None):
        g = torch.Generator().manual_seed(seed)
        x = torch.randn(B, T, DIM, generator=g, dtype=dtype)
        if perturb_at is not None:
            x[:, perturb_at] += torch.randn(B, DIM, generator=g, dtype=dtype)
        return fam.check(x)
    return make


def _spread(module: torch.nn.Module, std: float, skip: tuple[str, ...] = ()) -> None:
    with torch.no_grad():
        for name, p in module.named_parameters():
            if not any(s in name for s in skip):
                p.add_(std * torch.randn_like(p))


def mingru_lm(layers: int = 1, lstm: bool = False, dtype=torch.float32):
    importlib.import_module("minGRU_pytorch")
    from minGRU_pytorch.minLM import minLM

    from gatelens.families.mingru_pytorch import MinGRUPytorchFamily

    torch.manual_seed(1)
    m = minLM(num_tokens=VOCAB, dim=DIM, depth=layers, use_lstm=lstm).to(dtype).eval()
    fam = MinGRUPytorchFamily(m)
    return fam, _ids_call(fam, dtype)


def hf_mamba(layers: int = 1, dtype=torch.float32):
    importlib.import_module("transformers")
    _quiet()
    from transformers import MambaConfig, MambaModel

    from gatelens.families.hf_mamba import HFMambaFamily

    torch.manual_seed(2)
    cfg = MambaConfig(vocab_size=VOCAB, hidden_size=DIM, state_size=4, num_hidden_layers=layers,
                      expand=2, conv_kernel=3, time_step_rank=2)
    m = MambaModel(cfg)
    _spread(m, 0.3, skip=("A_log", "dt_proj.bias"))
    m = m.to(dtype).eval()
    fam = HFMambaFamily(m)
    return fam, _ids_call(fam, dtype)


def mambapy_stack(layers: int = 1, dtype=torch.float32):
    importlib.import_module("mambapy")
    from mambapy.mamba import Mamba, MambaConfig

    from gatelens.families.mambapy import MambapyFamily

    torch.manual_seed(3)
    m = Mamba(MambaConfig(d_model=DIM, n_layers=layers, d_state=4, d_conv=3))
    _spread(m, 0.3, skip=("A_log", "dt_proj.bias"))
    m = m.to(dtype).eval()
    fam = MambapyFamily(m)
    return fam, _vec_call(fam, dtype)


def hf_rwkv(layers: int = 2, dtype=torch.float32):
    """RWKV-4; transformers 5.23 cannot build one layer (ZeroDivisionError in its
    _init_weights), so a one-layer model is a two-layer one with its top block dropped."""
    importlib.import_module("transformers")
    _quiet()
    from transformers import RwkvConfig, RwkvModel

    from gatelens.families.hf_rwkv import HFRwkvFamily

    torch.manual_seed(4)
    cfg = RwkvConfig(vocab_size=VOCAB, hidden_size=DIM, num_hidden_layers=max(2, layers),
                     context_length=T, attention_hidden_size=DIM, intermediate_size=2 * DIM)
    m = RwkvModel(cfg)
    if layers == 1:
        m.blocks = m.blocks[:1]
        m.config.num_hidden_layers = 1
    _spread(m, 0.3, skip=("time_",))
    m = m.to(dtype).eval()
    fam = HFRwkvFamily(m)
    return fam, _ids_call(fam, dtype)


def xlstm_slstm(layers: int = 1, dtype=torch.float32):
    importlib.import_module("xlstm")
    from gatelens.families.xlstm_slstm import XLSTMSLSTMFamily, tiny_slstm_stack

    torch.manual_seed(5)
    fam = XLSTMSLSTMFamily(tiny_slstm_stack(dim=DIM, blocks=layers, heads=2, conv=3).to(dtype))
    return fam, _vec_call(fam, dtype)


def xlstm_mlstm(layers: int = 1, dtype=torch.float32):
    importlib.import_module("xlstm")
    from gatelens.families.xlstm_mlstm import XLSTMMLSTMFamily, tiny_mlstm_stack

    torch.manual_seed(6)
    fam = XLSTMMLSTMFamily(tiny_mlstm_stack(dim=DIM, blocks=layers, heads=2, conv=3).to(dtype))
    return fam, _vec_call(fam, dtype)


def hf_mamba2(layers: int = 1, dtype=torch.float32):
    importlib.import_module("transformers")
    _quiet()
    from transformers import Mamba2Config, Mamba2Model

    from gatelens.families.hf_mamba2 import HFMamba2Family

    torch.manual_seed(8)
    cfg = Mamba2Config(vocab_size=VOCAB, hidden_size=DIM, state_size=4, num_heads=4,
                       head_dim=8, expand=2, n_groups=2, conv_kernel=3,
                       num_hidden_layers=layers, chunk_size=8)
    m = Mamba2Model(cfg)
    _spread(m, 0.3, skip=("A_log", "dt_bias"))
    m = m.to(dtype).eval()
    fam = HFMamba2Family(m)
    return fam, _ids_call(fam, dtype)
