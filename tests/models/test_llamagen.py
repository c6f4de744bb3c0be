"""The llamagen kind against LlamaGen's own code: golden files made by LlamaGen's gpt.py, generate.py and
vq_model.py (tests/data/llamagen/SOURCE.md) with tiny random weights, loaded here through the real path.

Tiny models: GPT width 32, 2 layers, 4 heads, 64 codes, a 4x4 token grid; c2i with 10 classes, t2i with
24-wide caption features and LlamaGen's 120 caption positions (7 where a test says so); VQ with 32 channels
and 2x downsampling (8 px images). A tiny random T5 encoder (width 24) with a word-level tokenizer stands in for flan-t5-xl.
"""

import argparse
import json
import math
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from grpo_vision.config import ConfigError, PolicyConfig
from grpo_vision.models.adapters import add_adapter
from grpo_vision.models.llamagen import LlamaGenPolicy, class_index, left_pad
from grpo_vision.models.llamagen_load import export
from grpo_vision.models.llamagen_vq import LlamaGenVQ
from grpo_vision.policy import load_bundle, prompt_problem
from grpo_vision.run.checkpoint import CheckpointError
from grpo_vision.sampling import SamplingParams, sample, sequence_logprobs
from tests.helpers import ROOT, run_cli

DATA = Path(__file__).resolve().parents[1] / "data" / "llamagen"
GOLDEN = load_file(DATA / "golden.safetensors")
OPTIONS = {"heads": 4, "image_size": 8}  # tiny models: no released size to take the heads from; 8 px images
WORDS = "a an the red blue green circle square dog cat on of left right grass photo two".split()
PROMPTS = ["a red circle", "a blue square on the grass", "two green dogs left of a cat"]
LLAMAGEN_PROMPTS = {"t2i": PROMPTS, "c2i": ["1 a red circle", "4 a dog", "7 a cat"]}  # training prompts per mode

pytestmark = pytest.mark.usefixtures("one_thread")


def build_tiny_t5(path: Path) -> Path:
    """A random T5 encoder of width 24 and its tokenizer (pad 0, EOS 1 appended, as T5's), saved with
    save_pretrained: what `policy.options.text_encoder` names in place of flan-t5-xl."""
    from tokenizers import Tokenizer, models, pre_tokenizers, processors
    from transformers import PreTrainedTokenizerFast, T5Config, T5EncoderModel

    vocab = {t: i for i, t in enumerate(["<pad>", "</s>", "<unk>", *WORDS])}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.post_processor = processors.TemplateProcessing(single="$A </s>", special_tokens=[("</s>", 1)])
    PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="<pad>", eos_token="</s>",
                            unk_token="<unk>").save_pretrained(str(path))
    torch.manual_seed(0)
    config = T5Config(vocab_size=len(vocab), d_model=24, d_kv=8, d_ff=32, num_layers=1, num_heads=3,
                      relative_attention_num_buckets=8, feed_forward_proj="gated-gelu", pad_token_id=0,
                      eos_token_id=1, decoder_start_token_id=0)
    T5EncoderModel(config).save_pretrained(str(path))
    return path


@pytest.fixture(scope="module")
def t5_dir(tmp_path_factory):
    return build_tiny_t5(tmp_path_factory.mktemp("t5") / "tiny-flan-t5")


def pcfg(mode: str, t5_dir=None, **changes) -> PolicyConfig:
    options = {**OPTIONS, **({"text_encoder": str(t5_dir)} if mode == "t2i" else {})}
    return PolicyConfig(**{"kind": "llamagen", "path": str(DATA / f"{mode}_tiny.pt"),
                           "tokenizer": str(DATA / "vq_tiny.pt"), "options": options, **changes})


@pytest.fixture(scope="module")
def c2i():
    return load_bundle(pcfg("c2i"), "cpu").policy


@pytest.fixture(scope="module")
def t2i(t5_dir):
    return load_bundle(pcfg("t2i", t5_dir), "cpu").policy


def golden_cond(policy: LlamaGenPolicy, mode: str) -> torch.Tensor:
    if mode == "c2i":
        return GOLDEN["c2i.labels"][:, None]  # [B, 1]
    c, n = GOLDEN["t2i.c_indices"], GOLDEN["t2i.lengths"]  # sample_t2i.py's left-padded captions
    cond = left_pad([c[i, 120 - int(n[i]):] for i in range(len(n))], 120)  # our left padding of the same tokens
    assert torch.equal(cond, c)
    return cond


# ---------------------------------------------------------------------------- numerical identity


@pytest.mark.parametrize("mode", ["c2i", "t2i"])
@torch.no_grad()
def test_teacher_forced_logits_equal_llamagens_conditional_and_null(mode, c2i, t2i):
    policy = c2i if mode == "c2i" else t2i
    cond, tokens = golden_cond(policy, mode), GOLDEN[f"{mode}.tokens"]
    for name, rows in (("cond", cond), ("null", policy.null_condition(cond))):
        diff = (policy.image_logits(rows, tokens) - GOLDEN[f"{mode}.logits_{name}"]).abs().max().item()
        print(f"{mode} logits {name}: max |ours - LlamaGen's| = {diff:.2e}")
        assert diff <= 1e-5


