"""The `grpo-vision` command line: one subcommand per job, each a thin shell over the library."""

from __future__ import annotations

import argparse
import json
import sys

from grpo_vision.config import ConfigError, derived_sizes, format_sizes, load_config, to_dict


def cmd_config(args) -> None:
    """Print the resolved config (defaults + YAML + overrides) and the derived batch sizes."""
    import yaml

    cfg = load_config(args.config, args.overrides)
    sizes = derived_sizes(cfg, args.num_processes)
    print(yaml.safe_dump(to_dict(cfg), sort_keys=False), end="")
    print("# derived: " + format_sizes(sizes))


def cmd_bench_sampler(args) -> None:
    from grpo_vision.bench import bench_sampler

    policy = None
    if args.policy:
        from grpo_vision.llama_policy import LlamaImagePolicy

        policy = LlamaImagePolicy.from_pretrained(args.policy)
    result = bench_sampler(policy, batch=args.batch, repeats=args.repeats, cfg_scale=args.cfg_scale,
                           top_k=args.top_k, dtype=args.dtype)
    if args.json:
        print(json.dumps(result, indent=2))
    else:
        for k, v in result.items():
            print(f"{k}: {v}")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="grpo-vision", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)

    p = sub.add_parser("config", help="print the resolved config and derived sizes")
    p.add_argument("config", help="YAML config file")
    p.add_argument("overrides", nargs="*", help="dotted overrides, e.g. train.lr=1e-5")
    p.add_argument("--num-processes", type=int, default=1, help="check divisibility for this many processes")
    p.set_defaults(func=cmd_config)

    bench = sub.add_parser("bench", help="benchmarks that print JSON").add_subparsers(dest="what", required=True)
    p = bench.add_parser("sampler", help="our sampler vs transformers generate() vs teacher forcing")
    p.add_argument("--json", action="store_true", help="print one JSON object")
    p.add_argument("--policy", default="", help="a saved policy directory (default: random default-size policy)")
    p.add_argument("--batch", type=int, default=64, help="sequences per call")
    p.add_argument("--repeats", type=int, default=3, help="timed repeats per run (median reported)")
    p.add_argument("--cfg-scale", type=float, default=3.0, help="guidance scale of the CFG-on runs")
    p.add_argument("--top-k", type=int, default=100, help="top-k of all runs (0 = off)")
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"], help="weights and compute dtype")
    p.set_defaults(func=cmd_bench_sampler)
    return parser


def main(argv: list[str] | None = None) -> None:
    args = build_parser().parse_args(argv)
    try:
        args.func(args)
    except (ConfigError, FileNotFoundError) as e:
        print(f"grpo-vision: error: {e}", file=sys.stderr)
        sys.exit(2)


if __name__ == "__main__":
    main()
