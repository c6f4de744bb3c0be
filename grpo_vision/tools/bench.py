"""Sampler benchmark: the decode paths of `sampling.decode.DECODERS` on one policy and one set of condition rows,
beside transformers' `generate()` and a teacher-forced pass, in one JSON shape.

`bench_sampler` times the paths asked for (eager, static, graph, compiled, speculative) on the same rows: ShapesWorld
captions x `group` seeds, as a GRPO step's groups, each image's text plan drawn first where the run plans (training's
`rollouts.condition`, once for all paths). `speculative` is timed with both draft kinds: the key "speculative" holds
MC-SJD's coupled drafts (training's default, sample.speculative_draft) and "speculative_jacobi" SJD's (DRAFTS).
Beside the paths, where they apply (`baselines`): `generate()` on the same weights and settings (the built-in policy
through its exported `LlamaForCausalLM`, CFG its own way: `guidance_scale` with `negative_prompt_ids`, a second model
call a step; Janus through its own image generation, tools/bench_gpu.py), and a teacher-forced forward pass over the
same rows: the ceiling, the same logits in one batched pass. Runs are interleaved so that machine noise hits all of
them alike; the median of `repeats` is reported.

Every entry has the same figures: seconds, images/s, tokens/s, forward passes an image (plain decoding: N, the
prefill and N - 1 decode steps; speculative: fewer, each row its own) and tokens a pass. The pass count is what
carries across devices (a GPU's decode step costs about the same for 1 or W tokens a row; a CPU's about W times one).
Speed targets are checked here, never in timed tests: `targets_met` holds where the path training takes by default
(`sample.decode: auto`) is at least TARGETS of `generate()` and of the ceiling.
"""

from __future__ import annotations

import statistics
from dataclasses import replace
from typing import Callable, Sequence

import torch

from grpo_vision.config import ConfigError
from grpo_vision.models.llama import LlamaImagePolicy, LlamaPolicyConfig
from grpo_vision.sampling import PlanParams, SamplingParams, decode_mode, sample_batched
from grpo_vision.sampling.decode import DECODERS, NEEDS
from grpo_vision.tools.timing import interleaved, machine, seconds, sig

BENCH_WORDS = "a an on of left right above below small large red green blue yellow purple orange " \
              "circle square triangle white black gray background".split()
# ShapesWorld captions of four forms (the main job's prompts are of these): words outside a policy's vocabulary read
# as <unk>, so any policy can run them
SPECULATIVE_PROMPTS = ["a red circle", "a red circle right of a purple triangle", "a blue square above a orange square",
                       "a orange triangle below a orange square"]
DRAFTS = {"speculative": "coupled", "speculative_jacobi": "jacobi"}  # a result key of speculative decoding -> drafts
# of the path `auto` takes (graph on a GPU, eager on a CPU): times generate()'s speed, the ceiling's fraction
TARGETS = {"speedup_vs_generate": 3.0, "fraction_of_ceiling": 0.4}
# paths whose failure is a line of the result, not the end of the bench: transformers' generate breaks between
# releases, a compiler may fail on a policy (sampling.decode.CompileError), a large window may not fit
FRAGILE = ("generate", "compiled", *DRAFTS)
COMPILED_ON_CPU = ("not by default on a CPU: it compiles for about 30 s and has measured slower than eager there "
                   "(docs/benchmarks.md); name it in --decode to time it")


def cannot_run(policy, decode: str, device) -> str | None:
    """Why `decode` cannot run on `policy` with its rows on `device` (None: it can), from the path's own needs in
    sampling/decode.py (NEEDS), without the advice on what to pick in a config."""
    for need in DECODERS[decode].needs:
        has, missing = NEEDS[need]
        if not has(policy, torch.device(device)):
            return missing.format(policy=type(policy).__name__, device=device).split(";")[0].lstrip(": ")
    return None


def llama_generate(policy: LlamaImagePolicy, cond: torch.Tensor, params: SamplingParams, batch: int) -> Callable:
    """transformers' `generate()` on the built-in policy's weights (its exported `LlamaForCausalLM`), image tokens
    only, at the sampler's settings, `batch` rows a call."""
    from grpo_vision.models.llama_hf import to_hf_llama

    hf, N = to_hf_llama(policy).to(cond.device), policy.num_image_tokens
    kwargs = dict(max_new_tokens=N, min_new_tokens=N, do_sample=True, temperature=params.temperature,
                  top_k=params.top_k or None, top_p=None, suppress_tokens=list(range(policy.cfg.image_offset)),
                  pad_token_id=0, eos_token_id=None)
    chunks = [cond[i:i + batch] for i in range(0, cond.shape[0], batch)]
    guided = [dict(guidance_scale=params.cfg_scale, negative_prompt_ids=policy.null_condition(c))
              if params.guided else {} for c in chunks]

    def run():
        for c, extra in zip(chunks, guided):
            hf.generate(c, attention_mask=torch.ones_like(c), **kwargs, **extra)
    return run


