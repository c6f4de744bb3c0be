"""Janus-Pro adapter on a tiny random Janus saved to disk and loaded through the real path.

The model (text width 32, 2 layers, 64-code VQ, 4x4 tokens of a 32 px image) and its processor (a
WordLevel tokenizer with Janus's special tokens and a chat template) are written with
`save_pretrained`, then read back by `JanusImagePolicy.from_pretrained` / `load_bundle`.
"""

import copy
import json
import logging
import shutil
import warnings
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from grpo_vision.config import ConfigError, PolicyConfig, load_config
from grpo_vision.models.janus import NO_TOKEN, JanusImagePolicy, JanusVQTokenizer
from grpo_vision.policy import load_bundle
from grpo_vision.models.adapters import add_adapter
from grpo_vision.run.metrics import load_metrics
from grpo_vision.sampling import SamplingParams, sample, sequence_logprobs
from grpo_vision.train import train

SPECIAL = ["<pad>", "<bos>", "<eos>", "<image_placeholder>", "<begin_of_image>", "<end_of_image>",
           "<|User|>", "<|Assistant|>", "<unk>"]
WORDS = "a red blue green circle square left right of : . ,".split()
PAD, BOS, BOI = 0, 1, 4
# The generation prompt of transformers' converted Janus-Pro chat template, for a one-turn user message.
TEMPLATE = ("{% for m in messages %}{% if m['role'] == 'user' %}<|User|>: {{ m['content'][0]['text'] | trim }}"
            "\n\n{% endif %}{% endfor %}{% if add_generation_prompt %}<|Assistant|>:{% endif %}")
PROMPTS = ["a red circle", "a blue square left of a red circle", "a green square"]


def build_tiny_janus(path: Path, words=WORDS, template: str = TEMPLATE, system_prompt: bool = False) -> Path:
    """`words`: the vocabulary after the special tokens; `template`: the processor's chat template; `system_prompt`:
    the processor's `use_default_system_prompt` (transformers' conversion script sets it for the released models)."""
    from tokenizers import Tokenizer, models, pre_tokenizers, processors
    from transformers import GenerationConfig, JanusConfig, JanusForConditionalGeneration, LlamaTokenizerFast
    from transformers.models.janus.image_processing_janus import JanusImageProcessor
    from transformers.models.janus.processing_janus import JanusProcessor

    vocab = {t: i for i, t in enumerate(SPECIAL + list(words))}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.add_special_tokens(SPECIAL)
    tok.post_processor = processors.TemplateProcessing(single="<bos> $A", special_tokens=[("<bos>", BOS)])
    # JanusProcessor before transformers 5 accepts only a Llama tokenizer (what the converted checkpoints carry)
    text_tokenizer = LlamaTokenizerFast(
        tokenizer_object=tok, bos_token="<bos>", eos_token="<eos>", pad_token="<pad>", unk_token="<unk>",
        extra_special_tokens={"image_token": "<image_placeholder>", "boi_token": "<begin_of_image>",
                              "eoi_token": "<end_of_image>"})
    processor = JanusProcessor(JanusImageProcessor(size={"height": 32, "width": 32}), text_tokenizer,
                               chat_template=template, num_image_tokens=16, use_default_system_prompt=system_prompt)
    config = JanusConfig(  # projection_dim and image_token_embed_dim must equal the text width
        text_config=dict(model_type="llama", vocab_size=len(vocab), hidden_size=32, intermediate_size=64,
                         num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                         pad_token_id=PAD, bos_token_id=BOS, eos_token_id=2),
        vision_config=dict(image_size=32, patch_size=8, num_image_tokens=16, hidden_size=32, num_hidden_layers=1,
                           num_attention_heads=2, projection_dim=32, mlp_ratio=2),
        vq_config=dict(embed_dim=8, num_embeddings=64, latent_channels=32, base_channels=32,  # 8x downsample
                       channel_multiplier=[1, 1, 2, 2], num_res_blocks=1, projection_dim=32, image_token_embed_dim=32),
        image_token_id=3)
    torch.manual_seed(0)
    model = JanusForConditionalGeneration(config).eval()
    with torch.no_grad():  # peaked (not near-uniform) image-token logits, so CFG and top-k matter
        for name, p in model.named_parameters():
            if p.ndim > 1 and "vqmodel" not in name:
                p.mul_(8.0 if "generation" in name else 4.0)
    model.generation_config = GenerationConfig(bos_token_id=BOS, pad_token_id=PAD,
                                               generation_kwargs={"boi_token_id": BOI})
    model.save_pretrained(str(path))
    processor.save_pretrained(str(path))
    return path


