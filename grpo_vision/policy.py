"""The contracts of a model: the `ImagePolicy` protocol, the `Judge` protocol, and the registry of
policy kinds that load them (`register_policy_kind`, `Bundle`).

`ImagePolicy`: what the sampler and the trainer need from an image-token model.

A policy turns captions into condition token ids, and gives logits over its image codebook, either
step by step with a KV cache (sampling) or for a whole token sequence at once (teacher forcing, for
training log-probs). Logits are always over the codebook only (`[..., codebook_size]`), so the
sampler never has to know where image tokens sit in a model's vocabulary.

Optional: `unknown_words(prompt) -> list[str]`, the words a policy would read as unknown, and
`caption_words`, its vocabulary. A policy with a closed vocabulary implements them, so that
training refuses prompts it cannot read (`prompt_problem` below); Janus reads any text and does not.

Optional, for a token weighting (`train.token_weighting`, credit.py): `token_embeddings(tokens [n, N]) ->
[n, N, E]`, the language model's input embeddings of image tokens (GCPO's critical tokens compare them across a
group), and the tokenizer's `code_vectors(tokens [n, N]) -> [n, N, D]`, its L2-normalised codebook vectors
(STAGE). A weighting whose hook a kind lacks is refused by name (`check_weighting_hooks`).

The sampler owns the distribution (CFG, temperature, top-k/top-p): see `sampling/`. Adapters:
`models.llama.LlamaImagePolicy` (built in, LlamaGen-style) and `models.janus.JanusImagePolicy` (Janus-Pro through transformers).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable, Iterable, Protocol, Sequence, runtime_checkable

import torch

from grpo_vision.config import Config, ConfigError, PolicyConfig, brief, from_dict
from grpo_vision.plugins import load_built_in, load_plugins, not_found_hint
from grpo_vision.prompts import PromptsError

if TYPE_CHECKING:  # splits.py builds on this module
    from grpo_vision.splits import PromptSets


@runtime_checkable
class ImagePolicy(Protocol):
    num_image_tokens: int  # tokens per image, h * w of the tokenizer's grid
    codebook_size: int  # K: image-token logits have this last dimension
    image_grid: tuple[int, int]  # (h, w) of the token grid, for the VQ decoder

    def encode_prompts(self, prompts: Sequence[str]) -> torch.Tensor:
        """Condition ids `[B, L]` for captions (all rows of one call share L)."""
        ...

    def null_condition(self, cond: torch.Tensor) -> torch.Tensor:
        """The unconditional rows for classifier-free guidance, same shape as `cond`."""
        ...

    def new_cache(self, batch_size: int) -> Any:
        """An empty KV cache for `batch_size` rows, sized for condition + image tokens."""
        ...

    def prefill(self, cond: torch.Tensor, cache: Any) -> torch.Tensor:
        """Run the condition `[B, L]` into `cache`; return logits `[B, K]` of image token 0."""
        ...

    def decode(self, tokens: torch.Tensor, cache: Any) -> torch.Tensor:
        """Append image tokens `[B]` (codebook ids) to `cache`; return logits `[B, K]` of the next."""
        ...

    def image_logits(self, cond: torch.Tensor, tokens: torch.Tensor) -> torch.Tensor:
        """Teacher-forced logits `[B, N, K]` for image tokens `[B, N]`, one forward pass, with grad."""
        ...

    def forward(self, cond: torch.Tensor, tokens: torch.Tensor) -> torch.Tensor:
        """`image_logits`: training calls the module itself, so that DDP's and FSDP's hooks run."""
        ...


@runtime_checkable
class PlanningPolicy(Protocol):
    """Optional: a policy that writes a text plan before it draws (`sample.plan`, T2I-R1's two-stage rollout,
    arXiv 2505.00703). The text stage reads the prompt through `sample.plan.template`, samples plan tokens with
    its own cache until `plan_end_id`, and the image stage is conditioned on `plan_condition(prompts, plans)`.
    Plan logits are over the kind's plan vocabulary only (`[..., plan_vocab_size]`), as image logits are over the
    codebook. A kind without these methods refuses `sample.plan` by name (`check_planning`)."""

    plan_vocab_size: int  # V: plan-token logits have this last dimension
    plan_end_id: int  # the plan token (in 0..V-1) that ends a plan

    def encode_plan_prompts(self, prompts: Sequence[str]) -> torch.Tensor:
        """The text stage's input ids `[B, L]` for prompts the template has already been applied to, left padded
        (no pad after the last prompt token: the first plan token follows it)."""
        ...

    def new_plan_cache(self, batch_size: int, max_tokens: int) -> Any:
        """An empty cache for the text stage of `batch_size` rows and up to `max_tokens` plan tokens."""
        ...

    def plan_prefill(self, ids: torch.Tensor, cache: Any) -> torch.Tensor:
        """Run the text stage's input `[B, L]` into `cache`; return logits `[B, V]` of plan token 0."""
        ...

    def plan_decode(self, tokens: torch.Tensor, cache: Any) -> torch.Tensor:
        """Append plan tokens `[B]` (ids in 0..V-1) to `cache`; return logits `[B, V]` of the next."""
        ...

    def plan_logits(self, ids: torch.Tensor, tokens: torch.Tensor) -> torch.Tensor:
        """Teacher-forced logits `[B, T, V]` of plan tokens `[B, T]` after input `ids` `[B, L]`, with grad (what
        comes after a row's end token is never read)."""
        ...

    def plan_text(self, tokens: Sequence[int]) -> str:
        """A plan's tokens (without its end token) as the text shown beside its image."""
        ...

    def plan_condition(self, prompts: Sequence[str], plans: Sequence[Sequence[int]]) -> torch.Tensor:
        """The image stage's condition ids `[B, L']` for each prompt and its plan (its tokens without the end
        token), for `prefill`, `image_logits` and `null_condition` as `encode_prompts`'s are."""
        ...

    # and, in place of ImagePolicy's, `forward(cond, tokens, plan) -> (image logits, plan logits)` for the rows'
    # plan segment (a `sampling.Plan`, T = 0 without a text stage: plan logits `[B, 0, V]`), so that one call of the
    # module (DDP's and FSDP's hooks) gives both segments of a training forward; optionally
    # `plan_prompting(template) -> dict`, how it wraps both stages' text, which an export records (export.py)


