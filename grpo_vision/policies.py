"""Policy kinds: a registry of short names mapped to loaders, like the reward registry.

A kind's loader reads `policy.path` (and `policy.tokenizer`) and returns a `Bundle`: the policy, its
image tokenizer, and what the kind brings besides: a judge (exact verdicts for the report and the
demo), default options for rewards whose model files it ships, and its own prompt splits. Built in:
`llama` (LlamaImagePolicy with a diffusers VQ tokenizer) and `janus` (Janus-Pro through
transformers); plugins add more (ShapesWorld adds `shapes`, see plugins.py).

    @register_policy_kind("my_gpt")
    def load_my_gpt(pcfg, device) -> Bundle:
        return Bundle(MyPolicy.from_pretrained(pcfg.path, device), MyTokenizer(pcfg.tokenizer, device))
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

import torch

from grpo_vision.config import DEVICE_HINT, DEVICE_NAME, Config, ConfigError, PolicyConfig, brief
from grpo_vision.judge import Judge
from grpo_vision.plugins import load_plugins, not_found_hint
from grpo_vision.policy import prompt_problem
from grpo_vision.prompts import PromptEntry, PromptsError, load_prompts

PromptSplits = Callable[[Config], "PromptSets"]


@dataclass
class Bundle:
    policy: torch.nn.Module  # an ImagePolicy
    tokenizer: torch.nn.Module  # an ImageTokenizer
    judge: Judge | None = None  # exact per-attribute verdicts, when the kind has a judge
    reward_defaults: dict[str, dict] = field(default_factory=dict)  # reward name -> default options
    source: Path | None = None  # the directory the kind loaded from, when it has one


@dataclass
class PolicyKind:
    name: str
    load: Callable[[PolicyConfig, torch.device | str], Bundle]
    prompts: PromptSplits | None = None  # its PromptSets when data.* names no files


REGISTRY: dict[str, PolicyKind] = {}


def register_policy_kind(name: str, prompts: PromptSplits | None = None):
    """Register `load(policy_config, device) -> Bundle` as policy kind `name`; `prompts(cfg)` gives the
    kind's default PromptSets."""
    def wrap(load):
        REGISTRY[name] = PolicyKind(name, load, prompts)
        return load
    return wrap


def policy_kind(name: str) -> PolicyKind:
    if name not in REGISTRY:
        load_plugins()
    if name not in REGISTRY:
        raise ConfigError(f"unknown policy.kind {brief(name)}; registered kinds: {', '.join(sorted(REGISTRY))} "
                          f"({not_found_hint()})")
    return REGISTRY[name]


def load_bundle(pcfg: PolicyConfig, device) -> Bundle:
    return policy_kind(pcfg.kind).load(pcfg, device)


@register_policy_kind("llama")
def load_llama(pcfg: PolicyConfig, device) -> Bundle:
    """The built-in LlamaGen-style policy (`policy.path`) and a diffusers VQ tokenizer (`policy.tokenizer`)."""
    from grpo_vision.llama_policy import LlamaImagePolicy
    from grpo_vision.tokenizer import VQTokenizer

    if not pcfg.tokenizer:
        raise ConfigError("policy.kind 'llama' needs policy.tokenizer: the directory of its VQ tokenizer")
    policy = LlamaImagePolicy.from_pretrained(pcfg.path, device).to(getattr(torch, pcfg.dtype))
    return Bundle(policy, VQTokenizer.from_pretrained(pcfg.tokenizer, device), source=Path(pcfg.path))


@register_policy_kind("janus")
def load_janus(pcfg: PolicyConfig, device) -> Bundle:
    """Janus-Pro through transformers; its VQ model, inside the checkpoint, is the tokenizer."""
    from grpo_vision.janus_policy import JanusImagePolicy

    if pcfg.tokenizer:
        raise ConfigError("policy.tokenizer is not used with policy.kind 'janus': its VQ model is part of the "
                          "Janus checkpoint in policy.path; leave policy.tokenizer empty")
    policy = JanusImagePolicy.from_pretrained(pcfg.path, device, pcfg.dtype)
    return Bundle(policy, policy.image_tokenizer(), source=Path(pcfg.path))  # the tokenizer shares the VQ model


