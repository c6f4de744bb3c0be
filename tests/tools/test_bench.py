"""`bench sampler` (tools/bench.py): one bench of every decode path, what it leaves out and why, and its refusals
in one line. On a tiny policy, one timed repeat: what is checked is the JSON, never a speed."""

import json

import pytest
import torch

from grpo_vision.models.llama import LlamaImagePolicy, LlamaPolicyConfig
from grpo_vision.tools.bench import BENCH_WORDS, COMPILED_ON_CPU, bench_sampler

on_a_cpu = pytest.mark.skipif(torch.cuda.is_available(), reason="a machine with a GPU runs graph and compiled")


def tiny() -> LlamaImagePolicy:
    """3x3 image tokens, one layer: the paths in milliseconds."""
    torch.manual_seed(0)
    return LlamaImagePolicy(LlamaPolicyConfig(words=BENCH_WORDS, codebook_size=32, image_grid=(3, 3), dim=32,
                                              n_layers=1, n_heads=2, n_kv_heads=1, ffn_dim=64))


@pytest.fixture
def saved(tmp_path) -> str:
    tiny().save_pretrained(tmp_path / "p")
    return str(tmp_path / "p")


@on_a_cpu
def test_without_decode_every_path_that_runs_here_and_why_the_others_do_not(saved, capsys):
    from grpo_vision.cli import main

    main(["bench", "sampler", "--json", "--policy", saved, "--group-size", "1", "--repeats", "1", "--no-generate",
          "--speculative-window", "3", "--speculative-tree", "2,1"])
    result = json.loads(capsys.readouterr().out)
    assert list(result["paths"]) == ["eager", "static", "speculative", "speculative_jacobi"]
    assert result["not_run"] == {"graph": "needs a CUDA device (the rows are on cpu)", "compiled": COMPILED_ON_CPU}
    assert result["device"] == "cpu" and result["targets_met"] is None  # no generate(): no target to check


@on_a_cpu
def test_a_path_named_that_cannot_run_here_is_one_line_naming_the_fix(saved, capsys):
    from grpo_vision.cli import main

    with pytest.raises(SystemExit) as stop:
        main(["bench", "sampler", "--json", "--policy", saved, "--decode", "eager,graph", "--repeats", "1"])
    assert stop.value.code == 2 and capsys.readouterr().err.splitlines() == [
        "grpo-vision: error: bench sampler --decode graph: needs a CUDA device (the rows are on cpu); leave graph "
        "out of --decode (without it the bench times every path that runs here)"]


def test_an_unknown_decode_name_is_one_line_listing_the_names(capsys):
    from grpo_vision.cli import main
    from grpo_vision.cli.args import DECODE_PATHS
    from grpo_vision.sampling.decode import DECODERS

    assert DECODE_PATHS == list(DECODERS)  # the parser's names (read without torch) are the table's
    with pytest.raises(SystemExit) as stop:
        main(["bench", "sampler", "--decode", "eager,fast"])
    err = capsys.readouterr().err.strip().splitlines()[-1]
    assert stop.value.code == 2 and err.endswith(
        "argument --decode: expected comma-separated decode paths from eager, static, graph, compiled, speculative, "
        "got 'eager,fast'")


def test_batch_splits_the_rows_into_calls_and_the_passes_follow():
    """8 rows, 3 a call: 3 calls, each with its own slowest row; the tokens do not depend on the chunking."""
    result = bench_sampler(tiny(), ["eager", "speculative"], group=2, batch=3, repeats=1, top_k=0, window=5,
                           tree=(2, 1), generate=False)
    assert (result["images"], result["batch"]) == (8, 3)
    eager, spec = result["paths"]["eager"], result["paths"]["speculative"]
    assert (eager["forwards_per_image"], eager["forwards_per_batch"]) == (9, 9)
    assert eager["ms_per_forward"] == pytest.approx(1000 * eager["seconds"] / (9 * 3), rel=0.01)  # 3 calls of 9 passes
    assert spec["forwards_per_image"] <= spec["forwards_per_batch"] <= 9
    assert spec["ms_per_forward"] == pytest.approx(1000 * spec["seconds"] / (spec["forwards_per_batch"] * 3), rel=0.01)


def test_a_baseline_or_path_that_fails_is_a_line_of_the_result():
    def broken(policy, cond, params, batch):
        def run():
            raise RuntimeError("generate() changed its arguments")
        return run

    result = bench_sampler(tiny(), ["static"], group=1, repeats=1, generate=broken)
    assert result["not_run"] == {"generate": "failed: RuntimeError: generate() changed its arguments"}
    assert list(result["paths"]) == ["static"] and list(result["baselines"]) == ["teacher_forced"]
    assert result["paths"]["static"]["speedup_vs_generate"] is None and result["targets_met"] is None
