"""`grpo-vision fit`, the memory planner: what fits in a GPU's memory and how fast it runs, before any weight is
loaded (`grpo-vision plan`, its old name, still runs it for one release).

Users ask "will it fit in 24 / 48 / 80 GB, and how long will it take" more than anything but "how do I train at
all" (deepseek-ai/Janus issue #41, CaraJ7/T2I-R1 issues #9 and #14, krennic999/STAGE issue #3). For a released model size
(tools/presets.py) the architecture is built on PyTorch's meta device, so its parameters are counted without a
byte of weights, and run/memory.py's estimate (the one `train` prints and refuses by, checked against measured
peaks in docs/benchmarks.md) is computed for each candidate setting. For each memory budget the largest setting
whose estimate stays under the fraction `train` warns at is printed, for a full fine-tune and for LoRA, with the
images/s a GRPO step of that kind measured on one GPU (docs/benchmarks.md), where one was measured, and the config
overrides that make it: every setting the estimate assumes, so that a shipped config with them applied is
estimated alike by `train` (tests/tools/test_fit.py checks this against each shipped config).

Budgets are GiB (2^30 bytes), as `train` reads the GPU's memory (torch.cuda.mem_get_info) and as `nvidia-smi`'s
MiB divide to: a "24 GB" card holds 23.99 GiB, an "80 GB" H100 79.6 GiB.

    grpo-vision fit --preset janus-pro-7b --gpu-memory 24,48,80

The estimate counts the policy's side (the reward models are not counted; `--judge-batch N` adds the understanding
forward of a self_judge reward, which judges with the policy's own network) and leaves a fifth of the memory for
what it does not count: the CUDA context, the allocator's reserve (measured 26-36% above the allocated peak on one
H200) and the rewards.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

import torch

from grpo_vision.models.janus_understanding import JUDGE_TEXT_TOKENS
from grpo_vision.run.memory import GIB, WARN_FRACTION, PolicyShape, estimate_memory, peak
from grpo_vision.tools.presets import janus_config, llamagen_config, preset

# A GRPO step of one prompt's group (G = 16, the model's CFG, one update of micro-batches), images/s on one H200
# (docs/benchmarks.md, "On a GPU: one command": the step tables of its two H200 measurements, each step setting's
# images/s column; `bench gpu` trains the presets with bf16 weights):
# (preset, mode, reference, merged sampling) -> images/s
MEASURED_DTYPE = "bfloat16"
MEASURED = {
    ("janus-pro-7b", "lora", "adapter", True): 1.54,
    ("janus-pro-1b", "lora", "adapter", True): 3.25,
    ("janus-pro-1b", "lora", "adapter", False): 2.27,
    ("janus-pro-1b", "full", "frozen", False): 4.21,
    ("janus-pro-1b", "full", "none", False): 4.58,
    ("llamagen-t2i-xl", "full", "frozen", False): 6.82,
    ("llamagen-t2i-xl", "full", "none", False): 7.44,
    ("llamagen-t2i-xl", "lora", "adapter", False): 4.12,
}
# LoRA's targets in the shipped configs: every projection of every block
JANUS_TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
LLAMAGEN_TARGETS = ("wqkv", "wo", "w1", "w2", "w3")
DEFAULT_PRESETS = ["janus-pro-1b", "janus-pro-7b", "llamagen-t2i-xl"]  # what `fit` prints without --preset
T5_XL_ENCODER = 1_220_000_000  # flan-t5-xl's encoder parameters: LlamaGen-T2I keeps it beside the GPT
# The weights each mode trains, as the shipped configs do: a full fine-tune keeps float32 master weights under bf16
# autocast (configs/janus_pro_1b.yaml, configs/llamagen_t2i.yaml: bf16 weights would round AdamW's ~1e-6 steps
# away); LoRA keeps the frozen base in bf16 (configs/janus_pro_7b_lora.yaml). mode -> (policy.dtype, mixed_precision)
PRECISION = {"full": ("float32", "bf16"), "lora": ("bfloat16", "no")}
DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}
# The shipped config a row's overrides are written for, per policy kind and mode (any shipped config of the kind
# without a text plan estimates alike with them)
CONFIGS = {("janus", "full"): "configs/janus_pro_1b.yaml", ("janus", "lora"): "configs/janus_pro_7b_lora.yaml",
           ("llamagen", "full"): "configs/llamagen_t2i.yaml", ("llamagen", "lora"): "configs/llamagen_t2i.yaml"}
# A step's images are split into this many updates in the shipped configs (train.minibatches_per_pass), and each
# must hold whole micro-batches (config/schema.py derived_sizes): a row's micro-batch divides G / 2
MINIBATCHES = 2


@dataclass(frozen=True)
class Setting:
    mode: str  # full | lora
    group: int  # G: one prompt's images a step on the GPU (the sampler's batch too)
    micro_batch: int  # sequences a forward/backward (CFG doubles the rows)
    checkpointing: bool  # train.gradient_checkpointing
    reference: str  # frozen | none (full, with beta 0: no KL) | adapter (LoRA)
    merge: bool  # sample.merge_adapter on (LoRA)
    rank: int = 0  # LoRA rank

    @property
    def dtype(self) -> str:  # policy.dtype
        return PRECISION[self.mode][0]

    def overrides(self, targets: tuple[str, ...]) -> list[str]:
        """The config overrides that make this setting: every one the estimate reads (`config_parts`), so that
        they make it on any shipped config; `targets`: the modules LoRA adapts."""
        dtype, autocast = PRECISION[self.mode]
        out = [f"policy.dtype={dtype}", f"train.mixed_precision={autocast}", "sample.prompts_per_step=1",
               f"sample.group_size={self.group}", f"sample.batch_size={self.group}",
               f"train.micro_batch_size={self.micro_batch}",
               f"train.gradient_checkpointing={str(self.checkpointing).lower()}"]
        if self.mode == "lora":
            out += ["train.adapter=lora", f"train.adapter_rank={self.rank}",
                    f"train.adapter_targets=[{','.join(targets)}]", "train.reference=adapter",
                    f"sample.merge_adapter={'on' if self.merge else 'off'}"]
        else:
            out += ["train.adapter=none", f"train.reference={self.reference}"]
            if self.reference == "none":  # no reference to measure a KL against
                out.append("train.beta=0.0")
        return out


@dataclass(frozen=True)
class Linear:  # an adapted projection of one block: its input and output widths
    fan_in: int
    fan_out: int


def preset_shape(name: str, mode: str, rank: int = 0, dtype_bytes: int | None = None,
                 targets: tuple[str, ...] | None = None) -> tuple[PolicyShape, int]:
    """The estimate's shape of preset `name` trained in full or with LoRA of `rank` on `targets` (default: every
    projection), its weights `dtype_bytes` each (default: the mode's, PRECISION; float32 adapters as peft keeps
    them), and the bytes of the weights LoRA adapts (a merged copy's)."""
    dtype_bytes = dtype_bytes or DTYPE_BYTES[PRECISION[mode][0]]
    p = preset(name)
    with torch.device("meta"):
        if p.kind == "janus":
            from transformers import JanusForConditionalGeneration

            config = janus_config(p)
            model = JanusForConditionalGeneration(config)
            t = config.text_config
            m = model.model
            frozen = {id(q) for part in (m.vision_model, m.aligner, m.vqmodel, m.language_model.embed_tokens,
                                         model.lm_head) for q in part.parameters()}
            arch = dict(layers=t.num_hidden_layers, dim=t.hidden_size, heads=t.num_attention_heads,
                        kv_heads=t.num_key_value_heads, ffn_dim=t.intermediate_size, cond_len=64,
                        codebook=config.vq_config.num_embeddings, vocab=t.vocab_size,
                        judge_len=JUDGE_TEXT_TOKENS + config.vision_config.num_image_tokens + 2)
            image_size, tokens, extra = p.size.image_size, config.vision_config.num_image_tokens, 0
        else:
            from grpo_vision.models.llamagen import LlamaGenPolicy

            cfg = llamagen_config(p)
            model = LlamaGenPolicy(cfg)
            frozen = set()
            arch = dict(layers=cfg.n_layer, dim=cfg.dim, heads=cfg.n_head, kv_heads=cfg.n_kv_head, ffn_dim=cfg.ffn_dim,
                        cond_len=cfg.cls_token_num, codebook=cfg.codebook_size)
            image_size, tokens = p.size.image_size, cfg.num_image_tokens
            extra = T5_XL_ENCODER * dtype_bytes if cfg.mode == "t2i" and p.size.gpt else 0
    params = {id(q): q.numel() for q in model.parameters()}
    total = sum(params.values())
    d, kv, f = arch["dim"], arch["kv_heads"] * (arch["dim"] // arch["heads"]), arch["ffn_dim"]
    widths = {"q_proj": (d, d), "k_proj": (d, kv), "v_proj": (d, kv), "o_proj": (d, d), "gate_proj": (d, f),
              "up_proj": (d, f), "down_proj": (f, d),  # transformers' Llama (Janus)
              "wqkv": (d, d + 2 * kv), "wo": (d, d), "w1": (d, f), "w3": (d, f), "w2": (f, d)}  # LlamaGen's gpt.py
    block = [Linear(*widths[name]) for name in (targets or kind_targets(p.kind))]
    adapted = arch["layers"] * sum(x.fan_in * x.fan_out for x in block) * dtype_bytes
    if mode == "lora":  # peft keeps the adapters in float32, and a bf16 layer's input is copied to float32 for them
        trainable = arch["layers"] * rank * sum(x.fan_in + x.fan_out for x in block)
        trainable_bytes = trainable * 4
        copies = arch["layers"] * sum(x.fan_in for x in block) * 4 if dtype_bytes != 4 else 0
        total, weight_bytes = total + trainable, total * dtype_bytes + trainable_bytes
    else:
        trainable = sum(n for i, n in params.items() if i not in frozen)
        trainable_bytes, copies, weight_bytes = trainable * dtype_bytes, 0, total * dtype_bytes
    shape = PolicyShape(total, trainable, dtype_bytes, tokens, 3 * image_size ** 2, **arch, weight_bytes=weight_bytes,
                        trainable_bytes=trainable_bytes, extra_bytes=extra, adapter_bytes=copies,
                        adapter=mode == "lora")
    return shape, adapted


def kind_targets(kind: str) -> tuple[str, ...]:
    """LoRA's targets in the shipped configs of a policy kind."""
    return JANUS_TARGETS if kind == "janus" else LLAMAGEN_TARGETS


def estimate(shape: PolicyShape, adapted: int, s: Setting, judge_batch: int = 0) -> float:
    """GiB of the setting's estimated peak (run/memory.py), one prompt's group a step on one GPU; `judge_batch`:
    images per understanding forward of a self_judge reward (reward.batch_size), 0 without one."""
    parts = estimate_memory(shape, images=s.group, sample_batch=s.group, micro_batch=s.micro_batch, guided=True,
                            frozen_reference=s.reference == "frozen", checkpointing=s.checkpointing,
                            activation_bytes=2 if PRECISION[s.mode][1] == "bf16" else None,
                            merged=adapted if s.merge else 0, judge_rows=min(judge_batch, s.group))
    return peak(parts) / GIB


def candidates(mode: str, ranks=(64, 32, 16, 8)):
    """Settings from the largest to the smallest: a bigger group first, then no recomputation (faster), a bigger
    micro-batch, a frozen reference (full) or merged sampling (LoRA), a higher rank."""
    for group in (16, 8, 4):
        for checkpointing in (False, True):
            for micro in (m for m in (8, 4, 2, 1) if group % (MINIBATCHES * m) == 0):
                if mode == "full":
                    for reference in ("frozen", "none"):
                        yield Setting("full", group, micro, checkpointing, reference, False)
                else:
                    for merge in (True, False):
                        for rank in ranks:
                            yield Setting("lora", group, micro, checkpointing, "adapter", merge, rank)


def fit(name: str, budgets_gib: list[float], judge_batch: int = 0) -> dict:
    """For each budget (GiB) and each mode (full fine-tune, LoRA): the largest setting that fits, its estimate, the
    overrides that make it on the mode's shipped config, and the step's images/s where a step of that kind was
    measured. `judge_batch`: a self_judge reward's images per understanding forward, counted in the estimate (its
    time is not in the measured images/s, which scored with no reward model)."""
    kind = preset(name).kind
    shapes = {"full": preset_shape(name, "full")}
    shapes |= {("lora", r): preset_shape(name, "lora", r) for r in (64, 32, 16, 8)}
    rows = []
    for budget in budgets_gib:
        for mode in ("full", "lora"):
            chosen = None
            for s in candidates(mode):
                shape, adapted = shapes["full"] if mode == "full" else shapes[("lora", s.rank)]
                gib = estimate(shape, adapted, s, judge_batch)
                if gib <= WARN_FRACTION * budget:
                    chosen = (s, gib)
                    break
            row = {"gpu_memory_gib": budget, "mode": mode, "dtype": PRECISION[mode][0],
                   "mixed_precision": PRECISION[mode][1], "config": CONFIGS[(kind, mode)]}
            if chosen is None:
                rows.append(row | {"fits": False})
                continue
            s, gib = chosen
            rate = MEASURED.get((name, mode, s.reference, s.merge))
            rows.append(row | {"fits": True, **asdict(s), "kl": s.reference != "none", "estimate_gib": round(gib, 1),
                               "images_per_s_measured": rate,
                               "measured_at": f"G 16, the shipped config's micro-batch, {MEASURED_DTYPE} weights, "
                                              "one H200" if rate else None,
                               "overrides": s.overrides(kind_targets(kind))})
    return {"preset": name, "fraction": WARN_FRACTION, "unit": "GiB", "judge_batch": judge_batch, "rows": rows}


def _reference(row: dict) -> str:
    """The reference and the KL a row trains with, in words."""
    return {"frozen": "frozen copy", "adapter": "adapter disabled", "none": "none: beta 0, no KL"}[row["reference"]]


def _rate(row: dict) -> str:
    rate = row["images_per_s_measured"]
    if not rate:
        return "not measured"
    return f"{rate}" if row["dtype"] == MEASURED_DTYPE else f"{rate} with {MEASURED_DTYPE} weights"


def markdown(report: dict) -> str:
    lines = [f"{report['preset']}: the largest setting whose estimated peak is at most {report['fraction']:.0%} of the "
             "GPU's memory (one prompt's group a step on the GPU, the model's CFG, no text plan; a full fine-tune "
             "with float32 master weights under bf16 autocast, LoRA on bf16 weights, as the shipped configs"
             + (f"; a self_judge reward scoring {report['judge_batch']} images a forward" if report.get("judge_batch")
                else "") + ")", "",
             "| GPU memory (GiB) | mode | weights | G | micro-batch | rank | checkpointing | reference | merged sampling "
             "| estimate (GiB) | images/s (measured, G 16) |", "|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in report["rows"]:
        if not r["fits"]:
            lines.append(f"| {r['gpu_memory_gib']:g} | {r['mode']} | {r['dtype']} | does not fit | | | | | | | |")
            continue
        lines.append(f"| {r['gpu_memory_gib']:g} | {r['mode']} | {r['dtype']} | {r['group']} | {r['micro_batch']} | "
                     f"{r['rank'] or ''} | {'on' if r['checkpointing'] else 'off'} | {_reference(r)} | "
                     f"{'on' if r['merge'] else 'off' if r['mode'] == 'lora' else ''} | {r['estimate_gib']} | "
                     f"{_rate(r)} |")
    lines += ["", "Each row's overrides (also in `--json`), on its shipped config with policy.path at the model's files:",
              ""]
    lines += [f"- {r['gpu_memory_gib']:g} GiB, {r['mode']}: `{r['config']} {' '.join(r['overrides'])}`"
              for r in report["rows"] if r["fits"]]
    return "\n".join(lines) + "\n"
