"""The `grpo-vision` command line: one subcommand per job, each a thin shell over the library.

Start-up imports only the config (YAML) and plugin registries: torch and the models load inside the
command that needs them, so `--help` answers at once.
"""

from __future__ import annotations

import argparse
import atexit
import gc
import json
import os
import signal
import sys
import warnings

from grpo_vision import __version__
from grpo_vision.cli.args import (
    DECODE_PATHS, at_least_two, cfg_scale, draft_tree, gib_list, int_list, name_list, non_negative_int, port,
    positive_int,
)
from grpo_vision.cli.runs import add_base_option, add_reader_options, add_reward_option, add_run_commands
from grpo_vision.cli.serve import add_bench_reward_server, add_serve_command
from grpo_vision.config import ConfigError, brief, derived_sizes, format_sizes, load_config, to_dict
from grpo_vision.config.load import warning_line
from grpo_vision.plugins import command_adders


class _Help(argparse.ArgumentDefaultsHelpFormatter):
    """Help that shows an option's default where it has a meaningful one (not an empty string)."""

    def _get_help_string(self, action):
        empty = action.default is None or action.default is False or action.default in ("", [], argparse.SUPPRESS)
        if empty or "%(default)" in (action.help or ""):
            return action.help
        return super()._get_help_string(action)


class _Parser(argparse.ArgumentParser):  # every subcommand's parser shows its defaults
    def __init__(self, *args, **kwargs):
        kwargs.setdefault("formatter_class", _Help)
        super().__init__(*args, **kwargs)


def cmd_config(args) -> None:
    """Print the resolved config (defaults + YAML + overrides) and the derived batch sizes."""
    import yaml

    from grpo_vision.rewards import check_options
    from grpo_vision.rewards.base import check_named_files

    cfg = load_config(args.config, args.overrides)
    check_options(cfg)  # reward.options and policy.options against their registered dataclasses
    check_named_files(cfg)  # every file it names, as train checks them before any model loads
    sizes = derived_sizes(cfg, args.num_processes)
    print(yaml.safe_dump(to_dict(cfg), sort_keys=False), end="")
    print("# derived: " + format_sizes(sizes))


def cmd_prompts(args) -> None:
    """GenEval's evaluation prompts, or training prompts from its templates outside them, as a prompts
    file; without --out, where the evaluation prompts are."""
    from grpo_vision.files import check_output_file
    from grpo_vision.rewards import geneval_prompts

    if not args.out:
        print(f"GenEval's 553 evaluation prompts, in GenEval's format (sample --layout geneval and eval --benchmark "
              f"geneval read it, and --out's file too): {geneval_prompts.EVALUATION}\nas a prompts file: grpo-vision "
              "prompts geneval --out F; N training prompts from its templates, none of them an evaluation prompt: "
              "--train N [--seed S]")
        return
    check_output_file(args.out, "--out")  # before the draw: a folder there was found only when writing
    entries = (geneval_prompts.training_entries(args.train, args.seed) if args.train
               else geneval_prompts.evaluation_entries())
    geneval_prompts.write(entries, args.out)
    print(f"[prompts] {len(entries)} GenEval {'training' if args.train else 'evaluation'} prompts -> {args.out}")


def cmd_score(args) -> None:
    """GenEval's verdicts on a folder in its layout written by any model, from the config's geneval reward
    options; its summary, and with --against another folder's and the change."""
    import dataclasses
    from pathlib import Path

    from grpo_vision.evaluation.geneval_bench import check_pairs, compare_folders, read_folder
    from grpo_vision.files import check_output_file, write_output_file
    from grpo_vision.rewards import CompositeReward
    from grpo_vision.run.machine import resolve_device

    # everything the arguments and the folders' metadata tell is checked before any model loads
    if args.verdicts:
        check_output_file(args.verdicts, "--verdicts")
    entries = [e for folder in filter(None, (args.folder, args.against)) for e in read_folder(folder)]
    if args.against:
        check_pairs(args.folder, args.against)
    cfg = load_config(args.config or None, args.overrides)
    device = resolve_device(args.device, "--device")
    only = dataclasses.replace(cfg.reward, weights={"geneval": 1.0}, monitor=[])  # its options, no other reward
    rewards = CompositeReward.from_config(only, device)
    reward = rewards.fns["geneval"]
    try:  # a colour clause and no colour classifier (read_folder checked the clauses themselves), before loading
        reward.check([m["prompt"] for m, _ in entries], [{k: v for k, v in m.items() if k != "prompt"}
                                                         for m, _ in entries])
    except ValueError as e:
        raise ConfigError(f"{args.folder}: {e}") from None
    rewards.load()
    try:
        result, rows = compare_folders(reward, args.folder, args.against or None)
    except ValueError as e:
        raise ConfigError(f"{args.folder}: {e}") from None
    if args.verdicts:
        write_output_file(Path(args.verdicts), "".join(json.dumps(row) + "\n" for row in rows), "--verdicts")
    print(json.dumps({"device": str(device), **result}, indent=2))


