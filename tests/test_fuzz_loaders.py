"""Fuzzing the loaders with random and mutated bytes: config.json (``load_run``), a vocabulary
(``read_vocab``), SPEC.toml (``load_spec``), safetensors headers (``read_weights``,
``read_tensors``, ``load_run``) and a torch.save file (``read_tensors``). Whatever the bytes,
a loader returns or raises GatelensError: never another exception, never a hang (a
hypothesis deadline and a hard alarm per example), never a write outside the test's
directory."""

from __future__ import annotations

import builtins
import io
import json
import os
import shutil
import signal
import struct
from contextlib import contextmanager
from pathlib import Path

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from gatelens.errors import GatelensError
from gatelens.lens.foreign_io import read_tensors, read_vocab
from gatelens.studies.spec import load_spec
from gatelens.training.runs import load_run, read_weights

TEXT = "\n".join(" ".join(("the", "quick", "brown", "fox", "jumps", "over", "a", "lazy",
                             "dog")[(i * 7 + k) % 9] for k in range(8)) for i in range(300))
# GATELENS_FUZZ_EXAMPLES=2000 for a longer, random search (the default is fixed and fast)
EXAMPLES = os.environ.get("GATELENS_FUZZ_EXAMPLES")
# a generous deadline (the machine is shared; the loaders are warmed up first) and a hard
# alarm (``guarded``) for a loader that would never return
FUZZ = settings(max_examples=int(EXAMPLES or 60), deadline=10_000, derandomize=EXAMPLES is None,
                database=None,
                suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large,
                                       HealthCheck.function_scoped_fixture])
WRITE_FLAGS = os.O_WRONLY | os.O_RDWR | os.O_CREAT | os.O_TRUNC | os.O_APPEND


@contextmanager
def guarded(root: Path, seconds: int = 20):
    """Fail on any write outside ``root`` (Python's open and os-level calls) and on an example
    running past ``seconds`` (SIGALRM)."""
    root = os.path.realpath(root)
    real = {"open": builtins.open, "os_open": os.open, "replace": os.replace,
            "rename": os.rename, "mkdir": os.mkdir, "unlink": os.unlink, "rmdir": os.rmdir}

    def inside(path) -> None:
        p = os.path.realpath(os.fsdecode(path)) if not isinstance(path, int) else root
        if not (p == root or p.startswith(root + os.sep)):
            raise AssertionError(f"a loader wrote outside the test's directory: {p}")

    def fake_open(file, mode="r", *a, **kw):
        if any(c in mode for c in "wax+"):
            inside(file)
        return real["open"](file, mode, *a, **kw)

    def fake_os_open(path, flags, *a, **kw):
        if flags & WRITE_FLAGS:
            inside(path)
        return real["os_open"](path, flags, *a, **kw)

    def two(name):
        def f(src, dst, *a, **kw):
            inside(src), inside(dst)
            return real[name](src, dst, *a, **kw)
        return f

    def one(name):
        def f(path, *a, **kw):
            inside(path)
            return real[name](path, *a, **kw)
        return f

    def alarm(signum, frame):
        raise TimeoutError(f"a loader ran past {seconds} s")

    patches = [(builtins, "open", fake_open), (io, "open", fake_open),
               (os, "open", fake_os_open), (os, "replace", two("replace")),
               (os, "rename", two("rename")), (os, "mkdir", one("mkdir")),
               (os, "unlink", one("unlink")), (os, "rmdir", one("rmdir"))]
    saved = [(m, n, getattr(m, n)) for m, n, _ in patches]
    old = signal.signal(signal.SIGALRM, alarm)
    signal.alarm(seconds)
    for m, n, f in patches:
        setattr(m, n, f)
    try:
        yield
    finally:
        for m, n, f in saved:
            setattr(m, n, f)
        signal.alarm(0)
        signal.signal(signal.SIGALRM, old)


def loads_or_says_why(root: Path, fn, *args) -> None:
    with guarded(root):
        try:
            fn(*args)
        except GatelensError as e:
            assert "\n" not in str(e) and str(e), repr(e)


@st.composite
def mutated(draw, seed: bytes) -> bytes:
    """``seed`` with a few byte-level edits: flips, insertions, deletions, a cut, a copy."""
    b = bytearray(seed)
    for _ in range(draw(st.integers(1, 6))):
        op = draw(st.sampled_from(["flip", "insert", "delete", "cut", "copy", "digit"]))
        at = draw(st.integers(0, max(0, len(b) - 1)))
        if op == "flip" and b:
            b[at] ^= 1 << draw(st.integers(0, 7))
        elif op == "insert":
            b[at:at] = draw(st.binary(min_size=1, max_size=8))
        elif op == "delete" and b:
            del b[at:at + draw(st.integers(1, 16))]
        elif op == "cut":
            del b[at:]
        elif op == "copy" and b:
            b[at:at] = b[:draw(st.integers(1, 64))]
        elif op == "digit":  # numbers are where parsers trust their input most
            digits = [i for i, c in enumerate(b) if 48 <= c <= 57]
            if digits:
                i = draw(st.sampled_from(digits))
                b[i:i + 1] = draw(st.sampled_from([b"9" * 12, b"-1", b"0", b"1e309", b"nan"]))
    return bytes(b)


JSON_LEAF = st.one_of(st.none(), st.booleans(), st.integers(-2**70, 2**70),
                      st.floats(allow_nan=False), st.text(max_size=4),
                      st.lists(st.text(max_size=2), max_size=3))