@pytest.fixture(scope="module")
def policy(janus_dir):
    return JanusImagePolicy.from_pretrained(janus_dir)


def chat(policy, prompts):
    """What transformers' docs do: chat template, then the processor in image mode."""
    texts = [policy.processor.apply_chat_template([{"role": "user", "content": [{"type": "text", "text": p}]}],
                                                  add_generation_prompt=True) for p in prompts]
    return policy.processor(text=texts, generation_mode="image", padding=True, return_tensors="pt")


def test_condition_is_the_chat_prompt_and_null_follows_generate(policy):
    cond = policy.encode_prompts(PROMPTS[:2])
    enc = chat(policy, PROMPTS[:2])
    assert torch.equal(cond, enc["input_ids"].masked_fill(enc["attention_mask"] == 0, NO_TOKEN))
    assert (cond[:, -1] == BOI).all() and cond[0, 0] == NO_TOKEN and cond[1, 0] == BOS  # left padding
    words = policy.processor.tokenizer.convert_ids_to_tokens(cond[1][cond[1] >= 0].tolist())
    assert words[:3] == ["<bos>", "<|User|>", ":"] and words[-3:] == ["<|Assistant|>", ":", "<begin_of_image>"]
    null = policy.null_condition(cond)
    keep = (cond == BOS) | (cond == BOI) | (cond == NO_TOKEN)
    assert torch.equal(null[keep], cond[keep]) and (null[~keep] == PAD).all()
    assert policy.image_grid == (4, 4) and policy.num_image_tokens == 16 and policy.codebook_size == 64


@torch.no_grad()
def test_guided_logits_match_transformers_generate(policy):
    """Greedy `generate(generation_mode="image")` with CFG records its raw [cond; uncond] scores at
    every step; the sampler (top_k=1) must pick the same tokens and its cached logits must match."""
    from transformers import LogitsProcessor, LogitsProcessorList

    class Record(LogitsProcessor):  # runs before the CFG processor generate() appends: sees [2B, K]
        def __init__(self):
            self.scores = []

        def __call__(self, input_ids, scores):
            self.scores.append(scores.clone())
            return scores

    scale, B = 3.0, len(PROMPTS)
    record = Record()
    generated = policy.model.generate(**chat(policy, PROMPTS), generation_mode="image", do_sample=False,
                                      guidance_scale=scale, logits_processor=LogitsProcessorList([record]))
    theirs = torch.stack(record.scores, dim=1)  # [2B, N, K]
    cond = policy.encode_prompts(PROMPTS)
    ours_sampled = sample(policy, cond, list(range(B)), SamplingParams(cfg_scale=scale, top_k=1))
    assert torch.equal(ours_sampled.tokens, generated)
    rows = torch.cat([cond, policy.null_condition(cond)])  # [2B, L]
    cache = policy.new_cache(2 * B)
    steps = [policy.prefill(rows, cache)]
    for i in range(policy.num_image_tokens - 1):
        steps.append(policy.decode(generated[:, i].repeat(2), cache))
    ours = torch.stack(steps, dim=1)  # [2B, N, K]

    def guided(x):
        return x[B:] + scale * (x[:B] - x[B:])

    diff = (guided(ours) - guided(theirs)).abs().max().item()
    print(f"max |guided logits - generate's| = {diff:.2e}")
    assert diff < 1e-5 and (ours - theirs).abs().max() < 1e-5
    teacher_forced = policy.image_logits(rows, generated.repeat(2, 1))  # [2B, N, K], one pass
    assert (teacher_forced - ours).abs().max() < 1e-5