def cmd_train(args) -> None:
    from grpo_vision.run.health import say_done
    from grpo_vision.splits import run_prompt_sets
    from grpo_vision.rewards import check_options, check_rewards
    from grpo_vision.rewards.base import check_named_files
    from grpo_vision.run.folder import refuse_code, resume_config
    from grpo_vision.train import train

    overrides = list(args.overrides)
    if args.resume:
        if args.config and "=" not in args.config:
            raise ConfigError("give either a config file or --resume RUN_DIR (a run resumes with its own "
                              "config.yaml; add key=value overrides to change it)")
        cfg = resume_config(args.resume, ([args.config] if args.config else []) + overrides)
        # a run folder may be someone else's: the code its rewards name runs only when the user says so
        entries = run_prompt_sets(cfg, args.resume).all()
        refuse_code(cfg, entries, args.resume, args.trust_run)
        check_rewards(cfg, args.resume, entries, args.reward, args.trust_run)
    else:
        if not args.config:
            raise ConfigError("grpo-vision train needs a config file, e.g. configs/shapes.yaml")
        cfg = load_config(args.config, overrides)
        check_options(cfg)  # a misspelt option is named now, not once the models have loaded
    check_named_files(cfg)  # all missing files in one line, not one at a time as each model loads
    try:
        run_dir = train(cfg, resume=args.resume or None, allow_other_base=args.allow_other_base)
    except KeyboardInterrupt as e:  # 130 after Ctrl-C, 143 after SIGTERM: what a shell reports for a killed command
        sys.exit(128 + getattr(e, "signum", signal.SIGINT))
    say_done(run_dir, cfg)


def cmd_matrix(args) -> None:
    import shlex
    from pathlib import Path

    from grpo_vision.tools.matrix import run_matrix

    command = "grpo-vision " + shlex.join(sys.argv[1:])
    if args.against_reward and not args.against:
        raise ConfigError("--against-reward names a run of another matrix: give that matrix's folder with --against")
    try:
        betas = None if args.kl is None else _items(args.kl, float, "--kl")  # None: the config's train.beta
        result = run_matrix(args.config, args.overrides, _items(args.rewards, str, "--rewards"), betas,
                            _items(args.seeds, int, "--seeds"), Path(args.out), args.jobs, args.images, command,
                            args.variant, Path(args.against) if args.against else None, args.against_reward)
    except KeyboardInterrupt as e:  # Ctrl-C or SIGTERM: the runs in training saved a checkpoint first
        signum = getattr(e, "signum", signal.SIGINT)
        print(f"[matrix] stopped by {signal.Signals(signum).name}; continue with: {command} (finished runs and "
              "scores are reused, stopped runs resume from their checkpoint)", file=sys.stderr)
        sys.exit(128 + signum)
    failed = [r["name"] for r in result["runs"] if r["status"] == "failed"]
    print(f"[matrix] {Path(args.out) / 'matrix.md'}" + (f" ({len(failed)} failed: {', '.join(failed)})" if failed else ""))
    if failed:
        sys.exit(1)


def _items(text: str, kind, option: str) -> list:
    """A comma-separated option as a list of `kind`; ConfigError naming the option otherwise."""
    try:
        return [kind(t.strip()) for t in text.split(",") if t.strip()]
    except ValueError:
        raise ConfigError(f"{option} {brief(text)}: expected a comma-separated list of {kind.__name__}") from None


