"""`grpo-vision fit`: the released sizes' shapes counted on the meta device equal the loaded models' own, and
each budget gets the first candidate setting whose estimate fits."""

import functools
import json

import pytest

from grpo_vision.config import derived_sizes, load_config
from grpo_vision.models.adapters import add_adapter
from grpo_vision.policy import load_bundle
from grpo_vision.run.memory import GIB, WARN_FRACTION, config_parts, peak, policy_shape
from grpo_vision.sampling import SamplingParams
from grpo_vision.tools import fit as planner
from grpo_vision.tools.presets import preset_overrides
from tests.helpers import ROOT

# the shipped configs of each kind without a text plan: a row's overrides must make its setting on every one
SHIPPED = {"janus": ["configs/janus_pro_1b.yaml", "configs/janus_pro_7b_lora.yaml"],
           "llamagen": ["configs/llamagen_t2i.yaml"]}


@pytest.mark.parametrize("name,targets", [("janus-pro-1b-tiny", list(planner.JANUS_TARGETS)),
                                          ("llamagen-t2i-xl-tiny", list(planner.LLAMAGEN_TARGETS))])
@pytest.mark.parametrize("mode", ["full", "lora"])
def test_a_presets_shape_on_the_meta_device_is_the_loaded_models(name, targets, mode, tmp_path):
    bundle = load_bundle(load_config(None, preset_overrides(name, tmp_path, "bfloat16")).policy, "cpu")
    policy = bundle.policy
    if mode == "lora":
        policy = add_adapter(policy, "lora", 4, 8.0, targets)
    trainable = [p for p in policy.parameters() if p.requires_grad]
    loaded = policy_shape(policy, bundle.tokenizer, trainable)
    counted, adapted = planner.preset_shape(name, mode, rank=4, dtype_bytes=2)
    for field in ("params", "trainable", "trainable_bytes", "adapter_bytes", "adapter", "layers", "dim", "heads",
                  "kv_heads", "ffn_dim", "codebook", "image_tokens", "image_values", "judge_len", "vocab"):
        assert getattr(counted, field) == getattr(loaded, field), field
    # on a CPU Janus runs its frozen VQ model in float32 (models/janus.py); on a GPU, as planned, in bf16
    vq = sum(p.numel() for p in bundle.policy.model.model.vqmodel.parameters()) if "janus" in name else 0
    assert counted.weight_bytes + 2 * vq == loaded.weight_bytes
    merged = sum(m.base_layer.weight.numel() * 2 for m in policy.modules() if hasattr(m, "base_layer"))
    assert mode == "full" or adapted == merged


def test_each_budget_gets_the_first_setting_that_fits():
    report = planner.fit("janus-pro-7b", [24, 80])
    shapes = {r: planner.preset_shape("janus-pro-7b", "lora", r) for r in (64, 32, 16, 8)}
    full = planner.preset_shape("janus-pro-7b", "full")
    for row in report["rows"]:
        if not row["fits"]:  # 7B in full, float32: 99.7 GiB at G 4 (weights, gradients, AdamW's moments)
            assert row["mode"] == "full"
            assert all(planner.estimate(*full, s) > WARN_FRACTION * row["gpu_memory_gib"]
                       for s in planner.candidates("full"))
            continue
        chosen = planner.Setting(*(row[k] for k in ("mode", "group", "micro_batch", "checkpointing", "reference",
                                                    "merge", "rank")))
        for s in planner.candidates(row["mode"]):
            shape, adapted = full if s.mode == "full" else shapes[s.rank]
            fits = planner.estimate(shape, adapted, s) <= WARN_FRACTION * row["gpu_memory_gib"]
            if s == chosen:
                assert fits and row["estimate_gib"] == round(planner.estimate(shape, adapted, s), 1)
                break
            assert not fits, s  # every larger setting is over
    lora_24 = next(r for r in report["rows"] if r["mode"] == "lora" and r["gpu_memory_gib"] == 24)
    assert lora_24["group"] < 16 and not lora_24["merge"]  # 7B LoRA on 24 GB: a smaller group, no merged copy
    assert "train.adapter=lora" in lora_24["overrides"] and "sample.merge_adapter=off" in lora_24["overrides"]


def test_the_command_prints_a_table_per_model_and_names_an_unknown_size(capsys):
    from grpo_vision.cli import main

    main(["fit", "--preset", "janus-pro-1b", "--gpu-memory", "24,80"])
    out = capsys.readouterr().out
    assert "| 24 | lora | bfloat16 | 16 |" in out and "| 80 | full | float32 |" in out
    with pytest.raises(SystemExit) as stop:
        main(["fit", "--preset", "janus-pro-3b"])
    err = capsys.readouterr().err
    assert stop.value.code == 2 and err.strip().count("\n") == 0 and "unknown --preset 'janus-pro-3b'" in err


def test_plan_is_fits_old_name_for_one_release_and_says_so_in_one_line(capsys):
    """"plan" means the text plan (sample.plan) only: the memory planner is `fit`, and `plan` still runs it, with
    one warning line on stderr (config/load.py's warning_line) before the same table on stdout."""
    from grpo_vision.cli import main

    main(["fit", "--preset", "janus-pro-1b", "--gpu-memory", "24"])
    new = capsys.readouterr()
    main(["plan", "--preset", "janus-pro-1b", "--gpu-memory", "24"])
    old = capsys.readouterr()
    assert old.out == new.out and "| 24 | lora | bfloat16 |" in new.out and new.err == ""
    assert old.err == ("grpo-vision: warning: grpo-vision plan is now grpo-vision fit (the memory planner); the old "
                       "name goes in the next release\n")


