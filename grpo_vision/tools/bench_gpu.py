"""One command for a GPU: sampler and GRPO-step figures for the released model sizes, within a budget.

`grpo-vision bench gpu --json --budget 420 --out DIR` runs, preset by preset (tools/presets.py: random
weights at the released sizes, written in each model's own format and loaded through its policy kind),
the measurements users plan with, in order of how much they are asked for:

* the sampler (`bench_preset_sampler`, which is `bench sampler`'s own `bench_sampler` per group size): images/s,
  tokens/s and forward passes an image for one group of G images with the model's CFG, per decode path (eager,
  static, speculative with both draft kinds, and the CUDA graph and the compiled step on a GPU); transformers'
  `generate(generation_mode="image")` for Janus (the baseline users have); and the teacher-forced ceiling
  (the same logits in one batched pass);
* one GRPO step by phase (`bench_train.bench_step`, the real loop): LoRA and full fine-tune, a frozen
  reference and none, seconds per phase, images/s, peak memory beside the run's own memory estimate.

It degrades instead of dying: a measurement that runs out of memory is reported as not fitting, one that
fails says why, whatever was measured is written (`DIR/bench_gpu.json` after every item, and a markdown
table `DIR/bench_gpu.md`), and items the budget does not reach are listed as not run. The reward of the
step figures is `jpeg_compressibility` (no model files; the reward models of a real run add their own
time, which the step's `reward` phase shows). Recipe and device call: docs/benchmarks.md, "On a GPU".
"""

from __future__ import annotations

import gc
import json
import time
import traceback
from pathlib import Path

import torch

from grpo_vision.config import ConfigError
from grpo_vision.files import check_output_folder, write_output_file
from grpo_vision.tools.presets import preset, preset_overrides, prompts_for
from grpo_vision.tools.timing import machine, sig

# The step settings of every preset (one prompt's group of G images; rewards without model files).
STEP_COMMON = ["sample.prompts_per_step=1", "sample.batch_size={G}", "sample.group_size={G}",
               "train.minibatches_per_pass=1", "reward.weights={jpeg_compressibility: 1.0}", "reward.options={}",
               "reward.monitor=[]"]
LLAMAGEN_LORA = ["train.adapter=lora", "train.reference=adapter", "train.lr=1e-4",
                 "train.adapter_targets=[wqkv, wo, w1, w2, w3]"]
# (label, config, overrides) per preset: LoRA and full fine-tune, a frozen reference and none; speculative rollouts
# (the window recorded as a CUDA graph, sampling/speculative.py) against the graph's one token a pass.
STEPS = {
    "janus-pro-7b": [("LoRA, reference = adapter off, checkpointing", "configs/janus_pro_7b_lora.yaml",
                      ["train.gradient_checkpointing=true"])],
    "janus-pro-1b": [("LoRA, reference = adapter off", "configs/janus_pro_7b_lora.yaml", []),
                     ("LoRA, reference = adapter off, compiled decode", "configs/janus_pro_7b_lora.yaml",
                      ["sample.decode=compiled"]),
                     ("LoRA, reference = adapter off, unmerged sampling", "configs/janus_pro_7b_lora.yaml",
                      ["sample.merge_adapter=off"]),
                     ("LoRA, reference = adapter off, speculative decode", "configs/janus_pro_7b_lora.yaml",
                      ["sample.decode=speculative"]),
                     ("full, frozen reference", "configs/janus_pro_1b.yaml", []),
                     ("full, no reference", "configs/janus_pro_1b.yaml", ["train.reference=none", "train.beta=0.0"])],
    "llamagen-t2i-xl": [("full, frozen reference", "configs/llamagen_t2i.yaml", []),
                        ("full, no reference", "configs/llamagen_t2i.yaml", ["train.reference=none", "train.beta=0.0"]),
                        ("LoRA, reference = adapter off", "configs/llamagen_t2i.yaml", LLAMAGEN_LORA),
                        ("LoRA, reference = adapter off, speculative decode", "configs/llamagen_t2i.yaml",
                         [*LLAMAGEN_LORA, "sample.decode=speculative"])],
}
# what users ask for first: the 7B (the anchors' model) in a process of its own before anything else, a preset's
# steps before its sampler
ORDER = ["janus-pro-7b", "janus-pro-1b", "llamagen-t2i-xl", "llamagen-c2i-xl"]
def bench_preset_sampler(name: str, directory: str | Path, groups=(8, 16), repeats: int = 1, dtype: str = "bfloat16",
                         device: str | None = None, generate: bool = True, decodes: list[str] | None = None,
                         speculative_window: int = 32) -> dict:
    """`bench_sampler` (tools/bench.py, the same figures) for each group size G: one prompt's group of G images at
    the preset's CFG, every decode path that runs on the device (the compiled step on a GPU only) or `decodes`,
    speculative at window `speculative_window`, beside transformers' generate (Janus) and the teacher-forced
    ceiling. Random weights: their conditionals are flat, so few drafts are kept (the ShapesWorld policy's figures
    say what a trained model keeps: `bench sampler --run`)."""
    from grpo_vision.config import load_config
    from grpo_vision.policy import load_bundle
    from grpo_vision.tools.bench import bench_sampler

    device = device or ("cuda" if torch.cuda.is_available() else "cpu")
    p = preset(name)
    start = time.perf_counter()
    bundle = load_bundle(load_config(None, preset_overrides(name, directory, dtype)).policy, device)
    policy = bundle.policy
    result = {"preset": name, "dtype": dtype, "device": device, "cfg_scale": p.cfg_scale,
              "image_tokens": policy.num_image_tokens, "params": sum(q.numel() for q in policy.parameters()),
              "load_s": round(time.perf_counter() - start, 1), "groups": {}}
    prompts = prompts_for(name, 1)  # one prompt's group
    for G in groups:
        janus = (lambda policy, cond, params, batch, G=G: _janus_generate(policy, prompts * G, params.cfg_scale))
        result["groups"][str(G)] = bench_sampler(policy, decodes, group=G, repeats=repeats, cfg_scale=p.cfg_scale,
                                                 top_k=0, window=speculative_window, prompts=prompts, device=device,
                                                 generate=janus if generate and p.kind == "janus" else False)
    if device == "cuda":
        result["cuda_max_allocated_gib"] = sig(torch.cuda.max_memory_allocated() / 2**30)
    return result


