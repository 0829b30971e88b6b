"""Reading Keras files with h5py and zipfile only: layer configs and recurrent weights.

Keras' own loader never runs (no TensorFlow, no Keras import, nothing deserialised but
JSON and arrays). Four layouts (docs/formats.md):

- **.keras** (Keras 3): a zip of ``config.json``, ``metadata.json`` (``keras_version``) and
  ``model.weights.h5``, whose groups ``layers/<name>/cell/vars/0, 1, 2`` hold kernel,
  recurrent kernel and bias (``forward_layer``/``backward_layer`` under a Bidirectional;
  nested models under ``layers/<model>/layers/…``), each layer's name in ``vars``' attribute.
- **Keras 3 weights file** (``.weights.h5``): the same groups, no config.
- **legacy .h5** (Keras 2 ``model.save``, Keras 3 ``save(".h5")``): root attributes
  ``keras_version`` and ``model_config`` (JSON), group ``model_weights`` with
  ``layer_names``, each layer group listing its ``weight_names`` (``lstm_1/kernel:0``, or
  ``model/layer/lstm_cell/kernel``).
- **Keras 2 weights file** (``save_weights``): the same layer groups at the root, no config.

A recurrent layer's weights come back as {direction: {"kernel", "recurrent_kernel",
"bias"}} with direction "forward" (and "backward" under a Bidirectional).
"""

from __future__ import annotations

import io
import json
import zipfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from gatelens.errors import GatelensError

RECURRENT = ("LSTM", "GRU", "CuDNNLSTM", "CuDNNGRU")
KINDS = ("kernel", "recurrent_kernel", "bias")


@dataclass
class KerasFile:
    """What one Keras file holds: the layer configs by name (None: a weights-only file),
    the Keras version that wrote it, and the weights of every recurrent layer."""

    path: str
    form: str  # "keras", "keras3-weights", "legacy-h5", "keras2-weights"
    version: str | None
    configs: dict[str, dict] | None
    weights: dict[str, dict[str, dict[str, np.ndarray]]] = field(default_factory=dict)
    groups: dict[str, str] = field(default_factory=dict)  # layer -> its group (messages)


def _need_h5py() -> Any:
    try:
        import h5py
    except ImportError:
        raise GatelensError("reading Keras files needs the keras extra: "
                            "pip install 'gatelens[keras]'") from None
    return h5py


def _text(v: Any) -> str:
    return v.decode() if isinstance(v, bytes) else str(v)


def _names(v: Any) -> list[str]:
    return [_text(x) for x in np.asarray(v).reshape(-1)] if v is not None else []


def layer_configs(config: Any) -> dict[str, dict]:
    """Every layer config of a model config, by layer name, nested models included.

    >>> cfg = {"class_name": "Sequential", "config": {"layers": [
    ...     {"class_name": "LSTM", "config": {"name": "enc"}},
    ...     {"class_name": "Sequential", "config": {"name": "sub", "layers": [
    ...         {"class_name": "GRU", "config": {"name": "dec"}}]}}]}}
    >>> sorted(layer_configs(cfg))
    ['dec', 'enc', 'sub']
    """
    out: dict[str, dict] = {}

    def walk(layers: Any) -> None:
        for layer in layers or []:
            cfg = layer.get("config", {})
            if isinstance(cfg, dict) and cfg.get("name") is not None:
                out[cfg["name"]] = layer
            if isinstance(cfg, list):  # a Keras 2.0 Sequential inside
                walk(cfg)
            elif isinstance(cfg, dict) and "layers" in cfg:
                walk(cfg["layers"])

    cfg = config.get("config", config)
    walk(cfg if isinstance(cfg, list) else cfg.get("layers"))
    return out


