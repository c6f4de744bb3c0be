"""Released model sizes with random weights, written in the files a user of each model has.

`bench` commands take `--preset NAME`: the preset is built once with random weights (nothing is
downloaded), written in the model's own release format, and then loaded through the same policy kind
and loading code a user's files take (`policy.kind` janus or llamagen, `load_bundle`). Every shape
that costs time or memory is the released one; only the weights, the text tokenizer's vocabulary and
(for LlamaGen-T2I) the width-2048 text encoder's depth are stand-ins, since the encoder runs once per
caption, outside the step.

Sizes and their sources:
* `janus-pro-1b`, `janus-pro-7b`: the `config.json` of deepseek-community/Janus-Pro-1B and -7B (transformers'
  conversion): Llama text model 24 layers x 2048 (FFN 5632, 16 heads) / 30 x 4096 (FFN 11008, 32 heads),
  vocabulary 102,400; SigLIP-L/16 at 384 px; VQ-16 with 16,384 8-d codes; 384 px = 24 x 24 = 576 tokens.
  transformers' `JanusConfig()` defaults are Janus-Pro-1B's vision and VQ settings.
* `llamagen-t2i-xl`: LlamaGen's GPT-XL (36 x 1280, 20 heads, FFN 3584; `gpt.py`'s `GPT_XL`), 120 caption
  positions of flan-t5-xl width 2048, 256 px = 256 tokens, VQ-16 with 16,384 codes (`vq_ds16_t2i.pt`).
* `llamagen-c2i-xl`: GPT-XL class-conditional (1,000 classes), `c2i_XL_384.pt`: 384 px = 576 tokens.

Each has a `-tiny` twin of the same structure at toy widths (the fast test tier runs those on a CPU).
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass, field, replace
from pathlib import Path

import torch

from grpo_vision.config import ConfigError

JANUS_SPECIALS = ["<pad>", "<bos>", "<eos>", "<image_placeholder>", "<begin_of_image>", "<end_of_image>",
                  "<|User|>", "<|Assistant|>", "<unk>"]
# The generation prompt of transformers' converted Janus-Pro chat template, for one user message.
JANUS_TEMPLATE = ("{% for m in messages %}{% if m['role'] == 'user' %}<|User|>: {{ m['content'][0]['text'] | trim }}"
                  "\n\n{% endif %}{% endfor %}{% if add_generation_prompt %}<|Assistant|>:{% endif %}")
# A stand-in vocabulary: the bench's prompts are these words (a random model reads any token alike).
WORDS = ("a an the of on in and with photo picture image painting red blue green yellow black white orange purple "
         "brown pink gray cat dog car bird horse apple bench clock cup chair table bus train boat person two three "
         "four left right above below next to small large sky grass street room").split()
BENCH_PROMPTS = ["a photo of a red cat on a bench", "two dogs left of a blue car", "a painting of a horse",
                 "a yellow bird above a green apple", "three cups on a table", "a black train next to a boat",
                 "a small white clock", "a person with an orange umbrella"]  # c2i presets read a class index


@dataclass(frozen=True)
class JanusSize:
    hidden: int  # text width = projection_dim = image_token_embed_dim
    layers: int
    heads: int
    kv_heads: int
    ffn: int
    vocab: int = 102400
    image_size: int = 384  # SigLIP and the VQ grid: image_size / 16 per side
    vision: dict = field(default_factory=dict)  # JanusVisionConfig overrides (tiny twins)
    vq: dict = field(default_factory=dict)  # JanusVQVAEConfig overrides (tiny twins)


@dataclass(frozen=True)
class LlamaGenSize:
    mode: str  # c2i | t2i
    gpt: str  # gpt.py's size name, for the loader's check; "" for a tiny twin
    layers: int
    heads: int
    dim: int
    ffn: int
    image_size: int
    codebook: int = 16384
    num_classes: int = 1000  # c2i
    caption_dim: int = 2048  # t2i: flan-t5-xl's width
    cls_token_num: int = 120  # t2i caption positions (c2i: 1)
    vq_channels: int = 128  # vq_model.py's VQ_16: ch 128, mult [1, 1, 2, 2, 4], z 256, 8-d codes
    vq_mult: tuple = (1, 1, 2, 2, 4)
    vq_z: int = 256


@dataclass(frozen=True)
class Preset:
    name: str
    kind: str  # policy.kind
    size: JanusSize | LlamaGenSize
    cfg_scale: float  # the model's usual guidance: Janus-Pro 5, LlamaGen 4 (c2i) / 7.5 (t2i)


def _llamagen_ffn(dim: int) -> int:  # gpt.py's FeedForward: 2/3 * 4 * dim, rounded up to a multiple of 256
    hidden = int(2 * 4 * dim / 3)
    return 256 * ((hidden + 255) // 256)


PRESETS: dict[str, Preset] = {p.name: p for p in [
    Preset("janus-pro-1b", "janus", JanusSize(2048, 24, 16, 16, 5632), 5.0),
    Preset("janus-pro-7b", "janus", JanusSize(4096, 30, 32, 32, 11008), 5.0),
    Preset("llamagen-t2i-xl", "llamagen", LlamaGenSize("t2i", "GPT-XL", 36, 20, 1280, _llamagen_ffn(1280), 256),
           7.5),
    Preset("llamagen-c2i-xl", "llamagen", LlamaGenSize("c2i", "GPT-XL", 36, 20, 1280, _llamagen_ffn(1280), 384),
           4.0),
]}
# Tiny twins: the same structure and files at toy widths, for the fast tests.
TINY_JANUS_VISION = dict(image_size=32, patch_size=8, num_image_tokens=16, hidden_size=32, num_hidden_layers=1,
                         num_attention_heads=2, mlp_ratio=2)
TINY_JANUS_VQ = dict(embed_dim=8, num_embeddings=64, latent_channels=32, base_channels=32,
                     channel_multiplier=[1, 1, 2, 2], num_res_blocks=1)
for _p in list(PRESETS.values()):
    if _p.kind == "janus":
        tiny = JanusSize(32, 2, 4, 2, 64, vocab=len(JANUS_SPECIALS) + len(WORDS), image_size=32,
                         vision=TINY_JANUS_VISION, vq=TINY_JANUS_VQ)
    else:
        tiny = replace(_p.size, gpt="", layers=2, heads=4, dim=32, ffn=64, image_size=_p.size.image_size // 32,
                       codebook=64, num_classes=10, caption_dim=24, vq_channels=32, vq_mult=(1, 2), vq_z=32)
    PRESETS[_p.name + "-tiny"] = Preset(_p.name + "-tiny", _p.kind, tiny, _p.cfg_scale)


def preset(name: str) -> Preset:
    if name not in PRESETS:
        raise ConfigError(f"unknown --preset {name!r}; presets: {', '.join(PRESETS)}")
    return PRESETS[name]


def preset_home(directory: str | Path | None, name: str) -> Path:
    """Where preset `name` is written: `directory/name`, by default under ~/.cache/grpo_vision/presets."""
    import os

    root = Path(directory) if directory else Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / \
        "grpo_vision" / "presets"
    return root / name


def preset_overrides(name: str, directory: str | Path, dtype: str = "bfloat16") -> list[str]:
    """Write preset `name` into `directory` (once: a complete folder is reused) and return the config
    overrides that load it (`policy.kind`, `.path`, `.tokenizer`, `.options`, `.dtype`) with prompts it reads
    (`data.train_prompts`, `data.eval_prompts`: `prompts.txt` and `eval.txt` beside the weights)."""
    p = preset(name)
    directory = Path(directory)
    done = directory / "preset.json"
    if not (done.is_file() and json.loads(done.read_text()).get("name") == name):
        directory.mkdir(parents=True, exist_ok=True)
        start = time.perf_counter()
        files = (write_janus if p.kind == "janus" else write_llamagen)(p, directory)
        (directory / "prompts.txt").write_text("\n".join(prompts_for(name, 64)) + "\n")
        (directory / "eval.txt").write_text("\n".join(prompts_for(name, 16, start=64)) + "\n")
        done.write_text(json.dumps({"name": name, "files": files, "seconds": round(time.perf_counter() - start, 1)}))
    files = json.loads(done.read_text())["files"]
    over = [f"policy.kind={p.kind}", f"policy.path={directory / files['path']}", f"policy.dtype={dtype}",
            f"data.train_prompts={directory / 'prompts.txt'}", f"data.eval_prompts={directory / 'eval.txt'}"]
    if p.kind == "llamagen":
        s = p.size
        options = {"image_size": s.image_size, **({"gpt": s.gpt} if s.gpt else {"heads": s.heads})}
        if s.mode == "t2i":
            options["text_encoder"] = str(directory / files["text_encoder"])
        over += [f"policy.tokenizer={directory / files['tokenizer']}", f"policy.options={json.dumps(options)}"]
    return over


def prompts_for(name: str, n: int, start: int = 0) -> list[str]:
    """Prompts `start .. start + n - 1` of those the preset's policy reads: captions, or class indices for a
    class-conditional model (`prompts.txt` holds 0..63 for training, `eval.txt` 64..79)."""
    p = preset(name)
    if p.kind == "llamagen" and p.size.mode == "c2i":
        return [f"{(17 * i) % p.size.num_classes}" for i in range(start, start + n)]
    colours = "red blue green yellow black white orange purple brown pink".split()
    things = "cat dog car bird horse apple bench clock cup chair".split()
    return [f"{BENCH_PROMPTS[i % len(BENCH_PROMPTS)]} and a {colours[i % 10]} {things[i // 10 % 10]}"
            for i in range(start, start + n)]


# ---------------------------------------------------------------------------- Janus-Pro


def _word_tokenizer(specials: list[str], words: list[str], **tokens):
    from tokenizers import Tokenizer, models, pre_tokenizers

    vocab = {t: i for i, t in enumerate(specials + [w for w in words if w not in specials])}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.add_special_tokens(specials)
    return tok, vocab


def write_janus(p: Preset, directory: Path) -> dict:
    """A transformers-format Janus folder (`save_pretrained` of model and processor), random weights in bf16
    (the released checkpoints' dtype); a WordLevel tokenizer with Janus's special tokens stands in for its
    102,400-entry BPE vocabulary (the embedding table keeps the real row count)."""
    from tokenizers import processors
    from transformers import GenerationConfig, JanusForConditionalGeneration, PreTrainedTokenizerFast
    from transformers.models.janus.image_processing_janus import JanusImageProcessor
    from transformers.models.janus.processing_janus import JanusProcessor

    s = p.size
    tok, vocab = _word_tokenizer(JANUS_SPECIALS, WORDS)
    bos, pad, boi = vocab["<bos>"], vocab["<pad>"], vocab["<begin_of_image>"]
    tok.post_processor = processors.TemplateProcessing(single="<bos> $A", special_tokens=[("<bos>", bos)])
    text_tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=tok, bos_token="<bos>", eos_token="<eos>", pad_token="<pad>", unk_token="<unk>",
        extra_special_tokens={"image_token": "<image_placeholder>", "boi_token": "<begin_of_image>",
                              "eoi_token": "<end_of_image>"})
    grid = s.image_size // 16 if not s.vision else s.vision["image_size"] // s.vision["patch_size"]
    processor = JanusProcessor(JanusImageProcessor(size={"height": s.image_size, "width": s.image_size}),
                               text_tokenizer, chat_template=JANUS_TEMPLATE, num_image_tokens=grid * grid)
    config = janus_config(p, vocab)
    torch.manual_seed(0)
    with _default_dtype(torch.bfloat16), _fast_init(), torch.device(_build_device()):
        model = JanusForConditionalGeneration(config).eval()
    model.generation_config = GenerationConfig(bos_token_id=bos, pad_token_id=pad,
                                               generation_kwargs={"boi_token_id": boi})
    model.save_pretrained(str(directory / "model"))
    processor.save_pretrained(str(directory / "model"))
    return {"path": "model"}


def janus_config(p: Preset, vocab: dict | None = None):
    """transformers' JanusConfig of a Janus preset (`vocab`: the stand-in tokenizer's ids of the special tokens)."""
    from transformers import JanusConfig

    s = p.size
    vocab = vocab or {t: i for i, t in enumerate(JANUS_SPECIALS)}
    return JanusConfig(
        text_config=dict(model_type="llama", vocab_size=s.vocab, hidden_size=s.hidden, intermediate_size=s.ffn,
                         num_hidden_layers=s.layers, num_attention_heads=s.heads, num_key_value_heads=s.kv_heads,
                         max_position_embeddings=16384, rms_norm_eps=1e-6, pad_token_id=vocab["<pad>"],
                         bos_token_id=vocab["<bos>"], eos_token_id=vocab["<eos>"]),
        vision_config=dict(projection_dim=s.hidden, **s.vision),
        vq_config=dict(projection_dim=s.hidden, image_token_embed_dim=s.hidden, **s.vq),
        image_token_id=vocab["<image_placeholder>"])


# ---------------------------------------------------------------------------- LlamaGen


def write_llamagen(p: Preset, directory: Path) -> dict:
    """LlamaGen's release layout: the GPT as `{"model": state_dict}` in a `.pt` named as released (the loader
    reads the image size from the name), the VQ likewise, and for t2i a T5 encoder folder of flan-t5-xl's
    width (2 layers: its cost is one pass per caption, outside the step)."""
    from grpo_vision.models.llamagen import LlamaGenPolicy
    from grpo_vision.models.llamagen_vq import LlamaGenVQ

    s = p.size
    cfg = llamagen_config(p)
    torch.manual_seed(0)
    with _fast_init(), torch.device(_build_device()):
        gpt = LlamaGenPolicy(cfg)
        if s.mode == "t2i":  # gpt.py initialises it randn / sqrt(caption_dim)
            gpt.cls_embedding.uncond_embedding.normal_(0, s.caption_dim ** -0.5)
        vq = LlamaGenVQ(s.vq_channels, list(s.vq_mult), 2, s.vq_z, s.codebook, 8)
    name = f"{s.mode}_{s.gpt.removeprefix('GPT-') or 'tiny'}_{s.image_size}.pt"
    torch.save({"model": {k: v.cpu() for k, v in gpt.state_dict().items()}}, directory / name)
    vq_name = f"vq_ds16_{s.mode}.pt"
    torch.save({"model": {k: v.cpu() for k, v in vq.state_dict().items()}}, directory / vq_name)
    files = {"path": name, "tokenizer": vq_name}
    if s.mode == "t2i":
        files["text_encoder"] = write_t5(directory / "t5", s.caption_dim, layers=2 if s.gpt else 1)
    return files


def llamagen_config(p: Preset):
    """The LlamaGenConfig of a LlamaGen preset."""
    from grpo_vision.models.llamagen import LlamaGenConfig

    s = p.size
    cfg = LlamaGenConfig(s.mode, s.dim, s.layers, s.heads, s.heads, s.ffn, s.codebook, s.image_size // 16,
                         1 if s.mode == "c2i" else s.cls_token_num,
                         num_classes=s.num_classes if s.mode == "c2i" else 0,
                         caption_dim=s.caption_dim if s.mode == "t2i" else 0)
    if s.gpt == "":  # tiny twins: a 2x-downsampling VQ, so the grid is image_size / 2
        cfg = replace(cfg, grid=s.image_size // 2 ** (len(s.vq_mult) - 1))
    return cfg


def write_t5(path: Path, width: int, layers: int) -> str:
    """A random T5 encoder of `width` (flan-t5-xl: 2048, 32 heads of 64, FFN 5120) with a word-level tokenizer."""
    from tokenizers import processors
    from transformers import PreTrainedTokenizerFast, T5Config, T5EncoderModel

    tok, vocab = _word_tokenizer(["<pad>", "</s>", "<unk>"], WORDS)
    tok.post_processor = processors.TemplateProcessing(single="$A </s>", special_tokens=[("</s>", 1)])
    PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="<pad>", eos_token="</s>",
                            unk_token="<unk>").save_pretrained(str(path))
    heads = max(1, width // 64)
    config = T5Config(vocab_size=len(vocab), d_model=width, d_kv=width // heads, d_ff=width * 5 // 2,
                      num_layers=layers, num_heads=heads, feed_forward_proj="gated-gelu", pad_token_id=0,
                      eos_token_id=1, decoder_start_token_id=0)
    torch.manual_seed(0)
    T5EncoderModel(config).save_pretrained(str(path))
    return path.name


# ---------------------------------------------------------------------------- helpers


def _build_device() -> str:
    """Random weights are drawn on a GPU where there is one: seconds for Janus-Pro-7B's 7.4B values, where a
    CPU takes minutes (the files are the same either way, up to the random values)."""
    return "cuda" if torch.cuda.is_available() else "cpu"


class _default_dtype:
    def __init__(self, dtype):
        self.dtype = dtype

    def __enter__(self):
        self.old = torch.get_default_dtype()
        torch.set_default_dtype(self.dtype)

    def __exit__(self, *exc):
        torch.set_default_dtype(self.old)


@torch.no_grad()
def _normal(t: torch.Tensor, *args, **kwargs) -> torch.Tensor:
    return t.normal_(0, 0.02) if t.is_floating_point() else t


class _fast_init:
    """Random weights without the slow per-module initialisers (uniform/orthogonal/kaiming over billions of
    values): every floating parameter ~ N(0, 0.02) drawn once, norms' weights stay 1. The values are random
    either way; only their shapes and dtypes matter to a benchmark."""

    def __enter__(self):
        self.saved = {n: getattr(torch.nn.init, n) for n in ("kaiming_uniform_", "uniform_", "normal_",
                                                              "trunc_normal_", "xavier_uniform_", "orthogonal_")}
        for n in self.saved:
            setattr(torch.nn.init, n, _normal)

    def __exit__(self, *exc):
        for n, f in self.saved.items():
            setattr(torch.nn.init, n, f)
