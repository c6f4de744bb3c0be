"""The command line: `grpo-vision config | train | sample | eval | prompts | matrix | demo | convert-clip |
serve-reward | bench` (plugins add more, e.g. `world`). app.py builds the parser and runs a command; args.py holds argument
types; runs.py the commands that read a run folder (sample, eval); serve.py serve-reward."""

from grpo_vision.cli.app import build_parser, main

__all__ = ["build_parser", "main"]
