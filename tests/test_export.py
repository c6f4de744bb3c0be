"""`export`: a trained run's policy out, loaded by its ecosystem's own loaders, never by ours alone.

For each kind a tiny run trains two steps; its export is then opened with transformers
(`from_pretrained`), peft (`PeftModel.from_pretrained` on the user's own base model) or a strict
`load_state_dict`, and its image-token logits must equal the run's policy's on a fixed input (1e-5 in
float32). A run folder as `policy.path` continues from the trained weights.
"""

import json
import re
import subprocess

import pytest
import torch
from safetensors import SafetensorError

from grpo_vision.cli import main
from grpo_vision.config import ConfigError, PolicyConfig, load_config
from grpo_vision.step.load import load_run
from grpo_vision.policy import load_bundle
from grpo_vision.export import export_run
from grpo_vision.train import train
from tests.models.test_janus import PROMPTS as JANUS_PROMPTS, build_tiny_janus, write_config as janus_config
from tests.models.test_llamagen import LLAMAGEN_PROMPTS

LLAMA_PROMPTS = ["a red circle", "a blue square", "a red square left of a blue circle"]


def image_logits(policy, prompts, seed=0):
    """The policy's logits `[B, N, K]` on fixed random image tokens."""
    cond = policy.encode_prompts(prompts)
    tokens = torch.randint(0, policy.codebook_size, (len(prompts), policy.num_image_tokens),
                           generator=torch.Generator().manual_seed(seed))
    with torch.no_grad():
        return policy.image_logits(cond, tokens), cond, tokens


def close(a, b, tol=1e-5):
    """Within `tol` of each other, relative to the logits' largest magnitude where that exceeds 1: a merged
    adapter (W + BA against Wx + B(Ax)) differs from peft's sum by float32 rounding, which scales with the logits."""
    diff, scale = (a - b).abs().max().item(), max(1.0, b.abs().max().item())
    print(f"max |exported - run| logits = {diff:.2e} (largest |logit| {scale:.3g})")
    return diff < tol * scale


# ---------------------------------------------------------------------------- janus


@pytest.fixture(scope="module")
def janus_dir(tmp_path_factory):
    return build_tiny_janus(tmp_path_factory.mktemp("janus") / "tiny_janus")


@pytest.fixture(scope="module")
def janus_runs(janus_dir, tmp_path_factory):
    """A full fine-tune and a LoRA run of two steps each on the tiny Janus."""
    runs = {}
    for mode in ("frozen", "lora"):
        tmp = tmp_path_factory.mktemp(f"janus_{mode}")
        runs[mode] = train(load_config(janus_config(tmp, janus_dir, mode), ["log.sample_every=0", "log.report=false"]),
                           progress=False)
    return runs


def janus_logits(model, processor, prompts):
    from grpo_vision.models.janus import JanusImagePolicy

    return image_logits(JanusImagePolicy(model.eval(), processor), prompts)[0]


def test_janus_full_fine_tune_exports_a_transformers_folder(janus_runs, tmp_path):
    from transformers import JanusForConditionalGeneration, JanusProcessor

    done = export_run(janus_runs["frozen"], tmp_path / "out")
    assert done.form == "model" and done.step == 2
    model = JanusForConditionalGeneration.from_pretrained(tmp_path / "out")  # transformers' own loader, whole
    processor = JanusProcessor.from_pretrained(tmp_path / "out")
    run = load_run(janus_runs["frozen"], device="cpu")
    assert close(janus_logits(model, processor, JANUS_PROMPTS), image_logits(run.policy, JANUS_PROMPTS)[0])
    # what transformers' docs do with it: the chat template, then generate in image mode
    text = processor.apply_chat_template([{"role": "user", "content": [{"type": "text", "text": "a red circle"}]}],
                                         add_generation_prompt=True)
    inputs = processor(text=[text], generation_mode="image", return_tensors="pt")
    codes = model.generate(**inputs, generation_mode="image", do_sample=False, guidance_scale=2.0)
    assert codes.shape == (1, 16) and int(codes.max()) < 64
    assert json.loads((tmp_path / "out" / "export.json").read_text())["step"] == 2


