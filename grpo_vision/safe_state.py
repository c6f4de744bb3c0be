"""State that cannot carry code: nested Python data and tensors in one safetensors file.

Optimizer, scheduler and RNG states are trees of dicts, lists, tuples, numbers, strings, tensors and
(numpy's RNG) arrays. `torch.save` pickles them, and unpickling a file someone else wrote can run any
code it names (PyTorch's own warning on `torch.load`). Here the tensors are stored as safetensors and
the rest of the tree as JSON in the file's metadata, so reading a file only ever builds data:

    save_state({"optimizer": opt.state_dict(), "step": 3}, "optimizer.safetensors")
    tree = load_state("optimizer.safetensors")

Tuples, dicts with non-string keys (an optimizer's per-parameter state is keyed by int) and numpy
arrays are tagged in the JSON so that they come back as the same types; floats round-trip exactly
(JSON keeps `repr`), NaN and infinities included.
"""

from __future__ import annotations

import contextlib
import json
import pickle
import re
from pathlib import Path
from typing import Any

import numpy as np
import torch
from safetensors import safe_open
from safetensors.torch import save_file

FORMAT = "grpo_vision.state/1"
_TAGS = ("__tensor__", "__tuple__", "__items__", "__ndarray__")


class UnsafeFileError(ValueError):
    """A file that could only be read by unpickling Python objects, which may run code; refused."""


def save_state(tree: Any, path: str | Path) -> None:
    """Write `tree` to `path` (a safetensors file): tensors as tensors, everything else as JSON."""
    tensors: dict[str, torch.Tensor] = {}
    encoded = _encode(tree, tensors, "state")
    save_file(tensors, str(path), metadata={"format": FORMAT, "tree": json.dumps(encoded)})


def load_state(path: str | Path, device: str | torch.device = "cpu") -> Any:
    """The tree `save_state` wrote; ValueError when the file is not one."""
    with safe_open(str(path), framework="pt", device=str(device)) as f:
        meta = f.metadata() or {}
        if meta.get("format") != FORMAT or "tree" not in meta:
            raise ValueError(f"not a {FORMAT} file (its metadata has format {meta.get('format')!r})")
        tensors = {k: f.get_tensor(k) for k in f.keys()}
    return _decode(json.loads(meta["tree"]), tensors)


def _encode(x: Any, tensors: dict, where: str) -> Any:
    if isinstance(x, torch.Tensor):
        key = f"t{len(tensors)}"
        tensors[key] = x.detach().cpu().contiguous()
        return {"__tensor__": key}
    if isinstance(x, np.ndarray):
        if x.dtype == object:
            raise TypeError(f"{where}: numpy arrays of Python objects cannot be stored")
        return {"__ndarray__": x.tolist(), "dtype": x.dtype.str, "shape": list(x.shape)}
    if isinstance(x, tuple):
        return {"__tuple__": [_encode(v, tensors, f"{where}[{i}]") for i, v in enumerate(x)]}
    if isinstance(x, list):
        return [_encode(v, tensors, f"{where}[{i}]") for i, v in enumerate(x)]
    if isinstance(x, dict):
        if all(isinstance(k, str) and k not in _TAGS for k in x):
            return {k: _encode(v, tensors, f"{where}.{k}") for k, v in x.items()}
        return {"__items__": [[_encode(k, tensors, where), _encode(v, tensors, f"{where}[{k!r}]")]
                              for k, v in x.items()]}
    if x is None or isinstance(x, (bool, int, float, str)):
        return x
    if isinstance(x, (np.integer, np.floating, np.bool_)):
        return x.item()
    raise TypeError(f"{where}: cannot store a {type(x).__name__} (only tensors, arrays, numbers, strings, "
                    "None and lists, tuples and dicts of them)")


def _decode(x: Any, tensors: dict) -> Any:
    if isinstance(x, list):
        return [_decode(v, tensors) for v in x]
    if not isinstance(x, dict):
        return x
    if "__tensor__" in x:
        return tensors[x["__tensor__"]]
    if "__ndarray__" in x:
        return np.asarray(x["__ndarray__"], dtype=np.dtype(x["dtype"])).reshape(x["shape"])
    if "__tuple__" in x:
        return tuple(_decode(v, tensors) for v in x["__tuple__"])
    if "__items__" in x:
        return {_hashable(_decode(k, tensors)): _decode(v, tensors) for k, v in x["__items__"]}
    return {k: _decode(v, tensors) for k, v in x.items()}


def _hashable(key: Any) -> Any:
    if isinstance(key, (list, dict, torch.Tensor, np.ndarray)):
        raise ValueError(f"a dict key of type {type(key).__name__} in a state file")
    return key


# ---------------------------------------------------------------- pickled files, read without pickle's risk

# numpy's RNG state inside files that `torch.save` wrote: numpy arrays, rebuilt from raw bytes by
# functions that call nothing else (PyTorch's docs list these as safe for weights_only loading).
_multiarray = (np._core if hasattr(np, "_core") else np.core).multiarray  # numpy 2 renamed core to _core
_NUMPY_GLOBALS = [_multiarray._reconstruct, np.ndarray, np.dtype, np.dtypes.UInt32DType]


def load_pickled_tensors(path: str | Path, numpy_arrays: bool = False) -> Any:
    """`torch.load(weights_only=True)`: tensors, numbers, strings and containers (with `numpy_arrays`,
    plain numpy arrays too), never other Python objects. A file that holds any raises UnsafeFileError."""
    allowed = torch.serialization.safe_globals(_NUMPY_GLOBALS) if numpy_arrays else contextlib.nullcontext()
    try:
        with allowed:
            return torch.load(path, map_location="cpu", weights_only=True)
    except pickle.UnpicklingError as e:
        if not names_python_objects(e):
            raise  # not a pickle at all, or a damaged one
        raise UnsafeFileError(unsafe_message(path, e)) from None


def names_python_objects(error: Exception) -> bool:
    """Whether torch's weights-only unpickler refused a file for naming a Python object (a function or
    class it would have to import and call), as opposed to bytes that are not a pickle at all."""
    return "GLOBAL" in str(error)


def unsafe_message(path: str | Path, error: Exception) -> str:
    """Why a pickled file was refused and which object it names; callers add what to do instead."""
    found = re.search(r"(?:unsupported|Unsupported global:) GLOBAL ([\w.]+)", str(error))
    named = f" (it names {found.group(1)})" if found else ""
    return (f"{path} holds pickled Python objects besides tensors and numbers{named}; loading it could run "
            "code from the file, so it is refused")