# ---------------------------------------------------------------------------- prompts

KIND_PROMPTS = "the policy kind's prompts"
SPLIT_SEED = 0  # the seed that holds back a prompts file's test set: the same split for every run.seed


@dataclass
class PromptSets:
    """A run's prompts: what it trains on and its two evaluation sets, neither ever trained on.

    `test` is the headline (GenEval's practice): prompts of the training distribution held back from
    training. `heldout` is the transfer row: compositions no model trained on (empty when the kind or
    the config names none). `train_sample`: some of the training prompts, scored beside both, so that a
    reader sees what RL did on what it trained on against what it never saw."""
    train: list[PromptEntry]
    test: list[PromptEntry]
    heldout: list[PromptEntry] = field(default_factory=list)
    train_sample: list[PromptEntry] = field(default_factory=list)

    def named(self) -> dict[str, list[PromptEntry]]:
        """The evaluation sets that have prompts (never trained on), the headline first."""
        return {k: v for k, v in (("test", self.test), ("heldout", self.heldout)) if v}

    def scored(self) -> dict[str, list[PromptEntry]]:
        """What the report and the matrix score: the evaluation sets, then the sample of training prompts."""
        return {**self.named(), **({"train_sample": self.train_sample} if self.train_sample else {})}

    def all(self) -> list[PromptEntry]:
        return [*self.train, *self.test, *self.heldout]


def prompt_lists(cfg: Config) -> PromptSets:
    """A run's prompts without loading a model: the files of `data.*`, else the policy kind's own sets.
    Without `data.eval_prompts`, a prompts file's test set is `data.test_prompts` of its prompts, held
    back with a fixed seed. Both evaluation sets are removed from the training prompts."""
    d = cfg.data
    splits = policy_kind(cfg.policy.kind).prompts
    if not d.train_prompts and splits is None:
        raise ConfigError(f"data.train_prompts is required: policy.kind {cfg.policy.kind!r} brings no prompts "
                          "of its own")
    own = splits(cfg) if not d.train_prompts else None
    train = load_prompts(d.train_prompts) if d.train_prompts else own.train
    if d.eval_prompts:
        test = load_prompts(d.eval_prompts)
    else:
        test = own.test if own else _hold_back(train, d.test_prompts, d.train_prompts)
    heldout = load_prompts(d.heldout_prompts) if d.heldout_prompts else (own.heldout if own else [])
    unseen = {e.prompt for e in (*test, *heldout)}
    sets = PromptSets([e for e in train if e.prompt not in unseen], test, heldout)
    if not sets.train:  # else the first step fails deep in numpy, after the run folder is written
        raise ConfigError(_nothing_to_train(cfg, train, sets, own is not None))
    kept = {e.prompt for e in sets.train}
    sets.train_sample = [e for e in own.train_sample if e.prompt in kept] if own and own.train_sample else \
        _draw(sets.train, d.eval_size)
    return sets


def _nothing_to_train(cfg: Config, train: list[PromptEntry], sets: PromptSets, kind: bool) -> str:
    """Why `train` (the prompts before both evaluation sets were removed) leaves nothing to train on."""
    d = cfg.data
    source = f"data.train_prompts ({d.train_prompts})" if d.train_prompts else KIND_PROMPTS
    if not train:
        return f"no prompt of {source} is left to train on: it has none; give data.train_prompts"
    names = {"test": f"data.eval_prompts ({d.eval_prompts})" if d.eval_prompts else
             "the policy kind's test set" if kind else "its held-back test set",
             "heldout": f"data.heldout_prompts ({d.heldout_prompts})" if d.heldout_prompts else
             "the policy kind's held-out set"}
    trained = {e.prompt for e in train}
    where = " or ".join(names[k] for k, v in sets.named().items() if trained & {e.prompt for e in v})
    return (f"no prompt of {source} is left to train on: all {len(train)} of its prompts are in {where}, and evaluation "
            "prompts are never trained on: train on other prompts (data.train_prompts), or evaluate on others "
            "(data.eval_prompts, data.heldout_prompts)")


