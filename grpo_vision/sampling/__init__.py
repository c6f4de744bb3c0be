"""Sampling owns the distribution: every image token a rollout draws, and every log-prob training scores, comes
from here.

- distribution.py: `SamplingParams` and `PlanParams` (sample.*), CFG, temperature, top-k/top-p, the token draw
  (`sample_token`) and the log-probs of known tokens (`token_logprobs`), seeded uniforms;
- sequences.py: what a rollout is, a text-plan segment (`Plan`, T = 0 without one) then the image tokens
  (`Rollout`), each selecting and joining rows;
- decode.py: how a rollout runs, one table of decode paths (`DECODERS`: eager, static, graph, compiled,
  speculative) behind `sample`;
- speculative.py: speculative Jacobi decoding, the same distribution in fewer forward passes;
- cuda_graph.py: a fixed-shape step recorded once as a CUDA graph and replayed (both decoders' steps);
- plan.py: the text stage before the image (`sample_plan`) and its log-probs;
- score.py: training's teacher-forced log-probs of a rollout's sequence, plan and image segments
  (`sequence_logprobs`, `batched_logprobs`).
"""

from grpo_vision.sampling.decode import CompileError, decode_mode, decode_note, sample, sample_batched
from grpo_vision.sampling.distribution import (
    DECODE_MODES, LOGPROB_MODES, PlanParams, SamplingParams, filter_logits, target_logp, token_logprobs,
)
from grpo_vision.sampling.plan import sample_plan
from grpo_vision.sampling.score import (
    batched_logprobs, batched_logprobs_and_entropy, micro_batches, sequence_logprobs, sequence_logprobs_and_entropy,
)
from grpo_vision.sampling.sequences import Plan, Rollout

__all__ = ["CompileError", "DECODE_MODES", "LOGPROB_MODES", "Plan", "PlanParams", "Rollout", "SamplingParams",
           "batched_logprobs", "batched_logprobs_and_entropy", "decode_mode", "decode_note", "filter_logits",
           "micro_batches", "sample", "sample_batched", "sample_plan", "sequence_logprobs",
           "sequence_logprobs_and_entropy", "target_logp", "token_logprobs"]
