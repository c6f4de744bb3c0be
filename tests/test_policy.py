"""The policy contract (policy.py: the ImagePolicy protocol, prompt_problem) on the built-in Llama policy, and
that policy's KV-cache decoding, transformers interop, save/load."""

import pytest
import torch

from grpo_vision.models.llama_hf import condition_text, from_hf_llama, hf_tokenizer, to_hf_llama
from grpo_vision.models.llama import BOI, BOS, NULL, PAD, UNK, LlamaImagePolicy
from grpo_vision.policy import ImagePolicy, prompt_problem
from grpo_vision.sampling import Plan


def decode_all(policy, cond, tokens):
    """Prefill + decode step by step: logits [B, N, K] for every image position."""
    cache = policy.new_cache(cond.shape[0])
    logits = [policy.prefill(cond, cache)]
    for i in range(tokens.shape[1] - 1):
        logits.append(policy.decode(tokens[:, i], cache))
    return torch.stack(logits, dim=1)


def test_satisfies_the_protocol(tiny_policy):
    # each method called as the sampler and the trainer call it, its shape and meaning as ImagePolicy states them
    assert isinstance(tiny_policy, ImagePolicy) and not isinstance(torch.nn.Linear(2, 2), ImagePolicy)
    h, w = tiny_policy.image_grid
    assert (h, w) == (3, 4) and tiny_policy.num_image_tokens == h * w and tiny_policy.codebook_size == 32
    cond = tiny_policy.encode_prompts(["a red circle", "a blue square left of a red circle"])  # [2, L], one L
    assert cond.ndim == 2 and cond.shape[0] == 2 and not cond.is_floating_point()
    null = tiny_policy.null_condition(cond)
    assert null.shape == cond.shape and not torch.equal(null, cond)
    tokens = torch.randint(0, 32, (2, 12), generator=torch.Generator().manual_seed(0))  # codebook ids
    with torch.no_grad():
        full = tiny_policy.image_logits(cond, tokens)  # [2, 12, 32]: the codebook only, not the vocabulary
        image, plan = tiny_policy(cond, tokens, Plan.empty(2))  # a PlanningPolicy's forward: both segments' logits
        assert torch.equal(image, full) and plan.shape == (2, 0, tiny_policy.plan_vocab_size)  # no text stage: T = 0
        unconditional = tiny_policy.image_logits(null, tokens)
        cache = tiny_policy.new_cache(2)
        first = tiny_policy.prefill(cond, cache)  # [2, 32]: image token 0's logits
        second = tiny_policy.decode(tokens[:, 0], cache)  # [2, 32]: token 1's, token 0 appended
    assert full.shape == (2, 12, 32) and first.shape == second.shape == (2, 32)
    torch.testing.assert_close(first, full[:, 0], atol=1e-5, rtol=0)
    torch.testing.assert_close(second, full[:, 1], atol=1e-5, rtol=0)
    assert (unconditional - full).abs().max() > 1e-3  # CFG contrasts two different predictions


def test_words_the_policy_does_not_know_are_named_with_its_vocabulary(tiny_policy):
    assert prompt_problem(tiny_policy, "A Red  circle") is None  # read as the policy reads it: lower case
    assert prompt_problem(tiny_policy, "a teal hexagon left of a teal circle") == (
        "words the policy does not know: 'teal', 'hexagon' (its vocabulary: a red blue circle square left of)")
    assert "at most 8" in prompt_problem(tiny_policy, "a red circle left of a blue square now")

    class ReadsAnything:  # like Janus: no unknown_words, so nothing is unknown
        def encode_prompts(self, prompts):
            return None

    assert prompt_problem(ReadsAnything(), "a teal hexagon") is None


