"""The commands that read a run folder: `sample`, `eval`, `report` and `alerts` here, and the options they share with
`demo` and `bench demo` (cli/app.py). A run folder may come from someone else, so these commands load no code it
names without --trust-run (run/folder.py), sample where the run trained when this machine has that device
(else on the best one here), and refuse prompts the policy cannot read, as `train` does.
"""

from __future__ import annotations

import contextlib
import json
import sys
from pathlib import Path

from grpo_vision.cli.args import device, positive_float, positive_int, seed
from grpo_vision.config import EVAL_SEED, ConfigError


def add_reader_options(p, rewards: bool) -> None:
    """--device, and --trust-run for a command that loads the run's rewards."""
    p.add_argument("--device", type=device, default="run",
                   help="where to sample: run (the device the run trained on where this machine has it, so that "
                        "its report reproduces; else the best one here), auto (the best one here), cpu, cuda, "
                        "cuda:N or mps")
    add_base_option(p)
    if rewards:
        p.add_argument("--trust-run", action="store_true",
                       help="load python: rewards that the run folder names and import again the rewards it recorded "
                            "(rewards.json, code/): they run its code; only for a run folder you trust")
        add_reward_option(p)


def add_base_option(p) -> None:
    p.add_argument("--allow-other-base", action="store_true",
                   help="load the run although policy.path or policy.tokenizer now hold other files than its "
                        "checkpoint was trained from (refused otherwise: the weights would decode through another "
                        "tokenizer)")


def add_reward_option(p) -> None:
    """--reward NAME=python:module:function, repeatable: a reward the run names that only its script had."""
    p.add_argument("--reward", action="append", default=[], metavar="NAME=python:MODULE:FUNCTION",
                   help="supply a reward the run was trained or monitored with that is registered nowhere here (made "
                        "in a script): the function (images, prompts, metadata) -> scores; repeatable")


def add_run_commands(sub) -> None:
    """`sample`, `eval`, `report` and `alerts`, on the subparsers `sub`."""
    for name, help_text in (("sample", "write PNGs from a run's policy or reference"),
                            ("eval", "JSON: each reward's mean and 95%% interval, policy vs reference")):
        p = sub.add_parser(name, help=help_text)
        p.add_argument("run", help="run directory")
        p.add_argument("--prompts", required=name == "sample", default="",
                       help="plain text (one prompt per line), JSONL, CSV/TSV with a header, Parquet or a datasets "
                            "folder (docs/usage.md, \"Prompt sources\")" + (
                           "" if name == "sample" else "; default: the run's test and held-out sets and its sample "
                                                       "of training prompts (JSON 'sets')"))
        p.add_argument("--prompt-column", default="", metavar="NAME",
                       help="the column (JSONL: the key) of --prompts that holds the prompts (default: prompt, else "
                            "caption or text)")
        p.add_argument("--n", type=positive_int, default=4 if name == "sample" else None,
                       help="images per prompt" + ("" if name == "sample" else " (default: the run's log.eval_images, "
                                                                            "the images its report scored)"))
        p.add_argument("--seed", type=seed, default=0 if name == "sample" else EVAL_SEED,
                       help="image j of each prompt uses seed + j" if name == "sample" else
                       "image j of prompt i uses seed + 1000 i + j, so a repeated prompt gets fresh images (default "
                       f"{EVAL_SEED}: the images the run's report and the matrix scored)")
        p.add_argument("--step", type=positive_int, default=None, help="checkpoint step (default: the latest)")
        p.add_argument("--temperature", type=positive_float, default=None,
                       help="sampling temperature (default: the run's first log.eval_temperatures entry, "
                            "else sample.temperature)")
        add_reader_options(p, rewards=name == "eval")
        if name == "eval":
            p.add_argument("--benchmark", default="", choices=["", "geneval"],
                           help="geneval: GenEval's protocol, its 553 prompts (or --prompts: GenEval's own JSONL or "
                                "`prompts geneval --out`'s) scored by the run's reward.options.geneval; its summary "
                                "for policy and reference")
            p.add_argument("--verdicts", default="", help="with --benchmark: write each image's verdict and "
                                                          "reasons to this JSONL file")
            p.add_argument("--draw", type=positive_int, default=1,
                           help="2, 3, ...: other test and held-out prompts drawn from the policy kind's pools "
                                "(data.eval_draw; a check that a result is not the draw's); default 1, the run's own")
        if name == "sample":
            p.add_argument("--out", required=True, help="output directory")
            p.add_argument("--reference", action="store_true", help="sample the reference instead of the policy")
            p.add_argument("--layout", default="index", choices=["index", "geneval", "flat"],
                           help="index: numbered PNGs + index.jsonl; geneval: GenEval's folders, its flat "
                                "metadata.jsonl in each (--prompts: its evaluation_metadata.jsonl or `prompts geneval "
                                "--out`'s file); flat: <prompt>_<k>.png (T2I-CompBench style)")
        p.set_defaults(func=cmd_sample if name == "sample" else cmd_eval)
    p = sub.add_parser("report", help="write a finished or stopped run's report.md, eval.json and figures from its "
                                      "checkpoint (the latest, or --step), as training writes them at its end")
    p.add_argument("run", help="run directory")
    p.add_argument("--step", type=positive_int, default=None, help="checkpoint step (default: the latest)")
    add_reader_options(p, rewards=True)
    p.set_defaults(func=cmd_report)
    p = sub.add_parser("alerts", help="replay the training alerts over a run's metrics.jsonl: one JSON line per "
                                      "alert (step, name, evidence, advice), e.g. under other thresholds")
    p.add_argument("run", help="run directory")
    p.add_argument("overrides", nargs="*", help="other thresholds, e.g. log.alerts.window=20 log.alerts.sigmas=2.5")
    p.set_defaults(func=cmd_alerts)