@pytest.mark.parametrize("mode", ["c2i", "t2i"])
@pytest.mark.parametrize("cfg_scale", [1.0, 4.0])
def test_greedy_tokens_equal_llamagens_generate(mode, cfg_scale, c2i, t2i):
    policy = c2i if mode == "c2i" else t2i
    cond = golden_cond(policy, mode)
    ours = sample(policy, cond, list(range(len(cond))), SamplingParams(cfg_scale=cfg_scale, top_k=1)).tokens
    theirs = GOLDEN[f"{mode}.greedy_cfg{cfg_scale:g}"]
    print(f"{mode} greedy cfg {cfg_scale:g}: {int((ours != theirs).sum())} of {theirs.numel()} tokens differ")
    assert torch.equal(ours, theirs)


@torch.no_grad()
def test_vq_decodes_and_encodes_as_llamagens():
    vq = load_bundle(pcfg("c2i"), "cpu").tokenizer
    assert isinstance(vq, LlamaGenVQ) and vq.grid == (4, 4) and vq.codebook_size == 64 and vq.downsample == 2
    diff = (vq.decode_raw(GOLDEN["vq.codes"]) - GOLDEN["vq.decoded"]).abs().max().item()
    codes = vq.encode(GOLDEN["vq.images01"])
    print(f"VQ decode: max |ours - LlamaGen's| = {diff:.2e}; encode: {int((codes != GOLDEN['vq.encoded']).sum())} "
          "codes differ")
    assert diff <= 1e-5 and torch.equal(codes, GOLDEN["vq.encoded"])
    images = vq.decode(GOLDEN["vq.codes"])
    assert images.shape == (2, 3, 8, 8) and images.min() >= 0 and images.max() <= 1


# ---------------------------------------------------------------------------- sampler invariants


MODES = [SamplingParams(cfg_scale=3.0), SamplingParams(cfg_scale=2.0, temperature=0.8, top_k=8, top_p=0.9),
         SamplingParams(cfg_scale=3.0, logprob_mode="conditional"), SamplingParams(temperature=1.2)]


@pytest.mark.parametrize("mode", ["c2i", "t2i"])
@pytest.mark.parametrize("params", MODES, ids=str)
def test_rollout_logprobs_equal_teacher_forced_logprobs(mode, params, c2i, t2i):
    policy = c2i if mode == "c2i" else t2i
    cond = policy.encode_prompts(["3", "7 dogs", "class 9"] if mode == "c2i" else PROMPTS)  # captions of 4, 7, 8 tokens
    rollout = sample(policy, cond, [0, 1, 2], params)
    logp = sequence_logprobs(policy, cond, rollout, params)
    diff = (logp - rollout.logprobs).abs().max().item()
    print(f"{mode} max |rollout - teacher-forced logprob| = {diff:.2e}")
    # the ratio is 1 before the first update, to float32 rounding of guided logits that reach ~50 here
    # (s = 3 multiplies a difference of the two passes by 2s - 1 = 5)
    assert diff < 5e-5
    assert logp.requires_grad and rollout.logprobs.mean() < -0.1


@pytest.mark.parametrize("mode", ["c2i", "t2i"])
@torch.no_grad()
def test_kv_cache_logits_equal_the_teacher_forced_forward(mode, c2i, t2i):
    policy = c2i if mode == "c2i" else t2i
    cond = policy.encode_prompts(["3", "7", "9"] if mode == "c2i" else PROMPTS)
    rows = torch.cat([cond, policy.null_condition(cond)])  # [2B, ...]
    tokens = torch.randint(0, 64, (6, 16), generator=torch.Generator().manual_seed(0))
    cache = policy.new_cache(6)
    steps = [policy.prefill(rows, cache)] + [policy.decode(tokens[:, i], cache) for i in range(15)]
    cached, full = torch.stack(steps, 1), policy.image_logits(rows, tokens)  # [2B, N, K] each
    diff, scale = (cached - full).abs().max().item(), full.abs().max().item()
    print(f"{mode} max |KV-cache - teacher-forced logits| = {diff:.2e} (largest logit {scale:.1f})")
    assert diff <= 3e-6 * scale  # float32 rounding: one pass per token vs one pass for all, other SDPA kernels


def test_gradient_checkpointing_gives_the_same_gradients(t2i, checkpointing_gradients):
    plain, remat = checkpointing_gradients(t2i, PROMPTS)
    assert plain.keys() == remat.keys() and "cls_embedding.cap_proj.fc1.weight" in plain
    assert all(torch.allclose(plain[n], remat[n], rtol=1e-4, atol=1e-6) for n in plain)


def test_lora_targets_llamagens_fused_projections(c2i):
    import copy

    wrapped = add_adapter(copy.deepcopy(c2i), "lora", 4, 8.0, ["wqkv", "wo"])
    assert len([n for n, p in wrapped.named_parameters() if p.requires_grad]) == 2 * 2 * 2  # A, B x 2 x 2 layers


# ---------------------------------------------------------------------------- conditions