def masking_layer(configs: dict[str, dict] | None) -> tuple[str, str] | None:
    """(name, how) of the model's first layer that makes a mask (an Embedding with
    ``mask_zero``, a Masking layer); None when none does or the file has no config.

    >>> masking_layer({"emb": {"class_name": "Embedding", "config": {"mask_zero": True}}})
    ('emb', 'mask_zero')
    """
    for name, layer in (configs or {}).items():
        cfg = layer.get("config") if isinstance(layer, dict) else None
        cls = layer.get("class_name") if isinstance(layer, dict) else None
        if cls == "Masking":
            return name, "Masking"
        if cls == "Embedding" and isinstance(cfg, dict) and cfg.get("mask_zero"):
            return name, "mask_zero"
    return None


MODELS = ("Sequential", "Functional", "Model")


def _legacy_layer(group: Any, names: list[str]) -> dict[str, dict[str, np.ndarray]]:
    """A legacy layer group's weights by direction and kind; the directions of a
    Bidirectional are the path components ``forward_*`` and ``backward_*``."""
    parts = [n.split("/") for n in names]
    bi = any(c.startswith("forward") for p in parts for c in p[:-1]) and any(
        c.startswith("backward") for p in parts for c in p[:-1])
    out: dict[str, dict[str, np.ndarray]] = {}
    for name, p in zip(names, parts, strict=True):
        kind = p[-1].split(":")[0]
        if kind not in KINDS:
            continue
        back = bi and any(c.startswith("backward") for c in p[:-1])
        out.setdefault("backward" if back else "forward", {})[kind] = np.asarray(group[name])
    return out


def _read_legacy(root: Any, path: str, form: str, version: str | None,
                 configs: dict | None) -> KerasFile:
    kf = KerasFile(path, form, version, configs)
    for layer in _names(root.attrs.get("layer_names")):
        group = root[layer]
        names = _names(group.attrs.get("weight_names"))
        if configs is not None and configs.get(layer, {}).get("class_name") in MODELS:
            by: dict[str, list[str]] = {}  # a nested model: its layers' weights by their name
            for n in names:
                sub = next((c for c in n.split("/")[:-1] if c in configs and c != layer), None)
                if sub is not None:
                    by.setdefault(sub, []).append(n)
            for sub, mine in by.items():
                kf.weights[sub], kf.groups[sub] = _legacy_layer(group, mine), layer
            continue
        w = _legacy_layer(group, names)
        if w:
            kf.weights[layer], kf.groups[layer] = w, layer
    return kf


def _read_keras3(h5: Any, path: str, form: str, version: str | None,
                 configs: dict | None) -> KerasFile:
    kf = KerasFile(path, form, version, configs)

    def cell(g: Any) -> dict[str, np.ndarray]:
        v = g["cell/vars"]
        return {KINDS[int(k)]: np.asarray(v[k]) for k in sorted(v) if int(k) < 3}

    def walk(g: Any, where: str) -> None:
        for key in g:
            sub = g[key]
            if not hasattr(sub, "keys"):
                continue
            name = _text(sub["vars"].attrs.get("name", key)) if "vars" in sub else key
            if "cell" in sub and "vars" in sub["cell"]:
                kf.weights[name] = {"forward": cell(sub)}
            elif "forward_layer" in sub and "cell" in sub["forward_layer"]:
                kf.weights[name] = {"forward": cell(sub["forward_layer"]),
                                    "backward": cell(sub["backward_layer"])}
            elif "layers" in sub:
                walk(sub["layers"], f"{where}/{key}/layers")
                continue
            else:
                continue
            kf.groups[name] = f"{where}/{key}"

    if "layers" in h5:
        walk(h5["layers"], "layers")
    return kf


