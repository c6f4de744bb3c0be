"""The reward contract and its registry: short names mapped to factories of plain callables.

Every reward has one signature (ddpo-pytorch's contract):

    reward(images: Tensor[B, 3, H, W] in [0, 1], prompts: list[str], metadata: list[dict]) -> Tensor[B]

and NaN means "does not apply to this sample". A reward that can say why an image lost points (the
`geneval` reward: which clause failed) leaves, after each call, `last_reasons`: per image, a list of
`(kind, text)` pairs, e.g. `("position", "expected dog right of target, found left of")`; the
report counts the kinds, the demo shows the texts. A factory takes a `RewardContext` (device, batch
size) and, when it registers an options dataclass, its typed options (`reward.options.<name>` in
config, over the defaults the policy kind supplies); it checks them at once and loads its model
from local paths at the first call, or when `CompositeReward.load` asks.

    @register_reward("my_reward")
    def my_reward(ctx): return lambda images, prompts, metadata: images.mean(dim=(1, 2, 3))

Users pick rewards by name in YAML (`reward.weights: {clip: 1.0, aesthetic: 0.5}`), or point at
their own callable with `python:package.module:function` (the function is the reward itself).
"""

from __future__ import annotations

import dataclasses
import difflib
import importlib
import inspect
import json
import re
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Sequence

import torch

from grpo_vision.config import ConfigError, brief, from_dict
from grpo_vision.files import write_file
from grpo_vision.plugins import load_plugins, not_found_hint
from grpo_vision.policy import check_files, kind_options
from grpo_vision.run.folder import REWARDS, reward_records

RewardFn = Callable[[torch.Tensor, Sequence[str], Sequence[dict]], torch.Tensor]


class RewardError(RuntimeError):
    """A reward failed; `name` says which one, `message` what happened (without the name: a handler that
    adds to it builds a new RewardError from `message`, so the prefix is written once)."""

    def __init__(self, name: str, message: str):
        super().__init__(f"reward '{name}' failed: {message}")
        self.name, self.message = name, message


@dataclass
class RunModels:
    """The run's own networks, for a reward registered with `reads_policy` (the `self_judge`): each call gives
    `(model, context)`, the model to run inside `context`. `reference`: the KL reference (a frozen copy, or the
    policy under `disable_adapter()`, step/reference.py `Reference.sampler`); `policy`: the policy as it trains."""

    reference: Callable[[], tuple[Any, Any]]
    policy: Callable[[], tuple[Any, Any]]

    @classmethod
    def of(cls, model) -> RunModels:
        """`model` as both (the matrix's base policy, which judges every run's images alike)."""
        from contextlib import nullcontext

        return cls(reference=lambda: (model, nullcontext()), policy=lambda: (model, nullcontext()))


@dataclass
class RewardContext:
    """What every reward factory may read."""

    device: torch.device = field(default_factory=lambda: torch.device("cpu"))
    batch_size: int = 64  # images per model call (reward.batch_size)
    models: RunModels | None = None  # the run's own networks; only a command that loads a policy gives them


@dataclass
class Registered:
    factory: Callable[..., RewardFn]  # factory(ctx) or, with options, factory(ctx, options)
    options: type | None = None  # the dataclass of `reward.options.<name>`; None: the reward takes none
    reads_plan: bool = False  # scores an image against its text plan (metadata["plan"]): needs sample.plan
    reads_policy: tuple[str, ...] = ()  # scores with the run's own network (ctx.models), of these policy kinds


REGISTRY: dict[str, Registered] = {}


def register_reward(name: str, options: type | None = None, reads_plan: bool = False,
                    reads_policy: tuple[str, ...] = ()):
    """Register `factory` as reward `name`; with `options` (a dataclass), the factory is called as
    `factory(ctx, options_instance)`, the instance built strictly from `reward.options.<name>`. `reads_plan`: the
    reward scores an image against the text plan it was drawn from, so a config that trains on it without
    `sample.plan` is refused (every image would score NaN, and the weight would silently do nothing).
    `reads_policy`: the policy kinds whose own network the reward scores with (`ctx.models`, given by the commands
    that load a policy); a config of another kind, or one without a reference to judge with, is refused."""
    def wrap(factory):
        REGISTRY[name] = Registered(factory, options, reads_plan, tuple(reads_policy))
        return factory
    return wrap


def available_rewards() -> list[str]:
    return sorted(REGISTRY) + ["python:<module>:<function>"]


def is_registered(name: str) -> bool:
    """A registered name or a python: spec; plugins are loaded before a name is called unknown."""
    if name.startswith("python:") or name in REGISTRY:
        return True
    load_plugins()
    return name in REGISTRY