def test_captions_are_t5_features_left_padded_and_encoded_once(t2i, t5_dir):
    from transformers import AutoTokenizer, T5EncoderModel

    encoder = t2i.captions
    encoder.cache.clear()
    calls = []
    hook = encoder.model.register_forward_hook(lambda *a: calls.append(1))
    cond = t2i.encode_prompts(["A red  circle", "a red circle", "two green dogs left of a cat"] * 4)  # [12, 120, 24]
    t2i.encode_prompts(["a red circle"])
    hook.remove()
    assert len(calls) == 1 and len(encoder.cache) == 2  # one pass, two distinct captions, never again
    tok, model = AutoTokenizer.from_pretrained(str(t5_dir)), T5EncoderModel.from_pretrained(str(t5_dir))
    enc = tok(["a red circle"], max_length=120, padding="max_length", truncation=True, return_tensors="pt")
    direct = model(**enc).last_hidden_state[0, :4]  # 3 words + </s>
    assert cond.shape == (12, 120, 24) and torch.allclose(cond[0, -4:], direct, atol=1e-6)
    assert (cond[0, :-4] == 0).all() and torch.equal(cond[0], cond[1])
    null = t2i.null_condition(cond)
    assert torch.equal((null != 0).any(-1), (cond != 0).any(-1))  # the caption's own padding mask
    assert torch.equal(null[0, -4:], t2i.cls_embedding.uncond_embedding[-4:])


def with_args(tmp_path: Path, name: str, args) -> Path:
    """t2i_tiny.pt's weights saved as LlamaGen's training scripts save a checkpoint, with `args` (None: none)."""
    state = torch.load(DATA / "t2i_tiny.pt", weights_only=True)["model"]
    return save_as(tmp_path, name, {"model": state, "steps": 5, **({} if args is None else {"args": args})})


def test_a_files_own_image_size_wins_and_a_conflicting_option_is_one_line(tmp_path, t5_dir):
    """The shipped configs' image_size 256 silently overrode an export's own 8 px: a 16-token model sampled 4096
    tokens an image, 249 s a step."""
    recorded = with_args(tmp_path, "own.pt", {"image_size": 8})
    config = pcfg("t2i", t5_dir, path=str(recorded), options={"heads": 4, "text_encoder": str(t5_dir)})
    assert load_bundle(config, "cpu").policy.num_image_tokens == 16  # no option: the file's own size
    config.options["image_size"] = 256
    with pytest.raises(ConfigError) as err:
        load_bundle(config, "cpu")
    assert str(err.value) == (f"policy.options.image_size is 256, but {recorded} was trained at 8 (its "
                              "args.image_size): remove policy.options.image_size (the file's own size is used) or "
                              "set it to 8")


@pytest.mark.parametrize("source", ["args", "name", "run folder"])
def test_config_finds_the_image_size_conflict_that_train_finds_without_loading_the_model(source, tmp_path, capsys,
                                                                                        monkeypatch):
    """`grpo-vision config` passed what `train` refused once it had read the weights: the same check (the kind's
    `check`, through rewards.check_named_files) now runs in both, from the file's arguments or name, or the run's
    config."""
    from grpo_vision.cli import main
    from grpo_vision.config import load_config, save_config

    path = {"args": lambda: with_args(tmp_path, "own.pt", {"image_size": 8}),
            "name": lambda: with_args(tmp_path, "t2i_XL_stage1_384.pt", None),
            "run folder": lambda: tmp_path / "run"}[source]()
    if source == "run folder":
        (path / "checkpoints").mkdir(parents=True)
        own = pcfg("c2i")  # trained at 8 px (OPTIONS)
        save_config(load_config(None, ["policy.kind=llamagen", f"policy.path={own.path}", f"policy.tokenizer="
                                       f"{own.tokenizer}", f"policy.options={json.dumps(own.options)}"]),
                    path / "config.yaml")
    (tmp_path / "train.txt").write_text("a red circle\n")
    config = tmp_path / "c.yaml"
    save_config(load_config(None, ["policy.kind=llamagen", f"policy.path={path}", 'policy.options={"image_size": 256}',
                                   f"data.train_prompts={tmp_path / 'train.txt'}"]
                            + ([] if source == "run folder" else [f"policy.tokenizer={DATA / 'vq_tiny.pt'}"])),
                config)
    loaded = []
    monkeypatch.setattr(torch.nn.Module, "load_state_dict", lambda *a, **k: loaded.append(a))
    with pytest.raises(SystemExit) as e:
        main(["config", str(config)])
    assert e.value.code == 2 and not loaded
    recorded = {"args": "8 (its args.image_size)", "name": "384 (its name)"}
    assert capsys.readouterr().err == "grpo-vision: error: " + (
        f"policy.options.image_size is 256, but {path} was trained at {recorded[source]}: remove "
        "policy.options.image_size (the file's own size is used) or set it to " + recorded[source].split()[0]
        if source != "run folder" else
        f"policy.options.image_size is 256, but the run folder {path} trained at 8: remove policy.options.image_size "
        "(the run's own is used) or set it to 8") + "\n"


def test_caption_length_comes_from_options_then_the_checkpoints_args_then_120(tmp_path, t5_dir):
    def length(path, **options):
        config = pcfg("t2i", t5_dir, path=str(path), options={**OPTIONS, "text_encoder": str(t5_dir), **options})
        return load_bundle(config, "cpu").policy.cfg.cls_token_num

    namespace = with_args(tmp_path, "ns.pt", argparse.Namespace(gpt_model="GPT-B", cls_token_num=7, image_size=8))
    plain = with_args(tmp_path, "dict.pt", {"cls_token_num": 7})
    bare = with_args(tmp_path, "none.pt", None)
    assert [length(namespace), length(plain), length(bare), length(plain, cls_token_num=9)] == [7, 7, 120, 9]
    for args, message in (({"cls_token_num": 121}, "args.cls_token_num 121, more than its 120 null-caption rows"),
                          ({"cls_token_num": "7"}, "args.cls_token_num '7', not a positive whole number")):
        with pytest.raises(CheckpointError, match=message):
            length(with_args(tmp_path, "bad.pt", args))