def test_janus_lora_exports_an_adapter_for_the_users_own_model(janus_runs, janus_dir, tmp_path):
    from peft import PeftModel
    from transformers import JanusForConditionalGeneration, JanusProcessor

    done = export_run(janus_runs["lora"], tmp_path / "adapter")
    assert done.form == "adapter"
    config = json.loads((tmp_path / "adapter" / "adapter_config.json").read_text())
    assert config["target_modules"].startswith(r"model\.language_model\.")  # the user's model's module path
    base = JanusForConditionalGeneration.from_pretrained(janus_dir)
    peft_model = PeftModel.from_pretrained(base, tmp_path / "adapter")  # NoMatchingPeftModuleError before
    assert any("lora_A" in n for n, _ in base.named_parameters())
    run = load_run(janus_runs["lora"], device="cpu")
    ours = image_logits(run.policy, JANUS_PROMPTS)[0]
    processor = JanusProcessor.from_pretrained(janus_dir)
    assert close(janus_logits(peft_model.base_model.model, processor, JANUS_PROMPTS), ours)
    with run.policy.disable_adapter():  # the adapter changed something, so the comparison could fail
        assert not close(image_logits(run.policy, JANUS_PROMPTS)[0], ours)


def test_janus_lora_merged_is_a_whole_transformers_model(janus_runs, tmp_path):
    from transformers import JanusForConditionalGeneration, JanusProcessor

    done = export_run(janus_runs["lora"], tmp_path / "merged", merge=True)
    assert done.form == "model" and not (tmp_path / "merged" / "adapter_config.json").exists()
    model = JanusForConditionalGeneration.from_pretrained(tmp_path / "merged")
    processor = JanusProcessor.from_pretrained(tmp_path / "merged")
    run = load_run(janus_runs["lora"], device="cpu")
    assert close(janus_logits(model, processor, JANUS_PROMPTS), image_logits(run.policy, JANUS_PROMPTS)[0])


def test_a_janus_run_folder_is_a_policy_path_to_continue_from(janus_runs):
    run = load_run(janus_runs["lora"], device="cpu")
    bundle = load_bundle(PolicyConfig(kind="janus", path=str(janus_runs["lora"])), "cpu")
    assert close(image_logits(bundle.policy, JANUS_PROMPTS)[0], image_logits(run.policy, JANUS_PROMPTS)[0])
    # what the kind's loader froze stays frozen (the VQ model, the understanding tower); the rest trains again
    flags = {n: p.requires_grad for n, p in bundle.policy.named_parameters()}
    assert not any(flags[n] for n in flags if ".vqmodel." in n) and any(flags[n] for n in flags if "layers" in n)
    with pytest.raises(ConfigError, match="run folder of policy kind 'janus': set policy.kind"):
        load_bundle(PolicyConfig(kind="llama", path=str(janus_runs["lora"]), tokenizer=""), "cpu")


# ---------------------------------------------------------------------------- llama (built-in)


def llama_config(world, tmp_path, adapter: bool):
    (tmp_path / "train.txt").write_text("\n".join(LLAMA_PROMPTS) + "\n")
    (tmp_path / "eval.txt").write_text("a blue circle\n")
    config = {
        "run": {"name": f"llama_{adapter}", "out_dir": str(tmp_path / "runs"), "device": "cpu"},
        "policy": {"kind": "llama", "path": str(world / "policy"), "tokenizer": str(world / "vq")},
        "sample": {"prompts_per_step": 2, "group_size": 4, "cfg_scale": 2.0},
        "train": {"steps": 2, "micro_batch_size": 4, "lr": 1e-3, "beta": 0.04,
                  **({"adapter": "lora", "reference": "adapter", "adapter_rank": 4} if adapter else {})},
        "reward": {"weights": {"jpeg_compressibility": 1.0}, "monitor": []},
        "data": {"train_prompts": str(tmp_path / "train.txt"), "eval_prompts": str(tmp_path / "eval.txt")},
        "log": {"sample_every": 0, "checkpoint_every": 0, "eval_images": 1, "trackers": [], "report": False},
    }
    path = tmp_path / "llama.yaml"
    path.write_text(json.dumps(config))
    return load_config(path)


