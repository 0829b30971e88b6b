"""Training: run directory format, learning, determinism, resume, bias initialisers."""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file
from torch import nn

from gatelens.training.config import TrainConfig
from gatelens.training.runs import checkpoint_steps, load_run, read_config
from gatelens.training.train import train


def tiny(corpus: Path, **kw) -> TrainConfig:
    base = dict(corpus=str(corpus), hidden=16, steps=6, batch=4, seq=16, eval_every=3,
                val_windows=4, seed=0, device="cpu")
    base.update(kw)
    return TrainConfig(**base)


@pytest.mark.parametrize("cell", ["lstm", "gru", "rnn"])
def test_checkpoint_loads_into_plain_pytorch(tiny_text, tmp_path, cell):
    run = tmp_path / "run"
    train(tiny(tiny_text, cell=cell, layers=2), run, progress=False)
    cfg = read_config(run)
    V, H = len(cfg["vocab"]), cfg["model"]["hidden"]
    tensors = load_file(str(run / "model.safetensors"))
    rnn = {"lstm": nn.LSTM, "gru": nn.GRU, "rnn": nn.RNN}[cell](V, H, num_layers=2,
                                                               batch_first=True)
    rnn.load_state_dict({k[4:]: v for k, v in tensors.items() if k.startswith("rnn.")})
    head = nn.Linear(H, V)
    head.load_state_dict({"weight": tensors["head.weight"], "bias": tensors["head.bias"]})
    ids = torch.randint(0, V, (3, 10))
    x = torch.nn.functional.one_hot(ids, V).float()  # (B, T, V)
    plain = head(rnn(x)[0])
    ours = load_run(run).model(ids)[0]
    torch.testing.assert_close(plain, ours, rtol=0, atol=0)
    assert set(tensors) == {f"rnn.{k}" for k in rnn.state_dict()} | {"head.weight", "head.bias"}
    assert checkpoint_steps(run) == [0, 3, 6]


def test_embedding_names(tiny_text, tmp_path):
    train(tiny(tiny_text, embed=5), tmp_path / "run", progress=False)
    tensors = load_file(str(tmp_path / "run" / "model.safetensors"))
    assert tensors["embed.weight"].shape[1] == 5
    assert tensors["rnn.weight_ih_l0"].shape == (4 * 16, 5)


def test_training_lowers_validation_loss(tiny_text, tmp_path):
    res = train(tiny(tiny_text, hidden=32, steps=60, lr=1e-2, batch=16, eval_every=20),
                tmp_path / "run", progress=False)
    rows = (tmp_path / "run" / "history.csv").read_text().splitlines()
    val = {int(r.split(",")[0]): float(r.split(",")[2]) for r in rows[1:] if r.split(",")[2]}
    assert set(val) == {0, 20, 40, 60}
    assert val[60] < val[0] - 0.8, val  # from ~ln V = 2.9 to well under 2
    assert res.best_step == min(val, key=val.get)
    assert read_config(tmp_path / "run")["best"]["step"] == res.best_step


def _weights(run: Path) -> dict[str, torch.Tensor]:
    return load_file(str(run / "model.safetensors"))


def _same(a: dict, b: dict) -> bool:
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def test_same_seed_same_weights_and_history(tiny_text, tmp_path):
    train(tiny(tiny_text), tmp_path / "a", progress=False)
    train(tiny(tiny_text), tmp_path / "b", progress=False)
    train(tiny(tiny_text, seed=1), tmp_path / "c", progress=False)
    assert _same(_weights(tmp_path / "a"), _weights(tmp_path / "b"))
    assert not _same(_weights(tmp_path / "a"), _weights(tmp_path / "c"))

    def losses(run):
        return [r.split(",")[:3] for r in (run / "history.csv").read_text().splitlines()]
    assert losses(tmp_path / "a") == losses(tmp_path / "b")


def _final_state(run: Path) -> dict[str, torch.Tensor]:
    last = checkpoint_steps(run)[-1]
    state = load_file(str(run / "checkpoints" / f"step-{last:06d}.safetensors"))
    state.update({f"best.{k}": v for k, v in _weights(run).items()})
    state.update({f"resume.{k}": v for k, v in load_file(str(run / "resume.safetensors")).items()})
    return state


