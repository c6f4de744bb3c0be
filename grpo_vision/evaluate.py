"""Evaluate and sample a run: policy vs reference on the same prompts and seeds.

`evaluate` reports each reward's mean with a 95% interval (normal approximation, 1.96 standard
errors) for the policy and the reference, and, on ShapesWorld captions, the exact checker's accuracy
per attribute. Both models draw image i of a prompt with the same seed, so differences come from
the weights, not from the sampling noise.
"""

from __future__ import annotations

import json
import math
from contextlib import nullcontext
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from grpo_vision.checkpoint import find_checkpoint, load_checkpoint
from grpo_vision.config import Config, load_config
from grpo_vision.loading import Bundle, load_bundle
from grpo_vision.prompts import PromptEntry
from grpo_vision.reference import Reference, add_lora
from grpo_vision.sampling import SamplingParams, sample_batched


@dataclass
class LoadedRun:
    cfg: Config
    bundle: Bundle
    policy: torch.nn.Module  # with the checkpoint's weights (LoRA-wrapped if the run used LoRA)
    reference: Reference
    step: int


def load_run(run_dir: str | Path, step: int | None = None, device: str = "cpu") -> LoadedRun:
    run_dir = Path(run_dir)
    if not (run_dir / "config.yaml").is_file():
        raise FileNotFoundError(f"{run_dir} is not a run directory (no config.yaml)")
    cfg = load_config(run_dir / "config.yaml")
    ckpt = find_checkpoint(run_dir, step)
    bundle = load_bundle(cfg.policy, device)
    policy = bundle.policy
    if cfg.train.reference == "lora":
        policy = add_lora(policy, cfg.train.lora_rank, cfg.train.lora_alpha, cfg.train.lora_targets)
    reference = Reference(policy, cfg.train.reference)
    state, ref_state = load_checkpoint(ckpt, policy)
    if ref_state is not None:
        reference.load_state_dict(policy, ref_state)
    return LoadedRun(cfg, bundle, policy.eval(), reference, state["step"])


def sampling_params(cfg: Config, temperature: float | None = None) -> SamplingParams:
    """The run's sampling settings; `temperature` replaces sample.temperature (evaluation only)."""
    s = cfg.sample
    return SamplingParams(s.cfg_scale, temperature or s.temperature, s.top_k, s.top_p, s.logprob_mode)


def eval_temperatures(cfg: Config) -> list[float]:
    """Temperatures the report evaluates at, the headline first (log.eval_temperatures, else the
    training temperature)."""
    return list(cfg.log.eval_temperatures) or [cfg.sample.temperature]


def eval_params(cfg: Config, temperature: float | None = None) -> SamplingParams:
    """Sampling settings of `eval` and `sample`: at `temperature`, else at the report's headline one."""
    return sampling_params(cfg, temperature or eval_temperatures(cfg)[0])


def reference_sampler(policy, reference: Reference, cfg: Config):
    """(model, context) that samples from the reference; without one, the base model reloaded."""
    if reference.mode == "frozen":
        return reference.model, nullcontext()
    if reference.mode == "lora":
        return policy, policy.disable_adapter()
    return load_bundle(cfg.policy, "cpu").policy.eval(), nullcontext()


@torch.no_grad()
def generate(model, tokenizer, prompts: list[str], seeds: list[int], params: SamplingParams,
             batch_size: int = 64) -> torch.Tensor:
    """Images `[n, 3, H, W]` in [0, 1] for prompts, image i drawn with seeds[i]."""
    rollout = sample_batched(model, model.encode_prompts(prompts), seeds, params, batch_size)
    return torch.cat([tokenizer.decode(rollout.tokens[i:i + batch_size]) for i in range(0, len(prompts), batch_size)])


def _interval(values: torch.Tensor) -> dict:
    v = values[~values.isnan()].double()
    if v.numel() == 0:
        return {"mean": None, "ci95": None, "n": 0}
    half = 1.96 * float(v.std()) / math.sqrt(v.numel()) if v.numel() > 1 else float("nan")
    return {"mean": round(float(v.mean()), 5), "ci95": [round(float(v.mean()) - half, 5),
                                                      round(float(v.mean()) + half, 5)], "n": int(v.numel())}


def checker_tables(images: torch.Tensor, prompts: list[str]) -> tuple[dict | None, dict | None]:
    """The exact checker's accuracy per attribute, and its all-attributes-right rate per caption form
    (plain, size, background, relation), from one check of each image; (None, None) when a prompt is
    not a ShapesWorld caption."""
    from grpo_vision.shapes.checker import ATTRIBUTES, check
    from grpo_vision.shapes.scene import FORMS, CaptionError, as_policy_reads, parse_caption

    try:
        captions = [as_policy_reads(p) for p in prompts]
        forms = [parse_caption(c).form for c in captions]
        results = [check(img, c) for img, c in zip(images, captions)]
    except CaptionError:
        return None, None
    table = {"correct": _interval(torch.tensor([float(r.correct) for r in results]))}
    for a in ATTRIBUTES:
        vals = [float(getattr(r, a)) for r in results if getattr(r, a) is not None]
        table[a] = _interval(torch.tensor(vals)) if vals else {"mean": None, "ci95": None, "n": 0}
    by_form = {f: _interval(torch.tensor([float(r.correct) for g, r in zip(forms, results) if g == f]))
               for f in FORMS if f in forms}
    return table, by_form


