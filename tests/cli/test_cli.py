"""The real `grpo-vision` entry point, run as a user would run it: in a subprocess where what is checked
is what a shell sees (exit codes, stderr, a closed pipe, start-up imports: the e2e tier), else through
`main` in this process."""

import json
import os
import subprocess
import sys

import pytest

from tests.helpers import ROOT, cli_cmd, run_cli

# `config` checks that every file a config names is there: the micro world is built by the tests, not committed
MICRO_WORLD = "policy.path=worlds/shapes"


@pytest.mark.e2e
def test_config_prints_resolved_values_and_sizes():
    out = run_cli("config", "configs/shapes.yaml", "train.lr=2e-5", "--num-processes", "2")
    assert out.returncode == 0, out.stderr
    assert "lr: 2.0e-05" in out.stdout
    assert "images_per_step=64" in out.stdout and "images_per_process=32" in out.stdout


@pytest.mark.e2e
def test_config_errors_exit_2_and_name_the_key(tmp_path):
    bad = tmp_path / "bad.yaml"
    bad.write_text("sample:\n  group_siz: 8\n")
    for args, needle in [
        (("config", str(bad)), "unknown key 'sample.group_siz' (did you mean 'sample.group_size'?)"),
        (("config", "configs/shapes.yaml", "train.lr=fast"), "'train.lr' expects a number, got 'fast'"),
        (("config", "configs/shapes.yaml", "sample.group_size=1"), "sample.group_size must be >= 2"),
    ]:
        out = run_cli(*args)
        assert out.returncode == 2 and needle in out.stderr, out.stderr
        assert "Traceback" not in out.stderr


def test_bench_sampler_prints_every_requested_path_in_one_shape(tmp_path, capsys):
    from grpo_vision.cli import main
    from grpo_vision.tools.bench import BENCH_WORDS
    from grpo_vision.models.llama import LlamaImagePolicy, LlamaPolicyConfig

    # A tiny saved policy, not the default-size one: what is checked is the JSON, not the speed, and
    # the default size takes minutes on a shared CPU
    LlamaImagePolicy(LlamaPolicyConfig(words=BENCH_WORDS, codebook_size=32, image_grid=(2, 2), dim=32,
                                       n_layers=1, n_heads=2, n_kv_heads=1, ffn_dim=64)).save_pretrained(tmp_path / "p")
    main(["bench", "sampler", "--json", "--policy", str(tmp_path / "p"), "--decode", "eager,static,speculative",
          "--group-size", "1", "--repeats", "1", "--top-k", "8", "--speculative-window", "2",
          "--speculative-tree", "1,0"])
    result = json.loads(capsys.readouterr().out)
    paths, baselines = result["paths"], result["baselines"]
    assert list(paths) == ["eager", "static", "speculative", "speculative_jacobi"] and result["not_run"] == {}
    assert result["drafts"] == {"speculative": "coupled", "speculative_jacobi": "jacobi"}
    assert len({tuple(r) for r in paths.values()}) == 1  # the same figures for every path
    assert set(baselines) == {"generate", "teacher_forced"}
    assert all(set(b) == set(paths["eager"]) - {"speedup_vs_generate", "fraction_of_ceiling", "wall_clock_vs_plain"}
               for b in baselines.values())
    assert (result["image_tokens"], result["images"], result["batch"]) == (4, 4, 4)  # the saved policy, 4 prompts x 1
    for name, r in paths.items():  # the ratios are those of the seconds reported
        assert r["images_per_s"] == pytest.approx(4 / r["seconds"], rel=0.01)
        assert r["speedup_vs_generate"] == pytest.approx(baselines["generate"]["seconds"] / r["seconds"], rel=0.01)
        assert r["fraction_of_ceiling"] == pytest.approx(baselines["teacher_forced"]["seconds"] / r["seconds"],
                                                         rel=0.01)
        assert r["wall_clock_vs_plain"] == pytest.approx(paths["static"]["seconds"] / r["seconds"], rel=0.01)
    assert result["plain_decode"] == "static" and result["targets"]["path"] == "eager"  # auto on a CPU
    assert result["targets_met"] == (paths["eager"]["speedup_vs_generate"] >= 3
                                     and paths["eager"]["fraction_of_ceiling"] >= 0.4)
    assert result["machine"]["torch"] and result["machine"]["cpu_threads"] >= 1


