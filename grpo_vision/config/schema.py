"""Typed configuration: nested dataclasses, YAML files and dotted command-line overrides.

Every knob is one typed field with a one-line doc (cleanrl style), and the defaults run. Loading is
strict: an unknown key, a value of the wrong type or a malformed YAML file raises `ConfigError` that
names the key and what was expected, so a typo never silently falls back to a default.

    cfg = load_config("configs/shapes.yaml", ["train.lr=1e-5", "sample.group_size=16"])
    sizes = derived_sizes(cfg, num_processes=2)   # checks divisibility, prints with format_sizes()
"""

from __future__ import annotations

import dataclasses
import math
import re
import warnings
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

import yaml

from grpo_vision.config.load import ConfigError, GrpoVisionWarning, apply_override, brief, from_dict, read_yaml
from grpo_vision.files import write_file


# run.device's names (and --device's); whether this machine has one is checked at use (run/machine.resolve_device)
DEVICE_NAME = re.compile(r"auto|cpu|cuda(:[0-9]+)?|mps")
DEVICE_HINT = "auto (the best device here), cpu, cuda, cuda:N or mps"
# the largest image seed the commands and the demo take (numpy's and most tools' limit); here, in the core,
# so that the command line and the tools share it without importing each other
MAX_SEED = 2**32 - 1
# Every eval image's base seed, whatever run.seed: image j of prompt i draws EVAL_SEED + 1000 i + j (rollouts.py),
# so a run's report, `eval RUN` and the matrix (whose runs differ in run.seed) score the same images
EVAL_SEED = 99


@dataclass
class RunConfig:
    name: str = "grpo"  # run directory name, created under out_dir
    out_dir: str = "runs"  # parent folder of run directories
    seed: int = 0  # seeds prompts order, sampling and initialisation
    device: str = "auto"  # "auto" (cuda if available, else cpu), "cpu", "cuda", "cuda:N" or "mps"
    threads: int = 0  # torch's CPU threads per process, at most the usable cores; 0 = OMP_NUM_THREADS if set, else its share


@dataclass
class PolicyConfig:
    # a registered policy kind: llama, janus, llamagen, or a plugin's; required (the core names no model)
    kind: str = ""
    path: str = ""  # required: what the kind loads, e.g. a LlamaImagePolicy or Janus-Pro directory, a LlamaGen .pt
    tokenizer: str = ""  # VQ: a diffusers VQModel directory (llama), a LlamaGen vq_ds16_*.pt; Janus ships its own
    dtype: Literal["float32", "bfloat16", "float16"] = "float32"  # parameter dtype of the policy
    # settings of the kind itself, checked against the options dataclass it registers when a command loads the
    # config (llamagen: LlamaGenOptions in models/llamagen_load.py; llama and janus take none)
    options: dict[str, Any] = field(default_factory=dict)


@dataclass
class PlanConfig:
    """A text plan before each image (T2I-R1's two-stage rollout, arXiv 2505.00703): the policy writes a plan with its
    language head, the image is drawn from the prompt and the plan, and both are trained under one advantage."""
    enabled: bool = False  # the policy kind must be able to plan (policy.PlanningPolicy)
    # the text stage's prompt, {prompt} the caption; a kind wraps it in its own chat format (Janus: T2I-R1's template
    # in configs/janus_pro_t2i_r1.yaml). A closed-vocabulary kind (shapes) takes "{prompt}" only
    template: str = "{prompt}"
    max_tokens: int = 64  # the plan-length cap: a plan that has not ended by then is cut there (ShortCoTI: short is fine)
    # the text stage's distribution, sampled and scored alike (T2I-R1 sampled with transformers' defaults and scored
    # with a plain softmax at T = 1; here the same settings do both, so rollout/logp_drift covers text too)
    temperature: float = 1.0
    top_k: int = 0  # 0 = all plan tokens
    top_p: float = 1.0  # 1 = all