MODES = [SamplingParams(cfg_scale=3.0), SamplingParams(cfg_scale=2.0, temperature=0.8, top_k=8, top_p=0.9),
         SamplingParams(cfg_scale=3.0, logprob_mode="conditional"), SamplingParams(temperature=1.2)]


@pytest.mark.parametrize("params", MODES, ids=str)
def test_rollout_logprobs_equal_teacher_forced_logprobs(policy, params):
    cond = policy.encode_prompts(PROMPTS * 2)  # with left-padded rows
    rollout = sample(policy, cond, list(range(6)), params)
    logp = sequence_logprobs(policy, cond, rollout, params)
    diff = (logp - rollout.logprobs).abs().max().item()
    print(f"max |rollout - teacher-forced logprob| = {diff:.2e}")
    assert diff < 1e-5  # the ratio is 1 before the first update
    assert logp.requires_grad and rollout.logprobs.mean() < -0.1  # not a degenerate, deterministic sampler


def test_gradient_checkpointing_gives_the_same_gradients(policy, checkpointing_gradients):
    # recomputing each block in the backward pass runs the same ops again: equal gradients, less memory
    plain, remat = checkpointing_gradients(policy, PROMPTS)
    assert plain.keys() == remat.keys() and any(g.abs().sum() > 0 for g in remat.values())
    assert all(torch.allclose(plain[n], remat[n], rtol=1e-4, atol=1e-6) for n in plain)


@torch.no_grad()
def test_left_padding_does_not_change_the_logits(policy):
    tokens = torch.randint(0, policy.codebook_size, (1, policy.num_image_tokens))
    alone = policy.image_logits(policy.encode_prompts(PROMPTS[:1]), tokens)
    padded = policy.image_logits(policy.encode_prompts(PROMPTS[:2]), tokens.repeat(2, 1))[:1]
    assert (alone - padded).abs().max() < 1e-5


def test_vq_tokenizer_decodes_to_unit_range_and_encodes_like_the_l2_quantizer(policy):
    tok = policy.image_tokenizer()
    assert isinstance(tok, JanusVQTokenizer) and tok.grid == (4, 4) and tok.codebook_size == 64
    codes = torch.randint(0, 64, (2, 16))
    images = tok.decode(codes)
    assert images.shape == (2, 3, 32, 32) and images.min() >= 0 and images.max() <= 1
    assert tok.encode(images).shape == (2, 16)
    # With unit-norm codes, nearest by distance (transformers' quantizer) = nearest by cosine (ours).
    vq = JanusVQTokenizer(copy.deepcopy(policy.model.model.vqmodel))
    with torch.no_grad():
        vq.vq.quantize.embedding.weight.copy_(torch.nn.functional.normalize(vq.vq.quantize.embedding.weight, dim=-1))
        z = vq.vq.quant_conv(vq.vq.encoder(images * 2 - 1))  # what `encode` runs; it returns a tuple before 4.5x
        theirs = vq.vq.quantize(z)[2].view(2, -1)  # (quantized, loss, indices) in every supported release
    assert torch.equal(vq.encode(images), theirs)


def test_load_bundle_freezes_understanding_and_lora_stays_in_the_language_model(janus_dir):
    bundle = load_bundle(PolicyConfig(kind="janus", path=str(janus_dir)), "cpu")
    assert isinstance(bundle.policy, JanusImagePolicy) and bundle.judge is None
    assert bundle.tokenizer.vq is bundle.policy.model.model.vqmodel  # one VQ in memory
    trainable = {n for n, p in bundle.policy.named_parameters() if p.requires_grad}
    assert trainable and all(n.startswith(("model.model.language_model.layers", "model.model.language_model.norm",
                                           "model.model.generation_")) for n in trainable)
    wrapped = add_adapter(bundle.policy, "lora", 4, 8.0, ["q_proj", "k_proj", "v_proj", "o_proj"])
    lora = [n for n, p in wrapped.named_parameters() if p.requires_grad]
    assert len(lora) == 2 * 4 * 2  # A and B, 4 projections, 2 layers: none in the SigLIP tower
    assert all("language_model.layers" in n and "lora_" in n for n in lora)
    with pytest.raises(ConfigError, match="not used with policy.kind 'janus'"):
        load_bundle(PolicyConfig(kind="janus", path=str(janus_dir), tokenizer="vq"), "cpu")
    with pytest.raises(FileNotFoundError, match="nowhere has no config.json"):
        load_bundle(PolicyConfig(kind="janus", path=str(janus_dir.parent / "nowhere")), "cpu")