def _janus_generate(policy, prompts: list[str], scale: float):
    """transformers' own image generation with CFG, as its docs call it, on the policy's model."""
    chat = [policy.processor.apply_chat_template([{"role": "user", "content": [{"type": "text", "text": t}]}],
                                                 add_generation_prompt=True) for t in prompts]
    enc = policy.processor(text=chat, generation_mode="image", padding=True, return_tensors="pt").to(policy.model.device)
    return lambda: policy.model.generate(**enc, generation_mode="image", do_sample=True, guidance_scale=scale)


def bench_preset_steps(name: str, directory: str | Path, G: int = 16, dtype: str = "bfloat16", steps: int = 1,
                       warmup: int = 1, only: list[str] | None = None):
    """One GRPO step by phase for each of the preset's step settings (STEPS); yields a result per setting."""
    from grpo_vision.tools.bench_train import bench_step

    for label, config, extra in STEPS.get(name.removesuffix("-tiny"), []):
        if only and label not in only:
            continue
        overrides = [*(o.replace("{G}", str(G)) for o in STEP_COMMON), *extra]
        if G < 8:  # a tiny group: micro-batches of the whole group (the configs' 2, 4 and 8 divide G = 16)
            overrides.append(f"train.micro_batch_size={G}")

        # a compiled decode compiles at its first rollout and, for a Janus cache of another prompt length, once more
        # for any length (sampling/decode.py, compiled_decode_step): two untimed steps
        warm = max(warmup, 2) if "sample.decode=compiled" in overrides else warmup

        def run(config=config, overrides=overrides, warm=warm):  # the preset is written when the first item runs
            return bench_step(config, [*preset_overrides(name, directory, dtype), *overrides], steps, warm)
        yield label, run


