"""Config loading is strict: every error names the key and what was expected."""

from pathlib import Path

import dataclasses
import typing

import pytest

from grpo_vision.config import Config, ConfigError, derived_sizes, load_config, save_config
from grpo_vision.policy import kind_options
from grpo_vision.rewards import check_options

CONFIGS = sorted(Path(__file__).resolve().parents[2].glob("configs/*.yaml"))


@pytest.mark.parametrize("path", CONFIGS, ids=lambda p: p.name)
def test_every_shipped_config_loads(path):
    cfg = load_config(path)
    assert isinstance(cfg, Config)
    derived_sizes(cfg)  # divisibility holds for one process
    check_options(cfg)  # its reward and policy options are keys of their registered dataclasses


def test_configs_folder_is_not_empty():
    assert len(CONFIGS) >= 2


def test_defaults_run_and_overrides_apply():
    cfg = load_config(None, ["train.lr=1e-5", "sample.group_size=16", "reward.weights={clip: 2}",
                             "train.adapter_targets=[q_proj]", "sample.logprob_mode=conditional"])
    assert cfg.train.lr == 1e-5 and isinstance(cfg.train.lr, float)  # YAML 1.1 reads 1e-5 as a string
    assert cfg.sample.group_size == 16
    assert cfg.reward.weights == {"clip": 2.0}
    assert cfg.train.adapter_targets == ["q_proj"]
    assert cfg.sample.logprob_mode == "conditional"


def test_a_bare_no_is_the_choice_not_false(tmp_path):
    # YAML 1.1 reads `no` as false; "no" is accelerate's spelling of "no mixed precision"
    assert load_config(None, ["train.mixed_precision=no"]).train.mixed_precision == "no"
    path = tmp_path / "c.yaml"
    path.write_text("train:\n  mixed_precision: no\n")
    assert load_config(path).train.mixed_precision == "no"
    with pytest.raises(ConfigError, match="'train.mixed_precision' expects one of 'no', 'bf16', 'fp16', got True"):
        load_config(None, ["train.mixed_precision=yes"])
    with pytest.raises(ConfigError, match="'train.loss_type' expects one of"):
        load_config(None, ["train.loss_type=no"])


def test_one_mapping_entry_can_be_overridden():
    cfg = load_config(None, ["reward.weights={clip: 4, aesthetic: 1}", "reward.weights.aesthetic=0.25",
                             "reward.weights.jpeg_compressibility=1"])
    assert cfg.reward.weights == {"clip": 4.0, "aesthetic": 0.25, "jpeg_compressibility": 1.0}
    with pytest.raises(ConfigError, match="'reward.weights.clip' expects a number, got 'lots'"):
        load_config(None, ["reward.weights.clip=lots"])


# ---------------------------------------------------------------- emptying a value: null is "not set"


@pytest.mark.parametrize("null", ["", "null", "~"])
def test_a_null_override_gives_a_field_its_default_and_removes_a_mapping_entry(null):
    given = ["run.name=mine", "train.mixed_precision=bf16", "train.adapter_targets=[q_proj]",
             "policy.options={gpt: GPT-XL, image_size: 256}", "reward.weights.jpeg_compressibility=2",
             "reward.options.clip.checkpoint=/m/c.bin", "reward.options.clip.model=ViT-B-32"]
    cleared = ["run.name", "train.mixed_precision", "train.adapter_targets", "policy.options.gpt",
               "reward.weights.jpeg_compressibility", "reward.options.clip.checkpoint",
               "policy.options.absent", "reward.options.absent.key"]  # entries not there: nothing to remove
    cfg = load_config(None, given + [f"{key}={null}" for key in cleared])
    assert (cfg.run.name, cfg.train.mixed_precision) == ("grpo", "no")  # the defaults, not "" or "null"
    assert cfg.train.adapter_targets == ["q_proj", "k_proj", "v_proj", "o_proj"]
    assert cfg.policy.options == {"image_size": 256}  # the kind's loader then uses its own default for gpt
    assert cfg.reward.weights == {"clip": 1.0, "aesthetic": 1.0}
    assert cfg.reward.options == {"clip": {"model": "ViT-B-32"}}


