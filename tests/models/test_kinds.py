"""Policy kinds and the prompts a run trains and evaluates on."""

import pytest
import torch

from grpo_vision.config import ConfigError, load_config
from grpo_vision.models.llama import LlamaImagePolicy, LlamaPolicyConfig
from grpo_vision.policy import REGISTRY, Bundle, load_bundle, policy_kind
from grpo_vision.splits import PromptSets, prompt_lists
from grpo_vision.splits import checked_prompt_sets
from grpo_vision.policy import register_policy_kind
from grpo_vision.prompts import PromptEntry
from grpo_vision.shapes.scene import all_words, is_held_out
from tests.helpers import ROOT

SHAPES = ["policy.kind=shapes"]  # the world's prompts need no policy.path; its loader does


@pytest.fixture(scope="module")
def bundle():
    policy = LlamaImagePolicy(LlamaPolicyConfig(words=all_words(), dim=32, n_layers=1, n_heads=2, n_kv_heads=1,
                                                ffn_dim=64))
    return Bundle(policy, tokenizer=None)  # the world's prompts come from its grammar, not its files


@pytest.mark.parametrize("split, held_out", [("train", {False}), ("heldout", {True}), ("all", {False, True})])
def test_world_split_picks_compositions_and_never_the_eval_prompts(bundle, split, held_out):
    sets = checked_prompt_sets(load_config(None, [*SHAPES, f"policy.options.world_train_split={split}"]), bundle)
    assert len(sets.test) == len(sets.heldout) == 128  # data.eval_size
    assert not any(is_held_out(e.prompt) for e in sets.test) and all(is_held_out(e.prompt) for e in sets.heldout)
    assert {is_held_out(e.prompt) for e in sets.train} == held_out
    assert not {e.prompt for e in sets.train} & {e.prompt for e in (*sets.test, *sets.heldout)}


def test_world_eval_sets_are_the_same_for_every_run_seed():
    a, b = (prompt_lists(load_config(None, [*SHAPES, f"run.seed={seed}"])) for seed in (0, 5))
    assert [e.prompt for e in a.train] == [e.prompt for e in b.train]  # a data set; the seed draws from it
    assert [e.prompt for e in a.test] == [e.prompt for e in b.test]
    assert [e.prompt for e in a.heldout] == [e.prompt for e in b.heldout]


def test_a_train_file_holds_back_a_fixed_test_set(tmp_path):
    prompts = tmp_path / "train.txt"
    prompts.write_text("".join(f"prompt {i}\n" for i in range(10)))
    runs = [prompt_lists(load_config(None, ["policy.kind=llama", f"data.train_prompts={prompts}",
                                            "data.test_prompts=3", f"run.seed={seed}"])) for seed in (0, 1)]
    test = [e.prompt for e in runs[0].test]
    assert len(set(test)) == 3 and test == [e.prompt for e in runs[1].test]  # the same split for every seed
    assert sorted(e.prompt for e in (*runs[0].train, *runs[0].test)) == sorted(f"prompt {i}" for i in range(10))
    assert runs[0].heldout == []
    with pytest.raises(ConfigError, match=r"train.txt has 10 distinct prompts: too few to hold back "
                                          r"data.test_prompts=6"):
        prompt_lists(load_config(None, ["policy.kind=llama", f"data.train_prompts={prompts}", "data.test_prompts=6"]))


def test_a_heldout_file_is_the_transfer_set_and_never_trained_on(tmp_path):
    train, heldout = tmp_path / "train.txt", tmp_path / "heldout.txt"
    train.write_text("".join(f"prompt {i}\n" for i in range(10)))
    heldout.write_text("prompt 4\nprompt 11\n")
    sets = prompt_lists(load_config(None, ["policy.kind=llama", f"data.train_prompts={train}", "data.test_prompts=2",
                                           f"data.heldout_prompts={heldout}"]))
    assert [e.prompt for e in sets.heldout] == ["prompt 4", "prompt 11"]
    assert "prompt 4" not in {e.prompt for e in sets.train} and len(sets.train) in (7, 8)


