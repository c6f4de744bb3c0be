"""The command line: `grpo-vision config | train | sample | eval | prompts | matrix | demo | convert-clip | bench`
(plugins add more, e.g. `world`). app.py builds the parser and runs a command; args.py holds argument
types; runs.py the commands that read a run folder (sample, eval)."""

from grpo_vision.cli.app import build_parser, main

__all__ = ["build_parser", "main"]