def cmd_demo(args) -> None:
    from grpo_vision.tools.demo import DemoRun
    from grpo_vision.tools.demo_app import serve

    # a bad run fails now, before serving
    run = DemoRun(args.run, args.device, args.trust_run, args.reward, args.allow_other_base)
    try:
        serve(run, host=args.host, port=args.port)
    except OSError as e:  # the port is taken or the address is not this machine's
        raise ConfigError(f"cannot listen on {args.host}:{args.port or '7860+'} ({e}); "
                          "choose another --port or --host") from None


def cmd_export(args) -> None:
    from grpo_vision.export import export_run

    done = export_run(args.run, args.out, args.step, args.merge, args.allow_other_base)
    what = {"adapter": "a peft adapter folder for", "model": "the whole model, for"}[done.form]
    loader = {"janus": "transformers' JanusForConditionalGeneration", "llamagen": "LlamaGen's own scripts",
              "llama": "transformers' LlamaForCausalLM"}.get(done.kind, f"policy kind {done.kind!r}")
    print(f"[export] step {done.step} of {args.run} -> {done.directory}: {what} {loader} "
          f"({', '.join(f.name for f in done.files)})")


def cmd_convert_clip(args) -> None:
    from grpo_vision.rewards.clip import ClipLoadError, convert_torchscript

    print(f"[convert-clip] loading {args.archive} with torch.jit.load, which runs the TorchScript code inside it")
    try:
        n = convert_torchscript(args.archive, args.out)
    except ClipLoadError as e:
        raise ConfigError(str(e)) from None
    print(f"[convert-clip] wrote {n} tensors to {args.out}; use it as the reward's checkpoint (no trust needed)")


def cmd_bench_sampler(args) -> None:
    import torch

    from grpo_vision.tools.bench import bench_sampler

    device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    if device == "cuda" and not torch.cuda.is_available():
        raise ConfigError("bench sampler --device cuda: this machine has no CUDA device; use --device cpu")
    if args.preset:
        from grpo_vision.tools.bench_gpu import bench_preset_sampler
        from grpo_vision.tools.presets import preset, preset_home

        preset(args.preset)  # an unknown name: one line, before anything is built
        _print_result(bench_preset_sampler(args.preset, preset_home(args.preset_dir, args.preset), args.groups,
                                           args.repeats, args.dtype or "float32", device, args.generate,
                                           args.decode, args.speculative_window or 32), args.json)
        return
    from grpo_vision.config.schema import SampleConfig

    spec = SampleConfig()  # the speculative path at sample's defaults
    policy, settings = None, {"cfg_scale": 3.0, "temperature": 1.0, "top_k": 100, "window": spec.speculative_window,
                              "tree": (spec.speculative_candidates, spec.speculative_branching)}
    if args.run:  # the run's latest checkpoint at its own sampling settings, unless the flags say otherwise
        from grpo_vision.sampling import SamplingParams
        from grpo_vision.step.load import load_run

        run = load_run(args.run, device=device)
        policy, s = run.policy, run.cfg.sample
        # its images are drawn after a text plan where it plans: the bench draws the plans as training does
        settings = {"cfg_scale": s.cfg_scale, "temperature": s.temperature, "top_k": s.top_k,
                    "window": s.speculative_window, "tree": (s.speculative_candidates, s.speculative_branching),
                    "plan": SamplingParams.from_config(s).plan}
    elif args.policy:
        from grpo_vision.models.llama import LlamaImagePolicy

        policy = LlamaImagePolicy.from_pretrained(args.policy)
    flags = (("cfg_scale", args.cfg_scale), ("top_k", args.top_k), ("window", args.speculative_window),
             ("tree", args.speculative_tree))
    settings |= {k: v for k, v in flags if v is not None}
    if not args.decode or any(d.startswith("speculative") for d in args.decode):
        from grpo_vision.sampling.speculative import DraftTree

        try:  # before any path runs
            DraftTree.build(settings["window"], *settings["tree"])
        except ValueError:
            (C, D), W = settings["tree"], settings["window"]
            raise ConfigError(f"bench sampler: --speculative-window {W} cannot hold the draft tree {C},{D} (C drafts "
                              f"at each of the first D positions: {C * D + 1} nodes at least); widen it to "
                              f"{C * D + 1} or more, or pass --speculative-tree 1,0 for a chain") from None
    _print_result(bench_sampler(policy, args.decode, group=args.group_size, batch=args.batch, repeats=args.repeats,
                                device=device, dtype=args.dtype, generate=args.generate, **settings), args.json)