@torch.no_grad()
def test_a_shorter_caption_length_takes_llamagens_null_rows(tmp_path, t5_dir):
    policy = load_bundle(pcfg("t2i", t5_dir, path=str(with_args(tmp_path, "seven.pt", {"cls_token_num": 7}))),
                         "cpu").policy
    uncond = policy.cls_embedding.uncond_embedding  # [120, 24]: LlamaGen's rows whatever cls_token_num is
    cond = policy.encode_prompts(["a red circle", "two green dogs left of a cat"])  # 3 words + </s>; 7 + </s> cut
    null = policy.null_condition(cond)
    assert uncond.shape == (120, 24) and cond.shape == null.shape == (2, 7, 24)
    # LlamaGen puts the whole uncond_embedding in place of the caption (gpt.py:107) and keeps the first
    # cls_token_num embedded rows (gpt.py:342): rows 0..6, here under each caption's own padding
    assert torch.equal(null[0, :3], torch.zeros(3, 24)) and torch.equal(null[0, 3:], uncond[3:7])
    assert torch.equal(null[1], uncond[:7])
    assert torch.equal(policy.cls_embedding(null[1:]), policy.cls_embedding.cap_proj(uncond[None])[:, :7])


@torch.no_grad()
def test_a_condition_of_the_wrong_length_is_a_one_line_error(tmp_path, c2i, t2i, t5_dir):
    seven = load_bundle(pcfg("t2i", t5_dir, path=str(with_args(tmp_path, "seven.pt", {"cls_token_num": 7}))),
                        "cpu").policy
    tokens = GOLDEN["t2i.tokens"]
    cases = [(t2i, GOLDEN["t2i.c_indices"][:, 1:], r"condition of 119 positions .* reads 120 .*\[B, 120, 24\]"),
             (seven, GOLDEN["t2i.c_indices"], r"condition of 120 positions .* reads 7 .*\[B, 7, 24\]"),
             (c2i, torch.tensor([[1, 2], [3, 4]]), "condition of 2 positions .* c2i model reads 1 ")]
    for policy, cond, message in cases:
        calls = [lambda: policy.image_logits(cond, tokens), lambda: policy(cond, tokens),
                 lambda: policy.prefill(cond, policy.new_cache(len(cond))), lambda: policy.null_condition(cond)]
        for call in calls:
            with pytest.raises(ValueError, match=message) as e:
                call()
            assert "\n" not in str(e.value)


def test_class_prompts_name_their_index():
    assert [class_index(p, 1000) for p in ["207", " class 207: golden retriever", "207 golden retriever"]] == [207] * 3
    for bad in ["golden retriever", "1000", "20.5 dogs", "207abc"]:
        with pytest.raises(ValueError, match="does not start with a class index in 0..999"):
            class_index(bad, 1000)


def test_prompt_problem_names_what_the_policy_cannot_read(c2i):
    assert prompt_problem(c2i, "7 cats") is None
    assert "class index in 0..9" in prompt_problem(c2i, "12 cats")


# ---------------------------------------------------------------------------- files


def save_as(tmp_path: Path, name: str, tree) -> Path:
    path = tmp_path / name
    torch.save(tree, path)
    return path


LAYER_NAMES = {"attention.wo": "self_attn.o_proj", "feed_forward.w1": "mlp.gate_proj", "feed_forward.w3": "mlp.up_proj",
               "feed_forward.w2": "mlp.down_proj", "attention_norm": "input_layernorm",
               "ffn_norm": "post_attention_layernorm"}


def hf_layout(state: dict) -> dict:
    """A LlamaGen state dict in transformers-Llama names, as GCPO's llama_model.py names its modules."""
    out = {}
    for key, value in state.items():
        parts = key.split(".")
        if parts[0] == "layers" and parts[2:4] == ["attention", "wqkv"]:
            out |= {f"model.layers.{parts[1]}.self_attn.{p}_proj.weight": t for p, t in zip("qkv", value.chunk(3))}
        elif parts[0] == "layers":
            out[f"model.layers.{parts[1]}.{LAYER_NAMES['.'.join(parts[2:-1])]}.weight"] = value
        else:
            top = {"tok_embeddings": "model.embed_tokens", "norm": "model.norm", "output": "lm_head"}
            out[".".join([top.get(parts[0], "model." + parts[0]), *parts[1:]])] = value
    return out


@torch.no_grad()
def test_every_checkpoint_layout_loads_the_same_weights(tmp_path, c2i):
    state = torch.load(DATA / "c2i_tiny.pt", weights_only=True)["model"]
    hf = hf_layout(state)
    assert "model.layers.1.self_attn.k_proj.weight" in hf and "lm_head.weight" in hf
    files = [save_as(tmp_path, "module.pt", {"module": state}), save_as(tmp_path, "sd.pt", {"state_dict": state}),
             save_as(tmp_path, "bare.pt", dict(state)),
             # as LlamaGen's training scripts save: optimizer, steps and the argparse Namespace of its arguments
             save_as(tmp_path, "trained.pt", {"model": state, "optimizer": {"state": {}, "param_groups": []},
                                              "steps": 5, "args": argparse.Namespace(gpt_model="GPT-B")}),
             # runtime tensors LlamaGen's strict=False loading passes over
             save_as(tmp_path, "runtime.pt", {"model": {**state, "freqs_cis": torch.zeros(17, 4, 2),
                                                        "layers.0.attention.kv_cache.k_cache": torch.zeros(1)}})]
    save_file({k: v.contiguous() for k, v in state.items()}, tmp_path / "c2i.safetensors")
    save_file({k: v.contiguous() for k, v in hf.items()}, tmp_path / "c2i_hf.safetensors")
    files += [tmp_path / "c2i.safetensors", tmp_path / "c2i_hf.safetensors"]
    cond, tokens = GOLDEN["c2i.labels"][:, None], GOLDEN["c2i.tokens"]
    for path in files:
        policy = load_bundle(pcfg("c2i", path=str(path)), "cpu").policy
        assert torch.equal(policy.image_logits(cond, tokens), c2i.image_logits(cond, tokens)), path.name