def test_bench_counts_must_be_positive(capsys):
    from grpo_vision.cli import main

    for args, needle in [
        (["bench", "sampler", "--repeats", "0"], "argument --repeats: expected a whole number >= 1, got '0'"),
        (["bench", "sampler", "--batch", "x"], "argument --batch: expected a whole number >= 1, got 'x'"),
        (["bench", "demo", "runs/none", "--repeats", "-1"], "argument --repeats: expected a whole number >= 1"),
        (["bench", "step", "c.yaml", "--warmup", "-1"], "argument --warmup: expected a whole number >= 0, got '-1'"),
        (["bench", "trl", "c.yaml", "--steps-per-round", "1"], "expected a whole number >= 2 (the first step is a "
                                                               "warm-up), got '1'"),
        (["matrix", "configs/shapes_micro.yaml", "--out", "o", "--rewards", "clip", "--against-reward", "clip"],
         "grpo-vision: error: --against-reward names a run of another matrix: give that matrix's folder with "
         "--against"),
    ]:
        with pytest.raises(SystemExit) as exit_info:
            main(args)
        assert exit_info.value.code == 2 and needle in capsys.readouterr().err


def test_overrides_are_taken_anywhere_on_the_line(monkeypatch, capsys):
    import grpo_vision.cli.app as cli

    seen = {}
    for name in ("cmd_matrix", "cmd_train", "cmd_bench_step", "cmd_bench_trl"):  # each records what it was given
        monkeypatch.setattr(cli, name, lambda args, name=name: seen.setdefault(name, args))
    # Before: argparse matched CONFIG and the overrides together, so an override after an option was an error
    cli.main(["matrix", "c.yaml", "a=1", "--out", "o", "b=2", "--rewards", "clip", "c.d=[1, 2]", "--kl", "0"])
    assert seen["cmd_matrix"].overrides == ["a=1", "b=2", "c.d=[1, 2]"] and seen["cmd_matrix"].rewards == "clip"
    cli.main(["train", "c.yaml", "--resume", "runs/x", "train.lr=1e-5"])
    assert seen["cmd_train"].overrides == ["train.lr=1e-5"] and seen["cmd_train"].config == "c.yaml"
    cli.main(["bench", "step", "c.yaml", "--steps", "2", "a=1"])
    cli.main(["bench", "trl", "c.yaml", "--rounds", "2", "a=1", "--json", "b=2"])
    assert seen["cmd_bench_step"].overrides == ["a=1"] and seen["cmd_bench_trl"].overrides == ["a=1", "b=2"]
    cli.main(["config", "configs/shapes_micro.yaml", "--num-processes", "1", "train.steps=3", MICRO_WORLD])
    assert "  steps: 3\n" in capsys.readouterr().out
    for args, needle in [(["matrix", "c.yaml", "--out", "o", "--rewards", "clip", "a=1", "--bogus=2", "stray"],
                          "unrecognized arguments: --bogus=2 stray"),  # anything else is refused as before
                         (["sample", "runs/x", "--prompts", "p.txt", "--out", "o", "a=1"],  # no overrides there
                          "unrecognized arguments: a=1")]:
        with pytest.raises(SystemExit) as exit_info:
            cli.main(args)
        assert exit_info.value.code == 2 and needle in capsys.readouterr().err


def test_config_and_train_refuse_a_misspelt_option_naming_the_key(tmp_path, capsys):
    # options are mappings the config cannot type; their registered dataclasses check them as the command loads
    # the config, so train refuses before its run folder is written or a model loads
    from grpo_vision.cli import main

    for args, needle in [
        (["config", "configs/shapes.yaml", "reward.options.clip.chekpoint=x"],
         "grpo-vision: error: config: unknown key 'reward.options.clip.chekpoint' (did you mean "
         "'reward.options.clip.checkpoint'?); valid keys in reward.options.clip: model, checkpoint, trust_torchscript\n"),
        (["train", "configs/shapes_micro.yaml", f"run.out_dir={tmp_path}", "policy.options.world_split=all"],
         "grpo-vision: error: config: unknown key 'policy.options.world_split' (did you mean "
         "'policy.options.world_train_split'?); valid keys in policy.options: world_train_split\n"),
    ]:
        with pytest.raises(SystemExit) as exit_info:
            main(args)
        assert exit_info.value.code == 2 and capsys.readouterr().err == needle
    assert list(tmp_path.iterdir()) == []