def cmd_bench_demo(args) -> None:
    from grpo_vision.tools.bench import bench_demo

    _print_result(bench_demo(args.run, n=args.n, repeats=args.repeats, prompt=args.prompt, device=args.device,
                             trust=args.trust_run), args.json)


def cmd_bench_step(args) -> None:
    from grpo_vision.tools.bench_train import bench_step

    overrides = args.overrides
    if args.preset:  # the preset's weights and prompts first, so that the command line's own overrides win
        from grpo_vision.tools.presets import preset, preset_home, preset_overrides

        preset(args.preset)
        overrides = [*preset_overrides(args.preset, preset_home(args.preset_dir, args.preset), args.dtype),
                     *overrides]
    _print_result(bench_step(args.config, overrides, steps=args.steps, warmup=args.warmup), args.json)


def cmd_bench_gpu(args) -> None:
    from grpo_vision.tools.bench_gpu import ORDER, bench_gpu, markdown
    from grpo_vision.tools.presets import preset

    names = args.presets.split(",") if args.presets else ORDER
    for name in names:
        preset(name)
    report = bench_gpu(args.out, args.budget, args.preset_dir or None, args.tiny, args.groups, args.step_group, names,
                       sampler=not args.steps_only, isolate=args.isolate, generate=args.generate,
                       only=[w.strip() for w in args.only.split(";")] if args.only else None)
    print(json.dumps(report, indent=2) if args.json else markdown(report))


def cmd_fit(args) -> None:
    from grpo_vision.tools.fit import DEFAULT_PRESETS, fit, markdown
    from grpo_vision.tools.presets import preset

    if args.command == "plan":  # the old name, kept one release: "plan" now means only a text plan (sample.plan)
        sys.stderr.write(warning_line("grpo-vision plan is now grpo-vision fit (the memory planner); the old name "
                                      "goes in the next release"))
    names = args.preset.split(",") if args.preset else DEFAULT_PRESETS
    for name in names:
        preset(name)  # an unknown name: one line, before anything is built
    reports = [fit(name, args.gpu_memory, args.judge_batch) for name in names]
    print(json.dumps(reports, indent=2) if args.json else "\n".join(markdown(r) for r in reports))


def cmd_bench_trl(args) -> None:
    try:
        from grpo_vision.tools.bench_train import bench_trl
        import trl  # noqa: F401
    except ImportError as e:
        raise ConfigError(f"bench trl needs TRL ({e}): pip install -e \".[bench]\"") from None
    _print_result(bench_trl(args.config, args.overrides, rounds=args.rounds, steps_per_round=args.steps_per_round),
                  args.json)


def cmd_bench_reward(args) -> None:
    from grpo_vision.tools.bench_reward import bench_reward

    _print_result(bench_reward(args.reward, args.overrides, images=args.images, size=args.size,
                               repeats=args.repeats, device=args.device), args.json)