def test_unknown_split_is_refused_with_the_choices():
    with pytest.raises(ConfigError, match="'policy.options.world_train_split' expects one of 'train', 'all', "
                                          "'heldout'"):
        prompt_lists(load_config(None, [*SHAPES, "policy.options.world_train_split=seen"]))


def test_training_prompts_all_in_the_eval_sets_are_a_config_error_naming_them(tmp_path):
    # the training set became empty silently, and the first step failed in numpy
    train, heldout = tmp_path / "train.txt", tmp_path / "heldout.txt"
    train.write_text("".join(f"prompt {i}\n" for i in range(4)))
    heldout.write_text("".join(f"prompt {i}\n" for i in range(4)))
    fix = ("and evaluation prompts are never trained on: train on other prompts (data.train_prompts), or "
           "evaluate on others (data.eval_prompts, data.heldout_prompts)")
    with pytest.raises(ConfigError) as err:
        prompt_lists(load_config(None, ["policy.kind=llama", f"data.train_prompts={train}",
                                        f"data.eval_prompts={train}"]))
    assert str(err.value) == (f"no prompt of data.train_prompts ({train}) is left to train on: all 4 of its prompts are in "
                              f"data.eval_prompts ({train}), {fix}")
    with pytest.raises(ConfigError) as err:  # the held-back test set takes 2, the held-out file the rest
        prompt_lists(load_config(None, ["policy.kind=llama", f"data.train_prompts={train}", "data.test_prompts=2",
                                        f"data.heldout_prompts={heldout}"]))
    assert str(err.value) == (f"no prompt of data.train_prompts ({train}) is left to train on: all 4 of its prompts are in "
                              f"its held-back test set or data.heldout_prompts ({heldout}), {fix}")


def test_a_kind_whose_training_prompts_are_its_eval_prompts_is_refused():
    same = [PromptEntry("a red circle")]
    for train, why in ((same, "all 1 of its prompts are in the policy kind's test set, and evaluation"),
                       ([], "it has none")):
        REGISTRY["test_kind"] = REGISTRY["llama"].__class__("test_kind", None, lambda cfg: PromptSets(train, same))
        try:
            with pytest.raises(ConfigError, match=f"no prompt of the policy kind's prompts is left to train on: {why}"):
                prompt_lists(load_config(None, ["policy.kind=test_kind"]))
        finally:
            del REGISTRY["test_kind"]


def test_an_eval_file_is_removed_from_the_kinds_training_prompts(tmp_path):
    evals = tmp_path / "eval.txt"
    cfg = load_config(None, [*SHAPES, "policy.options.world_train_split=all"])
    first = prompt_lists(cfg).train[0].prompt  # a caption the world would train on
    evals.write_text(first + "\n")
    sets = prompt_lists(load_config(None, [*SHAPES, "policy.options.world_train_split=all",
                                           f"data.eval_prompts={evals}"]))
    assert [e.prompt for e in sets.test] == [first] and first not in {e.prompt for e in sets.train}


def test_a_kind_without_prompts_needs_a_train_file():
    with pytest.raises(ConfigError, match="data.train_prompts is required: policy.kind 'llama' brings no prompts"):
        prompt_lists(load_config(None, ["policy.kind=llama"]))


def test_unknown_kind_lists_the_registered_ones():
    with pytest.raises(ConfigError, match=r"unknown policy.kind 'gpt5'; registered kinds: .*janus, llama, llamagen, shapes"):
        policy_kind("gpt5")


def test_the_core_names_no_policy_a_config_says_which():
    with pytest.raises(ConfigError) as err:  # the defaults: no kind
        prompt_lists(load_config(None))
    assert str(err.value) == "policy.kind is required: set it to one of janus, llama, llamagen, shapes"
    with pytest.raises(ConfigError) as err:
        load_bundle(load_config(None, SHAPES).policy, "cpu")
    assert str(err.value) == ("policy.path is required: what policy.kind 'shapes' loads (a model's directory or "
                              "checkpoint file, or a run folder to continue from)")