def test_loading_sampling_and_scoring_use_no_deprecated_transformers_names(janus_dir):
    """transformers deprecates an argument with a FutureWarning (`deprecate_kwarg`) and an output name with a
    logged warning, the latter once per process: both are caught here, the log's memory cleared first."""
    from transformers.utils import logging as hf_logging

    logged, verbosity = [], hf_logging.get_verbosity()
    handler = logging.Handler()
    handler.emit = logged.append
    hf_logging.warning_once.cache_clear()  # a warning logged once already in this process would not log again
    hf_logging.set_verbosity_warning()
    hf_logging.get_logger().addHandler(handler)  # transformers' root logger does not propagate to pytest's
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            policy = JanusImagePolicy.from_pretrained(janus_dir)
            cond = policy.encode_prompts(PROMPTS)
            params = SamplingParams(cfg_scale=3.0)
            rollout = sample(policy, cond, list(range(3)), params)  # prefill (transformers' forward) and decode
            sequence_logprobs(policy, cond, rollout, params)  # the teacher-forced forward
            policy.image_tokenizer().decode(rollout.tokens)
    finally:
        hf_logging.get_logger().removeHandler(handler)
        hf_logging.set_verbosity(verbosity)
    deprecated = [str(w.message) for w in caught if issubclass(w.category, (FutureWarning, DeprecationWarning))]
    deprecated += [r.getMessage() for r in logged if "deprecat" in r.getMessage().lower()]
    assert deprecated == []


@pytest.mark.parametrize("broken", ["no generation_kwargs", "no file"])
def test_a_generation_config_without_the_boi_token_is_a_one_line_error(janus_dir, tmp_path, broken):
    # transformers' generate(generation_mode="image") reads generation_kwargs["boi_token_id"]; the fix names its value
    copy_dir = Path(shutil.copytree(janus_dir, tmp_path / "janus"))
    gen_file = copy_dir / "generation_config.json"
    if broken == "no file":
        gen_file.unlink()
    else:
        gen = json.loads(gen_file.read_text())
        del gen["generation_kwargs"]
        gen_file.write_text(json.dumps(gen))
    with pytest.raises(ConfigError) as error:
        JanusImagePolicy.from_pretrained(copy_dir)
    message = str(error.value)
    assert "\n" not in message and str(gen_file) in message
    assert ("is missing" if broken == "no file" else "has no generation_kwargs.boi_token_id") in message
    assert f'"generation_kwargs": {{"boi_token_id": {BOI}}}' in message  # the <begin_of_image> id, 4


@torch.no_grad()
def test_save_pretrained_round_trip(policy, tmp_path):
    policy.save_pretrained(tmp_path / "copy")
    loaded = JanusImagePolicy.from_pretrained(tmp_path / "copy")
    cond = policy.encode_prompts(PROMPTS)
    tokens = torch.randint(0, 64, (3, 16))
    assert torch.equal(loaded.encode_prompts(PROMPTS), cond)
    assert torch.equal(loaded.image_logits(cond, tokens), policy.image_logits(cond, tokens))


