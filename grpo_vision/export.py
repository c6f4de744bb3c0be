"""A run's trained policy out of the run folder, whole, in the format its model's own tools load.

A checkpoint holds only what training changes (run/checkpoint.py): the trainable tensors, under the names of
this library's wrapper, and the buffers. `export_run` rebuilds the run's policy from its base weights and a
checkpoint, then writes it as the model's ecosystem reads it:

    janus     a transformers folder: JanusForConditionalGeneration.from_pretrained(DIR), processor and chat
              template included, so generate(generation_mode="image") runs on it. An adapter run gives a peft
              adapter folder whose target modules are the user's own JanusForConditionalGeneration's
              (PeftModel.from_pretrained(model, DIR)); with merge=True, the merged model instead.
    llamagen  LlamaGen's `model.pt` ({"model": state_dict, "args": {...}}, every key its gpt.py loads with
              strict=True) and `model.safetensors` beside it; an adapter run is merged (LlamaGen's samplers load
              whole weights).
    llama     a LlamaForCausalLM folder with its word-level tokenizer and policy_config.json (this library
              loads it back as policy.path); an adapter run gives a peft adapter folder for that
              LlamaForCausalLM (module names are one to one), or with merge=True the merged model.

A policy class opts in with `export(directory) -> list[Path]` (the whole model; the built-in Llama's and
LlamaGen's are functions beside their loaders, found by models/kinds.py's `exporter`) and, where a peft adapter
maps onto the ecosystem's own model, `adapter_root`: the module path of that model inside the policy ("model" for
Janus, "" for the built-in Llama). `export.json` beside the files says which run and step they came from.

The other way out needs no export: a run folder (or one of its step folders) given as `policy.path` loads as
the run's policy with the checkpoint's weights (models/kinds.py, `trained_bundle`).
"""

from __future__ import annotations

import json
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

from grpo_vision.config import ConfigError
from grpo_vision.files import disk_full, write_file


@dataclass
class Exported:
    directory: Path
    kind: str  # the policy kind
    form: str  # "model" (the whole model) or "adapter" (a peft adapter folder for the kind's own model)
    step: int
    files: list[Path]


def export_run(run_dir: str | Path, out: str | Path, step: int | None = None, merge: bool = False,
               allow_other_base: bool = False) -> Exported:
    """Write the policy of `run_dir`'s checkpoint (the latest, or `step`) into `out` (see the module docstring);
    `merge`: an adapter run's adapter folded into the weights, the whole model written; `allow_other_base`: as
    step/load.load_run."""
    from grpo_vision.step.load import load_run
    from grpo_vision.models.kinds import exporter

    run_dir, out = Path(run_dir), Path(out)
    check_export_target(out)  # before the run loads: a bad --out is one line, not minutes later
    run = load_run(run_dir, step, device="cpu", allow_other_base=allow_other_base)  # the whole model is written from host memory anyway
    kind, policy = run.cfg.policy.kind, run.policy
    adapter = run.cfg.train.adapter != "none"
    base = policy.get_base_model() if adapter else policy
    if exporter(base) is None:
        raise ConfigError(f"policy kind {kind!r} ({type(base).__name__}) has no export(directory): its weights are "
                          f"the run's checkpoints; load them with grpo_vision.step.load.load_run({str(run_dir)!r})")
    as_adapter = adapter and not merge and getattr(base, "adapter_root", None) is not None
    # written whole into a sibling, then renamed: no half export under --out's name
    with staging(out, tensor_bytes(policy, as_adapter)) as folder:
        if as_adapter:
            files, form = write_adapter(policy, base.adapter_root, run.cfg.train.adapter_targets, folder,
                                        base_path=run.cfg.policy.path), "adapter"
        else:
            model = policy.merge_and_unload() if adapter else policy  # peft folds LoRA, LoHa and LoKr alike
            files, form = exporter(model)(folder), "model"
        record = {"run": str(run_dir), "step": run.step, "kind": kind, "form": form, "base": run.cfg.policy.path,
                  "adapter": run.cfg.train.adapter, "merged": adapter and form == "model",
                  "dtype": run.cfg.policy.dtype, "text_stage": text_stage(run.cfg, base)}
        write_file(folder / "export.json", json.dumps(record, indent=2) + "\n")
    return Exported(out, kind, form, run.step, [out / f.relative_to(folder) for f in files] + [out / "export.json"])


def text_stage(cfg, policy) -> dict | None:
    """How the run's rollouts prompted the text plan before each image (sample.plan; None without one): the
    template, the plan's sampling settings, and the kind's own wrapping of both stages (`plan_prompting`, e.g.
    Janus's system prompt, chat turns and "{prompt}. {plan}" image condition), so the export alone rebuilds it."""
    p = cfg.sample.plan
    if not p.enabled:
        return None
    wrapping = policy.plan_prompting(p.template) if hasattr(policy, "plan_prompting") else {}
    return {"template": p.template, "max_tokens": p.max_tokens, "temperature": p.temperature, "top_k": p.top_k,
            "top_p": p.top_p, **wrapping}