def test_interrupted_then_resumed_equals_uninterrupted(tiny_text, tmp_path):
    cfg = tiny(tiny_text, steps=10, eval_every=4)
    train(cfg, tmp_path / "full", progress=False)
    res = train(cfg, tmp_path / "cut", progress=False, stop_at=6)  # as Ctrl-C after step 6
    assert res.interrupted and res.steps_done == 6
    assert read_config(tmp_path / "cut")["status"] == "interrupted"
    load_run(tmp_path / "cut")  # a valid run directory in the meantime
    res = train(None, tmp_path / "cut", resume=True, progress=False)
    assert not res.interrupted and res.steps_done == 10
    assert _same(_final_state(tmp_path / "full"), _final_state(tmp_path / "cut"))
    assert checkpoint_steps(tmp_path / "cut") == [0, 4, 8, 10]


def test_crash_then_resume_equals_uninterrupted(tiny_text, tmp_path):
    cfg = tiny(tiny_text, steps=10, eval_every=4)
    train(cfg, tmp_path / "full", progress=False)

    def crash(step):
        if step == 7:
            raise RuntimeError("power cut")
    with pytest.raises(RuntimeError):
        train(cfg, tmp_path / "cut", progress=False, on_step=crash)
    assert read_config(tmp_path / "cut")["steps_done"] == 4  # the last saved step
    train(None, tmp_path / "cut", resume=True, progress=False)
    assert _same(_final_state(tmp_path / "full"), _final_state(tmp_path / "cut"))
    full = (tmp_path / "full" / "history.csv").read_text().splitlines()
    cut = (tmp_path / "cut" / "history.csv").read_text().splitlines()
    assert [r.split(",")[:3] for r in full] == [r.split(",")[:3] for r in cut]


def test_resume_can_extend_steps(tiny_text, tmp_path):
    train(tiny(tiny_text, steps=6), tmp_path / "a", progress=False)
    train(None, tmp_path / "a", resume=True, progress=False, overrides={"steps": 9})
    train(tiny(tiny_text, steps=9), tmp_path / "b", progress=False)
    assert _same(_final_state(tmp_path / "a"), _final_state(tmp_path / "b"))


@pytest.mark.parametrize("cell,chunk", [("lstm", 1), ("gru", 1)])
def test_forget_bias_sets_total_bias(tiny_text, tmp_path, cell, chunk):
    train(tiny(tiny_text, cell=cell, forget_bias=1.5, steps=1, eval_every=1), tmp_path / "r",
          progress=False)
    t = load_file(str(tmp_path / "r" / "checkpoints" / "step-000000.safetensors"))
    H = 16
    total = (t["rnn.bias_ih_l0"] + t["rnn.bias_hh_l0"])[chunk * H:(chunk + 1) * H]
    assert torch.allclose(total, torch.full((H,), 1.5))


def test_chrono_initialisation(tiny_text, tmp_path):
    train(tiny(tiny_text, chrono=20.0, steps=1, eval_every=1), tmp_path / "r", progress=False)
    t = load_file(str(tmp_path / "r" / "checkpoints" / "step-000000.safetensors"))
    H = 16
    b = (t["rnn.bias_ih_l0"] + t["rnn.bias_hh_l0"]).view(4, H)  # i, f, g, o
    assert (b[1] >= 0).all() and (b[1] <= math.log(19) + 1e-6).all()
    assert b[1].std() > 0.3  # drawn, not constant
    torch.testing.assert_close(b[0], -b[1])


@pytest.mark.parametrize("name, cls", [("sgd", torch.optim.SGD), ("rmsprop", torch.optim.RMSprop),
                                       ("adam", torch.optim.Adam)])
