"""The built-in policy kinds: `llama` (LlamaImagePolicy with a diffusers VQ tokenizer), `janus`
(Janus-Pro through transformers) and `llamagen` (LlamaGen's released GPT and VQ checkpoints). They
register like any plugin's kinds (plugins.py, policy.py); `exporter` finds how a policy is written out."""

from __future__ import annotations

import dataclasses
import functools
import re
from pathlib import Path
from typing import Callable

import torch

from grpo_vision.config import ConfigError, PolicyConfig
from grpo_vision.models.llamagen_load import LlamaGenOptions, checked_image_size, checkpoint_args
from grpo_vision.policy import Bundle, Deferred, kind_options, register_path_loader, register_policy_kind


@register_policy_kind("llama")
def load_llama(pcfg: PolicyConfig, device) -> Bundle:
    """The built-in LlamaGen-style policy (`policy.path`) and a diffusers VQ tokenizer (`policy.tokenizer`)."""
    from grpo_vision.models.llama import LlamaImagePolicy
    from grpo_vision.models.tokenizer import VQTokenizer

    if not pcfg.tokenizer:
        raise ConfigError("policy.kind 'llama' needs policy.tokenizer: the directory of its VQ tokenizer")
    vq = VQTokenizer.check_dir(pcfg.tokenizer)
    policy = LlamaImagePolicy.from_pretrained(pcfg.path, device).to(getattr(torch, pcfg.dtype))
    # made when first read: diffusers' import alone takes seconds, and `export` never decodes
    return Bundle(policy, Deferred(lambda: VQTokenizer.from_pretrained(vq, device)), source=Path(pcfg.path))


@register_policy_kind("janus")
def load_janus(pcfg: PolicyConfig, device) -> Bundle:
    """Janus-Pro through transformers; its VQ model, inside the checkpoint, is the tokenizer."""
    from grpo_vision.models.janus import JanusImagePolicy

    if pcfg.tokenizer:
        raise ConfigError("policy.tokenizer is not used with policy.kind 'janus': its VQ model is part of the "
                          "Janus checkpoint in policy.path; leave policy.tokenizer empty")
    policy = JanusImagePolicy.from_pretrained(pcfg.path, device, pcfg.dtype)
    return Bundle(policy, policy.image_tokenizer(), source=Path(pcfg.path))  # the tokenizer shares the VQ model


def check_llamagen_files(pcfg) -> None:
    """The image-size conflict load_policy finds, checked from the file's name and arguments only (the kind's
    `check`: `grpo-vision config` and the start of `train` run it before any model loads). A run folder's own
    size is checked as trained_bundle checks it. It lives here, not in llamagen_load.py, which this
    module imports: the two would import each other."""
    if run_folder_of(pcfg.path):
        check_weight_options(pcfg)
    elif Path(pcfg.path).is_file():  # a missing file is named when the model loads
        checked_image_size(kind_options(pcfg), Path(pcfg.path), checkpoint_args(Path(pcfg.path)))


@register_policy_kind("llamagen", options=LlamaGenOptions, check=check_llamagen_files)
def load_llamagen(pcfg: PolicyConfig, device) -> Bundle:
    """LlamaGen's released GPT (`policy.path`, c2i or t2i), its VQ (`policy.tokenizer`), `policy.options`."""
    from grpo_vision.models.llamagen_load import load_llamagen as load

    return load(pcfg, device)


def exporter(policy) -> Callable[[str | Path], list[Path]] | None:
    """`write(directory) -> files`: `policy` whole, in the format its model's own code loads (export.py), or None.
    A policy class opts in with an `export(directory)` method (Janus's, a plugin's); the built-in Llama's and
    LlamaGen's exporters sit beside their loaders (llama_hf.py, llamagen_load.py), which import the policy modules:
    as methods, they would import them back."""
    if callable(getattr(policy, "export", None)):
        return policy.export
    from grpo_vision.models import llama_hf, llamagen_load
    from grpo_vision.models.llama import LlamaImagePolicy
    from grpo_vision.models.llamagen import LlamaGenPolicy

    for cls, write in ((LlamaImagePolicy, llama_hf.export), (LlamaGenPolicy, llamagen_load.export)):
        if isinstance(policy, cls):
            return functools.partial(write, policy)
    return None


# A run folder as policy.path: a new run continues from a trained one
STEP_DIR = re.compile(r"step_\d+")