@dataclass
class SampleConfig:
    prompts_per_step: int = 8  # distinct prompts per training step (B)
    group_size: int = 8  # images sampled per prompt (G); advantages are normalised within a group
    cfg_scale: float = 3.0  # classifier-free guidance: logits = uncond + s * (cond - uncond); 1 = off
    temperature: float = 1.0  # softmax temperature of image-token sampling
    top_k: int = 0  # keep the k most likely image tokens; 0 = all
    top_p: float = 1.0  # nucleus sampling: keep the smallest set with this much mass; 1 = all
    logprob_mode: Literal["guided", "conditional"] = "guided"  # distribution used by ratio and KL
    batch_size: int = 64  # sequences per sampler call (CFG doubles the rows internally)
    # how a rollout runs, not what it draws (sampling/decode.py): graph = a fixed-shape decode step recorded once as a
    # CUDA graph and replayed per token; static = that step without the graph; eager = attention over the keys
    # so far; compiled = the static step fused by torch.compile (inside the graph on a GPU; compiled once per
    # process and shape); auto = graph on a GPU, eager on a CPU. All give the same tokens for the same seeds.
    # speculative = SJD (sampling/speculative.py): drafted tokens verified several a forward pass; the same distribution
    # exactly, other tokens for a seed
    decode: Literal["auto", "eager", "static", "graph", "compiled", "speculative"] = "auto"
    speculative_window: int = 32  # decode=speculative: tokens one forward pass verifies (the last kept + W-1 drafts)
    # decode=speculative: where drafts come from. jacobi = SJD's, the last forward's prediction at each position;
    # coupled = MC-SJD's maximal coupling to the previous draft there (arXiv 2510.24211): the same law, fewer
    # forwards (ShapesWorld base policy, W = 16: 92 a 256-token image against jacobi's 111; docs/benchmarks.md)
    speculative_draft: Literal["jacobi", "coupled"] = "coupled"
    # decode=speculative: `speculative_candidates` drafts at each of the first `speculative_branching` positions
    # after the last kept token, siblings of the main draft inside the window (after SJD-PAC's proactive drafting,
    # arXiv 2603.18599), tested in turn by recursive rejection (the same law); 1 and 0 = a chain, SJD's window. The
    # defaults (W 32, 8 at 2) need 74 passes a 256-token image of the main job's trained policy and 104 for its batch
    # of 32, against 85 and 132 for a W = 16 chain (docs/benchmarks.md)
    speculative_candidates: int = 8
    speculative_branching: int = 2
    # rollouts under bf16 autocast (float32 weights decode faster on a GPU); rollout/logp_drift shows what it
    # costs, and the update's old log-probs are then recomputed, so that its first ratio is still exactly 1
    mixed_precision: Literal["no", "bf16"] = "no"
    # fold the peft adapter into the weights while a step samples, and put the weights back bit for bit after (TRL
    # 1.16 and verl's lora.merge): the rollout runs the base model's kernels only. auto = on for LoRA on one process
    # or DDP, off for LoHa / LoKr, DoRA, FSDP or where the merged copy does not fit; on refuses what cannot merge
    merge_adapter: Literal["auto", "on", "off"] = "auto"
    plan: PlanConfig = field(default_factory=PlanConfig)  # an optional text stage before the image (PlanConfig)