def test_a_caption_model_without_its_null_caption_is_refused_by_name(tmp_path, t5_dir):
    state = torch.load(DATA / "t2i_tiny.pt", weights_only=True)["model"]
    del state["cls_embedding.uncond_embedding"]  # as a saver of trained parameters only leaves it out
    path = save_as(tmp_path, "t2i_trained.pt", {"model": state})
    with pytest.raises(CheckpointError, match="text-to-image LlamaGen without cls_embedding.uncond_embedding"):
        load_bundle(pcfg("t2i", t5_dir, path=str(path)), "cpu")


def test_unexpected_missing_or_misshapen_keys_are_named(tmp_path):
    state = torch.load(DATA / "c2i_tiny.pt", weights_only=True)["model"]
    cases = {"extra": ({**state, "layers.0.attention.bias": torch.zeros(3)}, "has layers.0.attention.bias, which"),
             "missing": ({k: v for k, v in state.items() if k != "norm.weight"}, "lacks norm.weight"),
             "shape": ({**state, "norm.weight": torch.ones(7)}, r"norm.weight of shape \[7\], not \[32\]"),
             "nan": ({**state, "norm.weight": torch.full((32,), float("nan"))}, "32 NaN or infinite values")}
    for name, (bad, message) in cases.items():
        path = save_as(tmp_path, f"{name}.pt", {"model": bad})
        with pytest.raises(CheckpointError, match=f"policy.path {path}.*{message}"):
            load_bundle(pcfg("c2i", path=str(path)), "cpu")


def test_misshapen_integer_or_oversized_models_are_one_line_errors(tmp_path, t5_dir):
    """A clear one-line error for each; before, each was a traceback, a silent load, or an allocation of terabytes."""
    import shutil

    state = torch.load(DATA / "c2i_tiny.pt", weights_only=True)["model"]
    row = state["tok_embeddings.weight"][0]  # [32]: a 1-D embedding
    flat = save_as(tmp_path, "flat.pt", {"model": {**state, "tok_embeddings.weight": row}})
    # dtypes checked on load: a float model refuses integer tensors (they loaded, each weight cut to a whole number)
    ints = {k: v.to(torch.int32) for k, v in state.items()}
    save_file(ints, tmp_path / "ints.safetensors")
    vq = torch.load(DATA / "vq_tiny.pt", weights_only=True)
    vq = vq.get("model", vq)
    codebook = vq["quantize.embedding.weight"]
    int_vq = save_as(tmp_path, "vq_int.pt", {"model": {**vq, "quantize.embedding.weight": codebook.int()}})
    bare_t5 = Path(shutil.copytree(t5_dir, tmp_path / "t5_without_weights"))
    (bare_t5 / "model.safetensors").unlink()
    cases = [(pcfg("c2i", path=str(flat)), CheckpointError,
              r"flat.pt has tok_embeddings.weight of shape \[32\], not a \[rows, width\] matrix"),
             (pcfg("c2i", options={**OPTIONS, "image_size": -8}), ConfigError,
              "policy.options.image_size -8 is negative"),
             (pcfg("c2i", options={**OPTIONS, "heads": -4}), ConfigError, "policy.options.heads -4 is negative"),
             (pcfg("c2i", options={**OPTIONS, "image_size": 1048576}), ConfigError,
              r"image size 1048576 \(from policy.options.image_size\) is 524288 tokens per side .* more than the 64 "
              r"supported .* at most 128"),
             (pcfg("c2i", path=str(save_as(tmp_path, "ints.pt", {"model": ints}))), CheckpointError,
              "ints.pt has integer weights where LlamaGen's are floats: .* is torch.int32 \\(and 17 more\\)"),
             (pcfg("c2i", path=str(tmp_path / "ints.safetensors")), CheckpointError, "has integer weights"),
             (pcfg("c2i", tokenizer=str(int_vq)), CheckpointError,
              "policy.tokenizer .*vq_int.pt has integer weights .*quantize.embedding.weight is torch.int32"),
             (pcfg("t2i", t5_dir, options={**OPTIONS, "text_encoder": str(bare_t5)}), FileNotFoundError,
              "text_encoder .*t5_without_weights has no weights \\(model.safetensors, .*\\): copy google/flan-t5-xl")]
    for config, error, message in cases:
        with pytest.raises(error, match=message) as e:
            load_bundle(config, "cpu")
        assert "\n" not in str(e.value)


