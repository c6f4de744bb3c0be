"""Reading a run folder that may come from elsewhere: its config with its paths resolved, and no code
imported from it unless the user trusts it.

Paths. A run's `config.yaml` keeps paths as they were given, relative to the directory `train` ran
in; `origin.json` beside it records that directory twice, as seen from the run folder and absolute.
A relative path of the config (policy.path, policy.tokenizer, data.*, and reward options that name an
existing file) is looked for first from the run folder's side, which stays right when the run folder
is copied, to this machine or another, together with what it names (say `runs/` beside `worlds/`),
then at the absolute directory, right when only the run folder moved. So `eval RUN` works from any
directory. A folder without origin.json (not written by `train`: a config.yaml put there by hand)
resolves against the current directory.

Code. A `python:module:function` reward imports and runs that module, and a reward told
`trust_torchscript: true` runs its archive's code; a run folder's config or prompts files may say
either: commands that read a run folder refuse that unless given --trust-run.
"""

from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path

from grpo_vision.config import Config, ConfigError, apply_override, from_dict, read_yaml, save_config, validate
from grpo_vision.files import open_kept, write_file
from grpo_vision.reading import json_value, read_text
from grpo_vision.run.resumes import (config_at, config_changes, format_changes, in_force_header, record_resume,
                                     resume_records)

ORIGIN = "origin.json"  # where `train` ran: {"cwd": absolute, "cwd_from_run": relative to the run folder}
PATH_KEYS = (("policy", "path"), ("policy", "tokenizer"), ("data", "train_prompts"), ("data", "eval_prompts"),
             ("data", "heldout_prompts"))


def save_origin(run_dir: str | Path) -> None:
    """Record the directory `train` runs in, which the run config's relative paths are relative to."""
    run_dir, cwd = Path(run_dir), Path.cwd()
    record = {"cwd": str(cwd), "cwd_from_run": os.path.relpath(cwd, run_dir.resolve())}
    write_file(run_dir / ORIGIN, json.dumps(record, indent=2) + "\n")  # whole, never through a link


def read_run_config(run_dir: str | Path, overrides: list[str] | tuple = (), device: str | None = None,
                    step: int | None = None) -> Config:
    """A run folder's config.yaml with its relative paths resolved from here, then `overrides` (relative
    to the current directory, as typed). `device`, when given, replaces the saved run.device, which
    names where the run trained, perhaps a device this machine lacks: "run" keeps it where this machine
    has it (sampling there reproduces the run's own report), else takes the best one here. `step`: the
    config that trained that checkpoint, where a later resume changed settings (run/resumes.py)."""
    run_dir = Path(run_dir)
    path = run_dir / "config.yaml"
    if not path.is_file():
        raise FileNotFoundError(f"{run_dir} is not a run directory (no config.yaml)")
    raw = read_yaml(path)
    if step is not None and isinstance(raw, dict):
        raw = config_at(raw, resume_records(run_dir), step)
    cfg = from_dict(Config, raw, where=str(path))
    resolve_paths(cfg, path_bases(run_dir))
    if device == "run":
        device = cfg.run.device if _available(cfg.run.device) else "auto"
    if device is not None:
        cfg.run.device = device
    for item in overrides:
        apply_override(cfg, item)
    validate(cfg)
    return cfg


def resume_config(run_dir: str | Path, overrides: list[str]) -> Config:
    """The config `train --resume RUN` continues with: the run's own, then `overrides`."""
    path = Path(run_dir) / "config.yaml"
    if not path.is_file():
        raise FileNotFoundError(f"cannot resume: {path} not found (is {run_dir} a run directory?)")
    return read_run_config(run_dir, overrides)  # its relative paths resolved, from any directory


def save_run_config(run_dir: Path, cfg: Config, start: int | None) -> None:
    """The run's config.yaml; a resume from checkpoint `start` first appends what it changes to resumes.jsonl (read
    back against the config.yaml it replaces), and the file then says from which step it holds."""
    if start is not None:
        record_resume(run_dir, start, config_changes(read_run_config(run_dir), cfg))
    save_config(cfg, run_dir / "config.yaml", header=in_force_header(resume_records(run_dir)))


def refused_resume(run_dir: Path, holder: str, cfg: Config) -> str:
    """The line for a resume of a run another train holds: nothing of it was applied, its changes named."""
    try:
        changes = format_changes(config_changes(read_run_config(run_dir), cfg))
    except (ConfigError, OSError):  # config.yaml unreadable here: the refusal still stands
        changes = ""
    applied = f"its overrides ({changes}) were not applied" if changes else "nothing was changed there"
    return (f"{run_dir} is in use by a running train ({holder or 'another process'}); this resume did not start and "
            f"{applied}: wait for that train to end, or stop it, then resume again")


def record_other_base(run_dir: Path, step: int, change: str) -> None:
    """A resume onto other base files (--allow-other-base), said and kept in the run's base_changes.jsonl."""
    print(f"[train] --allow-other-base: from step {step}, {change}", file=sys.stderr, flush=True)
    with open_kept(run_dir / "base_changes.jsonl", root=run_dir) as f:
        f.write(json.dumps({"step": step, "time": time.time(), "change": change}) + "\n")