@dataclass
class TrainConfig:
    steps: int = 100  # training steps; one step = one rollout of B*G images plus its updates
    lr: float = 1e-5  # AdamW peak learning rate
    lr_schedule: Literal["constant", "cosine", "linear"] = "constant"  # decay after warmup
    warmup_steps: int = 0  # linear warmup, in optimizer updates
    weight_decay: float = 0.0  # AdamW weight decay
    adam_betas: list[float] = field(default_factory=lambda: [0.9, 0.999])  # AdamW (beta1, beta2)
    max_grad_norm: float = 1.0  # clip the global gradient norm; 0 = no clipping
    max_skipped_updates: int = 4  # stop (with a checkpoint) after this many skipped updates in a row; 0 = never
    num_iterations: int = 1  # update passes over each rollout (mu), old log-probs cached
    minibatches_per_pass: int = 1  # optimizer updates per pass; each averages its micro-batches
    micro_batch_size: int = 16  # sequences per forward/backward (gradient accumulation unit)
    mixed_precision: Literal["no", "bf16", "fp16"] = "no"  # autocast dtype for forward passes
    # recompute each transformer block's activations in the backward pass instead of keeping them:
    # activation memory falls from one copy per block to one block's, for about one more forward pass
    gradient_checkpointing: bool = False
    beta: float = 0.0  # weight of the k3 KL penalty against the reference policy
    epsilon_low: float = 0.2  # ratio clip below: 1 - epsilon_low
    epsilon_high: float = 0.28  # ratio clip above: 1 + epsilon_high (DAPO "clip higher")
    # loss normalisation or variant (TRL's names, grpo.py): grpo, bnpo, dr_grpo, dapo (token sum over the
    # global batch's tokens), cispo (clipped detached IS weight x log-prob; epsilon_high is its cap, e.g. 5.0)
    loss_type: Literal["grpo", "bnpo", "dr_grpo", "dapo", "cispo"] = "bnpo"
    importance_sampling_level: Literal["token", "sequence"] = "token"  # "sequence": one clipped ratio per image (GSPO)
    delta: float = 0.0  # cap the ratio at delta for negative-advantage tokens too (INTELLECT-2); 0 = off
    # only tokens whose sampling entropy is in this top fraction of the step carry the policy term (1 = all;
    # "Beyond the 80/20 rule" keeps 0.2); the KL term still covers every token
    top_entropy_quantile: float = 1.0
    adv_scale: Literal["group", "batch", "none"] = "group"  # divide advantages by this std
    # train a peft adapter instead of every weight: LoRA, DoRA (LoRA with a learned magnitude per output row, peft's
    # use_dora), or LoHa / LoKr of the LyCORIS family; none = full fine-tune
    adapter: Literal["none", "lora", "dora", "loha", "lokr"] = "none"
    # where reference log-probs come from: a frozen copy, the policy with its adapter disabled (multiplier 0;
    # needs train.adapter; no second copy), or none
    reference: Literal["frozen", "adapter", "none"] = "frozen"
    ref_sync_every: int = 0  # copy the policy into the reference every N steps; 0 = never
    # iterative RL (DeepSeekMath 4.2; not num_iterations, the passes per rollout): train.steps split into this
    # many equal iterations; at each boundary the reference becomes the policy and learning rewards update
    iterations: int = 1
    # With beta 0 the reference is only a yardstick: measure the logged KL on the first N of each
    # process's sequences a step (0 = all), which saves reference forward passes. With beta > 0
    # every sequence needs its reference log-probs, and this is ignored
    kl_metric_sequences: int = 0
    adapter_rank: int = 16  # the adapter's rank r (LoRA, LoHa, LoKr)
    adapter_alpha: float = 32.0  # the adapter's scaling numerator: its update is scaled by alpha / r
    adapter_targets: list[str] = field(default_factory=lambda: ["q_proj", "k_proj", "v_proj", "o_proj"])  # modules
    # Token-level credit assignment (credit.py): per-token weights of the policy and KL terms. stage: VQ-code
    # similarity to the group's opposite-advantage images (STAGE); critical: GCPO's first, entropy-edge and
    # least-alike tokens with its dynamic advantage weight; guidance_contrastive: each token's KL between the
    # prompt and the null prompt, rank-equalised (needs CFG). none: every token alike (today's loss)
    token_weighting: Literal["none", "stage", "critical", "guidance_contrastive"] = "none"
    critical_fraction: float = 0.1  # critical: share of tokens in each of GCPO's three subsets (its 10%)
    guidance_top_share: float = 0.8  # guidance_contrastive: weight share the top guidance_top_fraction tokens carry
    guidance_top_fraction: float = 0.4  # guidance_contrastive: the fraction of tokens that carries that share
    # stage: STAGE's entropy reward, 1/(1 + (H_ref - H)^2) of the image's mean token entropy, centred and added
    # with this scale to the rewards of each group's best images (needs a reference); 0 = off
    stage_entropy_reward_scale: float = 0.4
    # groups whose rewards are all equal (advantage 0): keep them (they add only KL), drop them from the update, or
    # resample: replace each by a group of a prompt the step has not drawn, for at most resample_rounds rounds, and
    # drop what is still flat (DAPO's dynamic sampling, arXiv 2503.14476; one process; logged as
    # train/groups_resampled and train/groups_dropped)
    zero_std_groups: Literal["keep", "drop", "resample"] = "keep"
    resample_rounds: int = 3  # resample: refill rounds a step at most (each samples one group per flat group)
    # KL times the importance ratio, its gradient the unbiased reverse-KL one (DeepSeek-V3.2). TRL 1.16 defaults
    # to True; off here so that existing runs stay bit-identical
    use_bias_correction_kl: bool = False
    # drop the policy term of a negative-advantage image whose mean log-prob drift from its rollout exceeds this
    # (DeepSeek-V3.2's off-policy sequence mask, TRL's; matters with num_iterations > 1); 0 = off (TRL: None)
    off_policy_mask_threshold: float = 0.0
    entropy_coef: float = 0.0  # entropy bonus: loss -= coef * mean token entropy (adaptive: its start); 0 = off
    use_adaptive_entropy: bool = False  # Skywork-OR1: step entropy_coef by entropy_coef_delta toward entropy_target
    entropy_coef_min: float = 0.0  # adaptive entropy: the coefficient's lower bound
    entropy_coef_max: float = 1.0  # adaptive entropy: the coefficient's upper bound
    entropy_coef_delta: float = 0.005  # adaptive entropy: the coefficient's step per optimizer update
    # adaptive entropy: the bonus applies while the mean token entropy (nats) is at or below this; TRL's 0.2 is
    # for text, and image tokens start far higher (several nats): set it near the entropy of early steps
    entropy_target: float = 0.2
    # ref_sync_every's mix: reference = alpha * policy + (1 - alpha) * reference (TR-DPO). 1 = a copy (today's);
    # TRL's default is 0.6
    ref_model_mixup_alpha: float = 1.0
    # with sample.plan: how much each plan token counts against an image token in the loss's token mean (T2I-R1: 1,
    # one mean over both segments, where a ~70-token plan is ~10% of a 576-token image's weight); 0 trains the image only
    plan_weight: float = 1.0


@dataclass
class RewardConfig:
    weights: dict[str, float] = field(default_factory=lambda: {"clip": 1.0, "aesthetic": 1.0})  # name -> weight
    monitor: list[str] = field(default_factory=list)  # rewards logged and evaluated, not trained on
    # reward name -> its options, checked by that reward's options dataclass (rewards/models.py), e.g.
    # {clip: {model: ViT-L-14-quickgelu, checkpoint: /models/clip.bin}}; a policy kind may supply defaults
    options: dict[str, dict[str, Any]] = field(default_factory=dict)
    batch_size: int = 64  # images per reward-model call
    # How several rewards make the total the advantages come from (TRL's multi_objective_aggregation):
    # "sum_then_normalize" weights the raw values; "normalize_then_sum" z-scores each reward within its
    # group first (GDPO), so rewards on different scales need no hand-tuned weights to count equally
    combine: Literal["sum_then_normalize", "normalize_then_sum"] = "sum_then_normalize"
    # iterative RL: a learning reward (e.g. clip_refit) updates at each boundary on that iteration's samples
    # plus earlier ones replayed as this fraction of the update set (DeepSeekMath replays 10%)
    replay_fraction: float = 0.1
    replay_capacity: int = 8192  # earlier samples (image tokens and prompts) kept for replay; a random subset


