"""Checkpoints, written atomically: a step directory is complete or absent, never half-written.

    run/checkpoints/step_000050/
      policy.safetensors      trainable policy weights (the full policy, or only its adapter) and its buffers
      reference.safetensors   the reference's weights when it was synced from the policy
      optimizer.safetensors   AdamW and LR-scheduler state
      trainer_state.json      step, counters, the base the policy was trained from (run/config.yaml: the config)
                              and the sha256 of each weights file, checked when it is read
      rng.safetensors         torch / numpy / python RNG states
      iterative.safetensors   iterative RL only: the replay buffer and what the learning rewards learned
    run/checkpoints/latest    name of the newest complete step directory

No file holds a pickle, so loading a checkpoint someone shared never runs code from it: tensors are
safetensors, the rest is JSON (run/safe_state.py).

Everything is written into `step_N.tmp/` first, flushed to disk and then renamed; `latest` is replaced
atomically last. Rewriting a step that exists (a finished run resumed, say) moves the old directory
aside before the new one is renamed in, so some complete copy of that step exists at every moment.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import random
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Sequence

import numpy as np
import torch
from safetensors.torch import load_file, save_file

from grpo_vision.files import disk_full, folder, write_file
from grpo_vision.run.safe_state import load_state, save_state


def trainable_state(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """Parameters that train (the adapter only, when the run trains one) and the persistent buffers, detached
    and contiguous. A buffer never trains, but a model may need it to be rebuilt from the checkpoint alone
    (LlamaGen's null caption, `cls_embedding.uncond_embedding`): buffers are small, so all are kept."""
    kept = {n: p for n, p in model.named_parameters() if p.requires_grad} | persistent_buffers(model)
    return {n: v.detach().contiguous().cpu() for n, v in kept.items()}


def persistent_buffers(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """The buffers that `model.state_dict()` holds, by their state-dict names."""
    return {f"{prefix}.{name}" if prefix else name: b for prefix, module in model.named_modules()
            for name, b in module._buffers.items() if b is not None and name not in module._non_persistent_buffers_set}


def save_checkpoint(run_dir: Path, step: int, policy, optimizer, scheduler, reference_state: dict | None,
                    state: dict, iterative: dict | None = None, weights: dict | None = None,
                    optimizer_state: dict | None = None) -> Path:
    """`weights` and `optimizer_state`, when given, are written instead of reading `policy` and
    `optimizer` (under FSDP every process gathers them whole first: run/distributed.py)."""
    root = folder(run_dir, Path(run_dir) / "checkpoints")  # never a link: the steps would land outside the run
    name = f"step_{step:06d}"
    tmp, final = root / f"{name}.tmp", root / name
    _remove(tmp)
    try:
        folder(run_dir, tmp)
        save_file(trainable_state(policy) if weights is None else weights, tmp / "policy.safetensors")
        if reference_state is not None:
            save_file({k: v.contiguous().cpu() for k, v in reference_state.items()}, tmp / "reference.safetensors")
        save_state({"optimizer": optimizer.state_dict() if optimizer_state is None else optimizer_state,
                    "scheduler": scheduler.state_dict()},
                   tmp / "optimizer.safetensors")
        save_state({"torch": torch.get_rng_state(), "numpy": np.random.get_state(), "python": random.getstate()},
                   tmp / "rng.safetensors")
        if iterative is not None:
            save_state(iterative, tmp / "iterative.safetensors")
        # a flipped bit in a weights file loads without a word (safetensors checks the header only): each weights
        # file's sha256 is kept beside the step and checked when it is read (`_verified`)
        hashes = {n: file_sha256(tmp / n) for n in WEIGHT_FILES if (tmp / n).is_file()}
        (tmp / "trainer_state.json").write_text(json.dumps({"step": step, **state, "sha256": hashes}, indent=2))
        _fsync_dir(tmp)
    except Exception as e:
        _remove(tmp)  # never leave a partial step behind
        if not disk_full(e):
            raise
        kept = latest_checkpoint(run_dir)
        raise CheckpointError(f"no space left on the disk of {run_dir} while writing the checkpoint of step {step}; "
                              f"nothing was lost: {f'the last checkpoint, {kept.name},' if kept else 'the run folder'} "
                              f"is intact. Free some space and continue with --resume {run_dir}") from None
    old = root / f"{name}.old"
    _remove(old)
    if final.exists() or final.is_symlink():
        os.replace(final, old)
    os.replace(tmp, final)
    write_file(root / "latest", name, root=run_dir)
    _remove(old)
    return final


def _remove(path: Path) -> None:
    """Delete a step directory left behind; a link there is unlinked, never followed."""
    if path.is_symlink() or path.is_file():
        path.unlink()
    else:
        shutil.rmtree(path, ignore_errors=True)


def _fsync_dir(directory: Path) -> None:
    """Flush a directory's files to disk, so a rename after it never exposes empty files."""
    for path in directory.iterdir():
        with open(path, "rb") as f:
            os.fsync(f.fileno())


def checkpoint_steps(run_dir: Path) -> list[int]:
    """Steps with a complete checkpoint, ascending."""
    return sorted(int(p.name[5:]) for p in (Path(run_dir) / "checkpoints").glob("step_*")
                  if p.name[5:].isdigit() and (p / "trainer_state.json").is_file())


def latest_checkpoint(run_dir: Path) -> Path | None:
    """The step `latest` names, or, when that pointer is missing or dangling, the highest complete step."""
    pointer = Path(run_dir) / "checkpoints" / "latest"
    steps = checkpoint_steps(run_dir)
    if pointer.is_file():
        name = pointer.read_text().strip()
        path = pointer.parent / name
        # a stop between a step's rename and the pointer's leaves a complete later step: that one is the latest
        behind = name[5:].isdigit() and steps and int(name[5:]) < steps[-1]
        if (path / "trainer_state.json").is_file() and not behind:
            return own_checkpoint(run_dir, path, f"{pointer} names {name!r}, which")
    return own_checkpoint(run_dir, Path(run_dir) / "checkpoints" / f"step_{steps[-1]:06d}") if steps else None


def own_checkpoint(run_dir: Path, path: Path, what: str = "") -> Path:
    """`path`, or CheckpointError when it resolves outside the run's checkpoints folder: a pointer or a
    link into another run would otherwise load (and score) that run's weights under this run's name."""
    root, real = Path(run_dir).resolve() / "checkpoints", path.resolve()
    links = [p for p in (Path(run_dir) / "checkpoints", *path.iterdir()) if p.is_symlink()]  # the folder, its files
    if real.parent != root or links:
        where = f"{links[0]} is a link to {links[0].resolve()}" if links else \
            f"{what or f'checkpoint {path}'} resolves to {real}"
        raise CheckpointError(f"{where}, outside this run's checkpoints folder {root}: a run loads only its own "
                              "checkpoints; delete that pointer or link")
    return path


def find_checkpoint(run_dir: Path, step: int | None = None) -> Path:
    """The checkpoint of `step` (or the latest); FileNotFoundError naming what exists otherwise."""
    run_dir = Path(run_dir)
    if not run_dir.is_dir():
        raise FileNotFoundError(f"run directory not found: {run_dir}")
    if step is None:
        path = latest_checkpoint(run_dir)
        if path is None:
            raise FileNotFoundError(f"{run_dir} has no checkpoint yet (checkpoints/ holds no complete step)")
        return path
    path = run_dir / "checkpoints" / f"step_{step:06d}"
    if not (path / "trainer_state.json").is_file():
        steps = ", ".join(str(s) for s in checkpoint_steps(run_dir)) or "none"
        raise FileNotFoundError(f"{run_dir} has no checkpoint for step {step}; available steps: {steps}")
    return own_checkpoint(run_dir, path)


def load_checkpoint(path: Path, policy, optimizer=None, scheduler=None) -> tuple[dict, dict | None]:
    """Load weights (and optimizer state when given); returns (trainer_state, reference_state or None)."""
    path = Path(path)
    state = _holding(_read(path / "trainer_state.json", lambda f: json.loads(f.read_text())), ("step", "counters"),
                     path / "trainer_state.json")
    weights = _read(_verified(path / "policy.safetensors", state), load_file)
    own = dict(policy.named_parameters()) | persistent_buffers(policy)  # an older checkpoint may have no buffers
    missing = [n for n, p in own.items() if p.requires_grad and n not in weights]  # saved: the trainable ones
    _check_fits(path / "policy.safetensors", weights, own, missing)
    _check_finite(path / "policy.safetensors", weights, path)
    with torch.no_grad():
        for name, value in weights.items():
            own[name].copy_(value)
    if optimizer is not None:
        load_training_state(path, optimizer, scheduler)
    if path.name.startswith("step_") and path.name[5:].isdigit() and state["step"] != int(path.name[5:]):
        raise CheckpointError(f"checkpoint file {path / 'trainer_state.json'} says step {state['step']} in "
                              f"{path.name} (copied from another step?); delete {path} and resume from an earlier step")
    ref = path / "reference.safetensors"
    ref_state = _read(_verified(ref, state), load_file) if ref.is_file() else None
    if ref_state is not None:  # the reference is the policy's own network (or a copy of it): its names and shapes
        _check_fits(ref, ref_state, policy.state_dict())
        _check_finite(ref, ref_state, path)
    return state, ref_state


WEIGHT_FILES = ("policy.safetensors", "reference.safetensors")  # a checkpoint's weights, each with its sha256


def file_sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            digest.update(chunk)
    return digest.hexdigest()


def _verified(file: Path, state: dict) -> Path:
    """`file` when its sha256 is the one trainer_state.json recorded when the step was written (a checkpoint
    written without them is not checked); else CheckpointError naming the file and both hashes."""
    recorded = state.get("sha256")
    expected = recorded.get(file.name) if isinstance(recorded, dict) else None
    if expected is None or not file.is_file():
        return file
    if (found := file_sha256(file)) != expected:
        raise CheckpointError(f"checkpoint file {file} has changed since it was written (sha256 {found[:16]}..., "
                              f"recorded {expected[:16]}...): a damaged copy or disk; copy it again, or delete "
                              f"{file.parent} and use an earlier step")
    return file


def _check_finite(file: Path, weights: dict, path: Path) -> None:
    """CheckpointError naming `file` and the tensor when a weight is NaN or infinite: loaded, every log-prob
    would be NaN (a resume would stop at its first step, eval would return NaN results)."""
    from grpo_vision.run.load_checks import non_finite

    if bad := non_finite(weights):
        raise CheckpointError(f"checkpoint {file} holds {bad}: these weights cannot be trained on or sampled; use "
                              f"an earlier checkpoint (delete {path}, or --step N)")


def _check_fits(file: Path, weights: dict, own: dict, missing: list[str] = ()) -> None:
    """CheckpointError naming `file` when its tensors are not `own`'s names and shapes."""
    unknown = sorted(set(weights) - set(own))
    wrong = sorted(n for n, v in weights.items() if n in own and v.shape != own[n].shape)
    # an integer tensor copied into a float weight is silently cut to whole numbers
    integer = sorted(n for n, v in weights.items() if n in own and own[n].is_floating_point()
                     and not v.is_floating_point())
    for problem, names in (("weights this policy does not have", unknown), ("no weights for", sorted(missing)),
                           ("weights of another shape for", wrong), ("integer tensors for the float weights", integer)):
        if names:
            raise CheckpointError(f"checkpoint {file} does not match this run's policy: {problem} "
                                  f"{names[:3]}{' ...' if len(names) > 3 else ''} ({len(names)} in all); "
                                  "was it written by a run with another policy or train.adapter setting?")


def load_training_state(path: Path, optimizer, scheduler, load_optimizer=None) -> None:
    """The optimizer, scheduler and RNG states of a checkpoint; `load_optimizer(state)` replaces
    `optimizer.load_state_dict` (FSDP loads a full state into shards: run/distributed.py)."""
    file = Path(path) / "optimizer.safetensors"
    opt = _holding(_read(file, load_state), ("optimizer", "scheduler"), file)
    with applying(file):
        (load_optimizer or optimizer.load_state_dict)(opt["optimizer"])
        scheduler.load_state_dict(opt["scheduler"])
    file = Path(path) / "rng.safetensors"
    rng = _holding(_read(file, load_state), ("torch", "numpy", "python"), file)
    with applying(file):
        torch.set_rng_state(rng["torch"])
        np.random.set_state(rng["numpy"])
        random.setstate(rng["python"])


def load_iterative_state(path: Path) -> dict | None:
    """The replay buffer and learned rewards' state of a checkpoint (iterative RL), or None if it has none."""
    file = Path(path) / "iterative.safetensors"
    return _holding(_read(file, load_state), ("buffer", "rewards"), file) if file.is_file() else None


# ---------------------------------------------------------------------------- resuming

@dataclass
class Resumed:  # what a resumed run takes from its checkpoint besides the weights (already in the policy)
    step: int  # the first step to run
    counters: dict  # the health counters (run/health.py COUNTERS)
    reference: dict | None  # the reference's weights, when it was synced from the policy
    learned: dict | None  # iterative RL: the replay buffer and the learning rewards' state
    other_base: str | None = None  # how the base files differ from the checkpoint's (--allow-other-base)
    entropy: list | None = None  # train.use_adaptive_entropy: the coefficient's state (update.EntropyControl)


def resume_weights(ckpt: Path, policy, steps: int, base: dict, learners: Sequence[str] = (),
                   allow_other_base: bool = False) -> Resumed:
    """Load `ckpt`'s weights into `policy` and check that the run can go on from it: train.steps at or past its
    step (a resume never writes a checkpoint at or below a step the run holds; `latest_checkpoint` is
    the highest complete step), the same base files (`base`, from `base_identity`) unless `allow_other_base`, the counters, and
    the iterative state that `learners` (the run's learning rewards) need to continue exactly."""
    from grpo_vision.run.health import COUNTERS

    state, ref_state = load_checkpoint(ckpt, policy)
    step, counters, file = state["step"], state["counters"], ckpt / "trainer_state.json"
    if steps < step:
        raise CheckpointError(f"{ckpt.parent.parent} holds step {step} and train.steps is {steps}: a resume only goes "
                              f"forward (it would overwrite checkpoints): set train.steps to {step} or more, or "
                              f"evaluate an earlier step with grpo-vision eval RUN --step N")
    if not isinstance(counters, dict) or set(counters) != set(COUNTERS):
        from grpo_vision.config import brief

        raise CheckpointError(f"{file} holds the counters {brief(counters)}, not {', '.join(COUNTERS)}: delete {ckpt} "
                              "and resume from an earlier step")
    differs = check_base(file, state.get("base"), base, allow_other_base)
    learned = load_iterative_state(ckpt)
    if learners and learned is None and step:
        raise CheckpointError(f"{ckpt} has no iterative.safetensors, which this run's learning rewards "
                              f"({', '.join(learners)}) need to resume exactly: resume with the config that wrote it")
    return Resumed(step, counters, ref_state, learned, differs, state.get("entropy"))


# Files that make a model (weights, their configs, vocabularies): what a base's identity reads. A run folder's logs,
# samples and reports change as it runs and are left out.
BASE_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth", ".ckpt", ".json", ".yaml", ".model", ".txt", ".npz")
FINGERPRINT_BYTES = 1 << 20


def base_identity(pcfg) -> dict:
    """Which files a policy is trained from: for policy.path and policy.tokenizer, the sha256 over each model file's
    name, size and first and last MiB (a 15 GB model is read in well under a second; swapped weights of one
    shape differ there). Recorded in every checkpoint; a resume, eval, sample or demo compares it."""
    return {key: {"path": str(path), "fingerprint": fingerprint(Path(path))}
            for key, path in (("policy.path", pcfg.path), ("policy.tokenizer", pcfg.tokenizer)) if path}


def fingerprint(path: Path) -> str:
    if path.is_file():
        files = [path]
    elif (path / "config.yaml").is_file() and (path / "checkpoints").is_dir():  # a run folder continued from:
        ckpt = latest_checkpoint(path)  # its config and the checkpoint it hands on, not its logs and reports
        files = [path / "config.yaml", *(sorted(ckpt.iterdir()) if ckpt else [])]
    elif path.is_dir():  # links to files count by their content (a Hugging Face snapshot is links to blobs)
        files = sorted(p for p in path.rglob("*") if p.suffix in BASE_SUFFIXES and p.is_file())
    else:
        return "missing"
    digest = hashlib.sha256()
    for file in files[:10_000]:
        size = file.stat().st_size
        digest.update(f"{file.relative_to(path) if file != path else file.name}\0{size}\0".encode())
        with open(file, "rb") as f:
            digest.update(f.read(FINGERPRINT_BYTES))
            if size > FINGERPRINT_BYTES:  # the last MiB, or what follows the first
                f.seek(max(FINGERPRINT_BYTES, size - FINGERPRINT_BYTES))
                digest.update(f.read(FINGERPRINT_BYTES))
    return digest.hexdigest()[:16]


def recorded_base(ckpt: Path) -> dict | None:
    """The base identity a checkpoint recorded (None for one that recorded none)."""
    state = _read(Path(ckpt) / "trainer_state.json", lambda f: json.loads(f.read_text()))
    return state.get("base") if isinstance(state, dict) else None


def other_base(recorded: dict | None, base: dict) -> str | None:
    """How `base` differs from the identity a checkpoint `recorded` (None: the same, or nothing recorded)."""
    if not isinstance(recorded, dict):
        return None
    for key in sorted(set(recorded) | set(base)):
        was, now = recorded.get(key) or {}, base.get(key) or {}
        if was.get("fingerprint") != now.get("fingerprint"):
            return (f"it was trained with {key} {was.get('path', '(none)')} (fingerprint {was.get('fingerprint')}) and "
                    f"the config now names {now.get('path', '(none)')} (fingerprint {now.get('fingerprint')})")
    return None


def check_base(where: Path, recorded: dict | None, base: dict, allowed: bool) -> str | None:
    """CheckpointError when the checkpoint at `where` was trained from other base files than `base`, unless
    `allowed` (then the difference is returned, for the run's log)."""
    differs = other_base(recorded, base)
    if differs and not allowed:
        raise CheckpointError(f"{where.parent}: {differs}; its weights would decode through another tokenizer and be "
                              "scored by other models: point the config at the files it was trained with, or pass "
                              "--allow-other-base if the change is meant")
    return differs


class CheckpointError(ValueError):
    """A checkpoint file that cannot be read; the message names it and what to do."""


def _read(path: Path, reader):
    try:
        return reader(path)
    except FileNotFoundError:
        raise CheckpointError(f"checkpoint file missing: {path}; the step directory is incomplete: delete "
                              f"{path.parent} and use an earlier step") from None
    except Exception as e:  # safetensors and JSON each raise their own kind
        raise CheckpointError(f"checkpoint file {path} is unreadable ({type(e).__name__}: {e}); delete "
                              f"{path.parent} and use an earlier step") from None


def _holding(tree, keys: tuple[str, ...], file: Path) -> dict:
    """`tree` when it is a dict with `keys`: a readable file of another kind (another checkpoint file
    copied over this one) is named, not a KeyError later."""
    if isinstance(tree, dict) and all(k in tree for k in keys):
        return tree
    held = (", ".join(map(repr, tree)) or "nothing") if isinstance(tree, dict) else f"a {type(tree).__name__}"
    missing = ", ".join(repr(k) for k in keys if not isinstance(tree, dict) or k not in tree)
    raise CheckpointError(f"checkpoint file {file} holds {held}, not {missing} (was another file copied over it?); "
                          f"delete {file.parent} and resume from an earlier step")


@contextlib.contextmanager
def applying(file: Path):
    """Loading a readable file's state into the run: state that does not fit (another run's optimizer, a
    damaged RNG state) is a CheckpointError naming the file, not a traceback from torch."""
    try:
        yield
    except (KeyError, IndexError, TypeError, ValueError, RuntimeError) as e:
        raise CheckpointError(f"checkpoint file {file} does not fit this run ({type(e).__name__}: {e}); delete "
                              f"{file.parent} and resume from an earlier step") from None