def run_folder_of(path: str | Path) -> tuple[Path, int | None] | None:
    """(run folder, step or None for the latest) when `path` is a run folder or one of its checkpoint
    step folders; None otherwise."""
    path = Path(path)
    if STEP_DIR.fullmatch(path.name) and path.parent.name == "checkpoints" and path.is_dir():
        return path.parent.parent, int(path.name[5:])
    if (path / "config.yaml").is_file() and (path / "checkpoints").is_dir():
        return path, None
    return None


WEIGHT_OPTIONS = ("image_size",)  # policy.options that describe the trained weights: a run folder's own wins


def trained_bundle(pcfg: PolicyConfig, device) -> Bundle:
    """The Bundle of the run folder in `pcfg.path`: its own policy kind, tokenizer and options (those that
    `pcfg.options` gives replaced), with the checkpoint's weights (an adapter merged into them) in `pcfg.dtype`;
    a new run trains on from there."""
    from grpo_vision.models.adapters import add_adapter
    from grpo_vision.policy import load_bundle
    from grpo_vision.run.checkpoint import base_identity, check_base, find_checkpoint, load_checkpoint, recorded_base
    from grpo_vision.run.folder import read_run_config

    run_dir, step = run_folder_of(pcfg.path)
    check_chain(run_dir)
    cfg = read_run_config(run_dir)
    own = check_weight_options(pcfg, cfg.policy)
    if pcfg.tokenizer:
        raise ConfigError(f"policy.path {pcfg.path} is a run folder, which brings its own policy.tokenizer: leave "
                          "it empty")
    # the run's own options, each that policy.options gives replaced: a setting of this run rather than of the
    # model (ShapesWorld's world_train_split), or a file that moved since (llamagen's text_encoder)
    own = dataclasses.replace(own, options={**own.options, **pcfg.options})
    bundle = load_bundle(own, device)  # the run's own base (itself a run folder, for a chain of runs)
    policy, t = bundle.policy, cfg.train
    frozen = {n for n, p in policy.named_parameters() if not p.requires_grad}  # what the kind's loader froze
    if t.adapter != "none":
        policy = add_adapter(policy, t.adapter, t.adapter_rank, t.adapter_alpha, t.adapter_targets)
    ckpt = find_checkpoint(run_dir, step)
    check_base(ckpt / "trainer_state.json", recorded_base(ckpt), base_identity(own), False)  # before it was continued
    load_checkpoint(ckpt, policy)
    if t.adapter != "none":  # peft folds LoRA, LoHa and LoKr alike; it leaves every base weight frozen
        policy = policy.merge_and_unload()
        for name, p in policy.named_parameters():
            p.requires_grad_(name not in frozen)
    bundle.policy = policy.to(getattr(torch, pcfg.dtype))
    return bundle


def check_weight_options(pcfg: PolicyConfig, own: PolicyConfig | None = None) -> PolicyConfig:
    """The policy config of the run folder in `pcfg.path` (`own`, else read from it), once `pcfg` asks for its
    kind and for no other WEIGHT_OPTIONS than those it trained with (what the trained weights are, not a setting
    of the new run). trained_bundle calls it, and so does a kind's `check` before any model loads."""
    from grpo_vision.run.folder import read_run_config

    run_dir = run_folder_of(pcfg.path)[0]
    own = own or read_run_config(run_dir).policy
    if pcfg.kind != own.kind:
        raise ConfigError(f"policy.path {pcfg.path} is a run folder of policy kind {own.kind!r}: set policy.kind "
                          f"to {own.kind!r}")
    for key in WEIGHT_OPTIONS:
        if key in own.options and key in pcfg.options and own.options[key] != pcfg.options[key]:
            raise ConfigError(f"policy.options.{key} is {pcfg.options[key]}, but the run folder {run_dir} trained at "
                              f"{own.options[key]}: remove policy.options.{key} (the run's own is used) or set it to "
                              f"{own.options[key]}")
    return own


def check_chain(run_dir: Path) -> None:
    """ConfigError naming the cycle when the runs whose `policy.path` is a run folder lead back to one of them
    (a run continued from itself, directly or through others): loading would recurse until Python gave up."""
    from grpo_vision.run.folder import read_run_config

    seen: list[Path] = []
    folder: Path | None = run_dir
    while folder is not None:
        here = folder.resolve()
        if here in seen:
            chain = " -> ".join(str(p) for p in [*seen[seen.index(here):], here])
            raise ConfigError(f"policy.path leads back to itself through run folders ({chain}): set the first run's "
                              "policy.path to the model it started from")
        seen.append(here)
        found = run_folder_of(read_run_config(folder).policy.path)
        folder = found[0] if found else None


register_path_loader(run_folder_of, trained_bundle)