@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
def test_the_shapes_kind_loads_its_policy_in_policy_dtype(dtype):
    """The world saves float32 weights; policy.dtype casts them, as for the llama kind (it was once ignored)."""
    world = ROOT / "worlds" / "shapes"
    cfg = load_config(None, [*SHAPES, f"policy.path={world}", f"policy.dtype={dtype}", "train.adapter=lora"])
    bundle = load_bundle(cfg.policy, "cpu")
    assert {p.dtype for p in bundle.policy.parameters()} == {getattr(torch, dtype)}
    assert {p.dtype for p in bundle.tokenizer.vq.parameters()} == {torch.float32}  # the tokenizer is not the policy


def test_a_run_folder_continues_with_its_own_options_and_those_given_replaced(micro_run):
    # world_train_split chooses the new run's prompts, not the weights: a run that continues another sets it
    from grpo_vision.config import PolicyConfig

    cfg = load_config(None, [*SHAPES, f"policy.path={micro_run}", "policy.options.world_train_split=all"])
    assert load_bundle(cfg.policy, "cpu").judge is not None  # the shapes kind's Bundle, the run's weights in it
    assert {is_held_out(e.prompt) for e in prompt_lists(cfg).train} == {False, True}
    with pytest.raises(ConfigError, match=r"^config: unknown key 'policy.options.world_split' \(did you mean "):
        load_bundle(PolicyConfig("shapes", str(micro_run), options={"world_split": "all"}), "cpu")
    with pytest.raises(ConfigError, match="is a run folder, which brings its own policy.tokenizer: leave it empty$"):
        load_bundle(PolicyConfig("shapes", str(micro_run), tokenizer="vq"), "cpu")


def test_a_policy_config_that_does_not_fit_its_weights_is_one_line_naming_both(tiny_policy, tmp_path):
    import json

    from grpo_vision.run.checkpoint import CheckpointError

    tiny_policy.save_pretrained(tmp_path)
    config = tmp_path / "policy_config.json"
    config.write_text(json.dumps(json.loads(config.read_text()) | {"dim": 96}))
    with pytest.raises(CheckpointError) as err:
        LlamaImagePolicy.from_pretrained(tmp_path)
    assert str(err.value) == (f"policy checkpoint {tmp_path / 'policy.safetensors'} does not fit {config} "
                              "(model.embed_tokens.weight is [44, 64] in the weights, [44, 96] in the model (and 20 "
                              "more)); use the policy_config.json saved with these weights")


def test_non_finite_policy_weights_are_named_at_load(tiny_policy, tmp_path):
    from safetensors.torch import load_file, save_file

    from grpo_vision.run.checkpoint import CheckpointError

    tiny_policy.save_pretrained(tmp_path)
    weights = tmp_path / "policy.safetensors"
    state = load_file(weights)
    state["lm_head.weight"][0, :3] = float("nan")
    state["model.norm.weight"][1] = float("inf")
    save_file(state, weights)
    with pytest.raises(CheckpointError) as err:
        LlamaImagePolicy.from_pretrained(tmp_path)
    assert str(err.value) == (f"policy checkpoint {weights} holds 3 NaN or infinite values in lm_head.weight (and 1 "
                              "other tensor): the file is damaged; copy it again, or rewrite it with save_pretrained "
                              "(or rebuild the world)")


def test_a_registered_kind_is_loaded_by_name_with_its_prompts(tiny_policy):
    @register_policy_kind("test_kind", prompts=lambda cfg: PromptSets([PromptEntry("a red circle")],
                                                                      [PromptEntry("a dog")]))
    def load(pcfg, device):
        return Bundle(tiny_policy, tokenizer=pcfg.path)

    try:
        cfg = load_config(None, ["policy.kind=test_kind", "policy.path=here"])
        assert load_bundle(cfg.policy, "cpu").tokenizer == "here"
        sets = prompt_lists(cfg)
        assert [[e.prompt for e in part] for part in (sets.train, sets.test, sets.heldout)] == \
            [["a red circle"], ["a dog"], []]
    finally:
        del REGISTRY["test_kind"]