@pytest.fixture(scope="module")
def llama_runs(micro_world, tmp_path_factory):
    return {adapter: train(llama_config(micro_world, tmp_path_factory.mktemp(f"llama_{adapter}"), adapter),
                           progress=False) for adapter in (False, True)}


def hf_image_logits(hf, policy, cond, tokens):
    """A LlamaForCausalLM's logits over the codebook, at the positions that predict image tokens."""
    c = policy.cfg
    ids = torch.cat([cond, tokens[:, :-1] + c.image_offset], dim=1)
    with torch.no_grad():
        logits = hf(input_ids=ids).logits
    return logits[:, cond.shape[1] - 1:, c.image_offset:c.image_offset + c.codebook_size]


def test_llama_exports_a_llama_for_causal_lm_folder(llama_runs, tmp_path):
    from transformers import AutoTokenizer, LlamaForCausalLM

    from grpo_vision.models.llama import LlamaImagePolicy
    from grpo_vision.models.llama_hf import condition_text

    main(["export", str(llama_runs[False]), "--out", str(tmp_path / "out")])  # the command, as users type it
    hf = LlamaForCausalLM.from_pretrained(tmp_path / "out").eval()
    run = load_run(llama_runs[False], device="cpu")
    ours, cond, tokens = image_logits(run.policy, LLAMA_PROMPTS)
    assert close(hf_image_logits(hf, run.policy, cond, tokens), ours)
    tokenizer = AutoTokenizer.from_pretrained(tmp_path / "out")  # the caption's words are the condition's ids
    assert tokenizer(condition_text(LLAMA_PROMPTS[0], run.policy.cfg))["input_ids"] == cond[0].tolist()
    again = LlamaImagePolicy.from_pretrained(tmp_path / "out")  # and this library reads it back as policy.path
    assert close(image_logits(again, LLAMA_PROMPTS)[0], ours)


def test_llama_lora_adapter_loads_on_the_users_llama_for_causal_lm(llama_runs, micro_world, tmp_path):
    from peft import PeftModel
    from transformers import LlamaForCausalLM

    from grpo_vision.models.llama import LlamaImagePolicy
    from grpo_vision.models.llama_hf import to_hf_llama

    to_hf_llama(LlamaImagePolicy.from_pretrained(micro_world / "policy")).save_pretrained(tmp_path / "base")
    assert export_run(llama_runs[True], tmp_path / "adapter").form == "adapter"
    hf = PeftModel.from_pretrained(LlamaForCausalLM.from_pretrained(tmp_path / "base"), tmp_path / "adapter").eval()
    run = load_run(llama_runs[True], device="cpu")
    ours, cond, tokens = image_logits(run.policy, LLAMA_PROMPTS)
    assert close(hf_image_logits(hf, run.policy.get_base_model(), cond, tokens), ours)
    merged = export_run(llama_runs[True], tmp_path / "merged", merge=True)
    assert merged.form == "model" and json.loads((tmp_path / "merged" / "export.json").read_text())["merged"]
    hf = LlamaForCausalLM.from_pretrained(tmp_path / "merged").eval()
    assert close(hf_image_logits(hf, run.policy.get_base_model(), cond, tokens), ours)