def write_config(tmp_path: Path, janus_dir: Path, reference: str) -> Path:
    (tmp_path / "train.txt").write_text("\n".join(PROMPTS) + "\n")
    (tmp_path / "eval.txt").write_text("a blue circle\n")
    config = {
        "run": {"name": f"janus_{reference}", "out_dir": str(tmp_path / "runs"), "device": "cpu"},
        "policy": {"kind": "janus", "path": str(janus_dir)},
        "sample": {"prompts_per_step": 2, "group_size": 4, "cfg_scale": 3.0, "batch_size": 8},
        "train": {"steps": 2, "micro_batch_size": 4, "num_iterations": 2, "beta": 0.04, "lr": 1e-3,
                  **({"adapter": "lora", "reference": "adapter", "adapter_rank": 4} if reference == "lora" else
                     {"reference": reference})},
        "reward": {"weights": {"jpeg_compressibility": 1.0}, "monitor": []},
        "data": {"train_prompts": str(tmp_path / "train.txt"), "eval_prompts": str(tmp_path / "eval.txt")},
        "log": {"sample_every": 1, "checkpoint_every": 0, "eval_images": 1, "trackers": []},
    }
    path = tmp_path / f"janus_{reference}.yaml"
    path.write_text(json.dumps(config))  # JSON is YAML
    return path


def test_two_lora_steps_move_the_adapters(janus_dir, tmp_path):
    run = train(load_config(write_config(tmp_path, janus_dir, "lora")), progress=False)
    after = load_file(run / "checkpoints" / "step_000002" / "policy.safetensors")
    assert after and all("lora_" in k and "language_model" in k for k in after)
    assert max(after[k].abs().max().item() for k in after if "lora_B" in k) > 0  # B starts at zero
    metrics = load_metrics(run)
    assert [m["step"] for m in metrics] == [1, 2]
    assert all(m["loss/ratio_mean"] is not None and m["reward/jpeg_compressibility/mean"] is not None for m in metrics)
    assert (run / "samples" / "step_000001.png").is_file() and (run / "report.md").is_file()


def test_two_full_fine_tune_steps_move_the_generation_path(janus_dir, tmp_path):
    run = train(load_config(write_config(tmp_path, janus_dir, "frozen")), progress=False)
    after = load_file(run / "checkpoints" / "step_000002" / "policy.safetensors")
    before = load_file(janus_dir / "model.safetensors")
    assert not any(k.startswith(("model.model.vision_model", "model.model.vqmodel", "model.lm_head")) for k in after)
    moved = {k for k in after if not torch.equal(after[k], before[k.removeprefix("model.")])}
    assert any("generation_head" in k for k in moved) and any("language_model.layers" in k for k in moved)


def test_token_weighting_hooks_are_what_the_model_embeds_and_decodes(policy):
    # GCPO compares the language model's input embeddings of image tokens (prepare_gen_img_embeds); STAGE the
    # L2-normalised code vectors the VQ decoder starts from (get_codebook_entry's quant)
    tokens = torch.tensor([[0, 5, 63, 5] * 4])  # [1, 16]: the 4x4 grid
    emb = policy.token_embeddings(tokens)
    m = policy.model.model
    assert emb.shape == (1, 16, 32) and not emb.requires_grad
    assert torch.equal(emb, m.generation_aligner(m.generation_embeddings(tokens)))
    vectors = policy.image_tokenizer().code_vectors(tokens)  # [1, 16, 8]
    quant = m.vqmodel.quantize.get_codebook_entry(tokens)  # [1, 8, 4, 4], what decode feeds the decoder
    torch.testing.assert_close(vectors, quant.permute(0, 2, 3, 1).reshape(1, 16, 8))
    torch.testing.assert_close(vectors.norm(dim=-1), torch.ones(1, 16))


def test_speculative_decoding_verifies_windows_from_per_row_positions(policy):
    """decode_block (speculative.py's verify pass) equals teacher forcing over left-padded rows at their own
    positions, and sample.decode=speculative returns the teacher-forced log-probs."""
    from grpo_vision.sampling import SamplingParams
    from tests.sampling.test_speculative import check_decode_block, check_speculative_sampler

    cond = policy.encode_prompts(["a red circle", "a blue square left of a red circle", "a blue circle"])
    check_decode_block(policy, cond, atol=1e-4)
    check_speculative_sampler(policy, cond, SamplingParams(cfg_scale=3.0, temperature=0.9, top_k=16), atol=1e-4)