def test_a_quoted_empty_string_is_a_value_in_a_field_and_in_a_mapping_alike():
    # what reaches the program: the shell turns key="" into key=, so this is written 'key=""' there
    cfg = load_config(None, ['policy.tokenizer=""', "policy.options.gpt=''", 'log.project="null"', "run.name=1e-5"])
    assert cfg.policy.tokenizer == "" and cfg.policy.options == {"gpt": ""}  # was the two characters "" in a field
    assert cfg.log.project == "null" and cfg.run.name == "1e-5"  # quoted "null" is text; unquoted text is as written
    with pytest.raises(ConfigError) as err:
        load_config(None, ['sample.top_k=""'])
    assert str(err.value) == "command line: 'sample.top_k' expects an integer, got '' (str)"


def test_a_null_in_a_file_is_the_same_as_leaving_the_key_out(tmp_path):
    path = tmp_path / "c.yaml"
    path.write_text("run:\n  name:\ntrain:\n  lr: null\npolicy:\n  options: {gpt: , image_size: 256}\n"
                    "reward:\n  weights: {clip: 2, aesthetic: ~}\n")
    cfg = load_config(path)
    assert (cfg.run.name, cfg.train.lr) == (Config().run.name, Config().train.lr)  # was "expects a string, got None"
    assert cfg.policy.options == {"image_size": 256} and cfg.reward.weights == {"clip": 2.0}


@pytest.mark.parametrize("empty", ["policy.options.gpt=", "policy.options.gpt=null", "policy.options.gpt=''"])
def test_every_way_of_emptying_a_kind_option_reaches_its_default(empty):
    # `policy.options.gpt=` stored None, which LlamaGenOptions refused ("expects a string"); only '' worked
    cfg = load_config(Path(__file__).resolve().parents[2] / "configs" / "llamagen_t2i.yaml",
                      ["policy.options.gpt=GPT-B", empty])
    options = kind_options(cfg.policy)  # the LlamaGenOptions the llamagen kind registered
    assert options.gpt == "" and options.image_size == 256  # "": the size is read from the weights


# ---------------------------------------------------------------- options checked at load


def test_a_misspelt_reward_option_is_refused_at_load_naming_the_key_and_the_right_one():
    cfg = load_config(None, ["reward.options.clip.chekpoint=/m/clip.bin"])  # a mapping of Any: its reader checks it
    with pytest.raises(ConfigError) as err:
        check_options(cfg)
    assert str(err.value) == ("config: unknown key 'reward.options.clip.chekpoint' (did you mean "
                              "'reward.options.clip.checkpoint'?); valid keys in reward.options.clip: model, "
                              "checkpoint, trust_torchscript")
    with pytest.raises(ConfigError, match=r"^reward.options names 'cilp', which is not a reward \(did you mean "
                                          r"'reward.options.clip'\?\); registered rewards: aesthetic, clip, "):
        check_options(load_config(None, ["reward.options.cilp.checkpoint=/m/clip.bin"]))
    with pytest.raises(ConfigError, match="^config: 'reward.options.hpsv2.trust_torchscript' expects a boolean"):
        check_options(load_config(None, ["reward.options.hpsv2.trust_torchscript=maybe"]))
    with pytest.raises(ConfigError, match=r"^reward.options.placebo: reward 'placebo' takes no options, got 'scale'"):
        check_options(load_config(None, ["reward.options.placebo.scale=2"]))


def test_a_misspelt_policy_option_is_refused_at_load_naming_the_key_and_the_right_one():
    with pytest.raises(ConfigError) as err:
        check_options(load_config(None, ["policy.kind=llamagen", "policy.options.imagesize=256"]))
    assert str(err.value) == ("config: unknown key 'policy.options.imagesize' (did you mean "
                              "'policy.options.image_size'?); valid keys in policy.options: gpt, heads, image_size, "
                              "text_encoder, cls_token_num")
    with pytest.raises(ConfigError) as err:  # llama and janus take none
        check_options(load_config(None, ["policy.kind=janus", "policy.options.image_size=256"]))
    assert str(err.value) == "policy.options (image_size) is not used with policy.kind 'janus'; remove it"
    with pytest.raises(ConfigError) as err:  # options, and no kind to read them
        check_options(load_config(None, ["policy.options.image_size=256"]))
    assert str(err.value) == "policy.kind is required: set it to one of janus, llama, llamagen, shapes"
    check_options(load_config(None, []))  # no policy at all: `score` reads rewards only


