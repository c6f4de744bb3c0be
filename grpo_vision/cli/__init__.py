"""The command line: `grpo-vision config | train | sample | eval | matrix | demo | convert-clip | bench`
(plugins add more, e.g. `world`). main.py builds the parser and runs a command; args.py holds argument
types; runs.py the commands that read a run folder (sample, eval)."""

from grpo_vision.cli.main import build_parser, main

__all__ = ["build_parser", "main"]
