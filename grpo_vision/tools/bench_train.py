"""Training benchmarks: one GRPO step by phase (`bench step`), and the same step against TRL (`bench trl`).

Both run the real loop, `train.train`, on a config (with checkpoints, sample grids and the report
off) and read its per-step timings from metrics.jsonl; the first steps are a warm-up and are dropped.

`bench trl` trains the same image-token model with TRL's `GRPOTrainer`: the built-in policy exported
as a `LlamaForCausalLM` (models/llama_hf.py), the same reward (completion ids decoded by the VQ tokenizer and
scored by the config's own rewards), the same prompts, group size, batch, micro-batch, learning rate,
loss and clip, one optimizer update per rollout and no CFG (TRL has none). Captions reach TRL padded
with `<pad>` words to the policy's caption length, so both models see the same condition ids at the
same positions. The two run in rounds, interleaved in one process, so that machine noise hits both
alike; each round drops its first step on both sides. Speed is checked here, never in timed tests.
"""

from __future__ import annotations

import json
import resource
import statistics
import sys
import tempfile
import time
from contextlib import redirect_stdout
from pathlib import Path

import torch

from grpo_vision.tools.timing import sig

PHASES = ("sample", "decode", "reward", "logprobs", "update")  # perf/<phase>_s of train.py's metrics


def _our_steps(config: str, overrides: list[str], steps: int, out_dir: str) -> tuple[list[dict], int]:
    """Run `steps` training steps of `config`; returns (metrics rows, images per step)."""
    from grpo_vision.config import load_config
    from grpo_vision.train import train

    name = f"bench_{time.monotonic_ns()}"
    cfg = load_config(config, [*overrides, f"train.steps={steps}", f"run.out_dir={out_dir}", f"run.name={name}",
                               "log.report=false", "log.sample_every=0", "log.checkpoint_every=0",
                               "log.trackers=[]"])
    lines = _Tee(sys.stderr)
    with redirect_stdout(lines):  # the run's own lines (to stderr; stdout is the benchmark's JSON), kept
        run = train(cfg, progress=False)
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    if rows:  # the estimate's parts, from the line set-up printed: what a memory row is compared part by part with
        rows[0]["memory_parts_gib"] = memory_parts("".join(lines.kept))
    return rows, cfg.sample.prompts_per_step * cfg.sample.group_size


class _Tee:
    """A stream that writes to `stream` and keeps what was written."""

    def __init__(self, stream):
        self.stream, self.kept = stream, []

    def write(self, text: str) -> int:
        self.kept.append(text)
        return self.stream.write(text)

    def flush(self) -> None:
        self.stream.flush()


def memory_parts(log: str) -> dict[str, float]:
    """The parts of `[train] memory: ... estimated peak (weights 1.23, optimizer ...)` in GiB; {} without one."""
    import re

    found = re.search(r"memory: [^(]*\(([^)]*)\)", log)
    if not found:
        return {}
    return {k: float(v) for k, v in (part.rsplit(" ", 1) for part in found.group(1).split(", "))}


def _fresh_accelerate() -> None:
    """Forget the accelerate state a previous run of this process fixed (its mixed precision): `bench gpu` runs
    steps of several configs in one process (accelerate's own AccelerateTestCase.tearDown resets it alike)."""
    from accelerate.state import AcceleratorState, GradientState

    AcceleratorState._reset_state(True)
    GradientState._reset_state()


def _peak_memory_gib() -> dict:
    if torch.cuda.is_available() and torch.cuda.max_memory_allocated():
        return {"cuda_max_allocated_gib": round(torch.cuda.max_memory_allocated() / 2**30, 3),
                "cuda_max_reserved_gib": round(torch.cuda.max_memory_reserved() / 2**30, 3)}
    return {"peak_rss_gib": round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20, 3)}  # KiB on Linux


