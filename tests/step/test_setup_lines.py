"""The lines `train` prints at its start where a setting costs time a user would not guess (a compiled decode step's
first rollout, speculative decoding on a CPU) or is resolved at load time (sample.merge_adapter=auto), and the same
decode lines from the commands that sample a run (eval_params)."""

import pytest

from tests.helpers import micro_cfg


def start_lines(capsys, micro_world, tmp_path, *overrides) -> list[str]:
    from grpo_vision.step.setup import set_up

    capsys.readouterr()
    set_up(micro_cfg(micro_world, tmp_path, *overrides), None)
    return capsys.readouterr().out.splitlines()


@pytest.mark.parametrize("decode,line", [
    ("compiled", "[train] sample.decode=compiled: compiling the decode step at the first rollout, once per process and "
                 "shape (about 30 s on a CPU); on a CPU the compiled step has measured slower than eager decoding at "
                 "the built-in policy's size (docs/benchmarks.md)"),
    ("speculative", "[train] sample.decode=speculative on a CPU: exact, but slower than plain decoding here (a pass "
                    "over W tokens costs about W single-token steps; a main-job step took 14 s against 9.3); its "
                    "fewer passes are meant for a GPU (docs/experiments/speculative_rollouts.md)"),
    ("static", None)])
def test_a_decode_path_slower_than_it_sounds_is_said_at_the_start(decode, line, micro_world, tmp_path, capsys):
    lines = start_lines(capsys, micro_world, tmp_path, f"sample.decode={decode}")
    said = [ln for ln in lines if ln.startswith("[train] sample.decode=")]
    assert said == ([line] if line else [])


def test_the_decode_notes_by_device():
    from grpo_vision.sampling import decode_note

    assert decode_note("compiled", "cuda").endswith("once per process and shape (inside the CUDA graph)")
    assert decode_note("speculative", "cuda") is None  # the passes it saves are the figure there
    assert all(decode_note(mode, "cpu") is None for mode in ("auto", "eager", "static"))


@pytest.mark.parametrize("adapter,line", [
    ("lora", "[train] sample.merge_adapter=auto: merged (lora on cpu)"),
    ("loha", "[train] sample.merge_adapter=auto: not merged (the adapter is loha (LyCORIS), which auto leaves "
             "unmerged)")])
def test_merge_adapter_auto_says_whether_it_merged(adapter, line, micro_world, tmp_path, capsys):
    lines = start_lines(capsys, micro_world, tmp_path, f"train.adapter={adapter}", "train.reference=adapter",
                        "train.adapter_rank=2")
    assert [ln for ln in lines if "] sample.merge_adapter" in ln] == [line]


def test_merge_adapter_off_or_no_adapter_says_nothing(micro_world, tmp_path, capsys):
    lines = start_lines(capsys, micro_world, tmp_path / "off", "train.adapter=lora", "train.reference=adapter",
                        "sample.merge_adapter=off")
    lines += start_lines(capsys, micro_world, tmp_path / "none")
    assert not [ln for ln in lines if "] sample.merge_adapter" in ln]


def test_a_command_that_samples_a_run_says_the_decode_note_on_stderr(micro_world, tmp_path, capsys):
    from grpo_vision.evaluation.evaluate import eval_params
    from grpo_vision.sampling import decode_note

    capsys.readouterr()
    params = eval_params(micro_cfg(micro_world, tmp_path, "sample.decode=speculative"))
    out = capsys.readouterr()
    assert params.decode == "speculative" and out.out == ""
    assert out.err == f"[sampling] {decode_note('speculative', 'cpu')}\n"