def test_a_run_folder_or_its_step_continues_training(llama_runs, tmp_path):
    """A new run from a LoRA run's step folder: it starts at the trained weights and trains a full fine-tune."""
    run = load_run(llama_runs[True], step=2, device="cpu")
    step_dir = llama_runs[True] / "checkpoints" / "step_000002"
    bundle = load_bundle(PolicyConfig(kind="llama", path=str(step_dir)), "cpu")
    assert close(image_logits(bundle.policy, LLAMA_PROMPTS)[0], image_logits(run.policy, LLAMA_PROMPTS)[0])
    cfg = load_config(llama_runs[True] / "config.yaml", [
        f"policy.path={step_dir}", "policy.tokenizer=", f"run.out_dir={tmp_path}", "run.name=next",
        "train.adapter=none", "train.reference=frozen", "train.steps=1"])
    assert (train(cfg, progress=False) / "checkpoints" / "step_000001").is_dir()


def test_export_refuses_a_folder_that_holds_files(llama_runs, tmp_path):
    (tmp_path / "taken").mkdir()
    (tmp_path / "taken" / "x").write_text("")
    with pytest.raises(ConfigError, match="is not an empty folder"):
        export_run(llama_runs[False], tmp_path / "taken")


def test_export_refuses_a_place_inside_a_run_folder_and_bad_paths_before_loading(tmp_path):
    """`--out RUN/checkpoints/step_000004` was accepted, and the next `train --resume` replaced the folder: the
    export vanished with exit 0. Each refusal comes before the run loads (the run here has no weights at all)."""
    run = tmp_path / "run"
    (run / "checkpoints" / "step_000004").mkdir(parents=True)
    (run / "config.yaml").write_text("run: {}\n")
    (run / "metrics.jsonl").write_text("")
    (tmp_path / "a_file").write_text("")
    (tmp_path / "dangling").symlink_to(tmp_path / "nowhere")
    cases = {run / "checkpoints" / "step_000004": f"lies inside the run folder {run}, which train --resume rewrites",
             run / "exports" / "new": f"lies inside the run folder {run}",
             tmp_path / "a_file" / "out": f"{tmp_path / 'a_file'} is a file, not a folder",
             tmp_path / "dangling": "is a link (to",
             tmp_path / "dangling" / "out": "is a dangling link, not a folder"}
    for out, says in cases.items():
        with pytest.raises(ConfigError) as err:
            export_run(run, out)
        assert says in str(err.value) and "\n" not in str(err.value), (out, str(err.value))
    assert not (run / "exports").exists()


FULL_DISK = r"^--out {out}: no space left on {disk}: the export's tensors take about (\d+\.\d) MiB and " \
            r"\d+\.\d MiB are free \(the partial export was removed\); free some space, or export to a folder on " \
            r"another disk$"


@pytest.mark.parametrize("error", [OSError(28, "No space left on device"),
                                   # safetensors' own error, as a full tmpfs raises it from save_file
                                   SafetensorError("Error while serializing: I/O error: No space left on device "
                                                   "(os error 28)")])
def test_a_failed_export_leaves_nothing_under_its_name(llama_runs, tmp_path, monkeypatch, error):
    """Before, safetensors' error was a traceback (an OSError was one line without the sizes)."""
    def full_disk(policy, directory):
        (directory / "model.safetensors").write_bytes(b"half")
        raise error

    monkeypatch.setattr("grpo_vision.models.llama_hf.export", full_disk)
    out = tmp_path / "out"
    with pytest.raises(ConfigError, match=FULL_DISK.format(out=re.escape(str(out)), disk=re.escape(str(tmp_path)))):
        export_run(llama_runs[False], out)
    assert list(tmp_path.iterdir()) == []  # no folder named out, no hidden half-written sibling