def bench_step(config: str, overrides: list[str], steps: int = 4, warmup: int = 1) -> dict:
    """Median seconds per phase of a training step, images per second, peak memory and the run's estimate."""
    before = {}
    if torch.cuda.is_available():  # the peak of this run, not of what the process ran before
        torch.cuda.reset_peak_memory_stats()
        # what the process still held (the peak includes it; train() and bench gpu collect what runs left):
        # 0 unless the caller keeps models of its own
        before = {"cuda_allocated_before_gib": round(torch.cuda.memory_allocated() / 2**30, 3)}
    _fresh_accelerate()
    with tempfile.TemporaryDirectory() as out:
        rows, images = _our_steps(config, overrides, warmup + steps, out)
    timed = rows[warmup:]
    step_s = statistics.median(r["perf/step_s"] for r in timed)
    phases = {p: round(statistics.median(r[f"perf/{p}_s"] for r in timed), 3) for p in PHASES}
    other = statistics.median(r["perf/step_s"] - sum(r[f"perf/{p}_s"] for p in PHASES) for r in timed)
    return {"config": config, "overrides": overrides, "images_per_step": images, "steps_timed": len(timed),
            "warmup_steps": warmup, "threads": torch.get_num_threads(), "step_s": round(step_s, 3),
            "phases_s": phases, "other_s": round(other, 3),  # advantages, logging; medians need not add up
            "images_per_s": sig(images / step_s), **_peak_memory_gib(),
            "memory_estimate_gib": round(timed[-1]["perf/memory_estimate_gib"], 3),
            "memory_parts_gib": rows[0].get("memory_parts_gib", {}), **before}


# The settings both trainers share in `bench trl`: what TRL can do (no CFG, no monitored rewards, no
# reference unless beta > 0, one optimizer update per rollout), with the config's clip reward only.
TRL_EQUAL = ["sample.cfg_scale=1.0", "reward.weights={clip: 1.0}", "reward.monitor=[]", "train.minibatches_per_pass=1",
             "train.num_iterations=1", "train.reference=none", "train.beta=0.0", "train.mixed_precision=no",
             "train.warmup_steps=0", "train.lr_schedule=constant"]


def _trl_trainer(cfg, out: Path):
    """TRL's GRPOTrainer on the exported policy, with the config's rewards over decoded completions."""
    from datasets import Dataset
    from transformers import TrainerCallback
    from trl import GRPOConfig, GRPOTrainer

    from grpo_vision.models.llama_hf import condition_text, hf_tokenizer, to_hf_llama
    from grpo_vision.splits import checked_prompt_sets
    from grpo_vision.policy import load_bundle
    from grpo_vision.rollouts import decode_images, score
    from grpo_vision.rewards import CompositeReward

    bundle = load_bundle(cfg.policy, "cpu")
    policy, pc, s, t = bundle.policy, bundle.policy.cfg, cfg.sample, cfg.train
    to_hf_llama(policy).save_pretrained(out / "model")  # TRL loads it by path, as users load Janus or LlamaGen
    tokenizer = hf_tokenizer(pc)
    tokenizer.eos_token = "<null>"  # suppressed below, so never sampled: every completion is N image tokens
    entries = checked_prompt_sets(cfg, bundle).train
    rewards = CompositeReward.from_config(cfg.reward, "cpu", bundle.reward_defaults, entries)
    rewards.load()

    def reward(prompts, completions, completion_ids, index, **_):
        codes = torch.tensor(completion_ids) - pc.image_offset  # [B*G, N] codebook ids
        if codes.shape[1] != pc.num_image_tokens or not 0 <= int(codes.min()) <= int(codes.max()) < pc.codebook_size:
            raise ValueError(f"TRL sampled {tuple(codes.shape)} completions outside the image codebook: the "
                             "generation settings (min_new_tokens, suppress_tokens) did not take")
        chosen = [entries[i] for i in index]
        total = score(rewards, decode_images(bundle.tokenizer, codes, s.batch_size), chosen).total  # [B*G]
        means.append(total.nanmean().item())
        return total.tolist()

    times: list[float] = []
    means: list[float] = []  # the reward's mean at each TRL step

    class StepTimer(TrainerCallback):  # generation, reward, log-probs and the update all happen inside a step
        def on_step_begin(self, args, state, control, **kwargs):
            self.start = time.perf_counter()

        def on_step_end(self, args, state, control, **kwargs):
            times.append(time.perf_counter() - self.start)

    images = s.prompts_per_step * s.group_size
    args = GRPOConfig(
        output_dir=str(out / "trl"), use_cpu=not torch.cuda.is_available(), report_to="none", save_strategy="no",
        logging_steps=10**6, disable_tqdm=True, seed=cfg.run.seed, learning_rate=t.lr, lr_scheduler_type="constant",
        weight_decay=t.weight_decay, adam_beta1=t.adam_betas[0], adam_beta2=t.adam_betas[1],
        max_grad_norm=t.max_grad_norm, per_device_train_batch_size=t.micro_batch_size,
        gradient_accumulation_steps=images // t.micro_batch_size, num_generations=s.group_size,
        max_completion_length=pc.num_image_tokens, temperature=s.temperature, top_k=s.top_k, top_p=s.top_p,
        generation_kwargs={"min_new_tokens": pc.num_image_tokens, "suppress_tokens": list(range(pc.image_offset))},
        beta=t.beta, num_iterations=1, epsilon=t.epsilon_low, epsilon_high=t.epsilon_high, loss_type=t.loss_type,
        scale_rewards=t.adv_scale,  # TRL's names are ours: group, batch, none
        mask_truncated_completions=False, log_completions=False, bf16=False, model_init_kwargs={"dtype": "float32"},
        gradient_checkpointing=cfg.train.gradient_checkpointing,  # TRL 1.16 turns it on by default
    )
    dataset = Dataset.from_list([{"prompt": condition_text(e.prompt, pc), "index": i} for i, e in enumerate(entries)])
    trainer = GRPOTrainer(model=str(out / "model"), reward_funcs=reward, args=args, train_dataset=dataset,
                          processing_class=tokenizer, callbacks=[StepTimer()])
    return trainer, times, means