def test_run_folders_whose_policy_path_leads_back_are_one_line_naming_the_cycle(micro_run, tmp_path):
    """Was a RecursionError after 17 s."""
    from grpo_vision.config import PolicyConfig, save_config

    a, b = tmp_path / "a", tmp_path / "b"
    for run, base in ((a, b), (b, a)):
        (run / "checkpoints").mkdir(parents=True)
        cfg = load_config(micro_run / "config.yaml", [f"policy.path={base}"])
        save_config(cfg, run / "config.yaml")
    with pytest.raises(ConfigError) as err:
        load_bundle(PolicyConfig("shapes", str(a)), "cpu")
    assert str(err.value) == (f"policy.path leads back to itself through run folders ({a.resolve()} -> "
                              f"{b.resolve()} -> {a.resolve()}): set the first run's policy.path to the model it "
                              "started from")
    save_config(load_config(micro_run / "config.yaml", [f"policy.path={a}"]), a / "config.yaml")  # itself
    with pytest.raises(ConfigError, match=r"run folders \(.*a -> .*a\)"):
        load_bundle(PolicyConfig("shapes", str(a)), "cpu")


def test_each_policy_class_finds_its_exporter(bundle):
    """The built-in Llama's and LlamaGen's exporters are functions beside their loaders; a class with an
    `export(directory)` method (Janus's, a plugin's) is written by it; a class with neither has none."""
    from grpo_vision.models import llama_hf, llamagen_load
    from grpo_vision.models.janus import JanusImagePolicy
    from grpo_vision.models.kinds import exporter
    from grpo_vision.models.llamagen import LlamaGenConfig, LlamaGenPolicy

    write = exporter(bundle.policy)
    assert write.func is llama_hf.export and write.args == (bundle.policy,)
    with torch.device("meta"):
        llamagen = LlamaGenPolicy(LlamaGenConfig("c2i", dim=32, n_layer=1, n_head=4, n_kv_head=4, ffn_dim=64,
                                                 codebook_size=16, grid=2, cls_token_num=1, num_classes=3))
    write = exporter(llamagen)
    assert write.func is llamagen_load.export and write.args == (llamagen,)

    class Plugin(torch.nn.Module):
        def export(self, directory):
            return []

    plugin = Plugin()
    assert exporter(plugin) == plugin.export and callable(JanusImagePolicy.export)
    assert exporter(torch.nn.Linear(1, 1)) is None


def test_the_vq_tokenizer_is_made_when_first_read_and_export_never_imports_diffusers(micro_world, tmp_path):
    # diffusers' import alone takes seconds on a CPU: the shapes and llama kinds defer their VQ (policy.Deferred),
    # so `export`, which never decodes, starts without it; the first read makes it once; a missing tokenizer
    # folder is still named at load
    import json
    import subprocess
    import sys

    code = f"""
import json, sys
from grpo_vision.config import load_config
from grpo_vision.policy import load_bundle
cfg = load_config({str(ROOT / "configs" / "shapes_micro.yaml")!r}, ["policy.path={micro_world}"])
bundle = load_bundle(cfg.policy, "cpu")
before = "diffusers" in sys.modules
first = bundle.tokenizer
print(json.dumps({{"before": before, "after": "diffusers" in sys.modules, "kind": type(first).__name__,
                  "same": bundle.tokenizer is first}}))
"""
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    seen = json.loads(done.stdout.splitlines()[-1])
    assert seen == {"before": False, "after": True, "kind": "VQTokenizer", "same": True}
    with pytest.raises(FileNotFoundError, match="VQ tokenizer .* has no config.json"):
        load_bundle(load_config(overrides=["policy.kind=llama", f"policy.path={micro_world / 'policy'}",
                                           f"policy.tokenizer={tmp_path}"]).policy, "cpu")
