"""Images in the folder layouts that published benchmarks' own scorers read.

* GenEval (djghosh13/geneval, `generation/diffusers_generate.py`): for the i-th prompt (of its
  `evaluation_metadata.jsonl` or a file of `prompts geneval --out`: both shapes, geneval_prompts.read),
  a folder `<out>/<i:05d>/` holding its line in GenEval's own flat shape as `metadata.jsonl` and the
  images as `samples/<j:05d>.png`; `evaluation/evaluate_images.py <out>` then scores them.
* index (`grpo-vision sample`'s own): `<i:05d>_<j:02d>_<policy|reference>.png` and `index.jsonl`
  (prompt, file, seed, model, step).
* flat: one folder of `<prompt>_<k:06d>.png` files, k counting images in prompt order, the naming
  that T2I-CompBench-style scorers match prompts by; plus `index.jsonl` (prompt, file, seed).

A run that plans before it draws (sample.plan) writes each image's text plan beside it: a `plan` field in
`index.jsonl`'s line, and in GenEval's layout a `plans.jsonl` (file, seed, plan) beside `metadata.jsonl`, out of
`samples/`, whose files GenEval's scorer reads as images. Without a text stage the files are as above.

Image j of every prompt is drawn with seed + j, as `grpo-vision sample` draws it, so the policy and
its reference export the same seeds.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import torch

from grpo_vision.files import write_file
from grpo_vision.images import to_uint8
from grpo_vision.prompts import PromptEntry
from grpo_vision.rewards.geneval_prompts import flat
from grpo_vision.rollouts import draw, eval_seeds, plan_texts

LAYOUTS = ("index", "geneval", "flat")
IMAGES_PER_CALL = 64  # images generated per sampler call, whatever the number of prompts
MAX_NAME_BYTES = 255  # the longest file name most file systems take (ext4, XFS, APFS, NTFS)


def _images(model, tokenizer, prompts: list[str], n: int, seed: int, params):
    """Per prompt, uint8 images `[n, H, W, 3]`, image j drawn with seed + j, in chunks of IMAGES_PER_CALL, and
    their n text plans (None without a text stage)."""
    per_call = max(1, IMAGES_PER_CALL // n)
    for start in range(0, len(prompts), per_call):
        chunk = prompts[start:start + per_call]
        with torch.no_grad():
            samples = draw(model, tokenizer, [PromptEntry(p) for p in chunk for _ in range(n)],
                           eval_seeds(1, n, seed) * len(chunk), params, IMAGES_PER_CALL)
        images, plans = to_uint8(samples.images), plan_texts(samples)
        for i in range(len(chunk)):
            yield images[i * n:(i + 1) * n], None if plans is None else plans[i * n:(i + 1) * n]


def write_index(model, tokenizer, prompts: list[str], out: str | Path, n: int, seed: int, params, which: str,
                step: int) -> int:
    """Numbered PNGs and `index.jsonl` (prompt, file, seed, model, step); returns the number of images."""
    return _write_folder(model, tokenizer, prompts, out, n, seed, params,
                         lambda i, j, prompt: f"{i:05d}_{j:02d}_{which}.png", {"model": which, "step": step})


def write_geneval(model, tokenizer, entries: list[PromptEntry], out: str | Path, n: int, seed: int, params) -> int:
    """GenEval's folder layout for `entries` (geneval_prompts.read); returns the number of images."""
    from PIL import Image

    out, count = Path(out), 0
    for index, (entry, (images, plans)) in enumerate(zip(entries, _images(model, tokenizer, [e.prompt for e in entries],
                                                                          n, seed, params))):
        samples = out / f"{index:05d}" / "samples"
        samples.mkdir(parents=True, exist_ok=True)
        # one line, GenEval's flat shape, as its generation script writes it: its scorer reads metadata["tag"]
        write_file(samples.parent / "metadata.jsonl", json.dumps(flat(entry)))
        for j, img in enumerate(images):
            Image.fromarray(img).save(samples / f"{j:05d}.png")
        if plans is not None:
            write_file(samples.parent / "plans.jsonl", "".join(
                json.dumps({"file": f"samples/{j:05d}.png", "seed": s, "plan": plan}) + "\n"
                for j, (s, plan) in enumerate(zip(eval_seeds(1, n, seed), plans))))
        count += len(images)
    return count


def flat_name(prompt: str, k: int) -> str:
    """`<prompt>_<k:06d>.png` with the characters a file name cannot hold replaced by '_'. A prompt too long
    for one file name is cut, and a hash of the whole prompt keeps prompts that start alike apart
    (`index.jsonl` holds each file's whole prompt)."""
    safe = "".join("_" if c in '/\\\0' else c for c in prompt.strip())
    tail = f"_{k:06d}.png"
    if len((safe + tail).encode()) <= MAX_NAME_BYTES:
        return safe + tail
    digest = "-" + hashlib.sha256(prompt.encode()).hexdigest()[:12]
    room = MAX_NAME_BYTES - len(digest) - len(tail)
    return safe.encode()[:room].decode("utf-8", errors="ignore") + digest + tail  # never half a character


def write_flat(model, tokenizer, prompts: list[str], out: str | Path, n: int, seed: int, params) -> int:
    """Prompt-named PNGs in one folder and `index.jsonl`; returns the number of images."""
    return _write_folder(model, tokenizer, prompts, out, n, seed, params,
                         lambda i, j, prompt: flat_name(prompt, i * n + j))


def _write_folder(model, tokenizer, prompts: list[str], out: str | Path, n: int, seed: int, params, name,
                  fields: dict | None = None) -> int:
    """The PNGs of one folder, image j of prompt i named `name(i, j, prompt)`, and `index.jsonl` (prompt, file,
    seed, then `fields`, then the image's text plan where the model plans); returns the number of images."""
    from PIL import Image

    out, index = Path(out), []
    out.mkdir(parents=True, exist_ok=True)
    for i, (prompt, (images, plans)) in enumerate(zip(prompts, _images(model, tokenizer, prompts, n, seed, params))):
        for j, (img, image_seed) in enumerate(zip(images, eval_seeds(1, n, seed))):
            file = name(i, j, prompt)
            # Image.save, not write_file: a flat name may take all 255 bytes, and write_file's temporary name
            # is longer than the name it replaces
            Image.fromarray(img).save(out / file)
            index.append({"prompt": prompt, "file": file, "seed": image_seed, **(fields or {}),
                          **({"plan": plans[j]} if plans is not None else {})})
    write_file(out / "index.jsonl", "".join(json.dumps(r) + "\n" for r in index))
    return len(index)