def test_world_train_split_is_an_option_of_the_shapes_kind():
    shapes = ["policy.kind=shapes", "policy.path=worlds/shapes"]
    assert kind_options(load_config(None, shapes).policy).world_train_split == "train"  # the default
    cfg = load_config(None, [*shapes, "policy.options.world_train_split=all"])
    check_options(cfg)
    assert kind_options(cfg.policy).world_train_split == "all"
    with pytest.raises(ConfigError) as err:
        check_options(load_config(None, [*shapes, "policy.options.world_train_splt=all"]))
    assert str(err.value) == ("config: unknown key 'policy.options.world_train_splt' (did you mean "
                              "'policy.options.world_train_split'?); valid keys in policy.options: world_train_split")
    with pytest.raises(ConfigError) as err:
        check_options(load_config(None, [*shapes, "policy.options.world_train_split=seen"]))
    assert str(err.value) == ("config: 'policy.options.world_train_split' expects one of 'train', 'all', 'heldout', "
                              "got 'seen' (str)")


def test_yaml_values_override_defaults(tmp_path):
    path = tmp_path / "c.yaml"
    path.write_text("train:\n  lr: 3.0e-6\n  steps: 7\nsample:\n  top_k: 50\n")
    cfg = load_config(path)
    assert (cfg.train.lr, cfg.train.steps, cfg.sample.top_k) == (3e-6, 7, 50)
    assert cfg.train.beta == Config().train.beta  # untouched keys keep their defaults


def test_save_and_reload_round_trip(tmp_path):
    cfg = load_config(None, ["train.beta=0.04", "run.name=x"])
    save_config(cfg, tmp_path / "resolved.yaml")
    assert load_config(tmp_path / "resolved.yaml") == cfg


def test_a_folder_that_turns_read_only_is_named_when_the_config_is_saved(tmp_path, monkeypatch):
    from grpo_vision.files import FolderError
    from tests.helpers import refuse_writes

    run = tmp_path / "run"
    run.mkdir()
    refuse_writes(monkeypatch)
    with pytest.raises(FolderError, match=f"^cannot write in {run} \\(Read-only file system\\): make it writable"):
        save_config(Config(), run / "config.yaml")


@pytest.mark.parametrize("text, needle", [
    ("train:\n  lrr: 1.0\n", "unknown key 'train.lrr' (did you mean 'train.lr'?)"),
    ("trian:\n  lr: 1.0\n", "unknown key 'trian' (did you mean 'train'?)"),
    ("train:\n  lr: fast\n", "'train.lr' expects a number, got 'fast'"),
    ("train:\n  steps: 1.5\n", "'train.steps' expects an integer"),
    ("train:\n  loss_type: ppo\n", "'train.loss_type' expects one of 'grpo', 'bnpo', 'dr_grpo'"),
    ("log:\n  report: 1\n", "'log.report' expects a boolean"),
    ("reward:\n  weights: [clip]\n", "'reward.weights' expects a mapping"),
    ("train: 3\n", "'train' must be a mapping"),
    ("- a\n- b\n", "top level must be a mapping"),
    ("train:\n  lr: [1\n", "is not valid YAML"),
    ("train:\n  lr: 1.0\ntrain:\n  steps: 3\n", "key 'train' appears twice in one mapping"),
    ("train:\n  lr: 1.0\n  lr: 2.0\n", "key 'lr' appears twice in one mapping"),
    ("log:\n  eval_images: 0\n", "log.eval_images must be >= 1"),
    ("reward:\n  batch_size: 0\n", "reward.batch_size must be >= 1"),
    ("reward:\n  weights: {clip: .nan}\n", "reward.weights must be finite numbers"),
    ("run:\n  name: a/b\n", "run.name must be a plain folder name"),
    # a newline in run.name printed a line of its own, e.g. a forged "[train] done: ..."
    ('run:\n  name: "x\\n[train] done: report.md (0 of 2 updates skipped)"\n',
     "run.name must be a plain folder name (no '/' or '\\', no newline or other control character), got 'x\\n[train]"),
    ('run:\n  name: "a\\tb"\n', "run.name must be a plain folder name"),
    ('run:\n  name: "a\\\\b"\n', "run.name must be a plain folder name"),
    ("run:\n  seed: -1\n", "run.seed must be a whole number from 0 to 4294967295, got -1"),
    ("run:\n  seed: 4294967296\n", "run.seed must be a whole number from 0 to 4294967295, got 4294967296"),
    ("log:\n  checkpoint_every: -1\n", "log.checkpoint_every must be >= 0"),
    ("log:\n  eval_temperatures: [0.7, 0]\n", "log.eval_temperatures[1] must be a finite number > 0, got 0.0"),
    ("train:\n  lr: .inf\n", "train.lr must be a finite number in (0, 1], got inf"),
    ("log:\n  eval_temperatures: [cold]\n", "'log.eval_temperatures[0]' expects a number"),
])
def test_bad_files_name_the_key(tmp_path, text, needle):
    path = tmp_path / "bad.yaml"
    path.write_text(text)
    with pytest.raises(ConfigError) as err:
        load_config(path)
    assert needle in str(err.value)