def evaluate(policy, reference: Reference, tokenizer, rewards, entries: list[PromptEntry], n: int,
             params: SamplingParams, cfg: Config, seed: int = 0) -> dict:
    prompts = [e.prompt for e in entries for _ in range(n)]
    seeds = [seed + 1000 * i + j for i in range(len(entries)) for j in range(n)]
    meta = [e.metadata for e in entries for _ in range(n)]
    result = {"prompts": len(entries), "images_per_prompt": n, "models": {}}
    ref_model, ref_ctx = reference_sampler(policy, reference, cfg)
    for name, model, ctx in (("policy", policy, nullcontext()), ("reference", ref_model, ref_ctx)):
        with ctx:
            images = generate(model, tokenizer, prompts, seeds, params)
        out = rewards(images, prompts, meta)
        table, by_form = checker_tables(images, prompts)
        result["models"][name] = {"rewards": {k: _interval(v) for k, v in out.raw.items()}, "checker": table,
                                  "checker_by_form": by_form}
    result["difference"] = {k: _diff(result, "rewards", k) for k in result["models"]["policy"]["rewards"]}
    if result["models"]["policy"]["checker"]:
        result["checker_difference"] = {k: _diff(result, "checker", k) for k in result["models"]["policy"]["checker"]}
    return result


def _diff(result: dict, table: str, key: str):
    p, r = (result["models"][m][table][key]["mean"] for m in ("policy", "reference"))
    return None if p is None or r is None else round(p - r, 5)


@torch.no_grad()
def save_sample_grid(policy, reference: Reference, cfg: Config, tokenizer, entries: list[PromptEntry],
                     params: SamplingParams, path: Path, seeds_per_prompt: int = 2) -> None:
    """A PNG: one row per prompt, policy samples on the left, reference samples (same seeds) right."""
    from PIL import Image, ImageDraw

    from grpo_vision.images import to_uint8

    prompts = [e.prompt for e in entries for _ in range(seeds_per_prompt)]
    seeds = [j for _ in entries for j in range(seeds_per_prompt)]
    pol = to_uint8(generate(policy, tokenizer, prompts, seeds, params))
    model, context = reference_sampler(policy, reference, cfg)
    with context:
        ref = to_uint8(generate(model, tokenizer, prompts, seeds, params))
    k, size, text_w = seeds_per_prompt, pol.shape[1], 230
    sheet = Image.new("RGB", (text_w + 2 * k * (size + 2) + 10, 16 + len(entries) * (size + 2)), "white")
    draw = ImageDraw.Draw(sheet)
    draw.text((text_w, 2), "policy", fill="black")
    draw.text((text_w + k * (size + 2) + 10, 2), "reference", fill="black")
    for row, entry in enumerate(entries):
        y = 16 + row * (size + 2)
        draw.text((2, y + size // 2 - 6), entry.prompt[:38], fill="black")
        for j in range(k):
            sheet.paste(Image.fromarray(pol[row * k + j]), (text_w + j * (size + 2), y))
            sheet.paste(Image.fromarray(ref[row * k + j]), (text_w + k * (size + 2) + 10 + j * (size + 2), y))
    path.parent.mkdir(parents=True, exist_ok=True)
    sheet.save(path)


def write_samples(model, tokenizer, entries: list[PromptEntry], out: Path, n: int, seed: int,
                  params: SamplingParams, which: str, step: int) -> list[dict]:
    """One PNG per image and an index.jsonl (prompt, file, seed, model, step)."""
    from PIL import Image

    from grpo_vision.images import to_uint8

    prompts = [e.prompt for e in entries for _ in range(n)]
    seeds = [seed + j for _ in entries for j in range(n)]
    images = to_uint8(generate(model, tokenizer, prompts, seeds, params))
    out.mkdir(parents=True, exist_ok=True)
    index = []
    for i, (prompt, s, img) in enumerate(zip(prompts, seeds, images)):
        name = f"{i // n:05d}_{i % n:02d}_{which}.png"
        Image.fromarray(img).save(out / name)
        index.append({"prompt": prompt, "file": name, "seed": s, "model": which, "step": step})
    (out / "index.jsonl").write_text("".join(json.dumps(r) + "\n" for r in index))
    return index