def _print_result(result: dict, as_json: bool) -> None:
    if as_json:
        print(json.dumps(result, indent=2))
    else:
        for k, v in result.items():
            print(f"{k}: {v}")


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(prog="grpo-vision", description=__doc__.split("\n\n")[0])
    parser.add_argument("--version", action="version", version=f"grpo-vision {__version__}")
    sub = parser.add_subparsers(dest="command", required=True)

    p = sub.add_parser("config", help="print the resolved config and derived sizes")
    p.add_argument("config", help="YAML config file")
    p.add_argument("overrides", nargs="*", help="dotted overrides, e.g. train.lr=1e-5")
    p.add_argument("--num-processes", type=positive_int, default=1, help="check divisibility for this many processes")
    p.set_defaults(func=cmd_config)

    p = sub.add_parser("fit", aliases=["plan"], help="the memory planner: what fits in 24 / 48 / 80 GiB of GPU "
                       "memory, and its measured images/s, for the released model sizes (nothing is loaded; plan: "
                       "its old name, for one release)")
    p.add_argument("--preset", default="", help="comma-separated released sizes (default: janus-pro-1b, janus-pro-7b, "
                                                "llamagen-t2i-xl)")
    p.add_argument("--gpu-memory", type=gib_list, default=[24, 48, 80],
                   help="GPU memory budgets in GiB (nvidia-smi's MiB / 1024), e.g. 24,48,79.6")
    p.add_argument("--judge-batch", type=non_negative_int, default=0,
                   help="count a self_judge reward's understanding forward of this many images (reward.batch_size)")
    p.add_argument("--json", action="store_true", help="print JSON (default: a markdown table per model)")
    p.set_defaults(func=cmd_fit)

    p = sub.add_parser("train", help="GRPO training from a YAML config (or --resume a run); the main job takes "
                                     "10-20 min on a quiet 2-core CPU")
    p.add_argument("config", nargs="?", default="", help="YAML config, e.g. configs/shapes.yaml")
    p.add_argument("overrides", nargs="*", help="dotted overrides, e.g. train.lr=1e-5 sample.group_size=16")
    p.add_argument("--resume", default="", metavar="RUN_DIR", help="continue a run exactly where it stopped")
    p.add_argument("--trust-run", action="store_true", help="with --resume: load python: rewards that the run "
                                                            "folder names and import again the rewards it recorded "
                                                            "(rewards.json, code/): they run its code")
    add_reward_option(p)
    add_base_option(p)  # with --resume: continue on other base files, said in the run's base_changes.jsonl
    p.set_defaults(func=cmd_train)

    add_run_commands(sub)

    p = sub.add_parser("prompts", help="benchmark prompt sets as prompts files: GenEval's evaluation prompts, or "
                                       "training prompts from its templates")
    p.add_argument("set", choices=["geneval"], help="the benchmark")
    p.add_argument("--out", default="", help="the prompts file (JSONL) to write; without it, where the set is")
    p.add_argument("--train", type=non_negative_int, default=0, metavar="N",
                   help="N training prompts from the templates, none an evaluation prompt (0: the evaluation set)")
    p.add_argument("--seed", type=non_negative_int, default=0, help="the training prompts' draw")
    p.set_defaults(func=cmd_prompts)

    p = sub.add_parser("score", help="score a folder of any model's images by a benchmark's rules: GenEval's "
                                     "layout (sample --layout geneval) with the config's reward.options.geneval")
    p.add_argument("benchmark", choices=["geneval"], help="the benchmark")
    p.add_argument("folder", help="the images, in GenEval's layout: <i:05d>/metadata.jsonl, <i:05d>/samples/*.png")
    p.add_argument("overrides", nargs="*", help="dotted overrides, e.g. reward.options.geneval.detector_path=DIR")
    p.add_argument("--config", default="", help="YAML config whose reward.options.geneval names the detector "
                                                "(and the colour CLIP); a run's config.yaml works")
    p.add_argument("--against", default="", help="a second folder of the same prompts and image counts (a baseline): "
                                                 "its summary too, and the change with intervals over prompts")
    p.add_argument("--verdicts", default="", help="write each image's verdict and reasons to this JSONL file")
    p.add_argument("--device", default="auto", help="where the detector runs: auto (the best one here), cpu, cuda, cuda:N")
    p.set_defaults(func=cmd_score)

    p = sub.add_parser("matrix", help="train on each reward, score every run with every reward: one table")
    p.add_argument("config", help="YAML config every run starts from, e.g. configs/shapes.yaml")
    p.add_argument("overrides", nargs="*", help="dotted overrides for every run, e.g. train.steps=36")
    p.add_argument("--out", required=True, help="output directory (runs/, scores/, matrix.md, matrix.json, matrix.png)")
    p.add_argument("--rewards", required=True,
                   help="train rewards, comma-separated: a name or a + mix (clip+aesthetic, 4*clip+aesthetic)")
    p.add_argument("--kl", default=None, help="KL coefficients (train.beta), comma-separated, e.g. 0,0.04 "
                                              "(default: the config's train.beta)")
    p.add_argument("--seeds", default="0", help="run seeds, comma-separated")
    p.add_argument("--variant", action="append", default=[], metavar="NAME:KEY=VALUE[,KEY=VALUE]",
                   help="a row of training options besides the reward, repeatable; every reward trains under each, "
                        "e.g. --variant base: --variant stage:train.token_weighting=stage")
    p.add_argument("--jobs", type=positive_int, default=1, help="runs trained at once (CPU cores are split among them)")
    p.add_argument("--images", type=positive_int, default=None, help="images per eval prompt (default log.eval_images)")
    p.add_argument("--against", default=None, metavar="OUT",
                   help="another matrix's --out, scored on the same prompts (e.g. the same runs without a text plan, "
                        "which samples differently): each run minus that matrix's run of the same reward, KL and seed")
    p.add_argument("--against-reward", default=None, metavar="REWARD",
                   help="with --against: pair each run with that matrix's run trained on REWARD (as its --rewards "
                        "wrote it) instead of its own reward, the same KL and seed: what swapping a reward did")
    p.set_defaults(func=cmd_matrix)

    p = sub.add_parser("demo", help="Gradio app: two checkpoints (or the reference) side by side on the same seeds")
    p.add_argument("run", help="run directory")
    p.add_argument("--host", default="127.0.0.1", help="address to listen on (0.0.0.0: every interface)")
    p.add_argument("--port", type=port, default=None, help="port (default: the first free one from 7860)")
    add_reader_options(p, rewards=True)
    p.set_defaults(func=cmd_demo)

    p = sub.add_parser("export", help="a run's trained policy, whole, in the format its model's own tools load "
                                      "(transformers, peft, LlamaGen's .pt); docs/usage.md, \"Weights out\"")
    p.add_argument("run", help="run directory")
    p.add_argument("--out", required=True, help="a new (or empty) folder to write")
    p.add_argument("--step", type=positive_int, default=None, help="the checkpoint's step (default: the latest)")
    p.add_argument("--merge", action="store_true",
                   help="an adapter run: fold the adapter into the weights and write the whole model (default: a "
                        "peft adapter folder where the model's tools load one)")
    add_base_option(p)
    p.set_defaults(func=cmd_export)

    p = sub.add_parser("convert-clip", help="a TorchScript CLIP archive (OpenAI's ViT-L-14.pt) to safetensors, once; "
                                            "this runs the archive's code: only on an archive you trust")
    p.add_argument("archive", help="the TorchScript archive")
    p.add_argument("out", help="the safetensors file to write (OUT.safetensors)")
    p.set_defaults(func=cmd_convert_clip)

    add_serve_command(sub)
    add_bench_commands(sub)
    for add_commands in command_adders():  # plugins' own subcommands (ShapesWorld: world build | render | prompts)
        add_commands(sub)
    return parser