def test_kv_cache_decode_equals_full_forward(tiny_policy):
    cond = tiny_policy.encode_prompts(["a red circle", "a blue square left of a red circle"])
    tokens = torch.randint(0, 32, (2, 12))
    with torch.no_grad():
        full = tiny_policy.image_logits(cond, tokens)  # [2, 12, 32]
        stepped = decode_all(tiny_policy, cond, tokens)
    assert full.shape == (2, 12, 32)
    torch.testing.assert_close(stepped, full, atol=1e-5, rtol=0)


def test_condition_layout_and_null_condition(tiny_policy):
    cond = tiny_policy.encode_prompts(["a red circle", "A  Red   Circle"])
    w = tiny_policy.word_ids
    assert cond[0].tolist() == [PAD, PAD, PAD, PAD, PAD, BOS, w["a"], w["red"], w["circle"], BOI]  # left-padded
    assert torch.equal(cond[0], cond[1])  # case and spacing are normalised
    assert tiny_policy.encode_prompts(["a green circle"])[0, -3].item() == UNK
    null = tiny_policy.null_condition(cond)
    assert null.shape == cond.shape and null[:, -2].eq(NULL).all() and null[:, -1].eq(BOI).all()


def test_too_long_caption_is_refused_with_its_text(tiny_policy):
    with pytest.raises(ValueError, match="'a red circle left of a blue square on the left' has 11 words.*at most 8"):
        tiny_policy.encode_prompts(["a red circle left of a blue square on the left"])


def test_image_logits_cover_the_codebook_rows_only(tiny_policy):
    cond = tiny_policy.encode_prompts(["a red circle"])
    tokens = torch.randint(0, 32, (1, 12))
    h_full = to_hf_llama(tiny_policy)(torch.cat([cond, tokens[:, :-1] + tiny_policy.cfg.image_offset], 1)).logits
    off = tiny_policy.cfg.image_offset
    with torch.no_grad():
        ours = tiny_policy.image_logits(cond, tokens)
    # Ours equals the transformers logits restricted to the codebook slice of the vocabulary.
    torch.testing.assert_close(ours, h_full[:, cond.shape[1] - 1:, off:off + 32], atol=1e-5, rtol=0)


def test_export_to_transformers_and_back_gives_identical_logits(tiny_policy):
    hf = to_hf_llama(tiny_policy)
    assert type(hf).__name__ == "LlamaForCausalLM"
    assert set(hf.state_dict()) - {"model.rotary_emb.inv_freq"} == set(tiny_policy.state_dict())
    back = from_hf_llama(hf, tiny_policy.cfg)
    cond = tiny_policy.encode_prompts(["a blue square"])
    tokens = torch.randint(0, 32, (1, 12))
    with torch.no_grad():
        assert torch.equal(back.image_logits(cond, tokens), tiny_policy.image_logits(cond, tokens))


def test_save_and_load_round_trip(tiny_policy, tmp_path):
    tiny_policy.save_pretrained(tmp_path / "p")
    loaded = LlamaImagePolicy.from_pretrained(tmp_path / "p")
    assert loaded.cfg == tiny_policy.cfg
    cond = tiny_policy.encode_prompts(["a red circle"])
    tokens = torch.randint(0, 32, (1, 12))
    with torch.no_grad():
        assert torch.equal(loaded.image_logits(cond, tokens), tiny_policy.image_logits(cond, tokens))


def test_missing_checkpoint_is_named(tmp_path):
    with pytest.raises(FileNotFoundError, match=r"nowhere has no policy_config.json"):
        LlamaImagePolicy.from_pretrained(tmp_path / "nowhere")


def test_integer_weights_are_refused_at_load(tiny_policy, tmp_path):
    from safetensors.torch import load_file, save_file

    from grpo_vision.run.checkpoint import CheckpointError

    tiny_policy.save_pretrained(tmp_path)
    weights = tmp_path / "policy.safetensors"
    save_file({k: v.to(torch.int32) for k, v in load_file(weights).items()}, weights)
    with pytest.raises(CheckpointError, match=f"{weights} has integer weights where the policy's are floats: "
                                              r".* is torch.int32 \(and \d+ more\); rewrite it with save_pretrained"):
        LlamaImagePolicy.from_pretrained(tmp_path)