@dataclass
class DataConfig:
    train_prompts: str = ""  # prompts file (text or JSONL); "" = the policy kind's own, where it has them
    # The report's headline eval set: prompts of the training distribution, never trained on (GenEval's
    # practice). "" = the kind's test captions, or with train_prompts, test_prompts of its prompts held
    # back with a fixed seed (the same split for every run.seed)
    eval_prompts: str = ""
    test_prompts: int = 32  # how many prompts of train_prompts to hold back when eval_prompts is ""
    # The transfer row: compositions no model trained on. "" = the kind's held-out set where it has one,
    # none with train_prompts. Removed from training like eval_prompts
    heldout_prompts: str = ""
    # The column of a table (.csv, .tsv, .parquet, a datasets folder) or the key of a JSONL file that holds
    # the prompts; "" = 'prompt', else 'caption' or 'text' where the table has one of them and not both. It is
    # data.train_prompts' column, and the other two sources' unless they name their own just below
    prompt_column: str = ""
    eval_prompt_column: str = ""  # data.eval_prompts' column; "" = data.prompt_column
    heldout_prompt_column: str = ""  # data.heldout_prompts' column; "" = data.prompt_column
    # Captions in each of the kind's eval sets (test, held-out, and the sample of training captions the
    # report also scores), for a kind that draws them; eval_draw 2, 3, ... draws other test and held-out
    # captions from the same pools (a check that the headline is not the draw's)
    eval_size: int = 128
    eval_draw: int = 1

    def column(self, source: str) -> str:
        """The prompt column of source "train", "eval" or "heldout" (its own, else data.prompt_column)."""
        return {"eval": self.eval_prompt_column, "heldout": self.heldout_prompt_column}.get(source) or \
            self.prompt_column


# The alerts a run watches for while it trains (run/alerts.py; docs/usage.md, "Watching a run")
ALERT_NAMES = ("flat_reward", "hacking_onset", "variance_collapse", "ratio_drift")
TRACKER_NAMES = ("tensorboard", "wandb", "mlflow")  # log.trackers: through accelerate's tracker API (run/trackers.py)


@dataclass
class AlertConfig:
    enabled: bool = True  # watch the metrics for the alerts below while training
    # steps per window; trends compare the last window with the one before it. 12 lets the main job's 72
    # steps be watched from step 24; on runs of hundreds of steps a longer window is less noisy
    window: int = 12
    sigmas: float = 3.0  # a change counts when it exceeds this many standard errors (Welch, each step one draw)
    flat_zero_std: float = 0.5  # flat_reward: the window's mean fraction of groups without reward spread at or above
    flat_change: float = 0.1  # flat_reward: a trend under this fraction of the within-group std is flat
    collapse_fraction: float = 0.2  # variance_collapse: within-group std below this fraction of the first window's
    ratio_tolerance: float = 0.01  # ratio_drift: loss/ratio_mean's window mean further than this from 1 (and noise)
    clip_rise: float = 0.02  # ratio_drift: a clip fraction rising by more than this between windows (and noise)


@dataclass
class LogConfig:
    sample_every: int = 25  # save a policy-vs-reference sample grid every N steps; 0 = never
    checkpoint_every: int = 50  # write a checkpoint every N steps; 0 = only at the end
    eval_images: int = 4  # images per prompt of each scored set (test, held-out, training sample) in the report
    # Sampling temperatures at which the report evaluates policy and reference (the same seeds for
    # both); the first gives the headline tables, each one a row of the by-temperature table. Empty =
    # sample.temperature only. Training still samples at sample.temperature
    eval_temperatures: list[float] = field(default_factory=list)
    report: bool = True  # evaluate and write report.md at the end (`matrix` scores its runs itself)
    # where the metrics, the sample grids (log.sample_every) and, on W&B, the rollouts table go besides
    # metrics.jsonl: tensorboard, wandb, mlflow (pip install grpo_vision[wandb] / [mlflow]); [] = none
    trackers: list[str] = field(default_factory=lambda: ["tensorboard"])
    project: str = "grpo_vision"  # the W&B project and MLflow experiment; TensorBoard writes tensorboard/<project>/
    alerts: AlertConfig = field(default_factory=AlertConfig)  # what to watch for while training
    judge_rollouts: bool = True  # judge every step's rollouts where the policy kind has a judge: judge/<attribute>
    stop_on: list[str] = field(default_factory=list)  # alerts that stop the run (checkpoint saved), e.g. [hacking_onset]


