"""Sampler benchmark: the KV-cache sampler vs transformers' `generate()` on the same weights.

Both sample 64 sequences x 64 image tokens with the same settings (temperature, top-k, image tokens
only), with CFG off and on; `generate()` runs on the exported `LlamaForCausalLM` and does CFG its own
way (`guidance_scale` with `negative_prompt_ids`, a second model call per step). A teacher-forced
forward pass over the same rows is the ceiling: it computes the same logits in one batched pass, as
fast as those logits can be had. Runs are interleaved so that machine noise hits all of them alike;
the median of `repeats` is reported. Speed targets are checked here, never in timed tests.

`bench_speculative` (`bench sampler --speculative-window W`): forward passes per image of speculative decoding
against plain decoding's N, and the wall-clock beside them (the speedup claim, measured on the run's own policy).
"""

from __future__ import annotations

import statistics
from dataclasses import replace

import torch

from grpo_vision.models.llama_hf import to_hf_llama
from grpo_vision.models.llama import LlamaImagePolicy, LlamaPolicyConfig
from grpo_vision.sampling import PlanParams, SamplingParams, sample
from grpo_vision.tools.timing import interleaved, seconds, sig

BENCH_WORDS = "a an on of left right above below small large red green blue yellow purple orange " \
              "circle square triangle white black gray background".split()


def bench_sampler(policy: LlamaImagePolicy | None = None, batch: int = 64, repeats: int = 3,
                  cfg_scale: float = 3.0, temperature: float = 1.0, top_k: int = 100,
                  dtype: str = "float32") -> dict:
    torch.manual_seed(0)
    policy = (policy or LlamaImagePolicy(LlamaPolicyConfig(words=BENCH_WORDS))).eval()
    policy = policy.to(getattr(torch, dtype))  # both implementations run on the same weights
    c, N = policy.cfg, policy.num_image_tokens
    hf = to_hf_llama(policy)
    cond = policy.encode_prompts(["a small red circle left of a blue square"] * batch)  # [B, L]
    null = policy.null_condition(cond[:1])  # [1, L]
    seeds = list(range(batch))
    gen_kwargs = dict(max_new_tokens=N, min_new_tokens=N, do_sample=True, temperature=temperature,
                      top_k=top_k or None, top_p=None, suppress_tokens=list(range(c.image_offset)),
                      pad_token_id=0, eos_token_id=None)

    def ours(scale):
        return lambda: sample(policy, cond, seeds, SamplingParams(scale, temperature, top_k))

    def theirs(scale):
        extra = dict(guidance_scale=scale, negative_prompt_ids=null.expand_as(cond)) if scale != 1 else {}
        return lambda: hf.generate(cond, attention_mask=torch.ones_like(cond), **gen_kwargs, **extra)

    tokens = torch.randint(0, c.codebook_size, (batch, N))

    def ceiling(scale):
        rows, toks = (cond, tokens) if scale == 1 else (torch.cat([cond, cond]), tokens.repeat(2, 1))
        return lambda: policy.image_logits(rows, toks)

    runs = {f"{name}_{tag}": make(scale) for tag, scale in (("cfg_off", 1.0), ("cfg_on", cfg_scale))
            for name, make in (("ours", ours), ("generate", theirs), ("teacher_forced", ceiling))}
    with torch.no_grad():
        times = interleaved(runs, repeats)
    tps = {name: batch * N / statistics.median(t) for name, t in times.items()}
    result = {
        "batch": batch, "image_tokens": N, "cfg_scale": cfg_scale, "temperature": temperature, "top_k": top_k, "dtype": dtype,
        "policy_params": sum(p.numel() for p in policy.parameters()), "threads": torch.get_num_threads(),
        "repeats": repeats, "tokens_per_s": {k: round(v, 1) for k, v in tps.items()},
    }
    for tag in ("cfg_off", "cfg_on"):
        result[f"speedup_vs_generate_{tag}"] = round(tps[f"ours_{tag}"] / tps[f"generate_{tag}"], 2)
        result[f"fraction_of_ceiling_{tag}"] = round(tps[f"ours_{tag}"] / tps[f"teacher_forced_{tag}"], 3)
    result["targets_met"] = all(result[f"speedup_vs_generate_{t}"] >= 3 and result[f"fraction_of_ceiling_{t}"] >= 0.4
                                for t in ("cfg_off", "cfg_on"))
    return result


# ShapesWorld captions of four forms (the main job's prompts are of these): words outside a policy's vocabulary read
# as <unk>, so any policy can run them
SPECULATIVE_PROMPTS = ["a red circle", "a red circle right of a purple triangle", "a blue square above a orange square",
                       "a orange triangle below a orange square"]