def run_folder_around(path: Path) -> Path | None:
    """The run folder that `path` is, or lies inside (its config.yaml beside a lock, metrics or checkpoints), or
    None: `train --resume` rewrites what is inside one (a checkpoint folder is replaced whole)."""
    for folder in (path, *path.parents):
        if (folder / "config.yaml").is_file() and any((folder / n).exists() for n in
                                                      ("run.lock", "metrics.jsonl", "checkpoints")):
            return folder
    return None


def check_export_target(out: Path) -> None:
    """One ConfigError line naming --out for a target that would fail or be lost: a link, a file or a folder that
    holds files, a place inside a run folder, a parent that is a file or cannot be written."""
    import os

    if out.is_symlink():
        raise ConfigError(f"--out {out} is a link (to {os.readlink(out)}): name a new folder, not a link")
    if out.exists() and (not out.is_dir() or any(out.iterdir())):
        raise ConfigError(f"--out {out} exists and is not an empty folder: name a new folder")
    absolute = Path(os.path.abspath(out))
    if (run := run_folder_around(absolute)) is not None:
        raise ConfigError(f"--out {out} lies inside the run folder {run}, which train --resume rewrites (a checkpoint "
                          "folder is replaced whole): export to a folder outside the run")
    existing = next(p for p in (absolute, *absolute.parents) if p.exists() or p.is_symlink())
    if not existing.is_dir():
        raise ConfigError(f"--out {out}: {existing} is {'a dangling link' if not existing.exists() else 'a file'}, "
                          "not a folder; name a folder under a folder")
    if not os.access(existing, os.W_OK | os.X_OK):
        raise ConfigError(f"--out {out}: {existing} is not writable; name a folder where you can write")


def tensor_bytes(policy, adapter_only: bool) -> int:
    """About what an export writes: the bytes of the policy's tensors (each storage once: tied weights), or of its
    peft adapter's."""
    if adapter_only:
        from peft import get_peft_model_state_dict

        tensors = get_peft_model_state_dict(policy).values()
    else:
        tensors = policy.state_dict().values()
    return sum({(t.untyped_storage().data_ptr(), t.untyped_storage().nbytes()): t.untyped_storage().nbytes()
                for t in tensors}.values())


@contextmanager
def staging(out: Path, needed: int = 0):
    """A new hidden sibling of `out` to write into, renamed to `out` once the body ends; removed if it fails (a
    full disk is a ConfigError line naming --out and about `needed` bytes), so no half-written folder ever carries
    the export's name."""
    import errno
    import os
    import secrets
    import shutil

    out.parent.mkdir(parents=True, exist_ok=True)
    folder = out.parent / f".{out.name}.export-{secrets.token_hex(4)}"
    folder.mkdir()
    try:
        yield folder
        if out.is_dir():  # an empty folder the user made for it
            out.rmdir()
        os.rename(folder, out)
    except BaseException as e:
        shutil.rmtree(folder, ignore_errors=True)
        if disk_full(e):  # an OSError, or safetensors' own error naming it (files.disk_full)
            free = shutil.disk_usage(out.parent).free
            raise ConfigError(f"--out {out}: no space left on {out.parent}: the export's tensors take about "
                              f"{needed / 2**20:.1f} MiB and {free / 2**20:.1f} MiB are free (the partial export was "
                              "removed); free some space, or export to a folder on another disk") from None
        if isinstance(e, OSError) and e.errno in (errno.EROFS, errno.EACCES):
            raise ConfigError(f"--out {out}: writing the export failed ({e.strerror}); nothing was left there") from None
        raise


def write_adapter(policy, root: str, targets: list[str], out: Path, base_path: str = "") -> list[Path]:
    """`policy`'s peft adapter as a peft folder for the model at module path `root` of the policy: its
    tensors renamed from the policy's module paths to that model's, its `target_modules` rewritten the same
    way, so PeftModel.from_pretrained(that_model, out) finds every module the run trained."""
    import copy

    from peft import get_peft_model_state_dict
    from safetensors.torch import save_file

    from grpo_vision.models.adapters import target_pattern

    config = copy.deepcopy(policy.peft_config[policy.active_adapter])
    scope = getattr(policy.get_base_model(), "lora_scope", None)
    prefix = f"{root}." if root else ""
    if scope and not scope.startswith(prefix):
        raise ValueError(f"adapter scope {scope!r} lies outside the exported model {root!r}")
    # peft names a saved tensor base_model.model.<module path>.<factor>.weight (the adapter name dropped)
    head = "base_model.model."
    saved = get_peft_model_state_dict(policy)
    if any(not k.startswith(head + prefix) for k in saved):
        raise ValueError(f"peft's adapter state has keys outside {head + prefix}")
    state = {head + k[len(head) + len(prefix):]: v.detach().contiguous().cpu() for k, v in saved.items()}
    config.target_modules = target_pattern(scope[len(prefix):] if scope else None, targets)
    config.base_model_name_or_path = base_path or None
    config.inference_mode = True
    config.save_pretrained(str(out))
    save_file(state, out / "adapter_model.safetensors")
    return [out / "adapter_config.json", out / "adapter_model.safetensors"]