@st.composite
def json_mutated(draw, seed: dict) -> bytes:
    """``seed`` (a JSON document) with a few values anywhere in it replaced or removed."""
    doc = json.loads(json.dumps(seed))
    for _ in range(draw(st.integers(1, 4))):
        node, path = doc, []
        while isinstance(node, dict | list) and node and draw(st.booleans()):
            key = draw(st.sampled_from(sorted(node) if isinstance(node, dict)
                                       else list(range(len(node)))))
            path.append((node, key))
            node = node[key]
        if not path:
            continue
        parent, key = path[-1]
        if isinstance(parent, dict) and draw(st.booleans()):
            del parent[key]
        else:
            parent[key] = draw(JSON_LEAF)
    return json.dumps(doc).encode()


@pytest.fixture(scope="module")
def seed_run(tmp_path_factory):
    from gatelens.training.config import TrainConfig
    from gatelens.training.train import train

    d = tmp_path_factory.mktemp("fuzz")
    (d / "tiny.txt").write_text(TEXT, encoding="utf-8")
    train(TrainConfig(corpus=str(d / "tiny.txt"), hidden=4, steps=2, batch=2, seq=8,
                      eval_every=2, val_windows=2, device="cpu"), d / "run", progress=False)
    return d / "run"


@pytest.fixture(scope="module")
def work(seed_run, tmp_path_factory):
    d = tmp_path_factory.mktemp("fuzzwork")
    shutil.copytree(seed_run, d / "run")
    return d


def test_config_json(seed_run, work):
    seed_doc = json.loads((seed_run / "config.json").read_text())
    target = work / "run" / "config.json"

    def one(data: bytes) -> None:
        target.write_bytes(data)
        loads_or_says_why(work, load_run, work / "run")
    one(json.dumps(seed_doc).encode())  # warm up: the imports of a first load
    FUZZ(given(st.one_of(st.binary(max_size=600), mutated(json.dumps(seed_doc).encode()),
                         json_mutated(seed_doc)))(one))()


def test_vocab(work):
    path_json, path_txt = work / "vocab.json", work / "vocab.txt"
    seed = json.dumps({"chars": ["\n", " ", "a", "b"]}).encode()

    def one(data: bytes) -> None:
        path_json.write_bytes(data)
        path_txt.write_bytes(data)
        loads_or_says_why(work, read_vocab, path_json)
        loads_or_says_why(work, read_vocab, path_txt)
    one(seed)  # warm up: the imports of a first load
    FUZZ(given(st.one_of(st.binary(max_size=300), mutated(seed),
                         json_mutated({"chars": ["\n", " ", "a"], "vocab": ["x"]})))(one))()


SPEC = b"""[grid]
cell = ["lstm", "gru"]
seed = [0, 1, -2]
init = ["none", "forget_bias:1", "chrono:16"]
model = [{layers = 1}, {cell = "mingru", layers = 2}]
[train]
corpus = "recall:gap=5-9,chars=500"
hidden = 8
steps = 4
eval_every = 2
lr = 0.01
optimizer = "rmsprop"
[analysis]
windows = 2
length = 24
perturb_pos = 8
"""


def test_spec_toml(work):
    path = work / "spec.toml"

    def one(data: bytes) -> None:
        path.write_bytes(data)
        loads_or_says_why(work, load_spec, path)
    one(SPEC)  # warm up: the imports of a first load
    FUZZ(given(st.one_of(st.binary(max_size=400), mutated(SPEC)))(one))()


def _header(data: bytes) -> tuple[dict, bytes]:
    n = struct.unpack("<Q", data[:8])[0]
    return json.loads(data[8:8 + n]), data[8 + n:]


@st.composite
def header_mutated(draw, seed: bytes) -> bytes:
    """A safetensors file whose JSON header has shapes, dtypes or offsets changed."""
    header, body = _header(seed)
    names = sorted(k for k in header if k != "__metadata__")
    for _ in range(draw(st.integers(1, 3))):
        entry = header[draw(st.sampled_from(names))]
        field = draw(st.sampled_from(["dtype", "shape", "data_offsets"]))
        entry[field] = draw({
            "dtype": st.sampled_from(["F32", "F16", "BF16", "I64", "U8", "BOOL", "F64", "X9"]),
            "shape": st.lists(st.integers(-1, 2**40), max_size=4),
            "data_offsets": st.lists(st.integers(-1, 2**40), min_size=0, max_size=3)}[field])
    text = json.dumps(header).encode()
    return struct.pack("<Q", len(text)) + text + body[:draw(st.integers(0, len(body)))]


def test_safetensors_headers(seed_run, work):
    seed = (seed_run / "model.safetensors").read_bytes()
    loose = work / "w.safetensors"
    in_run = work / "run" / "model.safetensors"
    (work / "run" / "config.json").write_bytes((seed_run / "config.json").read_bytes())

    def one(data: bytes) -> None:
        loose.write_bytes(data)
        in_run.write_bytes(data)
        loads_or_says_why(work, read_weights, loose)
        loads_or_says_why(work, read_tensors, loose)
        loads_or_says_why(work, load_run, work / "run")
    one(seed)  # warm up: the imports of a first load
    FUZZ(given(st.one_of(st.binary(max_size=400), mutated(seed), header_mutated(seed)))(one))()


def test_torch_save_files(work):
    path = work / "w.pt"
    buf = io.BytesIO()
    torch.save({"model": torch.nn.LSTM(3, 2).state_dict(), "epoch": 3}, buf)

    def one(data: bytes) -> None:
        path.write_bytes(data)
        loads_or_says_why(work, read_tensors, path)
    one(buf.getvalue())  # warm up: the imports of a first load
    FUZZ(given(st.one_of(st.binary(max_size=300), mutated(buf.getvalue())))(one))()