def cmd_report(args) -> None:
    from grpo_vision.evaluation.report import report_run

    report_run(args.run, args.step, args.device, args.trust_run, args.reward, args.allow_other_base)


def cmd_alerts(args) -> None:
    from dataclasses import asdict

    from grpo_vision.run.alerts import replay_run

    # stdout holds the alerts' JSON lines only; what was read, and what was skipped, goes to stderr
    for alert in replay_run(args.run, args.overrides, say=lambda line: print(f"[alerts] {line}", file=sys.stderr)):
        print(json.dumps(asdict(alert)), flush=True)


def cmd_sample(args) -> None:
    from grpo_vision.evaluation import image_layouts
    from grpo_vision.evaluation.evaluate import eval_params
    from grpo_vision.step.load import load_run
    from grpo_vision.policy import check_prompts
    from grpo_vision.prompts import load_prompts
    from grpo_vision.files import check_writable
    from grpo_vision.rewards import geneval_prompts
    from grpo_vision.rollouts import check_seeds

    # read the prompts and look at --out before loading the model: a bad file or folder is named at once
    if args.layout == "geneval":
        no_prompt_column(args, "--layout geneval")
        entries = geneval_prompts.read(args.prompts)  # GenEval's own lines or `prompts geneval --out`'s
    else:
        entries = load_prompts(args.prompts, column=args.prompt_column)
    prompts, where = [e.prompt for e in entries], [f"{args.prompts}, line {e.line}" for e in entries]
    check_seeds(args.seed, 1, args.n)
    check_writable(args.out, "make it writable, or choose another --out")
    run = load_run(args.run, args.step, args.device, args.allow_other_base)
    check_prompts(run.policy, zip(where, prompts))
    model, ctx = run.reference.sampler(run.policy) if args.reference else (run.policy, contextlib.nullcontext())
    params, tokenizer = eval_params(run.cfg, args.temperature), run.bundle.tokenizer
    with ctx:
        if args.layout == "geneval":
            count = image_layouts.write_geneval(model, tokenizer, entries, args.out, args.n, args.seed, params)
        elif args.layout == "flat":
            count = image_layouts.write_flat(model, tokenizer, prompts, args.out, args.n, args.seed, params)
        else:
            count = image_layouts.write_index(model, tokenizer, prompts, args.out, args.n, args.seed, params,
                                              "reference" if args.reference else "policy", run.step)
    where = "each prompt folder's plans.jsonl" if args.layout == "geneval" else "index.jsonl"
    plans = "" if params.plan is None else f", each image's text plan in {where}"
    print(f"wrote {count} images to {args.out} ({args.layout} layout){plans}")


