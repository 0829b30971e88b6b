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
- **Keras 2 weights file** (``save_weights``): the same layer groups at the root, no config;
  a group is recurrent when it holds a recurrent kernel, the others are left alone
  (``KerasFile.skipped``). ``layer_names`` may be split into ``layer_names0``, … (Keras 2
  past HDF5's 64 KB attribute limit).

A recurrent layer's weights come back as {direction: {"kernel", "recurrent_kernel",
"bias"}} with direction "forward" (and "backward" under a Bidirectional).
"""

from __future__ import annotations

import io
import json
import re
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
    skipped: dict[str, str] = field(default_factory=dict)  # layers with weights not read, why


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


def _attr_list(obj: Any, name: str) -> list[str]:
    """A Keras 2 list attribute (``layer_names``, ``weight_names``), also when Keras split a
    long one into ``name0``, ``name1``, … (over HDF5's 64 KB attribute limit)."""
    if name in obj.attrs:
        return _names(obj.attrs[name])
    out, k = [], 0
    while f"{name}{k}" in obj.attrs:
        out += _names(obj.attrs[f"{name}{k}"])
        k += 1
    return out


def _kind(name: str) -> str:
    """kernel, recurrent_kernel or bias from a weight name (``gru_1/kernel:0``; ``kernel_1:0``
    where TensorFlow made a repeated name unique); the last component otherwise."""
    last = name.split("/")[-1].split(":")[0]
    base = re.sub(r"_\d+$", "", last)
    return base if base in KINDS else last


def _by_names(group: Any, names: list[str]) -> dict[str, dict[str, np.ndarray]]:
    """A layer group's weights by direction and kind, read from the weight names: the path
    components ``forward_*``/``backward_*`` of a Bidirectional, or (no such components) a
    kind's second occurrence as the backward direction."""
    out: dict[str, dict[str, np.ndarray]] = {}
    for name in names:
        kind, where = _kind(name), name.split("/")[:-1]
        if kind not in KINDS:
            continue
        if any(c.startswith("backward") for c in where):
            d = "backward"
        elif any(c.startswith("forward") for c in where) or kind not in out.get("forward", {}):
            d = "forward"
        else:
            d = "backward"
        out.setdefault(d, {})[kind] = np.asarray(group[name])
    return out


def _recurrent_class(layer: dict | None) -> str | None:
    """The recurrent class of a config (the wrapped one of a Bidirectional), else None."""
    if not isinstance(layer, dict):
        return None
    cls = layer.get("class_name")
    if cls == "Bidirectional":
        cls = (layer.get("config", {}).get("layer") or {}).get("class_name")
    return cls if cls in RECURRENT else None


def _legacy_layer(group: Any, names: list[str], layer: str, config: dict | None,
                  path: str) -> dict[str, dict[str, np.ndarray]] | None:
    """A legacy layer group's recurrent weights by direction and kind, None for a layer that
    is not recurrent. With a config, as Keras 2's own loader does: by position (kernel,
    recurrent kernel, bias per direction, forward first) where a name does not say its kind
    (``param_0``); without one, a group is recurrent when it holds a recurrent kernel."""
    found = _by_names(group, names)
    if config is None:
        if not any("recurrent_kernel" in w for w in found.values()):
            k, b = (found.get("forward", {}).get(n) for n in ("kernel", "bias"))
            if k is not None and b is not None and k.ndim == 2 and b.shape == (2 * k.shape[1],):
                raise GatelensError(  # a Dense's bias is never twice its kernel's width
                    f"{path}: layer {layer!r}: kernel {k.shape} and bias {b.shape} are a CuDNN "
                    f"layer's but there is no weight 'recurrent_kernel' among its weights "
                    f"{', '.join(names)}")
            return None
        cls, dirs = "recurrent layer", sorted(found)
    else:
        cls = _recurrent_class(config)
        if cls is None:
            return None
        dirs = ["forward", "backward"] if config.get("class_name") == "Bidirectional" \
            else ["forward"]
        if any(_kind(n) not in KINDS for n in names):  # names that do not say (param_0)
            per = len(names) // len(dirs)
            if per in (9, 12) and per * len(dirs) == len(names):
                raise GatelensError(f"{path}: layer {layer!r} ({cls}) holds {per} arrays per "
                                    "direction, Keras 1's layout (W_*, U_*, b_* per gate), "
                                    "which gatelens does not read")
            if per in (2, 3) and per * len(dirs) == len(names):
                found = {d: {KINDS[j]: np.asarray(group[names[i * per + j]])
                             for j in range(per)} for i, d in enumerate(dirs)}
    for d in dirs:
        for kind in ("kernel", "recurrent_kernel"):
            if kind not in found.get(d, {}):
                side = f" ({d})" if len(dirs) > 1 else ""
                raise GatelensError(f"{path}: layer {layer!r}{side} ({cls}): no weight "
                                    f"{kind!r} among its weights "
                                    f"{', '.join(names) or 'none'}")
    return found


def _read_legacy(root: Any, path: str, form: str, version: str | None,
                 configs: dict | None) -> KerasFile:
    kf = KerasFile(path, form, version, configs)

    def read(group: Any, layer: str, names: list[str], label: str) -> None:
        cfg = None if configs is None else configs.get(layer, {})
        if cfg == {} and any(_kind(n) == "recurrent_kernel" for n in names):
            raise GatelensError(f"{path}: weights of {layer!r} (a recurrent kernel among them) "
                                "have no layer of that name in the model config")
        w = _legacy_layer(group, names, layer, cfg, path)
        if w is not None:
            kf.weights[layer], kf.groups[layer] = w, label
        elif names:
            what = (cfg or {}).get("class_name") or "no recurrent kernel"
            kf.skipped[layer] = f"{what}: {', '.join(sorted({_kind(n) for n in names}))}"

    for layer in _attr_list(root, "layer_names"):
        if layer not in root:
            raise GatelensError(f"{path}: layer {layer!r} is in layer_names but has no group")
        group = root[layer]
        names = _attr_list(group, "weight_names")
        missing = [n for n in names if n not in group]
        if missing:
            raise GatelensError(f"{path}: layer {layer!r}: weight {missing[0]!r} is in "
                                "weight_names but not in the file")
        if configs is not None and configs.get(layer, {}).get("class_name") in MODELS:
            by: dict[str, list[str]] = {}  # a nested model: its layers' weights by their name
            for n in names:
                sub = next((c for c in n.split("/")[:-1] if c in configs and c != layer), None)
                if sub is not None:
                    by.setdefault(sub, []).append(n)
            for sub, mine in by.items():
                read(group, sub, mine, layer)
            continue
        read(group, layer, names, layer)
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
            if "layer_names" in f.attrs or "layer_names0" in f.attrs:
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
            if "layer_names" in root.attrs or "layer_names0" in root.attrs:
                for layer in _attr_list(root, "layer_names"):
                    seen.append(layer)
                    if layer == name:
                        g = root[layer]
                        found = [np.asarray(g[n]) for n in _attr_list(g, "weight_names")]
            else:
                found = keras3(f)
    if not found:
        raise GatelensError(f"{p}: no layer {name!r} with weights; layers here: "
                            f"{', '.join(seen) or 'none'}")
    return found