def read_keras(path: str | Path) -> KerasFile:
    """The layer configs and recurrent weights of a Keras file (module docstring).

    >>> import tempfile, h5py, numpy as np
    >>> p = tempfile.mkdtemp() + "/w.h5"
    >>> with h5py.File(p, "w") as f:
    ...     f.attrs["layer_names"] = [b"lstm_1"]; f.attrs["keras_version"] = b"2.2.4"
    ...     g = f.create_group("lstm_1")
    ...     g.attrs["weight_names"] = [b"lstm_1/kernel:0", b"lstm_1/recurrent_kernel:0",
    ...                                b"lstm_1/bias:0"]
    ...     for n, s in (("kernel:0", (3, 8)), ("recurrent_kernel:0", (2, 8)), ("bias:0", (8,))):
    ...         _ = g.create_dataset("lstm_1/" + n, data=np.zeros(s, np.float32))
    >>> kf = read_keras(p)
    >>> kf.form, kf.version, kf.configs, sorted(kf.weights["lstm_1"]["forward"])
    ('keras2-weights', '2.2.4', None, ['bias', 'kernel', 'recurrent_kernel'])
    """
    h5py = _need_h5py()
    p = Path(path)
    if not p.is_file():
        raise GatelensError(f"{p}: no such file")
    try:
        if zipfile.is_zipfile(p):
            with zipfile.ZipFile(p) as z:
                names = set(z.namelist())
                if "config.json" not in names or "model.weights.h5" not in names:
                    raise GatelensError(f"{p}: a zip without config.json and model.weights.h5 "
                                        "is not a .keras file")
                config = json.loads(z.read("config.json"))
                meta = json.loads(z.read("metadata.json")) if "metadata.json" in names else {}
                data = z.read("model.weights.h5")
            with h5py.File(io.BytesIO(data), "r") as h5:
                return _read_keras3(h5, str(p), "keras", meta.get("keras_version"),
                                    layer_configs(config))
        with h5py.File(p, "r") as f:
            version = _text(f.attrs["keras_version"]) if "keras_version" in f.attrs else None
            if "model_config" in f.attrs:
                configs = layer_configs(json.loads(_text(f.attrs["model_config"])))
                root = f["model_weights"]
                version = version or (_text(root.attrs["keras_version"])
                                      if "keras_version" in root.attrs else None)
                return _read_legacy(root, str(p), "legacy-h5", version, configs)
            if "layer_names" in f.attrs:
                return _read_legacy(f, str(p), "keras2-weights", version, None)
            if "layers" in f:
                return _read_keras3(f, str(p), "keras3-weights", version, None)
    except GatelensError:
        raise
    except (OSError, KeyError, ValueError, zipfile.BadZipFile) as e:
        raise GatelensError(f"{p}: not a readable Keras file ({type(e).__name__}: "
                            f"{' '.join(str(e).split())[:120]})") from None
    raise GatelensError(f"{p}: an HDF5 file that is not a Keras model or weights file (no "
                        "model_config, layer_names or layers group)")


def layer_arrays(path: str | Path, name: str) -> list[np.ndarray]:
    """The weights of any layer (an Embedding's table, a Dense's kernel and bias), in the
    layer's own order; GatelensError naming the layers there are when ``name`` is none."""
    h5py = _need_h5py()
    p, found, seen = Path(path), None, []

    def keras3(h5: Any) -> list[np.ndarray] | None:
        def walk(g: Any) -> list[np.ndarray] | None:
            for key in g:
                sub = g[key]
                if not hasattr(sub, "keys") or "vars" not in sub:
                    continue
                own = _text(sub["vars"].attrs.get("name", key))
                seen.append(own)
                if own == name:
                    return [np.asarray(sub["vars"][k]) for k in sorted(sub["vars"], key=int)]
                if "layers" in sub and (hit := walk(sub["layers"])) is not None:
                    return hit
            return None
        return walk(h5["layers"]) if "layers" in h5 else None

    if zipfile.is_zipfile(p):
        with zipfile.ZipFile(p) as z, h5py.File(io.BytesIO(z.read("model.weights.h5"))) as h5:
            found = keras3(h5)
    else:
        with h5py.File(p, "r") as f:
            root = f["model_weights"] if "model_weights" in f else f
            if "layer_names" in root.attrs:
                for layer in _names(root.attrs["layer_names"]):
                    seen.append(layer)
                    if layer == name:
                        g = root[layer]
                        found = [np.asarray(g[n]) for n in _names(g.attrs.get("weight_names"))]
            else:
                found = keras3(f)
    if not found:
        raise GatelensError(f"{p}: no layer {name!r} with weights; layers here: "
                            f"{', '.join(seen) or 'none'}")
    return found