def test_counts_and_seeds_of_the_run_commands_are_checked_by_the_parser(capsys):
    from grpo_vision.cli import main

    for args, needle in [  # before: rc 0 with negative sizes; ZeroDivisionError; an OverflowError from torch
        (["config", "configs/shapes_micro.yaml", "--num-processes", "-2"], "argument --num-processes: expected a "
                                                                          "whole number >= 1, got '-2'"),
        (["config", "configs/shapes_micro.yaml", "--num-processes", "0"], "--num-processes: expected a whole number"),
        (["sample", "r", "--prompts", "p", "--out", "o", "--seed", "99999999999999999999"],
         "argument --seed: expected a whole number from 0 to 4294967295, got '99999999999999999999'"),
        (["eval", "r", "--seed", "-1"], "argument --seed: expected a whole number from 0 to 4294967295, got '-1'"),
        (["eval", "r", "--device", "banana"], "argument --device: expected run (the run's own device where this "
                                              "machine has it), auto (the best device here), cpu, cuda, cuda:N or "
                                              "mps, got 'banana'"),
    ]:
        with pytest.raises(SystemExit) as exit_info:
            main(args)
        assert exit_info.value.code == 2 and needle in capsys.readouterr().err


def test_every_numeric_option_refuses_a_value_outside_its_range(tmp_path, capsys):
    """Each is a one-line error naming the option. Before, --top-k -5 and --cfg-scale nan ran (generate() failed,
    or every guided logit was NaN), --port 70000 was an OverflowError inside the server, and run.seed=-1 a ValueError
    from numpy mid-run."""
    from grpo_vision.cli import main

    seed_range = "expected a whole number from 0 to 4294967295"
    for args, needle in [
        (["bench", "sampler", "--top-k", "-5"], "argument --top-k: expected a whole number >= 0, got '-5'"),
        (["bench", "sampler", "--cfg-scale", "nan"],
         "argument --cfg-scale: expected a number >= 0 (1 turns guidance off), got 'nan'"),
        (["bench", "sampler", "--cfg-scale", "inf"], "argument --cfg-scale: expected a number >= 0"),
        (["bench", "sampler", "--cfg-scale", "-1"], "argument --cfg-scale: expected a number >= 0"),
        (["bench", "demo", "r", "--n", "0"], "argument --n: expected a whole number >= 1, got '0'"),
        (["demo", "r", "--port", "70000"], "argument --port: expected a whole number from 1 to 65535, got '70000'"),
        (["demo", "r", "--port", "-1"], "argument --port: expected a whole number from 1 to 65535, got '-1'"),
        (["sample", "r", "--prompts", "p", "--out", "o", "--step", "-1"],
         "argument --step: expected a whole number >= 1, got '-1'"),
        (["eval", "r", "--step", "0"], "argument --step: expected a whole number >= 1, got '0'"),
        (["world", "build", "--seed", "-3"], f"argument --seed: {seed_range}, got '-3'"),
        (["world", "render", "--prompts", "p", "--out", "o", "--seed", "nan"], f"argument --seed: {seed_range}"),
        (["world", "prompts", "--out", "o", "--seed", str(2**64)], f"argument --seed: {seed_range}"),
        (["world", "bench", "--seed", "-1"], f"argument --seed: {seed_range}, got '-1'"),
        # the config's numbers, checked as it loads, and the matrix's lists
        (["train", "configs/shapes.yaml", f"run.out_dir={tmp_path}", "run.seed=-1"],
         "grpo-vision: error: run.seed must be a whole number from 0 to 4294967295, got -1\n"),
        (["matrix", "configs/shapes_micro.yaml", "--out", str(tmp_path / "m"), "--rewards", "clip", "--seeds", "-1"],
         "grpo-vision: error: --seeds -1: seeds must be whole numbers from 0 to 4294967295\n"),
    ]:
        with pytest.raises(SystemExit) as exit_info:
            main(args)
        err = capsys.readouterr().err  # argparse's usage lines, then the error in one line
        assert exit_info.value.code == 2 and needle.strip() in err.splitlines()[-1], (args, err)
        assert "Traceback" not in err and (not needle.endswith("\n") or err == needle)
    assert list(tmp_path.iterdir()) == []