@pytest.mark.parametrize("override, needle", [
    ("train.lrr=1", "unknown key 'train.lrr'"),
    ("nope.lr=1", "unknown key 'nope'"),
    ("sample.group_size=abc", "'sample.group_size' expects an integer, got 'abc'"),
    ("sample.group_size=1", "sample.group_size must be >= 2"),
    ("train.beta=0.1", None),  # valid
    ("train.lr", "must look like section.key=value"),
    ("train=3", "'train' is a section, not a value; write train.KEY=VALUE"),
    ("trian=3", "unknown key 'trian'"),
    ("train.lr.x=3", "'train.lr' is a value, not a section"),
    ("reward.weights.=1", "names no entry of 'reward.weights'"),
])
def test_bad_overrides_name_the_key(override, needle):
    if needle is None:
        load_config(None, [override])
        return
    with pytest.raises(ConfigError) as err:
        load_config(None, [override])
    assert needle in str(err.value)


def test_an_empty_section_keeps_its_defaults_and_a_non_utf8_file_is_named(tmp_path):
    path = tmp_path / "empty.yaml"
    path.write_text("train:\nsample:\n  group_size: 4\n")
    assert load_config(path).train == Config().train
    path.write_bytes(b"train:\n  lr: 1e-5 # \xe9\n")
    with pytest.raises(ConfigError, match="empty.yaml is not UTF-8 text"):
        load_config(path)


def test_missing_file_is_named(tmp_path):
    with pytest.raises(ConfigError, match="config file not found: .*missing.yaml"):
        load_config(tmp_path / "missing.yaml")


def test_beta_needs_a_reference():
    with pytest.raises(ConfigError, match="needs a reference policy"):
        load_config(None, ["train.beta=0.1", "train.reference=none"])


def test_float16_weights_train_only_under_an_adapter():
    """AdamW on float16 weights turns them NaN at the first small gradient (eps 1e-8 is 0 in float16):
    refused before a run starts, naming what works; frozen float16 weights under an adapter train."""
    with pytest.raises(ConfigError, match=r"^policy.dtype float16 cannot be fine-tuned in full .*use bfloat16, or "
                                          r"float32 with train.mixed_precision fp16, or .*\(train.adapter lora\)$"):
        load_config(None, ["policy.dtype=float16"])
    assert load_config(None, ["policy.dtype=float16", "train.adapter=lora"]).policy.dtype == "float16"
    assert load_config(None, ["policy.dtype=bfloat16"]).policy.dtype == "bfloat16"


def test_derived_sizes_arithmetic():
    cfg = load_config(None, ["sample.prompts_per_step=8", "sample.group_size=8", "train.micro_batch_size=8",
                             "train.minibatches_per_pass=2", "train.num_iterations=3", "train.steps=10"])
    sizes = derived_sizes(cfg, num_processes=2)
    # 8 prompts x 8 images = 64 per step; 32 per process; 2 minibatches of 16 = 2 micro-batches of 8 each.
    assert sizes["images_per_step"] == 64
    assert sizes["images_per_process"] == 32
    assert sizes["micro_batches_per_update"] == 2
    assert sizes["updates_per_step"] == 6
    assert sizes["total_updates"] == 60


def test_a_speculative_window_too_small_for_its_draft_tree_is_one_line_naming_the_keys():
    # the default tree (8 drafts at each of 2 positions) needs 17 nodes; a plain decode does not read the window
    assert load_config(None, ["sample.speculative_window=8"]).sample.speculative_window == 8
    with pytest.raises(ConfigError) as refused:
        load_config(None, ["sample.decode=speculative", "sample.speculative_window=8"])
    assert str(refused.value).splitlines() == [
        "sample.speculative_candidates=8 and sample.speculative_branching=2: a window of 8 cannot hold 8 drafts at "
        "each of 2 positions (17 nodes at least): widen sample.speculative_window to 17 or more, or draft fewer "
        "(sample.speculative_candidates=1 is a chain)"]
    chain = load_config(None, ["sample.decode=speculative", "sample.speculative_window=8",
                               "sample.speculative_candidates=1"])
    assert (chain.sample.speculative_window, chain.sample.speculative_candidates) == (8, 1)