def make_reward(name: str, ctx: RewardContext, options: dict[str, Any] | None = None) -> RewardFn:
    """The reward `name` built with `options` (a mapping, checked against its options dataclass)."""
    if name.startswith("python:"):
        reward_options(name, options)
        return _import_callable(name)
    if not is_registered(name):
        raise ConfigError(f"unknown reward {brief(name)}; registered rewards: {', '.join(available_rewards())} "
                          f"({not_found_hint()})")
    parsed = reward_options(name, options)
    if REGISTRY[name].reads_policy and ctx.models is None:
        raise ConfigError(f"reward {name!r} scores with the run's own {' or '.join(REGISTRY[name].reads_policy)} "
                          "model, and this command loads none: use it in train, eval, matrix or the demo, which load "
                          "the policy")
    return REGISTRY[name].factory(ctx) if parsed is None else REGISTRY[name].factory(ctx, parsed)


def reward_options(name: str, options: dict[str, Any] | None) -> Any:
    """`options` as registered reward `name`'s options dataclass, strictly (an unknown key or a wrong type is a
    ConfigError naming it); None for a reward that takes none, which refuses any."""
    if name.startswith("python:"):
        if options:
            raise ConfigError(f"reward.options.{name}: a python: reward takes no options; read your own "
                              "settings inside the function")
        return None
    entry = REGISTRY[name]
    if entry.options is None:
        if options:
            raise ConfigError(f"reward.options.{name}: reward {name!r} takes no options, got "
                              f"{', '.join(map(brief, options))}")
        return None
    return from_dict(entry.options, dict(options or {}), where="config", prefix=f"reward.options.{name}.")


def check_option_names(names) -> None:
    """ConfigError for the first of `names` (the keys of reward.options) that is no reward: a misspelt name's
    options would otherwise be silently unused."""
    for name in names:
        if not is_registered(name):
            close = difflib.get_close_matches(name, sorted(REGISTRY), n=1)
            hint = f" (did you mean 'reward.options.{close[0]}'?)" if close else ""
            raise ConfigError(f"reward.options names {brief(name)}, which is not a reward{hint}; registered "
                              f"rewards: {', '.join(available_rewards())}")


def check_options(cfg) -> None:
    """Check the config's `reward.options.<name>` and `policy.options` against the options dataclasses that the
    rewards and the policy kind registered (plugins loaded on demand, as every lookup does): a misspelt key
    is a ConfigError naming it, with a did-you-mean, when a command loads the config rather than when the
    model loads. A config without policy.kind (`score` needs none) has no policy options to check."""
    check_option_names(cfg.reward.options)
    for name, options in cfg.reward.options.items():
        reward_options(name, options)
    for name, weight in cfg.reward.weights.items():  # is_registered loads plugins; python: rewards are not in REGISTRY
        entry = REGISTRY.get(name) if weight and is_registered(name) else None
        if entry is not None and entry.reads_plan and not cfg.sample.plan.enabled:
            raise ConfigError(f"reward.weights.{name}: reward {name!r} scores each image against its text plan, and "
                              "this config samples none; set sample.plan.enabled=true (with a policy that plans) or "
                              "drop the reward")
    for name in dict.fromkeys([*(n for n, w in cfg.reward.weights.items() if w), *cfg.reward.monitor]):
        entry = REGISTRY.get(name) if is_registered(name) else None
        if entry is not None and entry.reads_policy:
            check_reads_policy(name, entry.reads_policy, cfg, reward_options(name, cfg.reward.options.get(name)))
    if cfg.policy.kind or cfg.policy.options:
        kind_options(cfg.policy)


def policy_readers(cfg) -> list[str]:
    """The rewards of the config (weights and monitors) that score with the run's own network (`reads_policy`)."""
    names = dict.fromkeys([*cfg.reward.weights, *cfg.reward.monitor])
    return [n for n in names if is_registered(n) and n in REGISTRY and REGISTRY[n].reads_policy]


def check_reads_policy(name: str, kinds: tuple[str, ...], cfg, options) -> None:
    """ConfigError when reward `name`, which scores with the run's own network, cannot have one: a policy kind
    not among `kinds`, or a judging reference (options without `model: policy`) where train.reference is none."""
    if cfg.policy.kind not in kinds:
        raise ConfigError(f"reward {name!r} scores with the policy's own network, which policy kind "
                          f"{cfg.policy.kind!r} cannot give it: use it with policy.kind "
                          f"{' or '.join(map(repr, kinds))}, or drop it")
    if getattr(options, "model", "reference") == "reference" and cfg.train.reference == "none":
        raise ConfigError(f"reward {name!r} judges with the reference model, and "
                          "train.reference is none: set train.reference=adapter (with train.adapter=lora: no second "
                          f"copy of the weights) or frozen, or reward.options.{name}.model=policy")


