"""`bench gpu`, the one command for a GPU: its recipe in docs/benchmarks.md runs (tiny presets, on a CPU,
without the packages the device image lacks), and it degrades instead of dying."""

import json
import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from grpo_vision.tools import bench_gpu as bench
from tests.helpers import ROOT

# what the device image lacks (docs/benchmarks.md): the benchmark must run without them
ABSENT = ("diffusers", "open_clip", "gradio")


def recipe_command() -> list[str]:
    """The `bench gpu` command of docs/benchmarks.md's device call, as argv after `python3 -m grpo_vision.cli`."""
    doc = (ROOT / "docs" / "benchmarks.md").read_text()
    block = doc.split("<!-- gpu-command", 1)[1].split("```bash", 1)[1].split("```", 1)[0]
    command = re.search(r"python3 -m grpo_vision\.cli (bench gpu [^>;&]*)", block)
    assert command, "docs/benchmarks.md's gpu-command block has no `python3 -m grpo_vision.cli bench gpu` command"
    return shlex.split(command.group(1))


def test_the_speculative_device_commands_parse():
    """docs/benchmarks.md's speculative device call: every grpo_vision.cli command in it is one the parser takes, and
    the step settings it picks by label exist (a misspelt label would be refused on the device, costing the call)."""
    from grpo_vision.cli import build_parser

    doc = (ROOT / "docs" / "benchmarks.md").read_text()
    block = doc.split("<!-- speculative-gpu-command", 1)[1].split("```bash", 1)[1].split("```", 1)[0]
    lexer = shlex.shlex(block.replace("$1", "32").replace("$2", "8,2"), posix=True, punctuation_chars=True)
    lexer.whitespace_split = True
    commands, current = [], None
    for token in lexer:  # the words after each `python3 -m grpo_vision.cli`, to the next ; > & or |
        if token == "grpo_vision.cli":
            current = []
            commands.append(current)
        elif current is not None and set(token) <= set(";>&|"):
            current = None
        elif current is not None:
            current.append(token)
    assert [c[:2] for c in commands] == [["bench", "sampler"], ["bench", "gpu"]]
    parsed = [build_parser().parse_args(argv) for argv in commands]  # an unknown flag exits 2
    labels = {label for name in parsed[1].presets.split(",") for label, *_ in bench.STEPS[name]}
    assert parsed[1].only and set(parsed[1].only.split(";")) <= labels
    assert len(block.strip()) <= 2000  # the device tool's limit on a command


@pytest.mark.e2e
def test_the_documented_gpu_command_runs_tiny_on_a_cpu_without_the_packages_the_device_lacks(tmp_path):
    argv = [a.replace("$OUT", str(tmp_path)) for a in recipe_command()]
    argv[argv.index("--preset-dir") + 1] = str(tmp_path / "presets")
    argv += ["--tiny", "--budget", "600", "--groups", "2", "--step-group", "2", "--json"]
    blocked = "; ".join(f"sys.modules[{m!r}] = None" for m in ABSENT)  # `import diffusers` then fails
    code = f"import sys; {blocked}; sys.argv = ['grpo-vision', *{argv!r}]; from grpo_vision.cli import main; main()"
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=900)
    assert out.returncode == 0, out.stderr[-3000:]
    report = json.loads(out.stdout)
    assert report == json.loads((tmp_path / "bench" / "bench_gpu.json").read_text())
    assert report["not_run"] == [] and report["machine"]["torch"] == torch.__version__
    done = {(e["preset"], e["what"]): e for e in report["results"]}
    failed = {k: e.get("error") or e.get("does_not_fit") for k, e in done.items() if "result" not in e}
    assert failed == {}, failed
    for name in bench.ORDER:
        group = done[(name + "-tiny", "sampler")]["result"]["groups"]["2"]  # bench sampler's own JSON
        assert {"eager", "static", "speculative", "speculative_jacobi"} <= group["paths"].keys()
        assert set(group["baselines"]) == {"teacher_forced"} | ({"generate"} if name.startswith("janus") else set())
        assert all(r["images_per_s"] > 0 for r in [*group["paths"].values(), *group["baselines"].values()])
        N, spec = done[(name + "-tiny", "sampler")]["result"]["image_tokens"], group["paths"]["speculative"]
        assert group["window"] == 32 and 1 <= spec["tokens_per_forward"] <= 32  # at least the plain path's one a pass
        assert spec["forwards_per_image"] <= spec["forwards_per_batch"] <= N
        steps = [e["result"] for (n, what), e in done.items() if n == name + "-tiny" and what.startswith("step")]
        assert len(steps) == len(bench.STEPS.get(name, []))
        for r in steps:
            assert r["images_per_step"] == 2 and r["steps_timed"] == 1 and r["memory_estimate_gib"] > 0
            assert set(r["phases_s"]) == {"sample", "decode", "reward", "logprobs", "update"}
    table = (tmp_path / "bench" / "bench_gpu.md").read_text()
    assert "| janus-pro-1b-tiny | 2 | static |" in table
    assert "| janus-pro-1b-tiny | 2 | speculative, W = 32, tree 8,2 (" in table
    assert "| llamagen-t2i-xl-tiny | full, frozen reference |" in table


