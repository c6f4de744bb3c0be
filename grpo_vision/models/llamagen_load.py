"""Loading LlamaGen's released files as they are: its `.pt` checkpoints (a state dict under "model",
"module" or "state_dict", or bare; the training scripts' "args" beside it) read with
`torch.load(weights_only=True)` only, and their safetensors conversions, in LlamaGen's key names or
transformers-Llama ones, and its VQ checkpoints; the llamagen policy kind's loader. `export` writes a policy back
in that layout.

    policy:
      kind: llamagen
      path: /models/llamagen/t2i_XL_stage1_256.pt      # or c2i_L_256.pt, or a .safetensors conversion
      tokenizer: /models/llamagen/vq_ds16_t2i.pt        # vq_ds16_c2i.pt for the class-conditional models
      options: {image_size: 256, text_encoder: /models/flan-t5-xl}   # LlamaGenOptions
"""

from __future__ import annotations

import argparse
import json
import pickle
import re
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn as nn

from grpo_vision.config.load import ConfigError, brief
from grpo_vision.files import write_file
from grpo_vision.models.llamagen import CAPTION_ROWS, LlamaGenConfig, LlamaGenPolicy
from grpo_vision.run.checkpoint import CheckpointError
from grpo_vision.run.load_checks import integer_weights, non_finite
from grpo_vision.run.safe_state import UnsafeFileError, refusal

# gpt.py's GPT_models: name -> (n_layer, n_head, dim). B..XXXL are the class-conditional sizes, XL the T2I one.
SIZES = {"GPT-B": (12, 12, 768), "GPT-L": (24, 16, 1024), "GPT-XL": (36, 20, 1280), "GPT-XXL": (48, 24, 1536),
         "GPT-XXXL": (48, 40, 2560), "GPT-1B": (22, 32, 2048), "GPT-3B": (24, 32, 3200), "GPT-7B": (32, 32, 4096)}
# LlamaGen's samplers load with load_state_dict(strict=False); what that lets through are its runtime tensors,
# never weights: the RoPE table `freqs_cis` and `causal_mask` (attributes in gpt.py, buffers in some copies) and
# the KV-cache buffers that `setup_caches` registers (a model saved after sampling holds them). Any other key
# that is missing or extra is an error.
RUNTIME_KEYS = re.compile(r"(.*\.)?(freqs_cis|causal_mask)|layers\.\d+\.attention\.kv_cache\.[kv]_cache")
# Image tokens per side at most. No file bounds the grid (gpt.py builds its RoPE table from the image size it is
# given), and the table and the KV cache grow with its square, the attention mask with its fourth power: 1048576 px
# asked for terabytes. LlamaGen's largest release has 32 (512 px at 16x); 64 leaves room for 1024 px, or 512 px at 8x.
MAX_GRID = 64
# the tensors whose shapes size the model (LlamaGenConfig.from_weights): each a [rows, width] matrix
MATRICES = ("tok_embeddings.weight", "layers.0.attention.wqkv.weight", "layers.0.feed_forward.w1.weight",
            "cls_embedding.embedding_table.weight", "cls_embedding.uncond_embedding")


@dataclass
class LlamaGenOptions:
    """`policy.options` of the llamagen kind."""
    gpt: str = ""  # GPT-B, GPT-L, GPT-XL, GPT-XXL, ... (gpt.py's names); "" = the size of the weights' width and depth
    heads: int = 0  # attention heads; 0 = the size's (needed only for a model of no released size)
    image_size: int = 0  # pixels per side the checkpoint was trained at (256, 384, 512); 0 = from its args or name
    text_encoder: str = ""  # t2i: local flan-t5-xl directory (relative: from here, else beside policy.path)
    cls_token_num: int = 0  # t2i caption positions (--cls-token-num it was trained with); 0 = from its args, else 120


def read_state_dict(path: str | Path, what: str) -> dict[str, torch.Tensor]:
    """The state dict in a LlamaGen checkpoint (`read_checkpoint` without the arguments)."""
    return read_checkpoint(path, what)[0]