@pytest.mark.e2e
def test_a_warning_is_one_line_like_an_error():
    # not Python's format, "<file>:<line>: UserWarning: ..." with the library's source line under it
    out = run_cli("config", "configs/shapes_micro.yaml", "train.adapter=lora", "train.reference=frozen", MICRO_WORLD,
                  timeout=120)
    assert out.returncode == 0 and out.stderr == (
        "grpo-vision: warning: train.adapter with train.reference: frozen keeps a second full copy of the policy as "
        "the reference; train.reference: adapter is the same reference (the adapter disabled) without it\n")


@pytest.mark.e2e
def test_a_closed_stdout_ends_the_command_quietly():
    # `grpo-vision eval RUN | head -4` printed a BrokenPipeError traceback; now it exits 141 (128 + SIGPIPE),
    # as a command a closed pipe stopped does, and says nothing
    read, write = os.pipe()
    os.close(read)  # the reader has gone before the command writes
    out = subprocess.run(cli_cmd("config", "configs/shapes_micro.yaml", MICRO_WORLD), cwd=ROOT, stdout=write,
                         stderr=subprocess.PIPE, text=True, timeout=120)
    os.close(write)
    assert out.returncode == 141 and out.stderr == ""


def test_every_command_ends_the_process_group_it_ran_under(tmp_path, capsys):
    # Under `accelerate launch` a process that exits with its gloo group alive can abort in its teardown
    # (SIGABRT: pytorch/pytorch#190489) and fail a finished run; the CLI ends the group, on success or error.
    import torch.distributed as dist

    from grpo_vision.cli import main

    for n, (args, code) in enumerate([(["config", "configs/shapes_micro.yaml", "--num-processes", "1", MICRO_WORLD],
                                       None),
                                      (["train"], 2)]):  # a config error exits 2
        dist.init_process_group("gloo", init_method=f"file://{tmp_path / f'store{n}'}", rank=0, world_size=1)
        try:
            if code is None:
                main(args)
            else:
                with pytest.raises(SystemExit) as exit_info:
                    main(args)
                assert exit_info.value.code == code
            assert not dist.is_initialized(), args
        finally:
            if dist.is_initialized():
                dist.destroy_process_group()
    assert "grpo-vision train needs a config file" in capsys.readouterr().err


@pytest.mark.e2e
def test_a_non_finite_learning_rate_is_one_line_on_stderr():
    # Before: accepted, and every weight of the policy was NaN in the checkpoints
    out = run_cli("config", "configs/shapes_micro.yaml", "train.lr=inf")
    assert out.returncode == 2 and out.stdout == ""
    assert out.stderr == "grpo-vision: error: train.lr must be a finite number in (0, 1], got inf\n"


@pytest.mark.e2e
def test_help_imports_no_model_library_and_shows_defaults():
    # `grpo-vision --help` is fast because parsing imports neither torch nor the world's checker (scipy);
    # checked by what is imported, not by a clock
    heavy = ("torch", "scipy", "numpy", "grpo_vision.shapes.checker")
    code = (f"import json, sys; from grpo_vision.cli import build_parser; build_parser(); "
            f"print(json.dumps([m for m in {heavy!r} if m in sys.modules]))")
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert json.loads(out.stdout) == [], out.stderr
    prompts_help = run_cli("world", "prompts", "--help", timeout=120).stdout
    assert "(default: heldout)" in prompts_help and "{all,plain," in prompts_help and "{," not in prompts_help
    assert "(default: 0)" in prompts_help  # a zero default is shown; an empty one is not
    version = run_cli("--version", timeout=120)
    from grpo_vision import __version__
    assert version.stdout.strip() == f"grpo-vision {__version__}"
