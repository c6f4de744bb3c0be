"""`serve-reward` (registered rewards over HTTP, for a run's `remote` reward) and `bench reward-server`."""

from __future__ import annotations

import json

from grpo_vision.cli.args import port, positive_int


def _split(args) -> None:
    """The key=value overrides among the reward names (argparse takes both as the REWARD positional)."""
    args.overrides = [*args.overrides, *(r for r in args.rewards if "=" in r)]
    args.rewards = [r for r in args.rewards if "=" not in r]


def cmd_serve_reward(args) -> None:
    from grpo_vision.config import load_config
    from grpo_vision.run.machine import resolve_device
    from grpo_vision.tools.reward_server import build_rewards, listen, serve

    _split(args)
    cfg = load_config(args.config or None, args.overrides)
    listen(args.host, args.port).close()  # a taken port: one line before any model loads
    rewards = build_rewards(args.rewards, cfg, resolve_device(args.device, "--device"))
    serve(rewards, args.host, args.port, args.max_batch)


def cmd_bench_reward_server(args) -> None:
    from grpo_vision.tools.reward_server import bench_reward_server

    _split(args)
    print(json.dumps(bench_reward_server(args.rewards, args.overrides, args.config, args.batch, args.size,
                                         args.repeats, args.clients), indent=2))


def add_serve_command(sub) -> None:
    p = sub.add_parser("serve-reward", help="serve registered rewards over HTTP for a run's `remote` reward "
                                            "(docs/real_models.md, \"Rewards behind a server\")")
    p.add_argument("rewards", nargs="+", metavar="REWARD", help="registered reward names, then key=value overrides (reward.options.NAME.KEY=VALUE)")
    p.add_argument("--config", default="", help="YAML config whose reward.options.<name> set each reward's options "
                                                "(a policy kind's defaults are not applied: give paths in full)")
    p.add_argument("--host", default="127.0.0.1", help="address to listen on (0.0.0.0: every interface)")
    p.add_argument("--port", type=port, default=8000, help="port")
    p.add_argument("--device", default="auto", help="where the rewards' models run: auto, cpu, cuda, cuda:N")
    p.add_argument("--max-batch", type=positive_int, default=64,
                   help="images per reward call: requests that wait meanwhile are scored together up to this")
    p.set_defaults(func=cmd_serve_reward, overrides=[])


def add_bench_reward_server(bench) -> None:
    p = bench.add_parser("reward-server", help="images/s of a reward in this process and behind serve-reward "
                                               "(one client, and several at once)")
    p.add_argument("rewards", nargs="+", metavar="REWARD", help="a registered reward name, then key=value overrides")
    p.add_argument("--config", default="", help="YAML config with the reward's options")
    p.add_argument("--batch", type=positive_int, default=32, help="images per call")
    p.add_argument("--size", type=positive_int, default=64, help="image side in pixels")
    p.add_argument("--repeats", type=positive_int, default=5, help="timed calls (median reported)")
    p.add_argument("--clients", type=positive_int, default=4, help="clients calling at once (the batcher merges)")
    p.set_defaults(func=cmd_bench_reward_server, overrides=[])
