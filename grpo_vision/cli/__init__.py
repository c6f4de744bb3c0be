"""The command line, one subcommand per job (`grpo-vision --help` lists them; plugins add more, e.g. `world`).
app.py builds the parser and runs a command; args.py holds argument types; runs.py the commands that read a run
folder and the options they share; serve.py `serve-reward` and `bench reward-server`; __main__.py makes
`python -m grpo_vision.cli` the same program."""

from grpo_vision.cli.app import build_parser, main

__all__ = ["build_parser", "main"]