def _hold_back(entries: list[PromptEntry], n: int, source: str) -> list[PromptEntry]:
    """`n` distinct prompts of `entries`, drawn with SPLIT_SEED, as the test set."""
    if len({e.prompt for e in entries}) < 2 * n:
        raise ConfigError(f"{source} has {len({e.prompt for e in entries})} distinct prompts: too few to hold back "
                          f"data.test_prompts={n} as the test set and train on the rest; give data.eval_prompts (a "
                          "test set of your own) or lower data.test_prompts")
    return _draw(entries, n)


def _draw(entries: list[PromptEntry], n: int) -> list[PromptEntry]:
    """`n` distinct prompts of `entries` drawn with SPLIT_SEED, in the order they come in."""
    distinct = list({e.prompt: e for e in entries}.values())
    order = torch.randperm(len(distinct), generator=torch.Generator().manual_seed(SPLIT_SEED))[:n]
    return [distinct[i] for i in sorted(order.tolist())]


def run_prompt_sets(cfg: Config, run_dir: str | Path | None = None) -> PromptSets:
    """The prompts a run saved at its start (`run_dir`/prompts/*.jsonl), so that a resumed run trains on
    what it trained on whatever a later version of a kind's draw gives; else `prompt_lists(cfg)`."""
    folder = Path(run_dir) / "prompts" if run_dir else None
    files = [folder / f"{name}.jsonl" for name in ("train", "test", "heldout", "train_sample")] if folder else []
    # a link is never read as the run's own (runfiles.py): such a folder falls back to its config's prompts
    if not files or not files[0].is_file() or any(f.is_symlink() for f in (folder, *files)):
        return prompt_lists(cfg)
    return PromptSets(*(load_prompts(f) if f.is_file() else [] for f in files))


def checked_prompt_sets(cfg: Config, bundle: Bundle, run_dir: str | Path | None = None) -> PromptSets:
    """`run_prompt_sets`, each prompt checked against the loaded policy: an unknown word stops the run
    before it starts, naming the prompt and its line (it would be trained on as <unk>)."""
    d = cfg.data
    sets = run_prompt_sets(cfg, run_dir)
    # without data.eval_prompts, a train file's test set is held back from it (and named by its lines)
    for entries, source in ((sets.train, d.train_prompts), (sets.test, d.eval_prompts or d.train_prompts),
                            (sets.heldout, d.heldout_prompts)):
        for e in entries:
            problem = prompt_problem(bundle.policy, e.prompt)
            if problem:
                raise PromptsError(f"{source or KIND_PROMPTS}, line {e.line}: {problem}")
    return sets


def resolve_device(name: str, key: str = "run.device") -> str:
    """`run.device` (or a command's --device, named by `key`) as a torch device: "auto" is cuda when a GPU
    is visible, else cpu; a device this machine lacks is a ConfigError (never a silent fall back to the CPU)."""
    if name == "auto":
        return "cuda" if torch.cuda.is_available() else "cpu"
    if not DEVICE_NAME.fullmatch(name):
        raise ConfigError(f"{key} {brief(name)} is not a device: use {DEVICE_HINT}")
    kind, _, index = name.partition(":")
    gpus = torch.cuda.device_count() if kind == "cuda" and torch.cuda.is_available() else 0
    if kind == "cuda" and int(index or 0) >= gpus:
        have = f"only cuda:0 to cuda:{gpus - 1}" if gpus > 1 else "only cuda:0" if gpus else "no CUDA GPU torch can use"
        raise ConfigError(f"{key}={name}, and this machine has {have}: use {key}=auto (the best device here) or cpu")
    if kind == "mps" and not torch.backends.mps.is_available():
        raise ConfigError(f"{key}=mps, and this machine has no Apple GPU torch can use: use {key}=auto or cpu")
    return name