def bench_trl(config: str, overrides: list[str], rounds: int = 3, steps_per_round: int = 3) -> dict:
    """Images per second of our trainer and TRL's GRPOTrainer at equal settings, interleaved in rounds."""
    import trl

    from grpo_vision.config import ConfigError, load_config

    overrides = [*TRL_EQUAL, *overrides]
    cfg = load_config(config, overrides)
    if cfg.policy.kind not in ("llama", "shapes"):
        raise ConfigError(f"bench trl exports the built-in Llama policy to TRL; policy kind {cfg.policy.kind!r} is "
                          "not one: use a config with policy.kind llama or shapes")
    ours, theirs, our_rewards = [], [], []
    with tempfile.TemporaryDirectory() as out, redirect_stdout(sys.stderr):  # TRL prints its logs
        trainer, trl_times, trl_rewards = _trl_trainer(cfg, Path(out))
        for _ in range(rounds):
            rows, images = _our_steps(config, overrides, steps_per_round, out)
            ours += [row["perf/step_s"] for row in rows[1:]]
            our_rewards += [row["reward/total/mean"] for row in rows]
            trainer.args.max_steps = steps_per_round
            before = len(trl_times)
            trainer.train()  # continues from the last round's weights; ours starts from the base each round
            theirs += trl_times[before + 1:]
    ours_s, theirs_s = statistics.median(ours), statistics.median(theirs)
    return {"config": config, "overrides": overrides, "trl_version": trl.__version__, "images_per_step": images,
            "rounds": rounds, "steps_timed_each": len(ours), "threads": torch.get_num_threads(),
            "step_s": {"grpo_vision": round(ours_s, 3), "trl": round(theirs_s, 3)},
            "images_per_s": {"grpo_vision": round(images / ours_s, 2), "trl": round(images / theirs_s, 2)},
            "speedup_vs_trl": round(theirs_s / ours_s, 2), "target_met": theirs_s / ours_s >= 2.0,
            # both train: the reward's mean over each trainer's steps (their prompts differ, so do the means)
            "reward_mean": {"grpo_vision": round(statistics.mean(our_rewards), 4),
                            "trl": round(statistics.mean(trl_rewards), 4)}}