FILE_OPTION = re.compile(r"(path|checkpoint)$")  # an options field that names a local file or folder


def named_files(cfg) -> list[tuple[str, str]]:
    """(key, path) of every file or folder the config names: the policy's, the prompts files, and each option of a
    reward it trains on or monitors whose name ends in path or checkpoint (reward.options.hpsv2.checkpoint, ...)."""
    d = cfg.data
    named = [("policy.path", cfg.policy.path), ("policy.tokenizer", cfg.policy.tokenizer),
             ("data.train_prompts", d.train_prompts), ("data.eval_prompts", d.eval_prompts),
             ("data.heldout_prompts", d.heldout_prompts)]
    used = [n for n, w in cfg.reward.weights.items() if w] + list(cfg.reward.monitor)
    for name in dict.fromkeys(used):
        options = reward_options(name, cfg.reward.options.get(name)) if is_registered(name) else None
        named += [(f"reward.options.{name}.{f.name}", getattr(options, f.name))
                  for f in (dataclasses.fields(options) if options is not None else ()) if FILE_OPTION.search(f.name)]
    return [(key, path) for key, path in named if isinstance(path, str) and path]


def check_named_files(cfg) -> None:
    """What `grpo-vision config` and `train` check of the files the config names before any model loads: the
    policy kind's own check (policy.check_files: LlamaGen's image size against its file's, a missing world), then
    one ConfigError naming every file that is not there, rather than one at a time as each loader reaches its own."""
    if cfg.policy.kind:
        check_files(cfg.policy)
    missing = [f"{key} {path}" for key, path in named_files(cfg) if not Path(path).exists()]
    if missing:
        raise ConfigError(f"{len(missing)} file(s) the config names are missing: {'; '.join(missing)}; put them "
                          "there or point the keys elsewhere (docs/real_models.md says where each model comes from "
                          "and how to make a prompts file)")


def register_callable(name: str, fn: RewardFn) -> None:
    """Register the reward function `fn` itself (a script's, GRPOTrainer's `rewards=`) as reward `name`; the
    run folder records where it came from (`reward_origin`), so a later command can say how to supply it."""
    if not callable(fn):
        raise ConfigError(f"reward {brief(name)}: {brief(fn)} is not callable; give a function "
                          "(images, prompts, metadata) -> scores")

    held = REGISTRY.get(name)
    if held is not None and not hasattr(held.factory, "reward"):  # a built-in or a plugin's, not a script's function
        where = getattr(held.factory, "__module__", "") or "a plugin"
        raise ConfigError(f"reward {name!r} is a registered reward already (from {where}), and a function "
                          f"{getattr(fn, '__qualname__', brief(fn))} was given under that name: give it another name, "
                          f"e.g. {{'my_{name}': function}} (the CLI's --reward refuses the same clash)")

    def factory(ctx):
        return fn
    factory.reward = fn
    REGISTRY[name] = Registered(factory)


def supply_rewards(given: Sequence[str]) -> None:
    """Register each `name=python:module:function` of `given` (a command's --reward): a reward a run folder
    names that exists only in the script that trained it."""
    for item in given:
        name, _, spec = item.partition("=")
        if not name or not spec.startswith("python:"):
            raise ConfigError(f"--reward {brief(item)} must look like NAME=python:package.module:function")
        if name in REGISTRY and getattr(REGISTRY[name].factory, "spec", None) != spec:
            raise ConfigError(f"--reward {name}=...: {name!r} is a registered reward already; give it only for a "
                              "reward this machine does not have")
        fn = _import_callable(spec)

        def factory(ctx, fn=fn):
            return fn
        factory.spec = spec
        REGISTRY[name] = Registered(factory)