def test_derived_sizes_refuse_split_groups_and_ragged_micro_batches():
    cfg = load_config(None, ["sample.prompts_per_step=3"])
    with pytest.raises(ConfigError, match="divisible by the number of processes"):
        derived_sizes(cfg, num_processes=2)
    cfg = load_config(None, ["sample.prompts_per_step=2", "sample.group_size=6", "train.micro_batch_size=8"])
    with pytest.raises(ConfigError, match="must be divisible by"):
        derived_sizes(cfg)


@pytest.mark.parametrize("key, value, fix", [
    ("reward.clip_checkpoint", "/m/clip.bin", "; valid keys in reward: weights, monitor, options, batch_size, "
                                              "combine, replay_fraction, replay_capacity"),
    ("log.log_every", "1", " (did you mean 'log.sample_every'?); valid keys in log: sample_every, checkpoint_every, "
                           "eval_images, eval_temperatures, report"),
    ("log.tensorboard", "false", "; valid keys in log: "),  # one switch now: log.trackers
    ("data.world_train_split", "all", "; valid keys in data: "),  # now ShapesWorld's policy.options
    ("train.lora_rank", "8", "; valid keys in train: steps, lr, "),
])
def test_a_key_of_an_earlier_layout_is_an_unknown_key(tmp_path, key, value, fix):
    # keys that moved or were retired before any release are not migrated: a typo's one-line error
    section, name = key.split(".")
    path = tmp_path / "config.yaml"
    path.write_text(f"{section}:\n  {name}: {value}\n")
    for where, args in ((str(path), (path,)), ("command line", (None, [f"{key}={value}"]))):
        with pytest.raises(ConfigError) as err:
            load_config(*args)
        assert str(err.value).startswith(f"{where}: unknown key '{key}'{fix}") and "\n" not in str(err.value)


def test_reference_lora_is_not_a_reference():
    with pytest.raises(ConfigError) as err:
        load_config(None, ["train.reference=lora"])
    assert str(err.value) == ("command line: 'train.reference' expects one of 'frozen', 'adapter', 'none', "
                              "got 'lora' (str)")


@pytest.mark.parametrize("override, needle", [
    ("train.lr=inf", "train.lr must be a finite number in (0, 1], got inf"),
    ("train.lr=nan", "train.lr must be a finite number in (0, 1], got nan"),
    ("train.lr=0", "train.lr must be a finite number in (0, 1], got 0.0"),
    ("train.lr=1e39", "train.lr must be a finite number in (0, 1], got 1e+39"),
    ("sample.cfg_scale=inf", "sample.cfg_scale must be a finite number >= 0 (1 turns guidance off), got inf"),
    ("sample.cfg_scale=-0.5", "sample.cfg_scale must be a finite number >= 0"),
    ("sample.temperature=inf", "sample.temperature must be a finite number > 0, got inf"),
    ("sample.temperature=0", "sample.temperature must be a finite number > 0, got 0.0"),
    ("sample.top_p=0", "sample.top_p must be a finite number in (0, 1]"),
    ("sample.top_p=1.5", "sample.top_p must be a finite number in (0, 1]"),
    ("train.epsilon_low=1", "train.epsilon_low must be a finite number in [0, 1), got 1.0"),
    ("train.epsilon_high=inf", "train.epsilon_high must be a finite number >= 0, got inf"),
    ("train.beta=-0.1", "train.beta must be a finite number >= 0, got -0.1"),
    ("train.adam_betas=[2, 3]", "train.adam_betas[0] must be a finite number in [0, 1), got 2.0"),
    ("train.adam_betas=[0.9, 1]", "train.adam_betas[1] must be a finite number in [0, 1), got 1.0"),
    ("train.weight_decay=-1", "train.weight_decay must be a finite number >= 0, got -1.0"),
    ("train.max_grad_norm=nan", "train.max_grad_norm must be a finite number > 0, or 0 for no clipping, got nan"),
    ("train.max_grad_norm=-1", "train.max_grad_norm must be a finite number > 0, or 0 for no clipping"),
    ("train.adapter_alpha=0", "train.adapter_alpha must be a finite number > 0, got 0.0"),
    ("log.eval_temperatures=[1.0, inf]", "log.eval_temperatures[1] must be a finite number > 0, got inf"),
    ("train.adapter_rank=0", "train.adapter_rank must be >= 1"),
    ("train.warmup_steps=-1", "train.warmup_steps must be >= 0"),
])
def test_float_knobs_must_be_finite_and_in_range(override, needle):
    with pytest.raises(ConfigError) as err:
        load_config(None, [override])
    assert needle in str(err.value) and "\n" not in str(err.value)