def test_gradients_reach_every_parameter(tiny_policy):
    cond = tiny_policy.encode_prompts(["a red circle"])
    tokens = torch.randint(0, 32, (1, 12))
    tiny_policy.image_logits(cond, tokens).logsumexp(-1).sum().backward()
    no_grad = [n for n, p in tiny_policy.named_parameters() if p.grad is None or not p.grad.abs().sum() > 0]
    assert no_grad == []


def test_lora_adapters_are_used_by_kv_cache_decode(tiny_policy):
    from peft import LoraConfig, get_peft_model

    model = get_peft_model(tiny_policy, LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj", "up_proj"]))
    with torch.no_grad():  # make the adapters non-zero (lora_B starts at zero)
        for name, p in model.named_parameters():
            if "lora_B" in name:
                p.normal_(std=0.5)
    cond = model.encode_prompts(["a red circle", "a blue square"])
    tokens = torch.randint(0, 32, (2, 12))
    with torch.no_grad():
        full = model.image_logits(cond, tokens)
        torch.testing.assert_close(decode_all(model, cond, tokens), full, atol=1e-5, rtol=0)
        with model.disable_adapter():
            base = model.image_logits(cond, tokens)
            torch.testing.assert_close(decode_all(model, cond, tokens), base, atol=1e-5, rtol=0)
    assert (full - base).abs().max() > 1e-2  # the adapters really change the logits


def test_attention_stays_float32_under_cpu_autocast():
    # CPU autocast would run scaled_dot_product_attention in bf16, whose backward is slower than
    # float32's on CPU; `attention` keeps it in float32 and equal to the plain call.
    from grpo_vision.models.llama import attention

    q, k, v = torch.randn(2, 4, 9, 8), torch.randn(2, 2, 9, 8), torch.randn(2, 2, 9, 8)
    plain = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        y = attention(q.bfloat16(), k, v, causal=True, gqa=True)
    assert y.dtype == torch.float32
    torch.testing.assert_close(y, attention(q.bfloat16().float(), k, v, causal=True, gqa=True))
    torch.testing.assert_close(attention(q, k, v, causal=True, gqa=True), plain)


def test_the_transformers_tokenizer_reads_captions_as_encode_prompts_does(tiny_policy):
    # TRL tokenizes the dataset's prompt text itself: the rows must be the policy's condition ids
    tok = hf_tokenizer(tiny_policy.cfg)
    captions = ["a red circle", "a blue square left of a red circle", "a mauve circle"]  # mauve: unknown
    ids = tok([condition_text(c, tiny_policy.cfg) for c in captions], return_tensors="pt").input_ids
    assert torch.equal(ids, tiny_policy.encode_prompts(captions))  # <pad>s first, then <bos>, as ours
    assert tok.decode([tiny_policy.cfg.image_offset + 3]) == "<code_3>"


def test_gradient_checkpointing_gives_the_same_gradients(tiny_policy, checkpointing_gradients):
    # recomputing each block in the backward pass runs the same ops again: equal gradients, less memory
    plain, remat = checkpointing_gradients(tiny_policy, ["a red circle", "a blue square"])
    assert plain.keys() == remat.keys() and any(g.abs().sum() > 0 for g in remat.values())
    assert all(torch.allclose(plain[n], remat[n], rtol=1e-5, atol=1e-7) for n in plain)

def test_a_users_policy_kind_wins_over_the_built_in_of_the_same_name():
    # the built-in kinds register on the first lookup; a user's kind registered before it must not be
    # replaced by them (a fresh interpreter: in this one the built-ins have registered already)
    import subprocess
    import sys

    code = """
import grpo_vision
@grpo_vision.register_policy_kind("llama")
def mine(pcfg, device):
    return None
from grpo_vision.policy import policy_kind
print(policy_kind("llama").load is mine)
"""
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert out.stdout.strip() == "True", out.stderr[-2000:]