def cmd_eval(args) -> None:
    if args.benchmark:
        return cmd_benchmark(args)
    from grpo_vision.evaluation.evaluate import evaluate_run
    from grpo_vision.prompts import load_prompts
    from grpo_vision.run.folder import read_run_config

    read_run_config(args.run, device=args.device)  # not a run folder: said before the prompts are read
    if args.draw != 1 and args.prompts:
        raise ConfigError("--draw and --prompts: give one (--draw draws the policy kind's eval sets again)")
    sets = {"prompts": load_prompts(args.prompts, column=args.prompt_column)} if args.prompts else None
    result = evaluate_run(args.run, args.step, args.n, args.seed, args.device, sets, args.temperature, args.draw,
                          args.trust_run, args.reward, source=lambda name: _source(args, name),
                          allow_other_base=args.allow_other_base)
    print(json.dumps({k: v for k, v in result.items() if k != "sets"} | result["sets"]["prompts"] if args.prompts
                     else result, indent=2))


def cmd_benchmark(args) -> None:
    """`eval RUN --benchmark geneval`: GenEval's prompts x --n images for policy and reference, the same
    seeds, GenEval's verdicts from the run's `geneval` reward options, its summary and the paired change."""
    import dataclasses

    from grpo_vision.evaluation.evaluate import eval_params
    from grpo_vision.step.load import load_run
    from grpo_vision.evaluation.geneval_bench import benchmark
    from grpo_vision.files import check_output_file, write_output_file
    from grpo_vision.policy import check_prompts
    from grpo_vision.rewards import CompositeReward
    from grpo_vision.rewards.geneval_prompts import evaluation_entries, read
    from grpo_vision.rollouts import check_seeds

    if args.draw != 1:
        raise ConfigError("--draw draws the run's own eval sets again; --benchmark geneval scores GenEval's prompts")
    no_prompt_column(args, "--benchmark geneval")
    entries = read(args.prompts) if args.prompts else evaluation_entries()  # either of GenEval's shapes
    check_seeds(args.seed, len(entries), args.n)
    if args.verdicts:
        check_output_file(args.verdicts, "--verdicts")  # before the model loads, not after the sampling
    run = load_run(args.run, args.step, args.device, args.allow_other_base)
    source = args.prompts or "GenEval's evaluation prompts"
    check_prompts(run.policy, ((f"{source}, line {e.line or i + 1}", e.prompt) for i, e in enumerate(entries)))
    device = next(run.policy.parameters()).device
    only = dataclasses.replace(run.cfg.reward, weights={"geneval": 1.0}, monitor=[])  # its options, no other reward
    rewards = CompositeReward.from_config(only, device, run.bundle.reward_defaults)
    reward = rewards.fns["geneval"]
    try:  # the reward's own refusal (a colour clause and no colour classifier) in one line, as `score geneval`
        reward.check([e.prompt for e in entries], [e.metadata for e in entries])
    except ValueError as e:
        raise ConfigError(f"{source}: {e}") from None
    rewards.load()
    params = eval_params(run.cfg, args.temperature)
    try:
        result, rows = benchmark(run.policy, run.reference, run.bundle.tokenizer, entries, reward, args.n, params,
                                 args.seed)
    except ValueError as e:
        raise ConfigError(f"{source}: {e}") from None
    if args.verdicts:
        write_output_file(Path(args.verdicts), "".join(json.dumps(row) + "\n" for row in rows), "--verdicts")
    print(json.dumps({"run": str(args.run), "step": run.step, "device": str(device), "benchmark": "geneval",
                      "temperature": params.temperature, **result}, indent=2))


def no_prompt_column(args, what: str) -> None:
    """ConfigError for --prompt-column with GenEval's prompts, whose prompt is always their 'prompt' field."""
    if args.prompt_column:
        raise ConfigError(f"--prompt-column {args.prompt_column}: {what} reads GenEval's prompts, whose prompt is "
                          "their 'prompt' field; leave --prompt-column out")


def _source(args, name: str) -> str:
    """Where eval set `name` was read: the --prompts file, the run's prompts/<name>.jsonl, or its config."""
    if args.prompts:
        return args.prompts
    path = Path(args.run) / "prompts" / f"{name}.jsonl"
    return str(path) if path.is_file() else f"the {name} prompts of {args.run}/config.yaml"