def check_planning(policy, kind: str, max_tokens: int) -> None:
    """ConfigError naming the kind when `sample.plan.enabled` asks a policy for a text stage it cannot write, or
    for plans longer than it holds (sample.plan.max_tokens): before the first step rather than at it."""
    missing = [m for m in ("encode_plan_prompts", "new_plan_cache", "plan_prefill", "plan_decode", "plan_logits",
                           "plan_text", "plan_condition") if not callable(getattr(policy, m, None))]
    if missing or not getattr(policy, "plan_vocab_size", 0):
        raise ConfigError(f"sample.plan.enabled: policy.kind {kind!r} ({type(policy).__name__}) cannot write a text "
                          f"plan (it lacks {', '.join(missing) or 'a plan vocabulary'}); set sample.plan.enabled "
                          "to false, or use a kind that plans (janus, or shapes with a world built with plans)")
    try:
        policy.new_plan_cache(1, max_tokens)
    except ValueError as e:
        raise ConfigError(str(e)) from None


def check_plan_template(policy, template: str, prompts: Iterable[str]) -> None:
    """ConfigError when the text stage cannot read `template` (sample.plan.template) as captions are read: words
    the policy does not know (every plan prompt would read them as <unk>; a caption with one is refused, see
    prompt_problem), or more words with the longest of `prompts` than the policy's caption slots (else a ValueError
    at the first rollout)."""
    own = template.format(prompt="")  # the template's words besides the caption
    if unknown := unknown_words(policy, own):
        raise ConfigError(f"sample.plan.template {brief(template)} has words the policy does not know: "
                          f"{', '.join(map(brief, unknown[:5]))} (every plan prompt would read them as <unk>): write "
                          "it in the policy's caption words, or set it to {prompt}")
    longest = max(prompts, key=lambda p: len(p.split()), default="")
    try:
        policy.encode_plan_prompts([template.format(prompt=longest)])
    except ValueError as e:  # e.g. the caption slots of a ShapesWorld policy (max_caption_words)
        raise ConfigError(f"sample.plan.template {brief(template)} adds {len(own.split())} words to each caption, and "
                          f"with the longest prompt {brief(longest)}: {e}; shorten the template (or the prompts), or "
                          "set it to {prompt}") from None


def unknown_words(policy, prompt: str) -> list[str]:
    """The words of `prompt` that `policy` cannot read; none for a policy that reads any text."""
    check = getattr(policy, "unknown_words", None)
    return check(prompt) if check is not None else []