def teacher_forced(policy, cond: torch.Tensor, params: SamplingParams, batch: int) -> Callable:
    """One forward pass over the rows and N image tokens a call (the null rows beside them under CFG): the same
    logits a decode computes, at the speed a batched pass has them (token values do not change its cost)."""
    N, B = policy.num_image_tokens, cond.shape[0]
    tokens = torch.randint(0, policy.codebook_size, (B, N), device=cond.device)  # [B, N]
    rows = [(torch.cat([c, policy.null_condition(c)]), t.repeat(2, 1)) if params.guided else (c, t)
            for c, t in zip(cond.split(batch), tokens.split(batch))]  # [b or 2b, L], [b or 2b, N]

    def run():
        for c, t in rows:
            policy.image_logits(c, t)
    return run


def chosen_paths(policy, decodes: Sequence[str] | None, device) -> tuple[list[str], dict[str, str]]:
    """The result keys to time (speculative as DRAFTS) and the paths left out -> why: of the default list (every
    path), those that cannot run here and, on a CPU, the compiled step; a path named in `decodes` that cannot run
    here is a ConfigError naming the fix."""
    not_run = {}
    for d in decodes or DECODERS:
        why = cannot_run(policy, d, device)
        if why and decodes:
            raise ConfigError(f"bench sampler --decode {d}: {why}; leave {d} out of --decode (without it the bench "
                              f"times every path that runs here)")
        if why is None and decodes is None and d == "compiled" and torch.device(device).type == "cpu":
            why = COMPILED_ON_CPU
        if why:
            not_run[d] = why
    keys = [k for d in (decodes or DECODERS) if d not in not_run for k in (DRAFTS if d == "speculative" else [d])]
    return keys, not_run


def first_calls(runs: dict, not_run: dict) -> dict[str, float]:
    """Seconds of each run's untimed first call (a compiled step compiles in it); a FRAGILE run that fails leaves
    `runs` for a line of `not_run`."""
    first = {}
    for name, fn in list(runs.items()):
        try:
            first[name] = seconds(fn)
        except Exception as e:
            if name not in FRAGILE:
                raise
            not_run[name] = f"failed: {type(e).__name__}: {str(e)[:300]}"
            del runs[name]
    return first


