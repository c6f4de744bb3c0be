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
import io
import itertools
import json
import pickle
import pickletools
import re
import warnings
import zipfile
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

@contextlib.contextmanager
def quiet_protocol_note():
    """torch's safe unpickler warns that a pickle of protocol 3-5 "might not be supported" and asks for an
    issue: noise on the way to loading the file or refusing it in one line."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="Detected pickle protocol")
        yield


def load_pickled_tensors(path: str | Path) -> Any:
    """`torch.load(weights_only=True)`: tensors, numbers, strings and containers, never other Python
    objects. A file that holds any, or a TorchScript archive, raises UnsafeFileError; one that is not a
    pickle at all, ValueError."""
    if is_torchscript(path):  # torch.load would refuse it too, with a hint to unpickle it after all
        raise UnsafeFileError(f"{path} is a TorchScript archive, and loading one runs the TorchScript code inside "
                              "it, so it is refused")
    try:
        with quiet_protocol_note():
            return torch.load(path, map_location="cpu", weights_only=True)
    except pickle.UnpicklingError as e:
        raise refusal(path, e) from None


def is_torchscript(path: str | Path) -> bool:
    """True for a zip that claims to be a TorchScript archive (OpenAI's CLIP release format): it holds
    constants.pkl. Only torch.jit.load checks the claim: such a file is never unpickled."""
    if not zipfile.is_zipfile(path):
        return False
    with zipfile.ZipFile(path) as z:
        return any(n.endswith("/constants.pkl") for n in z.namelist())


def refusal(path: str | Path, error: pickle.UnpicklingError) -> ValueError:
    """What it means that torch's weights-only unpickler refused `path`, as an error to raise: UnsafeFileError
    for a pickle (it names Python objects, or uses what that unpickler does not read, as `pickle.dump`'s
    protocol 4 does), ValueError for bytes that are no pickle. Never with torch's hint that
    weights_only=False "will likely succeed": that is the unsafe path."""
    said = re.search(r"(?:unsupported|Unsupported global:) GLOBAL ([\w.]+)", str(error))  # the one torch refused
    try:
        named = [said.group(1)] if said else [g for g in pickled_globals(path) if g not in _safe_globals()]
    except ValueError:  # pickletools cannot parse it either: damaged, or not a pickle
        return ValueError(f"damaged or not a pickle: {torch_reason(error)}")  # callers name the file
    return UnsafeFileError(unsafe_message(path, named[0] if named else None))


def unsafe_message(path: str | Path, named: str | None) -> str:
    """Why a pickled file was refused and which object it names; callers add what to do instead."""
    what = f"pickled Python objects besides tensors and numbers (it names {named})" if named else \
        "a pickle that the safe loader cannot read (not written by torch.save)"
    return f"{path} holds {what}; unpickling it could run code from the file, so it is refused for safety"


def torch_reason(error: Exception) -> str:
    """The reason in a weights-only refusal (e.g. 'Unsupported operand 27'), without torch's advice around it."""
    text = str(error)
    if "WeightsUnpickler error:" in text:
        text = text.split("WeightsUnpickler error:", 1)[1]
    return next((line.strip() for line in text.splitlines() if line.strip()), type(error).__name__)


def pickled_globals(path: str | Path) -> list[str]:
    """`module.name` of every Python object the pickles in `path` name: one pickle, torch's legacy format
    (pickles, then raw bytes) or each .pkl inside a zip. pickletools parses the opcodes and calls
    nothing; ValueError when the file does not start with a pickle."""
    if zipfile.is_zipfile(path):
        with zipfile.ZipFile(path) as z:
            return [g for n in z.namelist() if n.endswith(".pkl") for g in _globals_in(io.BytesIO(z.read(n)))]
    with open(path, "rb") as f:
        return _globals_in(f)


def _globals_in(stream) -> list[str]:
    """The globals of the pickles at the start of `stream`; the module and name of a STACK_GLOBAL are the
    last two strings pushed (pickle protocol 4), also through the memo."""
    found: list[str] = []
    strings: list[str | None] = []  # each push: the string it pushed, or None
    memo: dict[int, str | None] = {}
    for n in itertools.count():
        try:
            for op, arg, _ in pickletools.genops(stream):
                if op.name in ("GLOBAL", "INST"):
                    found.append(arg.replace(" ", "."))
                elif op.name == "STACK_GLOBAL":
                    found.append(".".join(s or "?" for s in strings[-2:]))
                if op.name in ("MEMOIZE", "BINPUT", "LONG_BINPUT", "PUT"):  # memoizes the top of the stack
                    memo[len(memo) if arg is None else arg] = strings[-1] if strings else None
                elif op.name in ("BINGET", "LONG_BINGET", "GET"):
                    strings.append(memo.get(arg))
                elif op.stack_after:  # a push: a string's value, None for anything else
                    strings.append(arg if isinstance(arg, str) and "GLOBAL" not in op.name else None)
        except ValueError:
            if n == 0:
                raise
            return found  # the raw bytes after torch's legacy pickles
        if not stream.read(1):
            return found
        stream.seek(-1, 1)


def _safe_globals() -> set[str]:
    """What torch's weights-only unpickler allows (tensor rebuilders, OrderedDict, ...)."""
    from torch import _weights_only_unpickler

    allowed = getattr(_weights_only_unpickler, "_get_allowed_globals", dict)()  # private: absent, name them all
    return set(allowed)