def add_bench_commands(sub) -> None:
    bench = sub.add_parser("bench", help="benchmarks that print JSON").add_subparsers(dest="what", required=True)
    p = bench.add_parser("sampler", help="the decode paths of one policy, beside transformers generate() and a "
                                          "teacher-forced pass: seconds, images/s, forward passes an image")
    p.add_argument("--json", action="store_true", help="print one JSON object")
    p.add_argument("--decode", type=name_list(DECODE_PATHS, "decode paths"), default=None,
                   help="decode paths to time, comma-separated (sample.decode's: speculative with both draft kinds); "
                        "default: every one that runs on --device and the policy, compiled on a GPU only (on a CPU "
                        "it compiles for about 30 s: name it to time it)")
    p.add_argument("--policy", default="", help="a saved policy directory (default: random default-size policy)")
    p.add_argument("--group-size", type=positive_int, default=8,
                   help="seeds per prompt: the rows are 4 ShapesWorld captions x this many seeds")
    p.add_argument("--batch", type=positive_int, default=None,
                   help="rows per sampler call, as sample.batch_size (default: all rows in one call)")
    p.add_argument("--repeats", type=positive_int, default=3, help="timed repeats per run (median reported)")
    p.add_argument("--cfg-scale", type=cfg_scale, default=None,
                   help="guidance scale of every run, 1 = off (default 3.0; with --run, the run's)")
    p.add_argument("--top-k", type=non_negative_int, default=None,
                   help="top-k of all runs, 0 = off (default 100; with --run, the run's)")
    p.add_argument("--speculative-window", type=positive_int, default=None,
                   help="W: tokens a forward pass of the speculative path verifies (default 32; with --run, the run's)")
    p.add_argument("--speculative-tree", type=draft_tree, default=None, metavar="C,D",
                   help="the speculative path's draft tree: C drafts at each of the first D positions (sample."
                        "speculative_candidates and _branching; default 8,2; 1,0 is a chain; with --run, the run's)")
    p.add_argument("--dtype", default=None, choices=["float32", "bfloat16"],
                   help="cast the policy's weights (default: as loaded; the built-in and --preset: float32)")
    p.add_argument("--generate", action=argparse.BooleanOptionalAction, default=True,
                   help="time transformers' generate() beside the paths (the built-in policy kind; Janus presets)")
    add_preset_options(p, "a released model size with random weights (tools/presets.py) instead of the built-in "
                          "policy: the same figures per group size, one prompt's group")
    p.add_argument("--groups", type=int_list, default=[8, 16], help="group sizes G, comma-separated (--preset)")
    p.add_argument("--run", default="",
                   help="a run folder: its latest checkpoint at the run's CFG, temperature, top-k, window and text "
                        "plan (drawn first, as training does)")
    p.add_argument("--device", default=None, choices=["cpu", "cuda"],
                   help="where every run is timed (default: cuda where this machine has it, else cpu)")
    p.set_defaults(func=cmd_bench_sampler)
    p = bench.add_parser("demo", help="seconds per Compare click of the demo on a run (target 5 s)")
    p.add_argument("run", help="a run directory (as for grpo-vision demo)")
    p.add_argument("--json", action="store_true", help="print one JSON object")
    p.add_argument("--n", type=positive_int, default=4, help="images per side")
    p.add_argument("--repeats", type=positive_int, default=4, help="timed calls (median reported)")
    p.add_argument("--prompt", default="", help="the prompt (default: the run's first example prompt)")
    add_reader_options(p, rewards=True)
    p.set_defaults(func=cmd_bench_demo)

    def training_bench(name: str, help_text: str, config_help: str):  # the arguments of `train`, and --json
        p = bench.add_parser(name, help=help_text)
        p.add_argument("config", help=config_help)
        p.add_argument("overrides", nargs="*", help="key=value overrides")
        p.add_argument("--json", action="store_true", help="print one JSON object")
        return p

    p = training_bench("step", "one training step of CONFIG by phase, images/s and peak memory (a minute or two "
                               "for the main job on a 2-core CPU)", "a config file, as for grpo-vision train")
    p.add_argument("--steps", type=positive_int, default=4, help="timed steps (median reported)")
    p.add_argument("--warmup", type=non_negative_int, default=1, help="steps run first and not timed")
    add_preset_options(p, "train a released model size with random weights (tools/presets.py): its policy and "
                          "prompts come before the overrides")
    p.add_argument("--dtype", default="bfloat16", choices=["float32", "bfloat16"], help="the preset's policy.dtype")
    p.set_defaults(func=cmd_bench_step)
    p = bench.add_parser("gpu", help="every sampler and step figure of the released sizes that fits --budget seconds "
                                     "(one command for a GPU: docs/benchmarks.md)")
    p.add_argument("--out", required=True, help="folder for bench_gpu.json and bench_gpu.md (rewritten after each item)")
    p.add_argument("--budget", type=positive_int, default=420, help="seconds; items past it are listed as not run")
    p.add_argument("--json", action="store_true", help="print the JSON (default: the markdown tables)")
    p.add_argument("--preset-dir", default="", help="where the presets' files are written (default: OUT/presets)")
    p.add_argument("--presets", default="", help="comma-separated preset names (default: all four, in order)")
    p.add_argument("--tiny", action="store_true", help="the presets' tiny twins (the fast tests run this on a CPU)")
    p.add_argument("--groups", type=int_list, default=[8, 16], help="the sampler's group sizes G")
    p.add_argument("--step-group", type=positive_int, default=16, help="G of the step figures (one prompt a step)")
    p.add_argument("--steps-only", action="store_true", help="only the step figures (no sampler items)")
    p.add_argument("--generate", action=argparse.BooleanOptionalAction, default=True,
                   help="time transformers' generate beside the sampler (Janus; the slowest path)")
    p.add_argument("--only", default="", help="';'-separated items to run: 'sampler' and step settings by label")
    p.add_argument("--isolate", action=argparse.BooleanOptionalAction, default=None,
                   help="each item in a fresh process (default: on a GPU), so that each memory peak is its own")
    p.set_defaults(func=cmd_bench_gpu)
    p = training_bench("trl", "images/s of this trainer and TRL's GRPOTrainer at equal settings (needs .[bench]; "
                              "about 3 min for the main job on a 2-core CPU)",
                       "a config of the built-in Llama policy (e.g. configs/shapes.yaml)")
    p.add_argument("--rounds", type=positive_int, default=3, help="interleaved rounds (each trainer once per round)")
    p.add_argument("--steps-per-round", type=at_least_two, default=3,
                   help="steps per trainer and round; the first is not timed")
    p.set_defaults(func=cmd_bench_trl)
    p = bench.add_parser("reward", help="images/s of one reward on rendered words whose prompts quote them "
                                        "(bench reward ocr: the OCR reward on a CPU)")
    p.add_argument("reward", help="a registered reward name, e.g. ocr")
    p.add_argument("overrides", nargs="*", help="key=value config overrides, e.g. reward.options.ocr.threads=1")
    p.add_argument("--json", action="store_true", help="print one JSON object")
    p.add_argument("--images", type=positive_int, default=16, help="images per timed call")
    p.add_argument("--size", type=positive_int, default=256, help="image side in pixels")
    p.add_argument("--repeats", type=positive_int, default=3, help="timed calls (median reported)")
    p.add_argument("--device", default="cpu", help="the reward's device (RewardContext.device)")
    p.set_defaults(func=cmd_bench_reward)
    add_bench_reward_server(bench)