@pytest.mark.parametrize("override", ["train.max_grad_norm=0", "sample.cfg_scale=0", "train.epsilon_low=0",
                                      "train.adam_betas=[0, 0]", "sample.top_p=1", "train.weight_decay=0"])
def test_the_edges_of_each_range_are_allowed(override):
    load_config(None, [override])


def _float_keys(cls, prefix=""):
    """Dotted keys of every float or list-of-float field, found by walking the dataclasses."""
    for f in dataclasses.fields(cls):
        hint = typing.get_type_hints(cls)[f.name]
        if dataclasses.is_dataclass(hint):
            yield from _float_keys(hint, f"{prefix}{f.name}.")
        elif hint is float or hint == list[float]:
            yield f"{prefix}{f.name}", hint is float


@pytest.mark.parametrize("bad", ["nan", "inf", "-inf"])
def test_no_float_field_accepts_a_non_finite_value(bad):
    # Walks the config, so a float field added later without a range check fails here
    keys = list(_float_keys(Config))
    assert len(keys) >= 12
    for key, scalar in keys:
        with pytest.raises(ConfigError, match=rf"{key.replace('.', '[.]')}(\[0\])? must be a finite number"):
            load_config(None, [f"{key}={bad}" if scalar else f"{key}=[{bad}, {bad}]"])


def test_a_long_value_or_key_is_quoted_briefly():
    # errors quote user text through config/load.brief: the first 80 characters and the length, never the whole value
    for override, start in ((f"run.seed={'9x' * 50_000}", "command line: 'run.seed' expects an integer, got '9x9x"),
                            (f"run.{'e' * 99_996}=x", "command line: unknown key 'run.eee"),
                            ("r" * 100_000, "override 'rrr")):
        with pytest.raises(ConfigError) as err:
            load_config(None, [override])
        assert str(err.value).startswith(start) and "... (100000 characters)" in str(err.value)
        assert len(str(err.value)) < 400
    with pytest.raises(ConfigError) as err:
        load_config(None, [f"run.name={'a/' * 50_000}"])
    assert str(err.value) == ("run.name must be a plain folder name (no '/' or '\\', no newline or other control "
                              f"character), got {repr('a/' * 40)}... (100000 characters)")


def bomb(levels: int) -> str:
    """A "billion laughs" in YAML flow style: ten x's, then `levels - 1` lists of ten aliases of the one before,
    each anchored; the last stands for 10^levels x's in a few hundred bytes."""
    names = "abcdefghijk"[:levels]
    lists = [f"&a [{', '.join(['x'] * 10)}]"] + [f"&{n} [{', '.join([f'*{p}'] * 10)}]"
                                                  for p, n in zip(names, names[1:])]
    return f"[{', '.join(lists)}]"


@pytest.mark.parametrize("where", ["run:\n  name: ", "reward:\n  options:\n    clip:\n      checkpoint: "])
def test_yaml_aliases_that_expand_past_100000_values_are_refused_at_load(tmp_path, where):
    # before: 9 levels (537 bytes) in run.name or a reward option loaded in a moment, and the type
    # error's repr() of the value expanded 10^10 items (MemoryError); 6 levels here, 10^6 items
    path = tmp_path / "c.yaml"
    path.write_text(where + bomb(6) + "\n")
    with pytest.raises(ConfigError) as err:
        load_config(path)
    assert str(err.value) == (f"{path}, line {where.count(chr(10)) + 1}: more than 100000 values once its aliases "
                              "(*name) are expanded; write the values out, or use fewer aliases")
    path.write_text(where + bomb(3) + "\n")  # 1,000 x's: a value like any other, refused for its type, briefly
    with pytest.raises(ConfigError, match=r"(run.name|reward.options.clip.checkpoint)' expects a string, got "
                                          r"\"\[\['x', 'x', .*\.\.\. \(5796 characters\) \(list\)$"):
        check_options(load_config(path))