def test_bad_settings_are_one_line_errors_naming_the_key(tmp_path, t5_dir):
    cases = [(pcfg("c2i", tokenizer=""), ConfigError, "needs policy.tokenizer"),
             (pcfg("t2i", options=OPTIONS), ConfigError, "needs policy.options.text_encoder"),
             (pcfg("c2i", options={**OPTIONS, "text_encoder": str(t5_dir)}), ConfigError, "class-conditional model"),
             (pcfg("c2i", options={**OPTIONS, "typo": 1}), ConfigError, "policy.options.typo"),
             (pcfg("c2i", options={"heads": 4}), ConfigError,
              "image_size is not set and neither c2i_tiny.pt nor its args say it"),
             (pcfg("t2i", t5_dir, options={**OPTIONS, "text_encoder": str(t5_dir), "cls_token_num": 121}),
              ConfigError, "cls_token_num 121 is not in 1..120"),
             (pcfg("c2i", options={**OPTIONS, "cls_token_num": 120}), ConfigError,
              "class-conditional model, which reads one condition position"),
             (pcfg("c2i", options={**OPTIONS, "gpt": "GPT-Z"}), ConfigError, "'GPT-Z' is not a LlamaGen size"),
             (pcfg("c2i", options={**OPTIONS, "gpt": "GPT-B"}), ConfigError, "GPT-B has 12 layers of width 768"),
             (pcfg("c2i", options={"image_size": 8}), ConfigError, "set policy.options.heads"),
             (pcfg("t2i", t5_dir, options={**OPTIONS, "text_encoder": str(tmp_path)}), FileNotFoundError,
              "text_encoder .* has no config.json"),
             (pcfg("c2i", path=str(tmp_path / "c2i_XL_384.pt")), FileNotFoundError, "is not a file"),
             (pcfg("c2i", tokenizer=str(DATA / "c2i_tiny.pt")), CheckpointError, "not a LlamaGen VQ checkpoint"),
             (pcfg("c2i", path=str(DATA / "vq_tiny.pt")), CheckpointError, "not a LlamaGen GPT checkpoint")]
    cases += [(PolicyConfig(kind=kind, path=str(tmp_path), options={"image_size": 256}), ConfigError,
               f"policy.options \\(image_size\\) is not used with policy.kind '{kind}'")
              for kind in ("llama", "janus")]
    cases.append((PolicyConfig(kind="shapes", path=str(tmp_path), options={"image_size": 256}), ConfigError,
                  "unknown key 'policy.options.image_size'; valid keys in policy.options: world_train_split"))
    (tmp_path / "junk.pt").write_bytes(b"not a checkpoint")
    cases.append((pcfg("c2i", path=str(tmp_path / "junk.pt")), CheckpointError, "not a readable torch checkpoint"))
    for config, error, message in cases:
        with pytest.raises(error, match=message) as e:
            load_bundle(config, "cpu")
        assert "\n" not in str(e.value)


def test_a_crafted_pickle_named_like_a_llamagen_checkpoint_runs_no_code(tmp_path):
    from tests.test_security import Payload, armed

    def crafted(path, marker):
        torch.save({"model": Payload(marker), "steps": 1}, path)

    assert armed(crafted, tmp_path)  # the control: unpickled the unsafe way, it creates its marker
    marker = tmp_path / "RAN"
    for name, field in (("t2i_XL_stage1_256.pt", "path"), ("vq_ds16_t2i.pt", "tokenizer")):
        crafted(tmp_path / name, marker)
        with pytest.raises(CheckpointError, match=f"{name} holds pickled Python objects .*it names "
                                                  r"io.open\).*refused for safety"):
            load_bundle(pcfg("c2i", **{field: str(tmp_path / name)}), "cpu")
    assert not marker.exists()


# ---------------------------------------------------------------------------- export


@pytest.mark.parametrize("mode", ["c2i", "t2i"])
@torch.no_grad()
def test_export_writes_llamagens_layout_that_loads_back(mode, tmp_path, c2i, t2i, t5_dir):
    policy = c2i if mode == "c2i" else t2i
    out = tmp_path / "export"
    assert export(policy, out) == [out / "model.pt", out / "model.safetensors"]
    saved = torch.load(out / "model.pt", weights_only=True)  # torch's default since 2.6, and LlamaGen's loading
    golden = torch.load(DATA / f"{mode}_tiny.pt", weights_only=True)["model"]  # the keys gpt.py's Transformer saves
    assert saved.keys() == {"model", "args"}
    assert {k: v.shape for k, v in saved["model"].items()} == {k: v.shape for k, v in golden.items()}
    assert all(torch.equal(saved["model"][k], v.float()) for k, v in golden.items())  # float16 values, held as float32
    # the arguments worked out by hand: 64 codes, 8 px images over a 4x4 grid (a 2x VQ), no gpt.py size name, so
    # the size itself (2 layers of width 32, 4 heads)
    extra = {"num_classes": 10} if mode == "c2i" else {"t5_feature_dim": 24, "t5_feature_max_len": 120}
    assert saved["args"] == {"gpt_type": mode, "vocab_size": 64, "codebook_size": 64,
                             "cls_token_num": 1 if mode == "c2i" else 120, "image_size": 8, "downsample_size": 2,
                             "n_layer": 2, "n_head": 4, "dim": 32, **extra}
    tensors = load_file(out / "model.safetensors")
    assert tensors.keys() == golden.keys() and all(torch.equal(tensors[k], v) for k, v in saved["model"].items())
    LlamaGenPolicy(policy.cfg).load_state_dict(saved["model"], strict=True)
    cond, tokens = golden_cond(policy, mode), GOLDEN[f"{mode}.tokens"]
    for name in ("model.pt", "model.safetensors"):  # no image_size option: the args carry it
        options = {"heads": 4, **({"text_encoder": str(t5_dir)} if mode == "t2i" else {})}
        again = load_bundle(pcfg(mode, path=str(out / name), options=options), "cpu").policy
        assert (again.cfg.image_size, again.cfg.cls_token_num) == (8, policy.cfg.cls_token_num)
        torch.testing.assert_close(again.image_logits(cond, tokens), policy.image_logits(cond, tokens), atol=1e-5,
                                   rtol=0)