@torch.no_grad()
def bench_sampler(policy=None, decodes: Sequence[str] | None = None, group: int = 8, batch: int | None = None,
                  repeats: int = 3, cfg_scale: float = 3.0, temperature: float = 1.0, top_k: int = 100,
                  window: int = SamplingParams.speculative_window,
                  tree: tuple[int, int] = (SamplingParams.speculative_candidates, SamplingParams.speculative_branching),
                  plan: PlanParams | None = None,
                  prompts: Sequence[str] = SPECULATIVE_PROMPTS,
                  device: str = "cpu", dtype: str | None = None, generate: bool | Callable = True) -> dict:
    """The decode paths `decodes` (default: every one that runs on this policy and device, the compiled step on a
    GPU only) on `prompts` x `group` seeds, `batch` rows a sampler call (default: all in one call, as
    sample.batch_size), one JSON object: `paths` (decode -> figures; speculative as DRAFTS), `baselines` (generate,
    teacher_forced; the same figures), `not_run` (a path or baseline -> why: it cannot run here, or it failed).
    A path named in `decodes` that cannot run here is a ConfigError naming the fix.
    `policy`: default the built-in policy with random weights at its default size; `dtype`: cast it (default: as
    it is). `generate`: True times transformers' generate on the built-in policy kind (none for others), False
    none, or `make(policy, cond, params, batch) -> fn` for another kind's. `plan`: a run's sample.plan; each image's
    plan is drawn first, once for every path, and the image stage is timed on the condition it makes."""
    from grpo_vision.rollouts import condition

    torch.manual_seed(0)
    policy = (policy or LlamaImagePolicy(LlamaPolicyConfig(words=BENCH_WORDS))).eval().to(device)
    policy = policy.to(getattr(torch, dtype)) if dtype else policy
    N = policy.num_image_tokens
    rows = [p for p in prompts for _ in range(group)]
    seeds = list(range(len(rows)))
    B, batch = len(rows), batch or len(rows)
    base = SamplingParams(cfg_scale, temperature, top_k, speculative_window=window, plan=plan,
                          speculative_candidates=tree[0], speculative_branching=tree[1])
    made = []  # the condition rows [B, L or L'] and the plans
    plan_s = seconds(lambda: made.extend(condition(policy, rows, seeds, base, batch_size=batch)))
    cond, drawn = made[0].to(device), made[1]

    keys, not_run = chosen_paths(policy, decodes, device)
    rollouts = {}

    def sampler(key):
        params = replace(base, decode="speculative" if key in DRAFTS else key,
                         speculative_draft=DRAFTS.get(key, base.speculative_draft))
        return lambda: rollouts.__setitem__(key, sample_batched(policy, cond, seeds, params, batch))

    runs = {k: sampler(k) for k in keys}
    made_generate = llama_generate if generate is True and isinstance(policy, LlamaImagePolicy) else generate
    if callable(made_generate):
        try:  # a policy that does not export to transformers (a canvas) has no generate() to compare with
            runs["generate"] = made_generate(policy, cond, base, batch)
        except Exception as e:
            not_run["generate"] = f"{type(e).__name__}: {str(e)[:300]}"
    runs["teacher_forced"] = teacher_forced(policy, cond, base, batch)
    first = first_calls(runs, not_run)
    times = {k: statistics.median(t) for k, t in interleaved(runs, repeats, warm=False).items()}
    calls = -(-B // batch)

    def figures(name, per_image, per_call):  # per_call: passes of one sampler call, the mean over the calls
        s = times[name]
        return {"seconds": sig(s), "images_per_s": sig(B / s), "tokens_per_s": sig(B * N / s),
                "forwards_per_image": sig(per_image), "forwards_per_batch": sig(per_call),
                "tokens_per_forward": sig(N / per_image), "ms_per_forward": sig(1000 * s / (per_call * calls)),
                "first_call_s": sig(first[name])}

    plain = next((d for d in ("graph", "static", "eager") if d in times), None)
    paths = {}
    for k in (k for k in keys if k in times):
        forwards = rollouts[k].forwards  # [B] passes each row took (speculative), else None: N each
        if forwards is None:
            paths[k] = figures(k, N, N)
        else:  # a call runs until its slowest row is done
            paths[k] = figures(k, forwards.double().mean().item(),
                               statistics.mean(f.max().item() for f in forwards.split(batch)))
        paths[k] |= {ratio: sig(times[other] / times[k]) if other in times else None for ratio, other in
                     (("speedup_vs_generate", "generate"), ("fraction_of_ceiling", "teacher_forced"),
                      ("wall_clock_vs_plain", plain))}
    baselines = {k: figures(k, *((N, N) if k == "generate" else (1, 1))) for k in ("generate", "teacher_forced")
                 if k in times}
    target = decode_mode(policy, "auto", torch.device(device))
    result = {"images": B, "prompts": len(prompts), "group_size": group, "batch": batch, "image_tokens": N,
              "cfg_scale": cfg_scale, "temperature": temperature, "top_k": top_k, "window": window,
              "tree": {"candidates": tree[0], "branching": tree[1]},
              "drafts": {k: v for k, v in DRAFTS.items() if k in paths},
              "dtype": str(next(policy.parameters()).dtype).removeprefix("torch."), "device": str(device),
              "policy_params": sum(p.numel() for p in policy.parameters()), "repeats": repeats, "plan": None,
              "plain_decode": plain, "paths": paths, "baselines": baselines, "not_run": not_run,
              "targets": {"path": target, **TARGETS},
              "targets_met": all(paths[target][k] >= v for k, v in TARGETS.items())
              if target in paths and len(baselines) == 2 else None,
              "machine": machine()}
    if drawn.width:  # the plan stage (T = 0: none), the same for every path: its passes come before each image's
        lengths = drawn.mask.sum(1).double()  # [B] plan tokens, the end token included
        result["plan"] = {"max_tokens": plan.max_tokens, "template": plan.template,
                          "tokens_per_plan": sig(lengths.mean().item()), "condition_tokens": cond.shape[1],
                          "seconds": sig(plan_s),
                          "note": "forwards_per_image and seconds count the image stage; each image's plan took "
                                  "tokens_per_plan passes before it, alike for every path"}
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