def bench_speculative(policy: LlamaImagePolicy | None = None, window: int = 16, group: int = 8, repeats: int = 1,
                      cfg_scale: float = 3.0, temperature: float = 1.0, top_k: int = 0,
                      prompts: list[str] = SPECULATIVE_PROMPTS, device: str = "cpu",
                      plan: PlanParams | None = None) -> dict:
    """Speculative decoding (sampling/speculative.py) against plain decoding: forward passes per image and tokens accepted
    per pass (the figure that transfers across devices: a GPU's decode step costs about the same for 1 or W tokens a
    row), with the wall-clock beside it (a CPU is bound by arithmetic, so W tokens a row cost about W times one).
    `group` seeds per prompt, as a GRPO group; both draft kinds at window `window`. Plain decoding is the fixed-shape
    step (`static`), recorded as a CUDA graph on a GPU (`graph`, training's default there). With a text `plan`
    (a run's sample.plan) each image's plan is drawn first by training's own function (rollouts.condition), once
    for all paths, and the image stage is timed on the condition it makes (the prompt and its plan)."""
    from grpo_vision.rollouts import condition
    from grpo_vision.sampling.speculative import sample_speculative

    torch.manual_seed(0)
    policy = (policy or LlamaImagePolicy(LlamaPolicyConfig(words=BENCH_WORDS))).eval().to(device)
    N = policy.num_image_tokens
    rows = [p for p in prompts for _ in range(group)]
    seeds = list(range(len(rows)))
    plain = "graph" if torch.device(device).type == "cuda" else "static"
    base = SamplingParams(cfg_scale, temperature, top_k, decode=plain, speculative_window=window, plan=plan)
    made = []
    with torch.no_grad():  # the condition rows [P*G, L or L'] and the plans
        plan_s = seconds(lambda: made.extend(condition(policy, rows, seeds, base, batch_size=len(rows))))
    cond, drawn = made[0].to(device), made[1]
    stats = {}

    def speculative(draft):
        def run():
            stats[draft] = sample_speculative(policy, cond, seeds, replace(base, decode="speculative",
                                                                           speculative_draft=draft))[1]
        return run

    runs = {"plain": lambda: sample(policy, cond, seeds, base), "jacobi": speculative("jacobi"),
            "coupled": speculative("coupled")}
    with torch.no_grad():
        times = interleaved(runs, repeats)
    result = {"images": cond.shape[0], "prompts": len(prompts), "group_size": group, "image_tokens": N,
              "window": window, "cfg_scale": cfg_scale, "temperature": temperature, "top_k": top_k,
              "policy_params": sum(p.numel() for p in policy.parameters()), "threads": torch.get_num_threads(),
              "repeats": repeats, "device": str(device), "plain_decode": plain, "plan": None}
    if drawn.width:  # the plan stage (T = 0: none), the same for every path: its passes come before each image's
        lengths = drawn.mask.sum(1).double()  # [P*G] plan tokens, the end token included
        result["plan"] = {"max_tokens": plan.max_tokens, "template": plan.template,
                          "tokens_per_plan": sig(lengths.mean().item()), "condition_tokens": cond.shape[1],
                          "seconds": sig(plan_s),
                          "note": "forwards_per_image and seconds count the image stage; each image's plan took "
                                  "tokens_per_plan passes before it, alike for every path"}
    plain_s = statistics.median(times["plain"])
    result["plain"] = {"forwards_per_image": N, "tokens_per_forward": 1.0, "seconds": sig(plain_s),
                       "images_per_s": sig(cond.shape[0] / plain_s)}
    for draft, st in stats.items():
        per_image, secs = st.forwards.double().mean().item(), statistics.median(times[draft])
        result[draft] = {"forwards_per_image": sig(per_image), "forwards_per_batch": st.batch_forwards,
                         "tokens_per_forward": sig(N / per_image),
                         "seconds": sig(secs), "images_per_s": sig(cond.shape[0] / secs),
                         "wall_clock_vs_plain": sig(plain_s / secs)}
    return result


def bench_demo(run_dir: str, n: int = 4, repeats: int = 4, prompt: str = "", target_s: float = 5.0,
               device: str = "run", trust: bool = False) -> dict:
    """Seconds per Compare click of the demo (both sides: sampling, decoding, every reward, the grid
    PNG), through the app's own handler (Gradio's queue and page update are not included), for n
    images a side; the first call warms up and is not timed. `prompt` defaults to the run's first
    example prompt; `device` and `trust` are the demo's (DemoRun)."""
    import tempfile

    from grpo_vision.config import ConfigError
    from grpo_vision.tools.demo import DemoInputError, DemoRun, clean_prompt, sampling_request
    from grpo_vision.tools.demo_app import build_app
    from grpo_vision.sampling import SamplingParams

    run = DemoRun(run_dir, device, trust)
    prompt = prompt or next((p for examples in run.examples.values() for p in examples), "")
    if not prompt:
        raise ConfigError(f"bench demo: {run_dir} has no example prompts; pass --prompt")
    s = run.cfg.sample
    try:  # on the page these are messages; here they are command-line errors
        prompt = clean_prompt(prompt, run.bundle.policy, run.bundle.judge)
        sampling_request(0, n, s.cfg_scale, s.temperature, s.top_k, SamplingParams.from_config(s))
    except DemoInputError as e:
        raise ConfigError(f"bench demo: {e}") from None
    policy_side = run.choices()[0]
    with tempfile.TemporaryDirectory(prefix="grpo_bench_demo_") as out:
        app = build_app(run, out_dir=out)
        compare = next(dep.fn for dep in app.fns.values() if getattr(dep, "api_name", None) == "generate")

        def click(seed: int):
            return compare(prompt, seed, n, s.cfg_scale, s.temperature, s.top_k, policy_side, "reference")

        click(0)  # warm-up
        times = [seconds(lambda: click(seed)) for seed in range(1, repeats + 1)]
    median = statistics.median(times)
    return {"run": str(run_dir), "prompt": prompt, "images_per_side": n, "repeats": repeats,
            "threads": torch.get_num_threads(), "seconds": [round(t, 3) for t in times],
            "median_s": round(median, 3), "target_s": target_s, "target_met": median <= target_s}