@torch.no_grad()
def test_export_keeps_the_dtype_and_the_caption_length(tmp_path, t5_dir):
    import copy

    seven = load_bundle(pcfg("t2i", t5_dir, path=str(with_args(tmp_path, "seven.pt", {"cls_token_num": 7}))),
                        "cpu").policy
    half = copy.deepcopy(seven).to(torch.bfloat16)
    export(half, tmp_path / "out")
    saved = torch.load(tmp_path / "out" / "model.pt", weights_only=True)
    assert {v.dtype for v in saved["model"].values()} == {torch.bfloat16} and saved["args"]["cls_token_num"] == 7
    assert {v.dtype for v in load_file(tmp_path / "out" / "model.safetensors").values()} == {torch.bfloat16}
    for name in ("model.pt", "model.safetensors"):
        again = load_bundle(pcfg("t2i", t5_dir, path=str(tmp_path / "out" / name)), "cpu").policy
        assert again.cfg.cls_token_num == 7 and again.cls_embedding.uncond_embedding.shape == (120, 24)


def test_export_refuses_an_unmerged_adapter_and_non_finite_weights(tmp_path, c2i):
    import copy

    wrapped = add_adapter(copy.deepcopy(c2i), "lora", 4, 8.0, ["wqkv"])
    with pytest.raises(ValueError, match="has layers.0.attention.wqkv.base_layer.weight, .*merge_and_unload"):
        export(wrapped.get_base_model(), tmp_path / "lora")
    broken = copy.deepcopy(c2i)
    with torch.no_grad():
        broken.norm.weight[0] = float("nan")
    with pytest.raises(CheckpointError, match="holds 1 NaN or infinite values in norm.weight: not exported"):
        export(broken, tmp_path / "nan")
    assert not (tmp_path / "nan" / "model.pt").exists()


# ---------------------------------------------------------------------------- train, sample, demo


@pytest.fixture(scope="module")
def clip_options(tmp_path_factory):
    """reward.options.clip for a random open_clip model of ShapesWorld's tiny CLIP architecture."""
    import open_clip

    from grpo_vision.rewards.clip import resolve_model_name
    from grpo_vision.shapes.plugin import CLIP_CONFIG

    torch.manual_seed(0)
    model = open_clip.create_model(resolve_model_name(str(CLIP_CONFIG)), pretrained=None)
    path = tmp_path_factory.mktemp("clip") / "clip.safetensors"
    save_file({k: v.contiguous() for k, v in model.state_dict().items()}, path)
    return {"model": str(CLIP_CONFIG), "checkpoint": str(path)}


def write_config(tmp_path: Path, mode: str, t5_dir: Path, clip: dict | None, **changes: dict) -> Path:
    """Two steps of the tiny `mode` model on the clip reward (`clip`: its options) or, with clip None, on
    jpeg_compressibility; `changes`: keys per section over these (train={"adapter": "lora"}, ...)."""
    prompts = LLAMAGEN_PROMPTS[mode]
    (tmp_path / "train.txt").write_text("\n".join(prompts) + "\n")
    (tmp_path / "eval.txt").write_text("a green cat\n" if mode == "t2i" else "2 a cat\n")
    policy = pcfg(mode, t5_dir)
    config = {
        "run": {"name": f"llamagen_{mode}", "out_dir": str(tmp_path / "runs"), "device": "cpu"},
        "policy": {"kind": "llamagen", "path": policy.path, "tokenizer": policy.tokenizer, "options": policy.options},
        "sample": {"prompts_per_step": 2, "group_size": 4, "cfg_scale": 3.0, "batch_size": 8},
        "train": {"steps": 2, "micro_batch_size": 4, "lr": 1e-3, "beta": 0.04, "gradient_checkpointing": True},
        "reward": {"weights": {"clip": 1.0}, "monitor": [], "options": {"clip": clip}} if clip else
                  {"weights": {"jpeg_compressibility": 1.0}, "monitor": []},
        "data": {"train_prompts": str(tmp_path / "train.txt"), "eval_prompts": str(tmp_path / "eval.txt")},
        "log": {"sample_every": 1, "checkpoint_every": 0, "eval_images": 1, "trackers": []},
    }
    for section, keys in changes.items():
        config[section] = {**config[section], **keys}
    path = tmp_path / f"llamagen_{mode}.yaml"
    path.write_text(json.dumps(config))  # JSON is YAML
    return path


