"""Weights that load without error and are still wrong, named at load rather than steps later.

A file damaged under an intact safetensors header (bytes overwritten by NaN) parses and loads: a run
on it then skips every update or stops on non-finite weights, naming no file. A config edited after
the weights were saved builds a model of another shape: `load_state_dict` reports it as a multi-line
traceback. Each loader calls these and raises its own one-line error naming the file.
"""

from __future__ import annotations

import torch


def non_finite(tensors: dict[str, torch.Tensor]) -> str:
    """'' when every floating-point tensor is finite; else what is not, as '12 NaN or infinite values in
    lm_head.weight (and 2 other tensors)'."""
    bad = {}
    for name, t in tensors.items():
        if t.is_floating_point() and (n := int(t.numel() - torch.isfinite(t).sum())):
            bad[name] = n
    if not bad:
        return ""
    first = next(iter(bad))
    more = f" (and {len(bad) - 1} other tensor{'s' if len(bad) > 2 else ''})" if len(bad) > 1 else ""
    return f"{bad[first]} NaN or infinite values in {first}{more}"


def integer_weights(model: torch.nn.Module, state: dict[str, torch.Tensor]) -> str:
    """'' when no tensor of `state` is an integer (or bool) one where `model` holds a float; else the first, as
    'tok_embeddings.weight is torch.int32 (and 20 more)'. `load_state_dict` copies such a tensor in silently,
    every weight truncated to a whole number, and the run would train on that."""
    expected = model.state_dict()
    wrong = [f"{k} is {v.dtype}" for k, v in state.items()
             if k in expected and expected[k].is_floating_point() and not (v.is_floating_point() or v.is_complex())]
    return f"{wrong[0]}{f' (and {len(wrong) - 1} more)' if len(wrong) > 1 else ''}" if wrong else ""


def shape_mismatch(model: torch.nn.Module, state: dict[str, torch.Tensor]) -> str:
    """'' when `state` has exactly `model`'s keys and shapes; else the first difference of each kind, as
    'lm_head.weight is [283, 64] in the weights, [283, 96] in the model (and 20 more)'."""
    expected = {k: v.shape for k, v in model.state_dict().items()}
    wrong = [f"{k} is {list(state[k].shape)} in the weights, {list(s)} in the model"
             for k, s in expected.items() if k in state and state[k].shape != s]
    missing = [k for k in expected if k not in state]
    extra = [k for k in state if k not in expected]
    parts = [f"{found[0]}{f' (and {len(found) - 1} more)' if len(found) > 1 else ''}"
             for found in (wrong, [f"{k} is missing" for k in missing], [f"{k} is not in the model" for k in extra])
             if found]
    return "; ".join(parts)


def dtype_argument(dtype: torch.dtype) -> dict:
    """transformers' from_pretrained dtype argument, for every release of pyproject.toml's range: `dtype` from 4.56
    (4.52 to 4.55 refuse it), `torch_dtype` before (later releases keep it for backward compatibility only)."""
    from importlib.metadata import version

    from packaging.version import Version

    return {"dtype" if Version(version("transformers")) >= Version("4.56") else "torch_dtype": dtype}