def test_the_budget_and_failures_are_reported_not_fatal(tmp_path, monkeypatch):
    report = bench.bench_gpu(tmp_path / "none", budget_s=0, tiny=True)  # nothing fits in no time: all listed
    assert report["results"] == [] and len(report["not_run"]) == 4 + sum(len(v) for v in bench.STEPS.values())
    assert "janus-pro-1b-tiny sampler: the budget ran out" in report["not_run"]
    steps = bench.bench_gpu(tmp_path / "steps", budget_s=0, tiny=True, sampler=False)  # --steps-only
    assert len(steps["not_run"]) == sum(len(v) for v in bench.STEPS.values())
    assert not any("sampler" in line for line in steps["not_run"])

    def out_of_memory(*args, **kwargs):
        raise torch.cuda.OutOfMemoryError("CUDA out of memory. Tried to allocate 80.00 GiB")

    def missing(*args, **kwargs):
        raise ImportError("No module named 'flash_attn'")

    monkeypatch.setattr(bench, "bench_preset_sampler", out_of_memory)
    monkeypatch.setattr(bench, "bench_preset_steps", lambda *a, **k: iter([("LoRA", missing)]))
    report = bench.bench_gpu(tmp_path / "some", budget_s=600, tiny=True, presets=["janus-pro-1b"])
    step, sampler = report["results"]  # a preset's steps come before its sampler
    assert (step["what"], sampler["what"]) == ("step: LoRA", "sampler")
    assert sampler["does_not_fit"].startswith("out of memory: CUDA out of memory")
    assert step["missing_package"] == "No module named 'flash_attn'"
    table = (tmp_path / "some" / "bench_gpu.md").read_text()
    assert "janus-pro-1b-tiny sampler: out of memory" in table and "No module named 'flash_attn'" in table


def test_an_unknown_only_label_is_one_line_naming_the_labels(tmp_path):
    from grpo_vision.config import ConfigError

    with pytest.raises(ConfigError, match=r"^--only names 'LoRA, merged', which none of these presets has: choose "
                                          r"among LoRA, reference = adapter off; .*; sampler$"):
        bench.bench_gpu(tmp_path, budget_s=0, tiny=True, presets=["janus-pro-1b"], only=["sampler", "LoRA, merged"])