@pytest.mark.e2e
@pytest.mark.parametrize("mode", ["t2i", "c2i"])
def test_two_train_steps_through_the_cli_then_sample_and_the_demo(mode, tmp_path, t5_dir, clip_options):
    from grpo_vision.run.metrics import load_metrics
    from grpo_vision.tools.demo import DemoRun, clean_prompt, summary_rows

    done = run_cli("train", write_config(tmp_path, mode, t5_dir, clip_options))
    assert done.returncode == 0, done.stderr[-3000:]
    run = tmp_path / "runs" / f"llamagen_{mode}"
    metrics = load_metrics(run)
    assert [m["step"] for m in metrics] == [1, 2]
    assert all(torch.isfinite(torch.tensor([m["loss/policy"], m["reward/clip/mean"]])).all() for m in metrics)
    after = load_file(run / "checkpoints" / "step_000002" / "policy.safetensors")
    before = torch.load(DATA / f"{mode}_tiny.pt", weights_only=True)["model"]
    moved = [k for k in after if not torch.equal(after[k], before[k].float())]
    # the null caption is a buffer, never trained: a checkpoint holding it (persistent buffers) holds it unchanged
    assert any("layers.1.attention.wqkv" in k for k in moved) and "cls_embedding.uncond_embedding" not in moved
    assert (run / "samples" / "step_000001.png").is_file() and (run / "report.md").is_file()

    prompt = "a red dog" if mode == "t2i" else "5 a dog"
    (tmp_path / "ask.txt").write_text(prompt + "\n")
    done = run_cli("sample", run, "--prompts", tmp_path / "ask.txt", "--n", "2", "--out", tmp_path / "png",
                   "--device", "cpu")
    assert done.returncode == 0, done.stderr[-3000:]
    assert len(list((tmp_path / "png").glob("*.png"))) == 2

    demo = DemoRun(run, "cpu")  # what the app's Compare button runs, without a browser
    text = clean_prompt(prompt, demo.bundle.policy)
    params = SamplingParams(cfg_scale=2.0)
    left, right = demo.side("step 2", text, [0, 1], params), demo.side("reference", text, [0, 1], params)
    assert left.images.shape == (2, 3, 8, 8) and not torch.equal(left.images, right.images)
    assert summary_rows(left, right)[0][0] == "clip"

    if mode == "t2i":  # the reward-swap matrix on this kind, as on any: one run trained, scored against the base
        done = run_cli("matrix", write_config(tmp_path, mode, t5_dir, clip_options), "--out", tmp_path / "matrix",
                       "--rewards", "placebo", "--images", "2")
        assert done.returncode == 0, done.stderr[-3000:]
        result = json.loads((tmp_path / "matrix" / "matrix.json").read_text())
        (row,) = result["runs"]
        assert row["summary"]["step"] == 2 and math.isfinite(row["summary"]["sets"]["test"]["clip"]["change"]["mean"])


@pytest.mark.parametrize("name", ["llamagen_t2i.yaml", "llamagen_c2i.yaml"])
def test_shipped_configs_name_valid_options(name):
    from grpo_vision.config import load_config
    from grpo_vision.policy import kind_options

    cfg = load_config(ROOT / "configs" / name)
    options = kind_options(cfg.policy)  # the LlamaGenOptions the llamagen kind registered
    # no gpt pin: the size comes from the weights, so another size's checkpoint needs no override
    assert cfg.policy.kind == "llamagen" and not options.gpt and (options.text_encoder != "") == ("t2i" in name)


def test_token_weighting_hooks_are_what_the_model_embeds_and_decodes(c2i):
    # GCPO compares the GPT's input embeddings of image tokens; STAGE the normalised codes the VQ decoder reads
    tokens = torch.tensor([[0, 7, 63, 7], [1, 2, 3, 4]])
    emb = c2i.token_embeddings(tokens)
    assert emb.shape == (2, 4, c2i.cfg.dim) and not emb.requires_grad
    assert torch.equal(emb, c2i.tok_embeddings.weight[tokens])
    vq = load_bundle(pcfg("c2i"), "cpu").tokenizer
    vectors = vq.code_vectors(tokens)  # [2, 4, D]
    assert torch.equal(vectors, vq.codebook()[tokens])  # codebook_l2_norm: decode_raw's zq
    torch.testing.assert_close(vectors.norm(dim=-1), torch.ones(2, 4))
    assert torch.equal(vectors[0, 1], vectors[0, 3])


def test_a_run_folders_own_image_size_wins_over_the_config_continuing_it(tmp_path, t5_dir):
    from grpo_vision.config import load_config, save_config

    run = tmp_path / "run"
    (run / "checkpoints").mkdir(parents=True)
    own = pcfg("c2i")  # trained at 8 px (OPTIONS)
    save_config(load_config(None, ["policy.kind=llamagen", f"policy.path={own.path}",
                                   f"policy.tokenizer={own.tokenizer}", f"policy.options={json.dumps(own.options)}"]),
                run / "config.yaml")
    with pytest.raises(ConfigError) as err:
        load_bundle(PolicyConfig("llamagen", str(run), options={"image_size": 256}), "cpu")
    assert str(err.value) == (f"policy.options.image_size is 256, but the run folder {run} trained at 8: remove "
                              "policy.options.image_size (the run's own is used) or set it to 8")


@pytest.mark.parametrize("mode", ["c2i", "t2i"])
def test_speculative_decoding_verifies_windows_from_per_row_positions(mode, c2i, t2i):
    """decode_block (speculative.py's verify pass) equals teacher forcing at per-row positions (t2i: over padded
    captions), and sample.decode=speculative returns the teacher-forced log-probs (logits reach ~50 here: 2e-4)."""
    from tests.sampling.test_speculative import check_decode_block, check_speculative_sampler

    policy = c2i if mode == "c2i" else t2i
    cond = policy.encode_prompts(["3", "7 dogs", "class 9"] if mode == "c2i" else PROMPTS)
    check_decode_block(policy, cond, atol=2e-4)
    check_speculative_sampler(policy, cond, SamplingParams(cfg_scale=3.0, top_k=16), atol=2e-4)