def reward_origin(name: str) -> dict[str, str]:
    """Where reward `name` comes from, for a run folder's rewards.json: a python: spec (and the folder its module
    was imported from), or the module (and script) a registered reward was made in; what a command that misses
    the reward later tells its user, and what `--trust-run` imports again (`check_rewards`)."""
    entry = None if name.startswith("python:") else REGISTRY.get(name)
    if entry is not None and (recorded := getattr(entry.factory, "origin", None)):
        return dict(recorded)  # imported again from a run folder's record: the record stays as the run made it
    spec = name if name.startswith("python:") else getattr(getattr(entry, "factory", None), "spec", None)
    if spec:  # a python: name, or supplied on a command line
        return {"spec": spec, **_import_root(spec.split(":")[1])}
    if entry is None:
        return {}
    fn = getattr(entry.factory, "reward", entry.factory)  # the function itself, or the factory that makes it
    origin = {"module": getattr(fn, "__module__", None) or "?", "function": getattr(fn, "__qualname__", "?")}
    if origin["module"] == "__main__":
        origin["script"] = Path(sys.argv[0]).name if sys.argv and sys.argv[0] else "?"
        try:  # save_reward_origins keeps a copy of the script in the run folder, for --trust-run
            if origin["function"].isidentifier():  # a lambda or a nested function cannot be defined again
                origin["source"] = str(Path(inspect.getsourcefile(fn)).resolve())
        except (TypeError, OSError):  # made in a REPL or a notebook: no file to keep
            pass
    elif hasattr(entry.factory, "reward") and "<" not in origin["function"]:  # importable by that name
        origin |= {"spec": f"python:{origin['module']}:{origin['function']}", **_import_root(origin["module"])}
    return origin


def _import_root(module: str) -> dict[str, str]:
    """{"path": the sys.path folder `module` was imported from} where it was imported from a file, else {}."""
    loaded = sys.modules.get(module)
    file = getattr(loaded, "__file__", None)
    if not file:
        return {}
    root = Path(file).resolve().parent
    for _ in range(module.count(".") + (Path(file).name == "__init__.py")):
        root = root.parent
    return {"path": str(root)}


def restore_reward(name: str, origin: dict, run_dir: Path) -> None:
    """Register reward `name` as the run folder recorded it (`--trust-run`: this runs the code it names): its spec
    imported with the recorded folder on sys.path, or a script's function from the copy the run folder keeps,
    whose imports and definitions are run and nothing else (a script that trains at its top level would train)."""
    if origin.get("path") and origin["path"] not in sys.path:
        sys.path.append(origin["path"])  # after the installed packages: the recorded folder shadows none of them
    if name.startswith("python:"):
        return  # imported by its name where the run builds it
    held = REGISTRY.get(name)
    if origin.get("spec"):
        fn = _import_callable(origin["spec"])
    elif origin.get("code") and origin.get("function"):
        fn = _script_function(Path(run_dir) / origin["code"], origin["function"], name)
    else:
        return
    if REGISTRY.get(name) is not held:  # the script registered it itself (@register_reward): its factory, options
        REGISTRY[name].factory.origin = origin
        return

    def factory(ctx, fn=fn):
        return fn
    factory.origin = origin
    REGISTRY[name] = Registered(factory)


SCRIPT_MODULE = "grpo_vision_run_script_"  # the module a run folder's copy of a script is defined in (--trust-run)


def _script_function(path: Path, function: str, name: str) -> Callable:
    """Function `function` of the script at `path`, defined by running the script's top-level imports, function
    and class definitions and the assignments that call nothing (constants); a global the function reads that only
    the script's other top-level code would make (a loaded model) is named in one line, not at the first score."""
    import ast
    import builtins
    import dis
    import types

    try:
        tree = ast.parse(path.read_text(encoding="utf-8"), str(path))
    except (OSError, SyntaxError, ValueError) as e:
        raise ConfigError(f"reward {name!r}: the run folder's copy of its script, {path}, cannot be read "
                          f"({type(e).__name__}: {e})") from None
    kinds = (ast.Import, ast.ImportFrom, ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)
    constant = (ast.Assign, ast.AnnAssign)
    tree.body = [node for node in tree.body if isinstance(node, kinds) or (
        isinstance(node, constant) and not any(isinstance(n, ast.Call) for n in ast.walk(node)))]
    module = types.ModuleType(f"{SCRIPT_MODULE}{path.stem}")
    module.__file__ = str(path)
    sys.modules[module.__name__] = module  # dataclasses and pickle look their module up by name
    try:
        exec(compile(tree, str(path), "exec"), module.__dict__)  # noqa: S102 (--trust-run: the user trusts it)
    except Exception as e:  # an import the script needs is missing here
        raise ConfigError(f"reward {name!r}: defining it from {path} failed ({type(e).__name__}: {e})") from None
    fn = getattr(module, function, None)
    if not callable(fn):
        raise ConfigError(f"reward {name!r}: {path} defines no function {function!r} at its top level")
    codes, used = [getattr(fn, "__code__", None)], set()
    while codes:  # the globals it and its nested functions read
        code = codes.pop()
        if code is not None:
            used |= {i.argval for i in dis.get_instructions(code) if i.opname in ("LOAD_GLOBAL", "LOAD_NAME")}
            codes += [c for c in code.co_consts if isinstance(c, types.CodeType)]
    if missing := sorted(n for n in used if n not in module.__dict__ and not hasattr(builtins, n)):
        raise ConfigError(f"reward {name!r}: {function} in {path} reads {', '.join(missing)}, which the script makes "
                          "by running code at its top level (not run again under --trust-run): move the reward into a "
                          f"module and give it with --reward {name}=python:MODULE:FUNCTION")
    return fn