def test_an_export_onto_a_full_disk_through_the_real_writers(llama_runs, tmp_path):
    """On a 64 KiB tmpfs (where the machine lets the test mount one): the size said is the weights file's."""
    disk = tmp_path / "disk"
    disk.mkdir()
    if subprocess.run(["mount", "-t", "tmpfs", "-o", "size=64k", "tmpfs", str(disk)], capture_output=True).returncode:
        pytest.skip("cannot mount a small tmpfs here (needs root); the monkeypatched test covers the logic")
    try:
        with pytest.raises(ConfigError) as err:
            export_run(llama_runs[False], disk / "out")
        assert list(disk.iterdir()) == []
    finally:
        subprocess.run(["umount", str(disk)], capture_output=True)
    said = re.match(FULL_DISK.format(out=re.escape(str(disk / "out")), disk=re.escape(str(disk))), str(err.value))
    assert said, str(err.value)
    written = export_run(llama_runs[False], tmp_path / "roomy").directory / "model.safetensors"
    assert abs(float(said[1]) - written.stat().st_size / 2**20) <= 0.1


# ---------------------------------------------------------------------------- llamagen


@pytest.fixture(scope="module")
def t5_dir(tmp_path_factory):
    from tests.models.test_llamagen import build_tiny_t5

    return build_tiny_t5(tmp_path_factory.mktemp("t5") / "tiny-flan-t5")


def llamagen_config(mode, t5_dir, tmp_path, adapter: bool):
    from tests.models.test_llamagen import write_config

    lora = {"adapter": "lora", "reference": "adapter", "adapter_rank": 4, "adapter_targets": ["wqkv", "wo"]}
    return load_config(write_config(tmp_path, mode, t5_dir, None, train={"gradient_checkpointing": False,
                                                                         **(lora if adapter else {})},
                                    log={"sample_every": 0, "report": False}))


@pytest.mark.parametrize("mode,adapter", [("t2i", False), ("c2i", False), ("t2i", True)])
def test_llamagen_exports_the_pt_its_own_scripts_load(mode, adapter, t5_dir, tmp_path):
    """LlamaGen's layout: {"model": every key of the golden file LlamaGen's own code made, uncond_embedding
    included}, loadable strictly, torch.load(weights_only=True) as torch's default reads it; safetensors beside."""
    from safetensors.torch import load_file

    from grpo_vision.models.llamagen import LlamaGenPolicy
    from tests.models.test_llamagen import DATA

    run_dir = train(llamagen_config(mode, t5_dir, tmp_path, adapter), progress=False)
    done = export_run(run_dir, tmp_path / "out")
    assert done.form == "model"  # LlamaGen's samplers load whole weights: an adapter is merged
    saved = torch.load(tmp_path / "out" / "model.pt", weights_only=True)
    golden = torch.load(DATA / f"{mode}_tiny.pt", weights_only=True)["model"]
    assert {k: v.shape for k, v in saved["model"].items()} == {k: v.shape for k, v in golden.items()}
    assert saved["args"]["cls_token_num"] == (120 if mode == "t2i" else 1)
    run = load_run(run_dir, device="cpu")
    prompts = LLAMAGEN_PROMPTS[mode]
    expected = image_logits(run.policy, prompts)[0]  # the run's policy, its adapter applied by peft
    base = run.policy.get_base_model() if adapter else run.policy
    rebuilt = LlamaGenPolicy(base.cfg, base.captions if mode == "t2i" else None)
    rebuilt.load_state_dict(saved["model"], strict=True)  # every key, none left over
    assert all(torch.equal(v, saved["model"][k]) for k, v in load_file(tmp_path / "out" / "model.safetensors").items())
    assert close(image_logits(rebuilt.eval(), prompts)[0], expected)
    # and as policy.path of this library's llamagen kind, from the .pt alone: its args carry the sizes, the heads
    # of a size gpt.py does not name included (no policy.options.heads, no image_size)
    from tests.models.test_llamagen import pcfg

    assert (saved["args"]["n_head"], saved["args"]["n_layer"]) == (4, 2) and "gpt_model" not in saved["args"]
    for file in ("model.pt", "model.safetensors"):
        again = load_bundle(pcfg(mode, t5_dir, path=str(tmp_path / "out" / file),
                                 options={"text_encoder": str(t5_dir)} if mode == "t2i" else {}), "cpu").policy
        assert close(image_logits(again, prompts)[0], expected)