def _available(name: str) -> bool:
    from grpo_vision.run.machine import resolve_device  # brings torch: only for the commands that sample

    try:
        resolve_device(name)
        return True
    except ConfigError:
        return False


def path_bases(run_dir: Path) -> list[Path]:
    """Where the run's relative paths may start, in the order they are tried (module docstring)."""
    file = run_dir / ORIGIN
    if not file.is_file():
        return [Path.cwd()]
    try:
        record = json.loads(file.read_text(encoding="utf-8"))
        return [run_dir.resolve() / record["cwd_from_run"], Path(record["cwd"])]
    except (ValueError, KeyError, TypeError):
        raise ConfigError(f"{file} is not what train writes (JSON with cwd and cwd_from_run): delete it, and the "
                          "run's relative paths resolve against the current directory") from None


def resolve_paths(cfg: Config, bases: list[Path]) -> None:
    """Rewrite the config's relative paths as paths from the current directory (see _resolve)."""
    for section, key in PATH_KEYS:
        node = getattr(cfg, section)
        setattr(node, key, _resolve(getattr(node, key), bases, required=True))
    for options in cfg.reward.options.values():  # a model name (ViT-H-14) is no file: it stays as it is
        for key, value in options.items():
            if isinstance(value, str):
                options[key] = _resolve(value, bases, required=False)


def _resolve(value: str, bases: list[Path], required: bool) -> str:
    """`value` unchanged when empty, absolute or naming the same file from here; else the first base that
    holds it, as a path from here. A `required` path found nowhere is given from the first base, so
    the error that follows names where it was looked for."""
    if not value or Path(value).expanduser().is_absolute():
        return value
    found = next((base / value for base in bases if (base / value).exists()), None)
    if found is None:
        return os.path.relpath(bases[0] / value) if required else value
    if Path(value).exists() and os.path.samefile(found, value):
        return value  # written as it was: a resumed run rewrites its config.yaml with these values
    return os.path.relpath(found)


def code_reward(cfg: Config, entries=()) -> str | None:
    """What in the config or the prompt `entries` would run code when the rewards load (None: nothing): a
    `python:` reward imports its module, and a reward told `trust_torchscript` runs its archive's code."""
    named = [*cfg.reward.weights, *cfg.reward.monitor, *(n for e in entries for n in (e.rewards or {}))]
    code = next((n for n in named if n.startswith("python:")), None)
    if code is not None:
        return f"reward {code!r}, which imports and runs Python module {code.split(':')[1]!r}"
    trusted = [n for n, o in cfg.reward.options.items() if isinstance(o, dict) and o.get("trust_torchscript")]
    if trusted:
        return (f"reward.options.{trusted[0]}.trust_torchscript: true, which loads a TorchScript archive and runs "
                "the code inside it")
    return None


def resume_command(run_dir: str | Path, cfg: Config, entries=()) -> str:
    """The command that continues a run: with --trust-run where the run's rewards run code, which a
    resume refuses otherwise (whoever started the run chose them), or were made in a script, which only
    --trust-run imports again (rewards.json)."""
    trust = code_reward(cfg, entries) or script_rewards(run_dir)
    return f"grpo-vision train --resume {run_dir}" + (" --trust-run" if trust else "")


REWARDS = "rewards.json"  # in a run folder: where each reward came from, {name: rewards.reward_origin(name)}


def reward_records(run_dir: str | Path) -> dict[str, dict]:
    """A run folder's rewards.json, {reward name: where it came from}; {} where it has none, or not what `train`
    writes (the messages that read it then go without it)."""
    file = Path(run_dir) / REWARDS
    try:  # a run folder may come from anyone: a FIFO or JSON nested 100,000 deep is read as none (reading.py)
        records = json_value(read_text(file, _Unread, "none"), str(file), _Unread)
    except _Unread:
        return {}
    return {k: v for k, v in records.items() if isinstance(v, dict)} if isinstance(records, dict) else {}


class _Unread(Exception):
    """rewards.json missing or not readable as JSON: `reward_records` reads it as none."""


def script_rewards(run_dir: str | Path) -> list[str]:
    """The rewards a run folder's rewards.json records as made in a script or a module of the user's (a spec or a
    copy of the script), which a later process has only with --reward or --trust-run."""
    return [name for name, origin in reward_records(run_dir).items()
            if not name.startswith("python:") and (origin.get("code") or origin.get("spec"))]


def refuse_code(cfg: Config, entries, run_dir: str | Path, trust: bool) -> None:
    """ConfigError unless `trust`: what the run folder's config or prompt `entries` name would run code
    (code_reward), and a run folder may come from anyone."""
    code = None if trust else code_reward(cfg, entries)
    if code is not None:
        raise ConfigError(f"run folder {run_dir} names {code}; pass --trust-run if you trust whoever made that "
                          "folder")