def add_preset_options(p, help_text: str) -> None:
    p.add_argument("--preset", default="", help=help_text + "; names: janus-pro-1b, janus-pro-7b, llamagen-t2i-xl, "
                                                            "llamagen-c2i-xl, each also with -tiny")
    p.add_argument("--preset-dir", default="", help="where presets are written once and reused (default: "
                                                    "~/.cache/grpo_vision/presets)")


def _one_line(message, category, filename, lineno, line=None) -> str:
    """A warning as the command line prints it: one line, like its errors (not Python's file:line and
    source line, which name the library's code rather than what the user set), whoever warns."""
    return warning_line(message)


def main(argv: list[str] | None = None) -> None:
    warnings.formatwarning = _one_line
    # the interpreter's last cyclic collection at exit walks every object torch and transformers made: about a
    # second on a 2-core CPU once transformers has imported torch._dynamo, a fifth of a small `export`. The objects
    # frozen by an atexit hook (gc.freeze, Python's docs), that collection skips them; the OS frees the memory
    atexit.unregister(gc.freeze)  # once, however often a script or a test calls main()
    atexit.register(gc.freeze)
    parser = build_parser()
    args, extra = parser.parse_known_args(argv)
    if extra:
        _take_overrides(parser, args, extra)
    # the errors a command reports in one line; imported after parsing, since they bring torch
    from grpo_vision.run.checkpoint import CheckpointError
    from grpo_vision.run.health import TrainingHealthError
    from grpo_vision.prompts import PromptsError
    from grpo_vision.rewards import RewardError
    from grpo_vision.files import FolderError
    from grpo_vision.evaluation.geneval_bench import LayoutError
    from grpo_vision.run.lock import RunLockedError
    from grpo_vision.run.distributed import end_process_group

    try:
        args.func(args)
        sys.stdout.flush()  # a reader that has gone (`eval RUN | head -4`) shows here, not at exit
    except BrokenPipeError:  # Python's recipe: nothing more to say, and nothing more written to the closed pipe
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        sys.exit(128 + signal.SIGPIPE)  # 141: what a shell reports for a command a closed pipe stopped
    except (ConfigError, CheckpointError, FileNotFoundError, FolderError, LayoutError, PromptsError,
            RunLockedError) as e:
        print(f"grpo-vision: error: {e}", file=sys.stderr)
        sys.exit(2)
    except (RewardError, TrainingHealthError) as e:
        print(f"grpo-vision: error: {e}", file=sys.stderr)
        sys.exit(1)
    finally:  # under `accelerate launch`: every process ends its group itself, on success and on error
        end_process_group()


def _take_overrides(parser: argparse.ArgumentParser, args, extra: list[str]) -> None:
    """key=value overrides anywhere on the line: argparse matches CONFIG and the overrides positional
    together, so those after an option come back unparsed; they join the overrides, in order. Any
    other leftover is an error, as argparse reports it."""
    wanted = [t for t in extra if "=" in t and not t.startswith("-")] if hasattr(args, "overrides") else []
    unknown = [t for t in extra if t not in wanted]
    if unknown:
        parser.error(f"unrecognized arguments: {' '.join(unknown)}")
    args.overrides = [*args.overrides, *wanted]