def test_optimizer_is_recorded_and_resumes_exactly(tiny_text, tmp_path, name, cls):
    cfg = tiny(tiny_text, steps=10, eval_every=4, optimizer=name, lr=0.05)
    train(cfg, tmp_path / "full", progress=False)
    train(cfg, tmp_path / "cut", progress=False, stop_at=6)
    train(None, tmp_path / "cut", resume=True, progress=False)
    assert _same(_final_state(tmp_path / "full"), _final_state(tmp_path / "cut"))
    saved = read_config(tmp_path / "cut")
    assert saved["train"]["optimizer"] == name
    group = cls([nn.Parameter(torch.zeros(1))], lr=0.05).param_groups[0]
    expected = {k: list(v) if isinstance(v, tuple) else v for k, v in group.items()
                if k not in ("params", "lr")}
    assert saved["optimizer"] == {"name": cls.__name__, "lr": 0.05, "params": expected,
                                  "clip_grad_norm": 5.0,
                                  **({"betas": [0.9, 0.999]} if name == "adam" else {})}
    state = load_file(str(tmp_path / "cut" / "resume.safetensors"))
    opt_keys = {k.split(".", 2)[2] for k in state if k.startswith("opt.")}
    assert opt_keys == {"adam": {"step", "exp_avg", "exp_avg_sq"}, "sgd": set(),
                        "rmsprop": {"step", "square_avg"}}[name]
    other = tiny(tiny_text, steps=10, eval_every=4, optimizer="adam" if name != "adam" else "sgd",
                 lr=0.05)
    train(other, tmp_path / "other", progress=False)
    assert not _same(_weights(tmp_path / "full"), _weights(tmp_path / "other"))


def test_a_run_saved_with_the_old_adam_keys_still_resumes_exactly(tiny_text, tmp_path):
    from safetensors import safe_open
    from safetensors.torch import save_file

    cfg = tiny(tiny_text, steps=10, eval_every=4)
    train(cfg, tmp_path / "full", progress=False)
    train(cfg, tmp_path / "old", progress=False, stop_at=6)
    path = tmp_path / "old" / "resume.safetensors"
    with safe_open(str(path), "pt") as fh:
        meta = fh.metadata()
    state = {("adam." + k[4:] if k.startswith("opt.") else k): v
             for k, v in load_file(str(path)).items()}
    assert any(k.startswith("adam.") for k in state)
    save_file(state, str(path), metadata={k: meta[k] for k in ("step", "seconds", "best")})
    train(None, tmp_path / "old", resume=True, progress=False)
    assert _same(_final_state(tmp_path / "full"), _final_state(tmp_path / "old"))


@pytest.mark.parametrize("cell", ["lstm", "gru", "mingru"])
def test_zero_bias_init_zeroes_every_recurrent_bias_at_step_0(tiny_text, tmp_path, cell):
    train(tiny(tiny_text, cell=cell, bias_init="zero", steps=1, eval_every=1, layers=2),
          tmp_path / "z", progress=False)
    t = load_file(str(tmp_path / "z" / "checkpoints" / "step-000000.safetensors"))
    biases = [k for k in t if k.startswith("rnn.") and k.rsplit(".", 1)[-1].startswith("bias")]
    assert len(biases) >= 4 and all(bool((t[k] == 0).all()) for k in biases)
    assert bool((t["head.bias"] != 0).any())  # the head keeps PyTorch's init
    plain = load_file(str(_plain_run(tiny_text, tmp_path, cell) / "checkpoints" /
                          "step-000000.safetensors"))
    assert all(torch.equal(t[k], plain[k]) for k in t if k not in biases)  # only the biases
    assert read_config(tmp_path / "z")["train"]["bias_init"] == "zero"


def _plain_run(corpus, tmp_path, cell):
    out = tmp_path / "plain"
    train(tiny(corpus, cell=cell, steps=1, eval_every=1, layers=2), out, progress=False)
    return out


def test_zero_bias_init_comes_before_the_forget_bias(tiny_text, tmp_path):
    train(tiny(tiny_text, bias_init="zero", forget_bias=2.0, steps=1, eval_every=1),
          tmp_path / "r", progress=False)
    t = load_file(str(tmp_path / "r" / "checkpoints" / "step-000000.safetensors"))
    H = 16
    b_ih, b_hh = t["rnn.bias_ih_l0"].view(4, H), t["rnn.bias_hh_l0"].view(4, H)  # i, f, g, o
    assert torch.equal(b_ih[1], torch.full((H,), 2.0)) and bool((b_hh == 0).all())
    assert bool((b_ih[[0, 2, 3]] == 0).all())