def prompt_problem(policy, prompt: str) -> str | None:
    """Why `policy` cannot read `prompt` (too long, unknown words), or None when it can."""
    try:
        policy.encode_prompts([prompt])
    except ValueError as e:  # e.g. more words than the policy's caption length
        return str(e)
    unknown = unknown_words(policy, prompt)
    if not unknown:
        return None
    vocabulary = getattr(policy, "caption_words", None) or []
    more = " ..." if len(vocabulary) > 60 else ""  # a long vocabulary is cut short in the message
    shown = f" (its vocabulary: {' '.join(vocabulary[:60])}{more})" if vocabulary else ""
    more = f" and {len(unknown) - 5} more" if len(unknown) > 5 else ""  # a 10 MB line of unknown words: a few
    return f"words the policy does not know: {', '.join(map(brief, unknown[:5]))}{more}{shown}"


def check_prompts(policy, prompts: Iterable[tuple[str, str]]) -> None:
    """PromptsError for the first of `prompts`, (where it comes from, prompt) pairs, that `policy` cannot
    read: what `train` refuses (words it would read as unknown, more words than it takes) the commands
    that sample a run refuse too, naming the file and line."""
    for where, prompt in prompts:
        problem = prompt_problem(policy, prompt)
        if problem:
            raise PromptsError(f"{where}: {problem}")


# train.token_weighting -> the optional method it needs and what holds it (credit.py); the others need none
WEIGHTING_HOOKS = {"stage": ("tokenizer", "code_vectors"), "critical": ("policy", "token_embeddings")}


def check_weighting_hooks(weighting: str, kind: str, policy, tokenizer) -> None:
    """ConfigError, naming the kind and the weighting, when train.token_weighting needs a hook that `policy` (the
    unwrapped module) or `tokenizer` lacks: before the first step rather than at it."""
    if weighting not in WEIGHTING_HOOKS:
        return
    holder, method = WEIGHTING_HOOKS[weighting]
    owner = policy if holder == "policy" else tokenizer
    if not callable(getattr(owner, method, None)):
        others = " or ".join(w for w in ("none", "stage", "critical", "guidance_contrastive") if w != weighting)
        raise ConfigError(f"train.token_weighting={weighting} needs the {holder}'s {method}(tokens), which policy.kind "
                          f"{kind!r} ({type(owner).__name__}) does not have: add it, or set train.token_weighting to "
                          f"{others}")


# ---------------------------------------------------------------------------- judges

Verdict = dict[str, "bool | None"]


@runtime_checkable
class Judge(Protocol):
    name: str  # heading of its tables, e.g. "Exact checker (ShapesWorld)"
    attributes: Sequence[str]  # the verdict keys besides "correct", in table order
    forms: Sequence[str]  # prompt forms it groups by (e.g. plain, size, relation); may be empty

    def verdicts(self, images: torch.Tensor, prompts: Sequence[str]) -> list[Verdict | None]:
        """One verdict per image `[B, 3, H, W]` in [0, 1] against its prompt."""
        ...

    def form(self, prompt: str) -> str | None:
        """The prompt's form (one of `forms`), or None when the judge cannot read it."""
        ...

    def problem(self, prompt: str) -> str | None:
        """Why the judge cannot read `prompt`, or None when it can."""
        ...

    # Optional: `render(prompt, seed) -> uint8 [H, W, 3] | None`, an image the prompt describes (the
    # ground truth shown beside samples; ShapesWorld draws its scene). Sample sheets look it up by name.


# ---------------------------------------------------------------------------- policy kinds
# Policy kinds: a registry of short names mapped to loaders, like the reward registry.
#
# A kind's loader reads `policy.path` (and `policy.tokenizer`) and returns a `Bundle`: the policy, its
# image tokenizer, and what the kind brings besides: a judge (exact verdicts for the report and the
# demo), default options for rewards whose model files it ships, and its own prompt splits. A kind
# that takes settings registers their dataclass (`options=`): `policy.options` is checked against it
# when a command loads the config, and the loader reads them with `kind_options(pcfg)`. Built in:
# `llama` (LlamaImagePolicy with a diffusers VQ tokenizer), `janus` (Janus-Pro through transformers)
# and `llamagen`; plugins add more (ShapesWorld adds `shapes`, see plugins.py).
#
#     @register_policy_kind("my_gpt", options=MyGptOptions)
#     def load_my_gpt(pcfg, device) -> Bundle:
#         opts = kind_options(pcfg)  # a MyGptOptions
#         return Bundle(MyPolicy.from_pretrained(pcfg.path, opts, device), MyTokenizer(pcfg.tokenizer, device))

PromptSplits = Callable[[Config], "PromptSets"]