def read_checkpoint(path: str | Path, what: str) -> tuple[dict[str, torch.Tensor], dict]:
    """(state dict, training arguments) of a LlamaGen checkpoint: a `.pt` holding the state dict under "model"
    (DDP), "module" (DeepSpeed), "state_dict", or bare (FSDP), as sample_t2i.py accepts, its arguments under
    "args" (the training scripts' argparse.Namespace, or a plain dict); or a safetensors file, its arguments
    the JSON of its metadata's "args" (as `export` writes it). Arguments are {} where the file has none.
    Never runs pickled code."""
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"{what} {path} is not a file; expected a LlamaGen checkpoint (.pt or .safetensors)")
    if path.suffix == ".safetensors":
        from safetensors import safe_open

        try:
            with safe_open(str(path), framework="pt") as f:
                state, meta = {k: f.get_tensor(k) for k in f.keys()}, f.metadata() or {}
        except Exception as e:  # a header safetensors cannot parse
            raise CheckpointError(f"{what} {path} is not a readable safetensors file ({type(e).__name__}); "
                                  "copy it again") from None
        try:
            args = json.loads(meta.get("args", "{}"))
        except json.JSONDecodeError:
            args = None
        if not isinstance(args, dict):
            raise CheckpointError(f"{what} {path} has metadata 'args' that is not a JSON object: it is not a file "
                                  "this tool exported; remove that metadata or convert the .pt again")
        return state, args
    try:
        # Tensors, plain containers and argparse.Namespace only: LlamaGen's training scripts save
        # {"model", "optimizer", "steps", "args": args}, and a Namespace is rebuilt by setting attributes.
        with torch.serialization.safe_globals([argparse.Namespace]):
            raw = torch.load(path, map_location="cpu", weights_only=True)
    except pickle.UnpicklingError as e:
        why = refusal(path, e)  # a pickle naming Python objects, or bytes that are no pickle at all
        if isinstance(why, UnsafeFileError):
            raise CheckpointError(f"{what}: {why}. Where you trust the file, convert its weights to safetensors "
                                  "once and point to that (docs/real_models.md, LlamaGen)") from None
        raise CheckpointError(f"{what} {path} is not a readable torch checkpoint ({why}); copy it again") from None
    except Exception as e:  # not a torch archive at all, or a truncated one
        raise CheckpointError(f"{what} {path} is not a readable torch checkpoint ({type(e).__name__}); copy it "
                              "again") from None
    args = raw.get("args") if isinstance(raw, dict) else None
    args = vars(args) if isinstance(args, argparse.Namespace) else args if isinstance(args, dict) else {}
    for key in ("model", "module", "state_dict"):
        if isinstance(raw, dict) and isinstance(raw.get(key), dict):
            raw = raw[key]
            break
    if not isinstance(raw, dict) or not raw or not all(isinstance(v, torch.Tensor) for v in raw.values()):
        raise CheckpointError(f"{what} {path} holds no state dict (under 'model', 'module', 'state_dict' or bare)")
    return raw, args


def arg_int(args: dict, key: str, path: Path) -> int:
    """A positive whole number among a checkpoint's arguments; 0 where it has none."""
    value = args.get(key)
    if value is None:
        return 0
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise CheckpointError(f"policy.path {path} has args.{key} {brief(value)}, not a positive whole number: "
                              f"set policy.options.{key}")
    return value


def check_keys(model: nn.Module, state: dict, path: Path, what: str, ignored: re.Pattern = RUNTIME_KEYS) -> dict:
    """`state` without the keys LlamaGen's own loading ignores (`ignored`); a CheckpointError naming any
    other key that is missing or extra, a tensor of the wrong shape or of an integer dtype, or one that is
    not finite."""
    state = {k: v for k, v in state.items() if not ignored.fullmatch(k)}
    expected = model.state_dict()
    problems = [f"lacks {k}" for k in expected if k not in state]
    problems += [f"has {k}, which this model does not" for k in state if k not in expected]
    problems += [f"has {k} of shape {list(state[k].shape)}, not {list(v.shape)}" for k, v in expected.items()
                 if k in state and state[k].shape != v.shape]
    if problems:
        more = f" (and {len(problems) - 1} more differences)" if len(problems) > 1 else ""
        raise CheckpointError(f"{what} {path} {problems[0]}{more}: it is not the LlamaGen model this setting "
                              "loads; check the file and policy.options")
    if wrong := integer_weights(model, state):  # dtypes checked on load: a float model refuses integer tensors
        raise CheckpointError(f"{what} {path} has integer weights where LlamaGen's are floats: {wrong}; loaded, "
                              "each would be cut to a whole number: use the released file, or a float conversion")
    if bad := non_finite(state):
        raise CheckpointError(f"{what} {path} holds {bad}: the file is damaged; copy it again")
    return state