def _import_callable(spec: str) -> RewardFn:
    parts = spec.split(":")
    if len(parts) != 3 or not all(parts[1:]):
        raise ConfigError(f"reward {brief(spec)} must look like python:package.module:function")
    try:
        fn = getattr(importlib.import_module(parts[1]), parts[2])
    except Exception as e:  # ImportError, AttributeError, or whatever the user's module raises on import
        raise ConfigError(f"reward {brief(spec)}: cannot import {parts[2]} from {parts[1]} "
                          f"({type(e).__name__}: {e})") from None
    if not callable(fn):
        raise ConfigError(f"reward {brief(spec)}: {parts[2]} is not callable")
    return fn


def batched(fn: Callable[[torch.Tensor, Sequence[str]], torch.Tensor], batch_size: int, device,
            load: Callable[[], object] | None = None) -> RewardFn:
    """Run `fn(images, prompts)` in chunks of `batch_size` on `device`; results on the CPU, float32.
    `load`, if given, builds the reward's models; CompositeReward.load calls it before a run starts."""
    def reward(images, prompts, metadata):
        out = [fn(images[i:i + batch_size].to(device), list(prompts[i:i + batch_size])).float().cpu()
               for i in range(0, len(prompts), batch_size)]
        return torch.cat(out)
    if load is not None:
        reward.load = load
    return reward


# ---------------------------------------------------------------------------- a run folder's rewards


def reward_names(cfg, entries=()) -> list[str]:
    """Every reward the config `cfg` and the prompt `entries` name, each once, in order."""
    named = [*cfg.reward.weights, *cfg.reward.monitor, *(n for e in entries for n in (e.rewards or {}))]
    return list(dict.fromkeys(named))


def save_reward_origins(run_dir: str | Path, cfg, entries=()) -> None:
    """Record where each reward of the run came from (rewards.json), so that a command on the folder that
    misses one (a reward made in a script) can say which and how to supply it, or import it again when the user
    trusts the folder (`check_rewards`). A script's reward keeps a copy of its script in code/."""
    origins = {name: reward_origin(name) for name in reward_names(cfg, entries)}
    for origin in origins.values():
        if source := origin.pop("source", None):
            code = f"code/{Path(source).name}"
            try:
                write_file(Path(run_dir) / code, Path(source).read_bytes(), root=run_dir)
                origin["code"] = code
            except OSError:  # the script went away meanwhile: the run then names the reward only
                pass
    write_file(Path(run_dir) / REWARDS, json.dumps(origins, indent=2) + "\n")


def check_rewards(cfg, run_dir: str | Path, entries=(), given=(), trust: bool = False) -> None:
    """Register the `given` --reward NAME=python:module:function and, with `trust` (--trust-run), the rewards the
    run folder recorded (rewards.json: `restore_reward`); then ConfigError naming the first reward of the run that
    this process does not have, where it was made and how to supply it, instead of "unknown reward"."""
    supply_rewards(given)
    records = reward_records(run_dir)
    names = reward_names(cfg, entries)
    if trust:
        for name in names:
            if (name.startswith("python:") or not is_registered(name)) and name in records:
                restore_reward(name, records[name], run_dir)
        for name in names:  # registered by a script's @register_reward while another of its rewards was restored
            factory = getattr(REGISTRY.get(name), "factory", None)
            if getattr(factory, "__module__", "").startswith(SCRIPT_MODULE) and name in records:
                factory.origin = records[name]
    missing = [n for n in names if not is_registered(n)]
    if not missing:
        return
    name, origin = missing[0], records.get(missing[0]) or {}
    made = ""
    if origin.get("module"):
        made = f" (made by {origin.get('function', '?')} in {origin['module']}" + (
            f", script {origin['script']})" if origin.get("script") else ")")
    spec = origin.get("spec") or "python:MODULE:FUNCTION"
    again = ", or pass --trust-run to import it as the run recorded it" if (
        origin.get("spec") or origin.get("code")) and not trust else ""
    raise ConfigError(f"run folder {run_dir} names reward {name!r}{made}, which is not registered here: give it with "
                      f"--reward {name}={spec} (a function (images, prompts, metadata) -> scores){again}, or register "
                      "it in a plugin (README, \"Bring your own policy, tokenizer and reward\")")