@dataclass
class Bundle:
    policy: torch.nn.Module  # an ImagePolicy
    tokenizer: torch.nn.Module  # an ImageTokenizer (or a Deferred one, made when first read)
    judge: Judge | None = None  # exact per-attribute verdicts, when the kind has a judge
    reward_defaults: dict[str, dict] = field(default_factory=dict)  # reward name -> default options
    source: Path | None = None  # the directory the kind loaded from, when it has one

    def __getattribute__(self, name: str):
        value = object.__getattribute__(self, name)
        if type(value) is Deferred:  # made once, on the first read, and kept
            value = value.make()
            object.__setattr__(self, name, value)
        return value


class Deferred:
    """A part of a Bundle that a kind makes only when it is first read: a VQ tokenizer, whose diffusers import
    alone takes seconds on a CPU, is never read by `export` or by a script that samples tokens only."""

    def __init__(self, make: Callable[[], Any]):
        self.make = make


@dataclass
class PolicyKind:
    name: str
    load: Callable[[PolicyConfig, torch.device | str], Bundle]
    prompts: PromptSplits | None = None  # its PromptSets when data.* names no files
    options: type | None = None  # the dataclass of `policy.options`; None: the kind takes none
    check: Callable[[PolicyConfig], None] | None = None  # conflicts its files show without a model loaded (check_files)


REGISTRY: dict[str, PolicyKind] = {}


# Paths that load another way than their kind's loader: (recognises(path) -> bool-like, load(pcfg, device) -> Bundle)
PATH_LOADERS: list[tuple[Callable[[str], Any], Callable[[PolicyConfig, Any], Bundle]]] = []


def register_path_loader(recognises: Callable[[str], Any], load: Callable[[PolicyConfig, Any], Bundle]) -> None:
    """`load(pcfg, device)` for every `policy.path` that `recognises(path)` is truthy for, whatever policy.kind."""
    PATH_LOADERS.append((recognises, load))


def register_policy_kind(name: str, prompts: PromptSplits | None = None, options: type | None = None,
                         check: Callable[[PolicyConfig], None] | None = None):
    """Register `load(policy_config, device) -> Bundle` as policy kind `name`; `prompts(cfg)` gives the
    kind's default PromptSets, `options` is the dataclass of its `policy.options` (None: it takes none), `check`
    a ConfigError for what its files show conflicts with the config, read without loading a model (check_files).
    The built-in kinds register first, so a user's kind of the same name wins."""
    load_built_in()

    def wrap(load):
        REGISTRY[name] = PolicyKind(name, load, prompts, options, check)
        return load
    return wrap


def policy_kind(name: str) -> PolicyKind:
    load_built_in()
    if name not in REGISTRY:
        load_plugins()
    if not name:  # the core names no model: a config says which
        raise ConfigError(f"policy.kind is required: set it to one of {', '.join(sorted(REGISTRY))}")
    if name not in REGISTRY:
        raise ConfigError(f"unknown policy.kind {brief(name)}; registered kinds: {', '.join(sorted(REGISTRY))} "
                          f"({not_found_hint()})")
    return REGISTRY[name]


def kind_options(pcfg: PolicyConfig) -> Any:
    """`policy.options` as the kind's options dataclass, strictly (an unknown key or a wrong type is a ConfigError
    naming it); None for a kind that takes none, which refuses any."""
    kind = policy_kind(pcfg.kind)
    if kind.options is None:
        if pcfg.options:  # an unused key would be silently ignored otherwise
            raise ConfigError(f"policy.options ({', '.join(map(str, pcfg.options))}) is not used with policy.kind "
                              f"{pcfg.kind!r}; remove it")
        return None
    return from_dict(kind.options, dict(pcfg.options), where="config", prefix="policy.options.")


def check_files(pcfg: PolicyConfig) -> None:
    """The kind's `check` of the files policy.* names: `grpo-vision config` and the start of `train` (through
    rewards.check_named_files) find what the loader would find once it read the weights."""
    kind = policy_kind(pcfg.kind)
    if kind.check is not None and pcfg.path:
        kind.check(pcfg)


def load_bundle(pcfg: PolicyConfig, device) -> Bundle:
    """The policy kind's Bundle from `policy.path`, or that of a registered path loader that recognises the path
    (built in: a run folder, whose trained policy a new run continues from; models/kinds.py)."""
    load_built_in()
    kind_options(pcfg)  # a wrong kind or option is named before any file is read
    if not pcfg.path:
        raise ConfigError(f"policy.path is required: what policy.kind {pcfg.kind!r} loads (a model's directory or "
                          "checkpoint file, or a run folder to continue from)")
    for recognises, load in PATH_LOADERS:
        if recognises(pcfg.path):
            return load(pcfg, device)
    return policy_kind(pcfg.kind).load(pcfg, device)