def caption_length(options: LlamaGenOptions, args: dict, rows: int, path: Path) -> int:
    """t2i caption positions: policy.options.cls_token_num, else the checkpoint's args.cls_token_num (LlamaGen's
    training scripts save their arguments), else 120 (train_t2i.py's default, every released t2i model). Not
    uncond_embedding's rows: LlamaGen makes those 120 whatever --cls-token-num was (gpt.py:93, 273)."""
    if options.cls_token_num:
        if not 1 <= options.cls_token_num <= rows:
            raise ConfigError(f"policy.options.cls_token_num {options.cls_token_num} is not in 1..{rows}: {path} "
                              f"holds {rows} null-caption rows (uncond_embedding), the most it can read")
        return options.cls_token_num
    n = arg_int(args, "cls_token_num", path) or CAPTION_ROWS
    if n > rows:
        raise CheckpointError(f"policy.path {path} has args.cls_token_num {n}, more than its {rows} null-caption "
                              "rows (uncond_embedding): set policy.options.cls_token_num")
    return n


def released_image_size(path: Path) -> int:
    """256 / 384 / 512 from a released file name (c2i_XL_384.pt, t2i_XL_stage1_256.pt); 0 when it has none."""
    m = re.search(r"_(256|384|512)L?$", path.stem)
    return int(m.group(1)) if m else 0


def checked_image_size(options: LlamaGenOptions, path: Path, args: dict) -> tuple[int, str]:
    """(the size `path` was trained at, 0 where neither its `args` nor its name say it; where that came from).
    A ConfigError when policy.options.image_size names another: a 16-token model sampled 4096 tokens an image."""
    recorded, where, source = arg_int(args, "image_size", path), "args.image_size", f"args.image_size of {path.name}"
    if not recorded:
        recorded, where, source = released_image_size(path), "name", f"the name {path.name}"
    if options.image_size and recorded and options.image_size != recorded:
        raise ConfigError(f"policy.options.image_size is {options.image_size}, but {path} was trained at {recorded} "
                          f"(its {where}): remove policy.options.image_size (the file's own size is used) or set it "
                          f"to {recorded}")
    return recorded, source


def checkpoint_args(path: Path) -> dict:
    """A checkpoint's training arguments without reading its weights (safetensors' metadata; a .pt memory-mapped),
    {} where they cannot be read so: the loader reads the whole file and names what is wrong with it."""
    try:
        if path.suffix == ".safetensors":
            from safetensors import safe_open

            with safe_open(str(path), framework="pt") as f:
                args = json.loads((f.metadata() or {}).get("args", "{}"))
        else:
            with torch.serialization.safe_globals([argparse.Namespace]):
                raw = torch.load(path, map_location="cpu", weights_only=True, mmap=True)
            args = raw.get("args") if isinstance(raw, dict) else None
            args = vars(args) if isinstance(args, argparse.Namespace) else args
    except Exception:  # unreadable, unsafe, not a zip archive (mmap needs one): left to the loader
        return {}
    return args if isinstance(args, dict) else {}


def head_count(state: dict, gpt: str, heads: int, path: Path) -> int:
    """Attention heads: `heads` if given, else the named size's, else the size whose width and depth the
    weights have. A ConfigError when a named size does not fit the weights."""
    dim = state["tok_embeddings.weight"].shape[1]
    depth = len({k.split(".")[1] for k in state if k.startswith("layers.")})
    if gpt:
        if gpt not in SIZES:
            raise ConfigError(f"policy.options.gpt {brief(gpt)} is not a LlamaGen size: {', '.join(SIZES)}")
        if SIZES[gpt][::2] != (depth, dim):
            raise ConfigError(f"policy.options.gpt {gpt} has {SIZES[gpt][0]} layers of width {SIZES[gpt][2]}, but "
                              f"{path} has {depth} of width {dim}: name its size, or leave gpt empty")
    named = [n for n, (layers, _, width) in SIZES.items() if (layers, width) == (depth, dim)]
    if heads:
        return heads
    if gpt or named:
        return SIZES[gpt or named[0]][1]
    raise ConfigError(f"{path} ({depth} layers of width {dim}) is none of LlamaGen's sizes ({', '.join(SIZES)}): "
                      "set policy.options.heads to its number of attention heads")