def test_a_self_judge_batch_is_counted_and_said(capsys):
    """--judge-batch adds the understanding forward (run/memory.py's judging phase, its arithmetic tested there) of
    min(batch, G) images; the released sizes sample more than they judge, so the settings stay, and the table says
    what it counted."""
    from grpo_vision.cli import main
    from grpo_vision.run.memory import estimate_memory

    shape, adapted = planner.preset_shape("janus-pro-1b", "lora", 8)
    s = planner.Setting("lora", 16, 1, True, "adapter", False, 8)
    parts = estimate_memory(shape, 16, 16, 1, True, False, checkpointing=True, judge_rows=16)
    # 16 rows x 706 tokens (128 of text, 576 placeholders, 2 markers) of 24 blocks 2048 wide: under a GiB, below sampling
    assert 0.5 < parts["judging"] / 2**30 < parts["sampling"] / 2**30
    assert planner.estimate(shape, adapted, s, judge_batch=64) == planner.estimate(shape, adapted, s)
    main(["fit", "--preset", "janus-pro-1b", "--gpu-memory", "24", "--judge-batch", "16"])
    assert "a self_judge reward scoring 16 images a forward" in capsys.readouterr().out


@functools.lru_cache(maxsize=None)
def _shape(name, mode, rank, dtype_bytes, targets):
    return planner.preset_shape(name, mode, rank, dtype_bytes, targets)


@pytest.mark.parametrize("name,kind", [("janus-pro-1b", "janus"), ("janus-pro-7b", "janus"),
                                       ("llamagen-t2i-xl", "llamagen")])
def test_a_rows_overrides_on_a_shipped_config_are_estimated_as_the_row(name, kind):
    """A user applies a row's overrides to a shipped config; `train` then estimates that config (config_parts, at
    the config's policy.dtype, autocast, adapter and targets). The full rows assumed bf16 weights and did not set
    policy.dtype: configs/janus_pro_1b.yaml trains float32, estimated 29.3 GiB for the 24 GB row's 16.5."""
    report = planner.fit(name, [24, 48, 80])
    assert report["unit"] == "GiB"
    checked = 0
    for row in report["rows"]:
        if not row["fits"]:
            continue
        for config in SHIPPED[kind]:
            cfg = load_config(ROOT / config, row["overrides"])
            t = cfg.train
            mode = "full" if t.adapter == "none" else "lora"
            shape, adapted = _shape(name, mode, t.adapter_rank if mode == "lora" else 0,
                                    planner.DTYPE_BYTES[cfg.policy.dtype], tuple(t.adapter_targets))
            merged = adapted if mode == "lora" and cfg.sample.merge_adapter != "off" else 0
            parts = config_parts(shape, cfg, derived_sizes(cfg, 1)["images_per_process"],
                                 SamplingParams.from_config(cfg.sample).guided, merged)
            assert round(peak(parts) / GIB, 1) == row["estimate_gib"], (config, row)
            assert mode == row["mode"] and cfg.policy.dtype == row["dtype"]
            assert peak(parts) / GIB <= WARN_FRACTION * row["gpu_memory_gib"]
            assert (t.beta == 0) == (t.reference == "none")  # no reference: no KL, and the row says so
            checked += 1
    assert checked >= 3


def test_the_table_names_one_unit_the_dtype_and_a_row_without_kl(capsys):
    from grpo_vision.cli import main

    main(["fit", "--preset", "janus-pro-1b", "--gpu-memory", "24,48"])
    out = capsys.readouterr().out
    assert " GB" not in out and "(GiB)" in out  # budgets and estimates in GiB, as train reads a GPU's memory
    # float32 master weights: weights 7.0 GiB + gradients and AdamW 14.3 GiB are over 80% of 24 GiB at any batch
    assert "| 24 | full | float32 | does not fit |" in out
    row = next(line for line in out.splitlines() if line.startswith("| 48 | full |"))
    assert "| none: beta 0, no KL |" in row
    assert "train.reference=none train.beta=0.0" in out and "policy.dtype=float32" in out
    main(["fit", "--preset", "janus-pro-1b", "--gpu-memory", "23.99", "--json"])
    (report,) = json.loads(capsys.readouterr().out)
    assert report["unit"] == "GiB" and {r["gpu_memory_gib"] for r in report["rows"]} == {23.99}
    lora = next(r for r in report["rows"] if r["mode"] == "lora")
    assert "policy.dtype=bfloat16" in lora["overrides"] and lora["kl"] and lora["config"].endswith("lora.yaml")


@pytest.mark.parametrize("value", ["1e400", "inf", "nan", "-5", "0", str(10**30), "24,x", "5000"])
def test_an_absurd_budget_is_one_line(value, capsys):
    from grpo_vision.cli import main

    with pytest.raises(SystemExit) as stop:
        main(["fit", "--preset", "janus-pro-1b", "--gpu-memory", value])
    err = capsys.readouterr().err.strip().splitlines()[-1]
    assert stop.value.code == 2 and "--gpu-memory" in err and "GiB" in err and "from" in err
