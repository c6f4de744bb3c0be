"""Captions for text-to-image LlamaGen: flan-t5-xl's encoder through transformers (`T5EncoderModel` and the
tokenizer of a local directory), as LlamaGen's `language/t5.py` (`T5Embedder.get_text_embeddings`) uses it:
at most 120 tokens (EOS included, longer captions cut; at most the GPT's cls_token_num where a model was
trained with fewer), padded with an attention mask.

Each caption is encoded once and cached (its real tokens' features, on the CPU), never per image: a step's
B*G condition rows repeat B captions, and training draws the same captions again. One encoder (and cache)
per directory, device, dtype and caption length serves every policy of a process: the reference, a copy of the policy,
shares it, as does a base policy loaded again for sample grids. It is frozen and not part of the policy's
modules, so it is never trained, saved in checkpoints, sharded or copied.

Simplification: T5Embedder cleans captions with PixArt's `clean_caption` (ftfy, BeautifulSoup, URL and
punctuation rules, then lower case); here a caption is lower-cased and its whitespace collapsed, which is
what that cleaning does to a plain caption.
"""

from __future__ import annotations

from pathlib import Path
from typing import Sequence

import torch

from grpo_vision.config.load import ConfigError
from grpo_vision.run.load_checks import dtype_argument

# what T5EncoderModel.from_pretrained reads (flan-t5-xl ships its weights sharded, with an index)
WEIGHTS = ("model.safetensors", "model.safetensors.index.json", "pytorch_model.bin", "pytorch_model.bin.index.json")
MAX_TOKENS = 120  # sample_t2i.py's --t5-feature-max-len; a GPT's cls_token_num replaces it (caption_encoder)
_ENCODERS: dict[tuple, "CaptionEncoder"] = {}


class CaptionEncoder:
    def __init__(self, directory: Path, device, dtype: torch.dtype, max_tokens: int = MAX_TOKENS):
        from transformers import AutoTokenizer, T5EncoderModel

        self.directory, self.max_tokens = directory, max_tokens
        self.tokenizer = AutoTokenizer.from_pretrained(str(directory), local_files_only=True)
        self.model = T5EncoderModel.from_pretrained(str(directory), **dtype_argument(dtype), local_files_only=True)
        self.model.to(device).eval().requires_grad_(False)
        self.cache: dict[str, torch.Tensor] = {}  # caption -> [n, C] float32 features of its real tokens

    def __deepcopy__(self, memo):  # copies of a policy share the frozen encoder and its cache
        return self

    @property
    def width(self) -> int:
        return self.model.config.d_model

    def features(self, prompts: Sequence[str]) -> list[torch.Tensor]:
        """`[n_i, C]` features of each prompt's real tokens (n_i <= max_tokens), encoding only new captions."""
        texts = [" ".join(p.lower().split()) for p in prompts]
        if not all(texts):
            raise ValueError("empty prompt: a text-to-image LlamaGen needs a caption")
        new = list(dict.fromkeys(t for t in texts if t not in self.cache))
        for i in range(0, len(new), 32):  # 32 captions a pass bound the encoder's memory
            chunk = new[i:i + 32]
            enc = self.tokenizer(chunk, max_length=self.max_tokens, padding="max_length", truncation=True,
                                 return_attention_mask=True, add_special_tokens=True, return_tensors="pt")
            device = self.model.device
            with torch.no_grad():
                out = self.model(input_ids=enc["input_ids"].to(device),
                                 attention_mask=enc["attention_mask"].to(device)).last_hidden_state  # [b, 120, C]
            for text, h, mask in zip(chunk, out.float().cpu(), enc["attention_mask"]):
                self.cache[text] = h[mask.bool()].clone()  # [n, C]; T5's padding is at the end
        return [self.cache[t] for t in texts]


def caption_encoder(directory: str, checkpoint: Path, cfg, device, dtype: str) -> CaptionEncoder:
    """The process's CaptionEncoder for `directory` (policy.options.text_encoder: a relative path is looked for
    from here, then beside the checkpoint), checked against the GPT's caption width and length."""
    if not directory:
        raise ConfigError("a text-to-image LlamaGen needs policy.options.text_encoder: the local flan-t5-xl "
                          "directory (google/flan-t5-xl with its tokenizer)")
    path = Path(directory).expanduser()
    if not path.is_absolute() and not path.exists() and (checkpoint.parent / path).exists():
        path = checkpoint.parent / path
    if not (path / "config.json").is_file():
        raise FileNotFoundError(f"policy.options.text_encoder {path} has no config.json; expected a local "
                                "flan-t5-xl directory (transformers format, with its tokenizer files)")
    if not any((path / name).is_file() for name in WEIGHTS):  # transformers' OSError was a traceback
        raise FileNotFoundError(f"policy.options.text_encoder {path} has no weights ({', '.join(WEIGHTS)}): copy "
                                "google/flan-t5-xl's whole folder there, weights included")
    key = (str(path.resolve()), str(device), dtype, cfg.cls_token_num)  # captions cut at the GPT's length
    if key not in _ENCODERS:
        _ENCODERS[key] = CaptionEncoder(path, device, getattr(torch, dtype), cfg.cls_token_num)
    encoder = _ENCODERS[key]
    if encoder.width != cfg.caption_dim:
        raise ConfigError(f"policy.options.text_encoder {path} gives {encoder.width}-wide features, the GPT reads "
                          f"{cfg.caption_dim} (flan-t5-xl's 2048 for the released models): use flan-t5-xl")
    return encoder