def test_a_value_is_quoted_briefly_whatever_it_holds():
    from grpo_vision.config import brief

    shared = ["x"] * 10
    for _ in range(5):  # 10^6 x's through shared lists, a repr of 6.7 million characters
        shared = [shared] * 10
    assert brief(shared) == repr(repr(shared)[:80]) + "... (more than 100000 characters)"
    for _ in range(4):  # 10^10: walked for its first characters only
        shared = [shared] * 10
    ten = ", ".join(["'x'"] * 10)
    assert brief(shared) == repr(("[" * 10 + ten + "], [" + ten)[:80]) + "... (more than 100000 characters)"
    assert brief({"a": (1,), "b": {2}, "c": set(), "d": 10 ** 5000}) == \
        "{'a': (1,), 'b': {2}, 'c': set(), 'd': <an integer of 16610 bits>}"  # repr() raised past 4300 digits


def test_yaml_nested_50000_deep_is_one_line(tmp_path):
    path, deep = tmp_path / "c.yaml", "[" * 50_000 + "]" * 50_000  # was a RecursionError, in a file or an override
    path.write_text("run:\n  name: " + deep + "\n")
    with pytest.raises(ConfigError) as err:
        load_config(path)
    assert str(err.value) == f"{path}, line 2: lists and mappings nested more than 100 levels deep; write flatter YAML"
    with pytest.raises(ConfigError) as err:
        load_config(None, [f"run.name={deep}"])
    assert str(err.value) == (f"command line: {'[' * 80!r}... (100000 characters): lists and mappings nested more "
                              "than 100 levels deep; write flatter YAML")
    load_config(None, ["run.name=" + "[" * 50 + "]" * 50])  # well within the bound: a string like any other


# ---------------------------------------------------------------- run.device


@pytest.mark.parametrize("name", ["banana", "cuda:", "cuda:x", "gpu", "CPU", ""])
def test_an_unknown_device_name_is_refused_at_load(name):
    written = name or '""'  # run.device= alone is "not set": the default, auto
    with pytest.raises(ConfigError, match=rf"run.device '{name}' is not a device: use auto .*cpu, cuda, cuda:N or mps"):
        load_config(None, [f"run.device={written}"])


def test_a_device_this_machine_lacks_is_refused_naming_it(monkeypatch):
    import torch

    from grpo_vision.run.machine import resolve_device

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    monkeypatch.setattr(torch.backends.mps, "is_available", lambda: False)
    assert resolve_device("auto") == "cpu" and resolve_device("cpu") == "cpu"
    for name in ("cuda", "cuda:0"):
        with pytest.raises(ConfigError, match=rf"run.device={name}, and this machine has no CUDA GPU torch can use: "
                                              r"use run.device=auto \(the best device here\) or cpu"):
            resolve_device(name)
    with pytest.raises(ConfigError, match="--device=mps, and this machine has no Apple GPU"):
        resolve_device("mps", "--device")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)  # two GPUs: cuda:0 and cuda:1
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    assert resolve_device("auto") == "cuda" and resolve_device("cuda:1") == "cuda:1"
    with pytest.raises(ConfigError, match=r"run.device=cuda:7, and this machine has only cuda:0 to cuda:1"):
        resolve_device("cuda:7")


def test_train_refuses_a_missing_device_before_writing_anything(monkeypatch, tmp_path):
    import torch

    from grpo_vision.train import train

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    cfg = load_config(None, ["run.device=cuda", f"run.out_dir={tmp_path}"])
    with pytest.raises(ConfigError, match="run.device=cuda, and this machine has no CUDA GPU"):
        train(cfg, progress=False)  # it trained on the CPU, silently, and saved device: cuda
    assert list(tmp_path.iterdir()) == []


# ---------------------------------------------------------------- token weighting and TRL 1.16's options