def load_llamagen(pcfg, device):
    """The llamagen kind's Bundle: the GPT in `policy.path`, the VQ in `policy.tokenizer`, `policy.options`."""
    from grpo_vision.policy import Bundle, kind_options

    options = kind_options(pcfg)  # a LlamaGenOptions, the class the kind registered (models/kinds.py)
    if not pcfg.tokenizer:
        raise ConfigError("policy.kind 'llamagen' needs policy.tokenizer: LlamaGen's VQ checkpoint (vq_ds16_t2i.pt "
                          "for text-to-image, vq_ds16_c2i.pt for class-conditional)")
    vq = load_vq(pcfg.tokenizer, device)
    policy = load_policy(pcfg.path, options, device, pcfg.dtype, vq.downsample)
    if vq.codebook_size != policy.codebook_size:
        raise ConfigError(f"policy.tokenizer {pcfg.tokenizer} has {vq.codebook_size} codes, policy.path "
                          f"{pcfg.path} predicts {policy.codebook_size}: use the VQ the GPT was trained with")
    vq.grid = policy.image_grid
    return Bundle(policy, vq, source=Path(pcfg.path).parent)


def load_vq(path: str | Path, device="cpu"):
    """A LlamaGenVQ from LlamaGen's VQ checkpoint (vq_ds16_t2i.pt, vq_ds16_c2i.pt), every size read from the
    weights' shapes, in float32 and frozen."""
    from grpo_vision.models.llamagen_vq import IGNORED, LlamaGenVQ

    state = read_state_dict(path, "policy.tokenizer")
    try:
        levels = 1 + max(int(k.split(".")[2]) for k in state if k.startswith("encoder.conv_blocks."))
        blocks = 1 + max(int(k.split(".")[4]) for k in state if k.startswith("encoder.conv_blocks.0.res."))
        ch = state["encoder.conv_in.weight"].shape[0]
        mult = [state[f"encoder.conv_blocks.{i}.res.0.conv1.weight"].shape[0] // ch for i in range(levels)]
        z = state["encoder.conv_out.weight"].shape[0]
        codebook_size, code_dim = state["quantize.embedding.weight"].shape
    except (KeyError, ValueError, IndexError):  # ValueError: max() of no keys; IndexError: a tensor of too few dims
        raise CheckpointError(f"policy.tokenizer {path} is not a LlamaGen VQ checkpoint (no encoder.conv_in, "
                              "encoder.conv_blocks or quantize.embedding weights)") from None
    vq = LlamaGenVQ(ch, mult, blocks, z, codebook_size, code_dim)
    vq.load_state_dict(check_keys(vq, state, Path(path), "policy.tokenizer", IGNORED))
    return vq.to(device=device, dtype=torch.float32).eval().requires_grad_(False)


def load_policy(path: str | Path, options: LlamaGenOptions, device, dtype: str, vq_downsample: int) -> LlamaGenPolicy:
    """A LlamaGenPolicy from a released checkpoint (or its safetensors conversion) and `options`."""
    path = Path(path)
    for key, fix in (("image_size", "the size in pixels the checkpoint was trained at (256, 384 or 512)"),
                     ("heads", "its number of attention heads")):
        if getattr(options, key) < 0:
            raise ConfigError(f"policy.options.{key} {getattr(options, key)} is negative: set it to {fix}, or 0 to "
                              "take it from the checkpoint")
    state, args = read_checkpoint(path, "policy.path")
    if "tok_embeddings.weight" not in state or "layers.0.attention.wqkv.weight" not in state:
        state = from_hf_layout(state)
    for key in ("tok_embeddings.weight", "layers.0.attention.wqkv.weight", "layers.0.feed_forward.w1.weight"):
        if key not in state:
            raise CheckpointError(f"policy.path {path} has no {key}: it is not a LlamaGen GPT checkpoint")
    for key in MATRICES:  # a 1-D one was an IndexError while reading the sizes
        if key in state and (state[key].dim() != 2 or 0 in state[key].shape):
            raise CheckpointError(f"policy.path {path} has {key} of shape {list(state[key].shape)}, not a [rows, "
                                  "width] matrix: it is not a LlamaGen GPT checkpoint, or a damaged one; copy it again")
    if "cls_embedding.cap_proj.fc1.weight" in state and "cls_embedding.uncond_embedding" not in state:
        # a buffer, so savers of trained parameters leave it out; LlamaGen's strict=False loading would then keep
        # a random null caption without a word
        raise CheckpointError(f"policy.path {path} is a text-to-image LlamaGen without cls_embedding.uncond_embedding"
                              ", the null caption CFG needs: add it from the checkpoint it was trained from, or "
                              "write the model whole (grpo_vision.models.llamagen_load.export)")
    if "cls_embedding.embedding_table.weight" not in state and "cls_embedding.uncond_embedding" not in state:
        raise CheckpointError(f"policy.path {path} has neither a class embedding (c2i) nor a caption embedder's "
                              "uncond_embedding (t2i): it is not a LlamaGen GPT checkpoint")
    recorded, source = checked_image_size(options, path, args)
    size = options.image_size or recorded
    if options.image_size:
        source = "policy.options.image_size"
    if not size:
        raise ConfigError(f"policy.options.image_size is not set and neither {path.name} nor its args say it: set "
                          "it to the size the checkpoint was trained at (256, 384 or 512)")
    if size % vq_downsample:
        raise ConfigError(f"the image size {size} (policy.options.image_size, else the checkpoint's) is not a "
                          f"multiple of the VQ's downsampling {vq_downsample}")
    if size // vq_downsample > MAX_GRID:
        raise ConfigError(f"the image size {size} (from {source}) is {size // vq_downsample} tokens per side at the "
                          f"VQ's downsampling {vq_downsample}, more than the {MAX_GRID} supported (LlamaGen's largest "
                          "release has 32): set policy.options.image_size to the size the checkpoint was trained at "
                          f"(256, 384 or 512), at most {MAX_GRID * vq_downsample}")
    heads = head_count(state, options.gpt, options.heads or arg_int(args, "n_head", path), path)
    if "cls_embedding.uncond_embedding" in state:
        length = caption_length(options, args, state["cls_embedding.uncond_embedding"].shape[0], path)
    elif options.cls_token_num not in (0, 1):
        raise ConfigError(f"policy.options.cls_token_num is {options.cls_token_num}, but {path} is a class-"
                          "conditional model, which reads one condition position: leave cls_token_num 0")
    else:
        length = 1
    cfg = LlamaGenConfig.from_weights(state, heads, size // vq_downsample, length, size)
    captions = None
    if cfg.mode == "t2i":
        from grpo_vision.models.llamagen_text import caption_encoder

        captions = caption_encoder(options.text_encoder, path, cfg, device, dtype)
    elif options.text_encoder:
        raise ConfigError(f"policy.options.text_encoder is set, but {path} is a class-conditional model: it reads "
                          "class indices, not captions; leave text_encoder empty")
    try:
        policy = LlamaGenPolicy(cfg, captions)
    except ValueError as e:  # a head count that does not divide the weights' widths
        raise ConfigError(f"policy.options.heads {heads} does not fit {path}: {e}") from None
    policy.load_state_dict(check_keys(policy, state, path, "policy.path"))
    return policy.to(device=device, dtype=getattr(torch, dtype)).eval()


def llamagen_args(cfg: LlamaGenConfig) -> dict:
    """An exported model.pt's "args": LlamaGen's own argument names (train_t2i.py / sample_*.py's argparse), as
    plain values, with all load_policy reads back (image_size, cls_token_num). gpt_model only for a size
    gpt.py names; image_size and downsample_size only where the policy knows them (loaded with its VQ)."""
    c = cfg
    args = {"gpt_type": c.mode, "vocab_size": c.codebook_size, "codebook_size": c.codebook_size,
            "cls_token_num": c.cls_token_num}
    named = [name for name, size in SIZES.items() if size == (c.n_layer, c.n_head, c.dim)]
    if named:
        args["gpt_model"] = named[0]
    else:  # a size gpt.py does not name: its depth and width are in the weights, its heads only here
        args |= {"n_layer": c.n_layer, "n_head": c.n_head, "dim": c.dim}
    if c.image_size:
        args |= {"image_size": c.image_size, "downsample_size": c.image_size // c.grid}
    if c.mode == "c2i":
        args["num_classes"] = c.num_classes
    else:  # sample_t2i.py's caption settings: features of this width, cut at the GPT's caption length
        args |= {"t5_feature_dim": c.caption_dim, "t5_feature_max_len": c.cls_token_num}
    return args


def export(policy: LlamaGenPolicy, directory: str | Path) -> list[Path]:
    """`policy` whole in LlamaGen's layout: `directory/model.pt` = {"model": state_dict, "args": llamagen_args}
    (a plain dict, so torch.load's default weights_only=True reads it; gpt.py's Transformer loads the state
    dict with strict=True, uncond_embedding included) and `directory/model.safetensors`, the same tensors with
    the args as JSON metadata. In the policy's dtype. Both load back as `policy.path`."""
    from safetensors.torch import save

    directory = Path(directory)
    state = {k: v.detach().cpu().contiguous() for k, v in policy.state_dict().items()}
    with torch.device("meta"):  # the keys of an unwrapped policy: an adapter's layers rename them
        expected = LlamaGenPolicy(policy.cfg).state_dict()
    if state.keys() != expected.keys():
        odd = sorted(state.keys() ^ expected.keys())
        raise ValueError(f"LlamaGen export: the policy's state dict has {odd[0]}, which LlamaGen's Transformer has "
                         "not (or lacks it): merge an adapter into the weights first (merge_and_unload)")
    if bad := non_finite(state):
        raise CheckpointError(f"LlamaGen export: the policy holds {bad}: not exported; export an earlier step")
    args = llamagen_args(policy.cfg)
    pt = write_file(directory / "model.pt", lambda f: torch.save({"model": state, "args": args}, f))
    st = write_file(directory / "model.safetensors", save(state, metadata={"format": "pt", "args": json.dumps(args)}))
    return [pt, st]


# transformers-Llama module names -> LlamaGen's, for the HF-style conversions (jadohu/LlamaGen-T2I, which GCPO
# and LANTERN load): GCPO's `llama_model.py` keeps LlamaGen's interleaved 2D RoPE, so the weights map one to one,
# q/k/v concatenated into wqkv. Derived from that file's module names; no converted file was at hand to check.
HF_NAMES = {"model.embed_tokens": "tok_embeddings", "model.cls_embedding": "cls_embedding", "model.norm": "norm",
            "lm_head": "output", "self_attn.o_proj": "attention.wo", "mlp.gate_proj": "feed_forward.w1",
            "mlp.up_proj": "feed_forward.w3", "mlp.down_proj": "feed_forward.w2",
            "input_layernorm": "attention_norm", "post_attention_layernorm": "ffn_norm"}
HF_LAYER = re.compile(r"model\.layers\.(\d+)\.(.+)\.(weight)")


def from_hf_layout(state: dict) -> dict:
    """LlamaGen's key names for a state dict in transformers-Llama names (keys of neither pass through)."""
    out, qkv = {}, {}
    for key, value in state.items():
        if m := HF_LAYER.fullmatch(key):
            i, module = m.group(1), m.group(2)
            if module in ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"):
                qkv.setdefault(i, {})[module[-6]] = value  # "q", "k" or "v"
                continue
            key = f"layers.{i}.{HF_NAMES.get(module, module)}.weight"
        else:
            top = next((t for t in HF_NAMES if key.startswith(t + ".")), None)
            key = HF_NAMES[top] + key[len(top):] if top else key
        out[key] = value
    for i, parts in qkv.items():
        if parts.keys() == {"q", "k", "v"}:
            out[f"layers.{i}.attention.wqkv.weight"] = torch.cat([parts["q"], parts["k"], parts["v"]])
    return out