@dataclass
class Config:
    run: RunConfig = field(default_factory=RunConfig)
    policy: PolicyConfig = field(default_factory=PolicyConfig)
    sample: SampleConfig = field(default_factory=SampleConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    reward: RewardConfig = field(default_factory=RewardConfig)
    data: DataConfig = field(default_factory=DataConfig)
    log: LogConfig = field(default_factory=LogConfig)


# ---------------------------------------------------------------- loading


def load_config(path: str | Path | None = None, overrides: list[str] | None = None) -> Config:
    """Defaults, then the YAML file at `path`, then `overrides` like ``train.lr=1e-5``."""
    where = str(path) if path is not None else "config"
    raw = read_yaml(path) if path is not None else {}
    cfg = from_dict(Config, raw, where=where)
    for item in overrides or []:
        apply_override(cfg, item)
    validate(cfg)
    return cfg


def validate(cfg: Config) -> None:
    """Range checks that types alone cannot express."""
    s, t = cfg.sample, cfg.train
    for key, value, allowed, ok in _float_ranges(cfg):
        # isfinite first: NaN fails every comparison and inf passes `> 0`, and either reaches the
        # optimizer or the sampler as a silent no-op or as NaN weights
        if not (math.isfinite(value) and ok(value)):
            raise ConfigError(f"{key} must be a finite number {allowed}, got {value}")
    checks = [
        (s.group_size >= 2, "sample.group_size must be >= 2: GRPO normalises rewards within a group, "
                            "and a group of one has no spread to learn from"),
        (bool(DEVICE_NAME.fullmatch(cfg.run.device)), f"run.device {brief(cfg.run.device)} is not a device: use {DEVICE_HINT}"),
        (cfg.run.threads >= 0, "run.threads must be >= 0 (0 = one per core this process may use)"),
        # numpy's seed range: the step seeds take more, but TRL's set_seed (bench trl) and the tools do not
        (0 <= cfg.run.seed <= MAX_SEED, f"run.seed must be a whole number from 0 to {MAX_SEED}, got "
                                        f"{brief(cfg.run.seed)}"),
        (s.prompts_per_step >= 1, "sample.prompts_per_step must be >= 1"),
        (s.batch_size >= 1, "sample.batch_size must be >= 1"),
        (s.speculative_window >= 1, "sample.speculative_window must be >= 1"),
        (s.speculative_candidates >= 1, "sample.speculative_candidates must be >= 1 (1: one draft a position)"),
        (s.speculative_branching >= 0, "sample.speculative_branching must be >= 0 (0: no position branches)"),
        *_tree_checks(s),
        (s.top_k >= 0, "sample.top_k must be >= 0 (0 keeps every token)"),
        *_plan_checks(cfg),
        (t.steps >= 1, "train.steps must be >= 1"),
        (t.warmup_steps >= 0, "train.warmup_steps must be >= 0"),
        (t.num_iterations >= 1, "train.num_iterations must be >= 1"),
        (t.minibatches_per_pass >= 1, "train.minibatches_per_pass must be >= 1"),
        (t.micro_batch_size >= 1, "train.micro_batch_size must be >= 1"),
        (t.ref_sync_every >= 0, "train.ref_sync_every must be >= 0"),
        (t.iterations >= 1, "train.iterations must be >= 1 (1 = no iterative RL)"),
        (t.iterations < 1 or t.steps % t.iterations == 0,
         f"train.steps ({t.steps}) must split into train.iterations ({t.iterations}) equal iterations: make "
         f"train.steps a multiple of {t.iterations}, or pick iterations among "
         f"{[k for k in range(1, min(t.steps, 64) + 1) if t.steps % k == 0]}"),
        (cfg.reward.replay_capacity >= 0, "reward.replay_capacity must be >= 0 (0 = no replay)"),
        (t.kl_metric_sequences >= 0, "train.kl_metric_sequences must be >= 0 (0 = every sequence)"),
        (t.max_skipped_updates >= 0, "train.max_skipped_updates must be >= 0 (0 = never stop)"),
        (t.adapter_rank >= 1, "train.adapter_rank must be >= 1"),
        (t.resample_rounds >= 1, "train.resample_rounds must be >= 1 (train.zero_std_groups=drop refills nothing)"),
        (s.merge_adapter != "on" or t.adapter != "none",
         "sample.merge_adapter=on folds a peft adapter into the weights while sampling, and train.adapter is none: "
         "set sample.merge_adapter to auto or off, or train.adapter to lora"),
        (t.reference != "adapter" or t.adapter != "none",
         "train.reference: adapter is the policy with its adapter disabled, and train.adapter is none: set "
         "train.adapter to lora, dora, loha or lokr, or train.reference to frozen"),
        (len(t.adam_betas) == 2, "train.adam_betas must have two entries, e.g. [0.9, 0.999]"),
        # AdamW on float16 weights: grad**2 and eps (1e-8) underflow to 0, and 0/0 makes the weights NaN
        (cfg.policy.dtype != "float16" or t.adapter != "none", "policy.dtype float16 cannot be fine-tuned in full "
         "(AdamW's steps on float16 weights underflow and make them NaN): use bfloat16, or float32 with train."
         "mixed_precision fp16, or keep the float16 weights frozen under an adapter (train.adapter lora)"),
        (t.loss_type != "cispo" or t.epsilon_high > 1,
         f"train.loss_type=cispo caps the importance weight at train.epsilon_high itself (ScaleRL's eps_max), so it "
         f"must be above 1; got {t.epsilon_high}: set train.epsilon_high=5.0 (the ScaleRL recipe)"),
        (t.delta == 0 or t.loss_type != "cispo",
         "train.delta caps the ratio of the clipped losses; cispo clips its weight at train.epsilon_high instead: "
         "set train.delta=0"),
        (t.delta == 0 or t.loss_type == "cispo" or t.delta > 1 + t.epsilon_high,
         f"train.delta caps the ratio above the clip, so it must exceed 1 + train.epsilon_high = "
         f"{1 + t.epsilon_high:g}; got {t.delta}: set it higher, or 0 for off"),
        (not (t.beta > 0 and t.reference == "none"),
         "train.beta > 0 needs a reference policy: set train.reference to frozen or adapter, or beta to 0"),
        (bool(cfg.reward.weights), "reward.weights must name at least one reward, e.g. {clip: 1.0}"),
        (all(math.isfinite(w) for w in cfg.reward.weights.values()),
         f"reward.weights must be finite numbers, got {cfg.reward.weights}"),
        (cfg.reward.batch_size >= 1, "reward.batch_size must be >= 1"),
        # printable only: a newline in it printed as a line of its own, e.g. a forged "[train] done:"
        (bool(cfg.run.name) and cfg.run.name not in (".", "..") and not set("/\\") & set(cfg.run.name)
         and cfg.run.name.isprintable(),
         f"run.name must be a plain folder name (no '/' or '\\', no newline or other control character), got "
         f"{brief(cfg.run.name)}"),
        (cfg.log.sample_every >= 0, "log.sample_every must be >= 0 (0 = never)"),
        (cfg.log.checkpoint_every >= 0, "log.checkpoint_every must be >= 0 (0 = only at the end)"),
        (cfg.log.eval_images >= 1, "log.eval_images must be >= 1 (images per eval prompt in the report)"),
        (all(n in TRACKER_NAMES for n in cfg.log.trackers),
         f"log.trackers {brief(cfg.log.trackers)} may name only {', '.join(TRACKER_NAMES)}"),
        (all(n in ALERT_NAMES for n in cfg.log.stop_on),
         f"log.stop_on {brief(cfg.log.stop_on)} may name only the alerts {', '.join(ALERT_NAMES)}"),
        (cfg.log.alerts.window >= 2, "log.alerts.window must be >= 2 (steps per window; a window needs a spread)"),
        (cfg.data.test_prompts >= 1, "data.test_prompts must be >= 1 (prompts held back as the test set)"),
        (cfg.data.eval_size >= 1, "data.eval_size must be >= 1 (captions per eval set)"),
        (cfg.data.eval_draw >= 1, "data.eval_draw must be >= 1 (1: the eval sets every run is scored on)"),
    ]
    for ok, message in checks + _credit_checks(cfg):
        if not ok:
            raise ConfigError(message)
    if t.adapter != "none" and t.reference == "frozen":
        warnings.warn("train.adapter with train.reference: frozen keeps a second full copy of the policy as the "
                      "reference; train.reference: adapter is the same reference (the adapter disabled) without it",
                      GrpoVisionWarning, stacklevel=2)
    if t.reference == "adapter" and t.ref_sync_every and cfg.policy.dtype != "float32":
        warnings.warn(f"train.ref_sync_every folds the adapter into {cfg.policy.dtype} base weights, which rounds "
                      "it: after a sync the policy moves by that rounding and the reference equals it only "
                      "approximately", GrpoVisionWarning, stacklevel=2)


def _tree_checks(s) -> list:
    """With decode=speculative, a draft tree that fits the window (speculative.py DraftTree.build says what)."""
    from grpo_vision.sampling.speculative import DraftTree

    if s.decode != "speculative" or s.speculative_candidates < 1 or s.speculative_branching < 0 \
            or s.speculative_window < 1:
        return []
    try:
        DraftTree.build(s.speculative_window, s.speculative_candidates, s.speculative_branching)
    except ValueError as e:
        return [(False, f"sample.speculative_candidates={s.speculative_candidates} and "
                        f"sample.speculative_branching={s.speculative_branching}: {e}")]
    return []


def _plan_checks(cfg: Config) -> list[tuple[bool, str]]:
    """sample.plan's settings, and what the text stage does not combine with (yet)."""
    p, t = cfg.sample.plan, cfg.train
    if not p.enabled:
        return []
    return [
        (p.max_tokens >= 1, f"sample.plan.max_tokens must be >= 1 (the longest plan in tokens), got {p.max_tokens}"),
        (p.top_k >= 0, "sample.plan.top_k must be >= 0 (0 keeps every token)"),
        (_has_prompt_slot(p.template), f"sample.plan.template {brief(p.template)} must contain {{prompt}} once, where the "
                                       "caption goes, as is (no other {...}, no !r or :spec; write {{ and }} for "
                                       "braces)"),
        # GCPO's and STAGE's weights are defined on the image's token grid and its sequence: GCPO's dynamic weight is
        # a running mean over positions, its KL weight scaled to the image's token count, STAGE's entropy reward a
        # mean over the image's entropies; a plan segment before them has no place in either definition
        (t.token_weighting in ("none", "guidance_contrastive"),
         f"train.token_weighting={t.token_weighting} is defined on the image's token sequence only (its weights, "
         "its running mean over positions, its KL scale): with sample.plan.enabled use none or guidance_contrastive"),
    ]


def _has_prompt_slot(template: str) -> bool:
    """True when `template` has exactly one {prompt} field, without a conversion or format spec (`{prompt!r}`
    quotes the caption, `{prompt:>10}` pads it), and no other field (str.format's parse)."""
    import string

    try:
        fields = [(f, spec, conv) for _, f, spec, conv in string.Formatter().parse(template) if f is not None]
    except ValueError:  # an unmatched brace
        return False
    return fields == [("prompt", "", None)]


def _float_ranges(cfg: Config) -> list[tuple[str, float, str, Any]]:
    """(key, value, what is allowed, test) for every float knob; the test runs on finite values only."""
    s, t = cfg.sample, cfg.train
    ranges = [
        ("sample.cfg_scale", s.cfg_scale, ">= 0 (1 turns guidance off)", lambda v: v >= 0),
        ("sample.temperature", s.temperature, "> 0", lambda v: v > 0),
        ("sample.top_p", s.top_p, "in (0, 1] (1 keeps every token)", lambda v: 0 < v <= 1),
        ("sample.plan.temperature", s.plan.temperature, "> 0", lambda v: v > 0),
        ("sample.plan.top_p", s.plan.top_p, "in (0, 1] (1 keeps every token)", lambda v: 0 < v <= 1),
        ("train.plan_weight", t.plan_weight, ">= 0 (0: the plan is sampled but not trained)", lambda v: v >= 0),
        # AdamW moves each weight by about lr per update: above 1 that only wrecks the weights, and from
        # about 3e37 PyTorch cannot even represent the step (a RuntimeError mid-run)
        ("train.lr", t.lr, "in (0, 1]", lambda v: 0 < v <= 1),
        ("train.weight_decay", t.weight_decay, ">= 0", lambda v: v >= 0),
        ("train.max_grad_norm", t.max_grad_norm, "> 0, or 0 for no clipping", lambda v: v >= 0),
        ("train.beta", t.beta, ">= 0", lambda v: v >= 0),
        ("train.epsilon_low", t.epsilon_low, "in [0, 1)", lambda v: 0 <= v < 1),
        ("train.epsilon_high", t.epsilon_high, ">= 0", lambda v: v >= 0),
        ("train.delta", t.delta, ">= 0 (0 = off)", lambda v: v >= 0),
        ("train.top_entropy_quantile", t.top_entropy_quantile, "in (0, 1] (1 keeps every token)", lambda v: 0 < v <= 1),
        ("train.adapter_alpha", t.adapter_alpha, "> 0", lambda v: v > 0),
        ("reward.replay_fraction", cfg.reward.replay_fraction, "in [0, 1) (0 = no replay)", lambda v: 0 <= v < 1),
    ]
    ranges += [(f"train.adam_betas[{i}]", b, "in [0, 1)", lambda v: 0 <= v < 1) for i, b in enumerate(t.adam_betas)]
    ranges += [("train.critical_fraction", t.critical_fraction, "in (0, 1] (GCPO: 0.1)", lambda v: 0 < v <= 1),
               ("train.guidance_top_share", t.guidance_top_share, "in (0, 1) (0.8)", lambda v: 0 < v < 1),
               ("train.guidance_top_fraction", t.guidance_top_fraction, "in (0, 1) (0.4)", lambda v: 0 < v < 1),
               ("train.stage_entropy_reward_scale", t.stage_entropy_reward_scale, ">= 0 (0 = off)", lambda v: v >= 0),
               ("train.off_policy_mask_threshold", t.off_policy_mask_threshold, ">= 0 (0 = off)", lambda v: v >= 0),
               ("train.entropy_coef", t.entropy_coef, ">= 0 (0 = off)", lambda v: v >= 0),
               ("train.entropy_coef_min", t.entropy_coef_min, ">= 0", lambda v: v >= 0),
               ("train.entropy_coef_max", t.entropy_coef_max, ">= 0", lambda v: v >= 0),
               ("train.entropy_coef_delta", t.entropy_coef_delta, ">= 0", lambda v: v >= 0),
               ("train.entropy_target", t.entropy_target, ">= 0 (nats)", lambda v: v >= 0),
               ("train.ref_model_mixup_alpha", t.ref_model_mixup_alpha, "in (0, 1] (1 = a copy)", lambda v: 0 < v <= 1)]
    a = cfg.log.alerts
    ranges += [("log.alerts.sigmas", a.sigmas, "> 0", lambda v: v > 0),
               ("log.alerts.flat_zero_std", a.flat_zero_std, "in (0, 1]", lambda v: 0 < v <= 1),
               ("log.alerts.flat_change", a.flat_change, ">= 0", lambda v: v >= 0),
               ("log.alerts.collapse_fraction", a.collapse_fraction, "in [0, 1)", lambda v: 0 <= v < 1),
               ("log.alerts.ratio_tolerance", a.ratio_tolerance, ">= 0", lambda v: v >= 0),
               ("log.alerts.clip_rise", a.clip_rise, ">= 0", lambda v: v >= 0)]
    ranges += [(f"log.eval_temperatures[{i}]", x, "> 0", lambda v: v > 0)
               for i, x in enumerate(cfg.log.eval_temperatures)]
    return ranges


def _credit_checks(cfg: Config) -> list[tuple[bool, str]]:
    """(ok, message) for the token weightings, zero-std groups and TRL 1.16's options (grpo.py, credit.py)."""
    s, t = cfg.sample, cfg.train
    return [
        (t.token_weighting != "guidance_contrastive" or s.cfg_scale > 1,
         f"train.token_weighting=guidance_contrastive weighs tokens by the KL between the prompt and the null prompt "
         f"of classifier-free guidance, and sample.cfg_scale={s.cfg_scale:g} turns it off: set sample.cfg_scale > 1 "
         "(the paper samples at 5)"),
        (t.guidance_top_share > t.guidance_top_fraction,
         f"train.guidance_top_share ({t.guidance_top_share:g}) must exceed train.guidance_top_fraction "
         f"({t.guidance_top_fraction:g}): the top tokens carry more than their share (the paper: 0.8 on 0.4)"),
        (t.token_weighting != "stage" or t.stage_entropy_reward_scale == 0 or t.reference != "none",
         "train.stage_entropy_reward_scale compares each image's entropy with the reference's, and train.reference "
         "is none: set train.reference to frozen or adapter, or train.stage_entropy_reward_scale=0"),
        (t.token_weighting != "critical" or t.reference != "none",
         "train.token_weighting=critical scales advantages by GCPO's dynamic weight, exp(clamp(logp - ref_logp)), "
         "and train.reference is none: set train.reference to frozen or adapter"),
        (t.zero_std_groups != "resample" or t.token_weighting != "stage" or t.stage_entropy_reward_scale == 0,
         "train.zero_std_groups=resample refills the groups whose reward did not vary, and STAGE's entropy reward "
         "(train.stage_entropy_reward_scale) gives those groups a spread after it: use train.zero_std_groups=drop "
         "or keep with it, or train.stage_entropy_reward_scale=0"),
        (t.entropy_coef_min <= t.entropy_coef_max,
         f"train.entropy_coef_min ({t.entropy_coef_min:g}) must not exceed train.entropy_coef_max "
         f"({t.entropy_coef_max:g})"),
        (t.ref_model_mixup_alpha == 1 or t.ref_sync_every > 0,
         "train.ref_model_mixup_alpha mixes the policy into the reference at each train.ref_sync_every, which is 0 "
         "(never): set train.ref_sync_every, or train.ref_model_mixup_alpha=1"),
        (t.ref_model_mixup_alpha == 1 or t.reference == "frozen",
         f"train.ref_model_mixup_alpha mixes two sets of weights, and train.reference={t.reference} keeps no second "
         "set: use train.reference=frozen, or train.ref_model_mixup_alpha=1"),
    ]


# ---------------------------------------------------------------- derived sizes


def derived_sizes(cfg: Config, num_processes: int = 1) -> dict[str, int]:
    """The batch arithmetic, checked: whole groups stay on one process, micro-batches tile a minibatch."""
    s, t = cfg.sample, cfg.train
    if s.prompts_per_step % num_processes:
        raise ConfigError(
            f"sample.prompts_per_step={s.prompts_per_step} must be divisible by the number of processes "
            f"({num_processes}) so that every group of {s.group_size} images stays on one process")
    images_per_process = s.prompts_per_step // num_processes * s.group_size
    per_update = t.minibatches_per_pass * t.micro_batch_size
    if images_per_process % per_update:
        raise ConfigError(
            f"images per process per step ({images_per_process} = prompts_per_step {s.prompts_per_step} / "
            f"{num_processes} processes x group_size {s.group_size}) must be divisible by "
            f"train.minibatches_per_pass x train.micro_batch_size = {per_update}")
    return {
        "processes": num_processes,
        "images_per_step": s.prompts_per_step * s.group_size,
        "images_per_process": images_per_process,
        "micro_batch_size": t.micro_batch_size,
        "micro_batches_per_update": images_per_process // per_update,
        "updates_per_step": t.num_iterations * t.minibatches_per_pass,
        "steps": t.steps,
        "total_updates": t.steps * t.num_iterations * t.minibatches_per_pass,
        "total_images": t.steps * s.prompts_per_step * s.group_size,
    }


def format_sizes(sizes: dict[str, int]) -> str:
    return "  ".join(f"{k}={v}" for k, v in sizes.items())


def to_dict(cfg: Config) -> dict:
    return dataclasses.asdict(cfg)


def save_config(cfg: Config, path: str | Path, header: str = "") -> None:
    """Write the resolved config atomically (a resumed run reads it back), after the comment `header`."""
    write_file(path, header + yaml.safe_dump(to_dict(cfg), sort_keys=False))