@pytest.mark.parametrize("overrides, needle", [
    (["train.token_weighting=gcpo"], "'train.token_weighting' expects one of 'none', 'stage', 'critical', "
                                     "'guidance_contrastive', got 'gcpo'"),
    (["train.critical_fraction=0"], "train.critical_fraction must be a finite number in (0, 1]"),
    (["train.critical_fraction=1.5"], "train.critical_fraction must be a finite number in (0, 1]"),
    (["train.guidance_top_share=1"], "train.guidance_top_share must be a finite number in (0, 1)"),
    (["train.guidance_top_fraction=0"], "train.guidance_top_fraction must be a finite number in (0, 1)"),
    (["train.guidance_top_fraction=0.9"], "train.guidance_top_share (0.8) must exceed train.guidance_top_fraction"),
    (["train.token_weighting=guidance_contrastive", "sample.cfg_scale=1"], "sample.cfg_scale=1 turns it off"),
    (["train.token_weighting=guidance_contrastive", "sample.cfg_scale=0.5"], "set sample.cfg_scale > 1"),
    (["train.token_weighting=critical", "train.reference=none"], "train.token_weighting=critical"),
    (["train.token_weighting=stage", "train.reference=none"], "train.stage_entropy_reward_scale"),
    (["train.stage_entropy_reward_scale=-1"], "train.stage_entropy_reward_scale must be a finite number >= 0"),
    (["train.zero_std_groups=skip"], "'train.zero_std_groups' expects one of 'keep', 'drop', 'resample'"),
    (["train.zero_std_groups=resample", "train.resample_rounds=0"], "train.resample_rounds must be >= 1"),
    (["train.zero_std_groups=resample", "train.token_weighting=stage"],
     "STAGE's entropy reward (train.stage_entropy_reward_scale) gives those groups a spread"),
    (["train.off_policy_mask_threshold=-0.5"], "train.off_policy_mask_threshold must be a finite number >= 0"),
    (["train.entropy_coef=-0.01"], "train.entropy_coef must be a finite number >= 0"),
    (["train.entropy_coef_min=0.5", "train.entropy_coef_max=0.1"], "train.entropy_coef_min (0.5) must not exceed"),
    (["train.entropy_target=-1"], "train.entropy_target must be a finite number >= 0"),
    (["train.ref_model_mixup_alpha=0"], "train.ref_model_mixup_alpha must be a finite number in (0, 1]"),
    (["train.ref_model_mixup_alpha=0.6"], "train.ref_sync_every, which is 0"),
    (["train.ref_model_mixup_alpha=0.6", "train.ref_sync_every=10", "train.adapter=lora", "train.reference=adapter"],
     "train.reference=adapter keeps no second set"),
])
def test_bad_token_weighting_and_trl_options_are_refused_naming_the_key(overrides, needle):
    with pytest.raises(ConfigError) as err:
        load_config(None, overrides)
    assert needle in str(err.value) and "\n" not in str(err.value)


def test_token_weighting_and_trl_options_that_fit_load():
    cfg = load_config(None, ["train.token_weighting=guidance_contrastive", "sample.cfg_scale=5",
                             "train.zero_std_groups=drop", "train.ref_model_mixup_alpha=0.6",
                             "train.ref_sync_every=10", "train.use_adaptive_entropy=true", "train.critical_fraction=1"])
    assert cfg.train.token_weighting == "guidance_contrastive" and cfg.train.zero_std_groups == "drop"
    load_config(None, ["train.token_weighting=stage", "train.reference=none", "train.stage_entropy_reward_scale=0"])
    t = load_config(None).train  # the defaults keep today's loss
    assert (t.token_weighting, t.zero_std_groups, t.use_bias_correction_kl, t.entropy_coef,
            t.off_policy_mask_threshold, t.ref_model_mixup_alpha) == ("none", "keep", False, 0.0, 0.0, 1.0)


def test_trl_names_of_the_116_options_are_aliases():
    from grpo_vision.config.trl_names import trl_overrides

    overrides, _ = trl_overrides({"use_bias_correction_kl": True, "off_policy_mask_threshold": None,
                                  "entropy_coef": 0.01, "entropy_target": 5.0, "ref_model_mixup_alpha": 0.6})
    assert overrides == ["train.use_bias_correction_kl=true", "train.off_policy_mask_threshold=null",
                         "train.entropy_coef=0.01", "train.entropy_target=5.0", "train.ref_model_mixup_alpha=0.6"]
    cfg = load_config(None, overrides + ["train.ref_sync_every=4"])
    assert cfg.train.off_policy_mask_threshold == 0.0 and cfg.train.use_bias_correction_kl is True