def test_an_item_runs_in_a_process_of_its_own_and_a_crash_is_its_line(tmp_path):
    report = bench.bench_gpu(tmp_path / "iso", budget_s=600, tiny=True, presets=["llamagen-c2i-xl"], groups=(2,),
                             isolate=True, only=["sampler"], generate=False)
    assert report["isolated"] and [e["what"] for e in report["results"]] == ["sampler"]
    group = report["results"][0]["result"]["groups"]["2"]
    assert {"eager", "static"} <= group["paths"].keys() and "teacher_forced" in group["baselines"]
    if not torch.cuda.is_available():  # the compiled step is timed on a GPU by default, said so on a CPU
        assert "compiled" in group["not_run"] and "compiled" not in group["paths"]
    crashed = bench.run_isolated({"preset": "llamagen-c2i-xl-tiny", "what": "step: no such setting",
                                  "preset_dir": str(tmp_path / "x"), "groups": [2], "step_group": 2,
                                  "dtype": "float32"}, timeout_s=120)
    assert crashed["error"].startswith("the item's process exited 1 without a result") and "KeyError" in \
        crashed["traceback"]


def test_an_only_that_selects_nothing_under_steps_only_is_one_line(tmp_path, capsys):
    """--steps-only --only sampler ran nothing and wrote empty tables with rc 0."""
    from grpo_vision.cli import main

    with pytest.raises(SystemExit) as stop:
        main(["bench", "gpu", "--tiny", "--budget", "1", "--presets", "janus-pro-1b", "--steps-only", "--only",
              "sampler", "--out", str(tmp_path / "out")])
    err = capsys.readouterr().err.strip()
    assert stop.value.code == 2 and "\n" not in err
    assert err == ("grpo-vision: error: --only 'sampler' selects nothing under --steps-only (no sampler items): "
                   "choose among " + "; ".join(sorted(label for label, *_ in bench.STEPS["janus-pro-1b"]))
                   + ", or drop --steps-only")
    assert not (tmp_path / "out").exists()  # nothing written either
    with pytest.raises(SystemExit):  # a preset without step settings: --steps-only alone runs nothing
        main(["bench", "gpu", "--tiny", "--presets", "llamagen-c2i-xl", "--steps-only", "--out", str(tmp_path / "o")])
    assert capsys.readouterr().err.strip() == ("grpo-vision: error: --steps-only leaves nothing to run: "
                                               "llamagen-c2i-xl-tiny has no step settings; drop --steps-only")


@pytest.mark.parametrize("where", ["file", "under a file", "read-only"])
def test_an_out_that_cannot_be_written_is_one_line_before_any_item(where, tmp_path, capsys, monkeypatch):
    """--out a file, a path under a file or a read-only folder were tracebacks (FileExistsError,
    NotADirectoryError; PermissionError once the first item had run)."""
    import os

    from grpo_vision.cli import main

    (tmp_path / "f").write_text("kept")
    out = {"file": tmp_path / "f", "under a file": tmp_path / "f" / "bench", "read-only": tmp_path / "ro"}[where]
    if where == "read-only":  # root passes permission checks: the folder's refusal is simulated where it is asked
        out.mkdir()
        real = os.access
        monkeypatch.setattr(os, "access", lambda p, mode, **kw: Path(p) != out and real(p, mode, **kw))
    for name in ("run_item", "run_isolated"):
        monkeypatch.setattr(bench, name, lambda *a, **k: pytest.fail("an item ran"))
    with pytest.raises(SystemExit) as stop:
        main(["bench", "gpu", "--tiny", "--presets", "llamagen-c2i-xl", "--only", "sampler", "--out", str(out)])
    err = capsys.readouterr().err.strip()
    assert stop.value.code == 2 and "\n" not in err and "Traceback" not in err
    expected = {"file": f"--out {out}: {out} is a file, not a folder; choose another --out",
                "under a file": f"--out {out}: {tmp_path / 'f'} is a file, not a folder; choose another --out",
                "read-only": f"cannot write in {out} (no permission to write): make it writable, or choose "
                             "another --out"}[where]
    assert err == f"grpo-vision: error: {expected}"
    assert (tmp_path / "f").read_text() == "kept"