def bench_gpu(out: str | Path, budget_s: float = 420, preset_dir: str | Path | None = None, tiny: bool = False,
              groups=(8, 16), step_group: int = 16, presets: list[str] | None = None, sampler: bool = True,
              isolate: bool | None = None, only: list[str] | None = None, generate: bool = True) -> dict:
    """Every measurement that fits `budget_s` seconds, preset by preset (its steps, then its sampler); the JSON
    is rewritten after each. `sampler=False`: the step figures only. `isolate` (default: on a GPU): each item in a
    fresh process, so that its memory peak is its own and a crash or a hang costs that item only. `only`: the
    items whose "what" (e.g. "sampler", "step: LoRA, reference = adapter off") is listed. `generate=False`: the
    sampler items leave out transformers' generate (the slowest path: a baseline measured once is enough)."""
    out = Path(out)
    preset_dir = Path(preset_dir) if preset_dir else out / "presets"
    names = [n + ("-tiny" if tiny else "") for n in (presets or ORDER)]
    # float32 for the tiny twins on a CPU (bf16 matrix products are slow there); the released dtype on a GPU
    dtype = "bfloat16" if torch.cuda.is_available() else "float32"
    isolate = torch.cuda.is_available() if isolate is None else isolate
    report = {"machine": machine(), "budget_s": budget_s, "dtype": dtype, "isolated": isolate, "results": [],
              "not_run": []}
    items = []
    for name in names:
        items += [(name, f"step: {label}", fn) for label, fn in bench_preset_steps(name, preset_dir / name,
                                                                                   step_group, dtype)]
        if sampler:
            items.append((name, "sampler", lambda name=name: bench_preset_sampler(name, preset_dir / name, groups,
                                                                                  dtype=dtype, generate=generate)))
    selectable = sorted({what.removeprefix("step: ") for _, what, _ in items})  # under these flags
    if not selectable:  # a preset without step settings under --steps-only: nothing to run, said
        raise ConfigError(f"--steps-only leaves nothing to run: {', '.join(names)} "
                          f"{'has' if len(names) == 1 else 'have'} no step settings; drop --steps-only")
    if only:
        known = {"sampler"} | {label for n in names for label, *_ in STEPS.get(n.removesuffix("-tiny"), [])}
        if unknown := [w for w in only if w not in known]:  # a misspelt label would run nothing, silently
            raise ConfigError(f"--only names {', '.join(map(repr, unknown))}, which none of these presets has: "
                              f"choose among {'; '.join(sorted(known))}")
        if idle := [w for w in only if w not in selectable]:  # the sampler, left out by --steps-only
            raise ConfigError(f"--only {', '.join(map(repr, idle))} selects nothing under --steps-only (no sampler "
                              f"items): choose among {'; '.join(selectable)}, or drop --steps-only")
        items = [i for i in items if i[1] in only or i[1].removeprefix("step: ") in only]
    # before any item runs: a results folder that cannot be made or written was a traceback after the first one
    check_output_folder(out, "--out")
    check_output_folder(preset_dir, "--preset-dir")
    out.mkdir(parents=True, exist_ok=True)
    deadline = time.monotonic() + budget_s
    for name, what, fn in items:
        left = deadline - time.monotonic()
        if left <= 0:
            report["not_run"].append(f"{name} {what}: the budget ran out")
            continue
        start = time.perf_counter()
        entry = {"preset": name, "what": what}
        if isolate:
            entry |= run_isolated({"preset": name, "what": what, "preset_dir": str(preset_dir / name),
                                   "groups": list(groups), "step_group": step_group, "dtype": dtype,
                                   "generate": generate}, left + 30)
        else:
            entry |= run_item(fn)
        entry["seconds"] = round(time.perf_counter() - start, 1)
        report["results"].append(entry)
        gc.collect()  # an item's models sit in reference cycles: freed now, not inside the next item's peak
        if torch.cuda.is_available():
            torch.cuda.empty_cache()
            torch.cuda.reset_peak_memory_stats()
        _write(report, out)
    _write(report, out)
    return report


def run_item(fn) -> dict:
    """{"result": ...} of one measurement, or what stopped it: out of memory, a missing package, an error."""
    try:
        return {"result": fn()}
    except torch.cuda.OutOfMemoryError as e:
        return {"does_not_fit": f"out of memory: {str(e).splitlines()[0]}"}
    except ImportError as e:
        return {"missing_package": str(e)}
    except Exception as e:  # a failed item is a line of the report, not the end of the run
        return {"error": f"{type(e).__name__}: {e}", "traceback": traceback.format_exc(limit=6)}


ITEM_MARK = "BENCH_ITEM_RESULT "  # the line of a child process's stdout that holds its item's JSON


def run_isolated(spec: dict, timeout_s: float) -> dict:
    """One item (`spec`: preset, what, preset_dir, groups, step_group, dtype) in a fresh Python process: its
    entry fields, or why it gave none (a timeout, a crash with the end of its output)."""
    import subprocess
    import sys

    try:
        done = subprocess.run([sys.executable, "-m", "grpo_vision.tools.bench_gpu", json.dumps(spec)],
                              capture_output=True, text=True, timeout=timeout_s)
    except subprocess.TimeoutExpired:
        return {"error": f"timed out after {timeout_s:.0f} s (the budget's end)"}
    for line in reversed(done.stdout.splitlines()):
        if line.startswith(ITEM_MARK):
            return json.loads(line[len(ITEM_MARK):])
    return {"error": f"the item's process exited {done.returncode} without a result",
            "traceback": (done.stderr or done.stdout)[-2000:]}


def _item_main(spec: dict) -> None:
    """The child process of `run_isolated`: one item measured, its entry printed on a marked line."""
    name, what = spec["preset"], spec["what"]
    if what == "sampler":
        fn = lambda: bench_preset_sampler(name, spec["preset_dir"], spec["groups"], dtype=spec["dtype"],  # noqa: E731
                                          generate=spec.get("generate", True))
    else:
        fn = dict(bench_preset_steps(name, spec["preset_dir"], spec["step_group"], spec["dtype"]))[what[6:]]
    print(ITEM_MARK + json.dumps(run_item(fn)), flush=True)


def _write(report: dict, out: Path) -> None:
    write_output_file(out / "bench_gpu.json", json.dumps(report, indent=2), "--out")
    write_output_file(out / "bench_gpu.md", markdown(report), "--out")


def markdown(report: dict) -> str:
    """The report as two tables: the sampler per group size, the step per setting."""
    m = report["machine"]
    lines = [f"Device: {m.get('gpu') or 'CPU'} ({m.get('gpu_memory_gib', '-')} GiB), torch {m['torch']}, "
             f"CUDA {m['cuda']}; weights {report['dtype']}", "",
             "| preset | G | path | images/s | tokens/s | ms a forward pass | compile s | vs generate | of ceiling |",
             "|---|---|---|---|---|---|---|---|---|"]
    for e in report["results"]:
        if e["what"] != "sampler" or "result" not in e:
            continue
        for G, r in e["result"]["groups"].items():
            for path, row in [*r["paths"].items(), *r["baselines"].items()]:
                label = path if path not in r["drafts"] else (
                    f"{path}, W = {r['window']}, tree {r['tree']['candidates']},{r['tree']['branching']} "
                    f"({row['forwards_per_image']} passes an image, "
                    f"{row['forwards_per_batch']} the batch)")
                compile_s = sig(row["first_call_s"] - row["seconds"]) if path == "compiled" else ""
                lines.append(f"| {e['preset']} | {G} | {label} | {row['images_per_s']} | {row['tokens_per_s']} | "
                             f"{row['ms_per_forward']} | {compile_s} | {row.get('speedup_vs_generate') or ''} | "
                             f"{row.get('fraction_of_ceiling') or ''} |")
            lines += [f"| {e['preset']} | {G} | {path}: {why[:80]} | | | | | | |" for path, why in r["not_run"].items()]
    lines += ["", "| preset | step setting | images/s | step s | sample | decode | reward | log-probs | update | "
              "peak GiB | estimate GiB | estimate / peak |", "|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for e in report["results"]:
        if not e["what"].startswith("step"):
            continue
        r = e.get("result")
        if r is None:
            why = e.get("does_not_fit") or e.get("missing_package") or e.get("error", "")
            lines.append(f"| {e['preset']} | {e['what'][6:]} | {why.splitlines()[0][:80]} | | | | | | | | | |")
            continue
        ph = r["phases_s"]
        peak = r.get("cuda_max_allocated_gib", r.get("peak_rss_gib"))
        estimate = r.get("memory_estimate_gib")
        ratio = f"{estimate / peak:.2f}" if estimate and peak else ""
        lines.append(f"| {e['preset']} | {e['what'][6:]} | {r['images_per_s']} | {r['step_s']} | {ph['sample']} | "
                     f"{ph['decode']} | {ph['reward']} | {ph['logprobs']} | {ph['update']} | {peak} | "
                     f"{estimate or ''} | {ratio} |")
    for e in report["results"]:
        if "result" not in e and e["what"] == "sampler":
            lines.append(f"\n{e['preset']} sampler: {e.get('does_not_fit') or e.get('missing_package') or e.get('error')}")
    if report["not_run"]:
        lines += ["", "Not run: " + "; ".join(report["not_run"])]
    return "\n".join(lines) + "\n"


if __name__ == "__main__":  # run_isolated's child: python -m grpo_vision.tools.bench_gpu '{"preset": ...}'
    import sys

    _item_main(json.loads(sys.argv[1]))
