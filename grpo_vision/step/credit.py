"""Token-level credit assignment: per-token weights of the policy and KL terms of `grpo.grpo_loss`.

GRPO gives every token of an image the image's advantage. These methods say which tokens the reward is
about. Each returns `(policy_weight, kl_weight)`, both `[n, N]`, for one step's rows (n = B*G images,
groups contiguous, N image tokens in raster order). The loss then reads (grpo.py):

    loss = -sum(w * a * l) / (sum(w) + 1e-6) + beta * aggregate(m * k3)

Every function is pure (tensors in, tensors out, no gradient unless stated). The constants the papers fix
are keyword arguments with the papers' values. Sources, each at the commit and lines read:

* STAGE (arXiv 2509.25027; krennic999/STAGE@579e5cf `src/grpo/src/open_r1/trainer/grpo_trainer.py`): a
  token is credited where its VQ code differs from the codes at the same cell in the group's images of the
  opposite advantage sign (L1039-1070), and its KL is halved where they are opposite (L1076-1078).
* GCPO critical tokens (ICLR 2026; zghhui/GCPO@d2fa245 `janus/src/gcpo/src/open_r1/trainer/gcpo_trainer.py`):
  the policy term is kept on about 30% of the tokens (the first, those on edges of the guided entropy map,
  and those least alike across the group; L758-786), with a dynamic advantage weight (L792-798).
* Guidance-contrastive (arXiv 2605.29198; jacklishufan/gcpo@e0f183d `t2i/src/grpo/src/utils/importance.py`
  L12-38 and `.../trainer/grpo_trainer.py` L1084, L1124-1125): each token's weight follows the rank of its
  KL between the prompt and the null prompt.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import Tensor


def _wide(x: Tensor) -> Tensor:
    """x in float32 at least (bf16 log-probs and embeddings are widened; float64 stays)."""
    return x if x.dtype in (torch.float32, torch.float64) else x.float()


def _groups(x: Tensor, group_size: int) -> Tensor:
    """`[n, ...]` -> `[n / G, G, ...]`, checking that the rows split into whole groups."""
    if group_size < 2 or x.shape[0] % group_size:
        raise ValueError(f"{x.shape[0]} rows do not split into groups of {group_size} (group_size >= 2)")
    return x.view(x.shape[0] // group_size, group_size, *x.shape[1:])


def _pair_cosines(vectors: Tensor, group_size: int) -> Tensor:
    """cos(v_i,t, v_j,t) `[n / G, G, G, N]` for every pair of images i, j of a group at each position t.
    vectors: `[n, N, D]`; a zero vector has cosine 0 with everything."""
    v = _groups(F.normalize(_wide(vectors), dim=-1), group_size)  # [n/G, G, N, D]
    return torch.einsum("gitd,gjtd->gijt", v, v)  # [n/G, G, G, N]


# ---------------------------------------------------------------------------- STAGE


def stage_similarity(codes: Tensor, advantages: Tensor, group_size: int) -> Tensor:
    """STAGE's S `[n, N]`: for image i at cell p, the mean over the group's images j with A_i * A_j <= 0 of
    cos(e_i,p, e_j,p), e = the VQ code vectors `codes` `[n, N, D]` (tokenizer.code_vectors).

    As the source (L1039-1070): the pair j = i adds 0 but is counted when A_i = 0 (A_i^2 <= 0), so an image
    with advantage 0 averages its similarity to the others over all G. A group whose advantages are all 0
    (its rewards were all equal) gets S = 1 (same lines, "every reward constant and no entropy reward"): no
    policy weight, full KL. Simplification: the source keys that rule on the rewards before STAGE's entropy
    reward; here it is keyed on the advantages after it, which differ only when that reward is on and still
    leaves every reward equal.
    """
    cos = _pair_cosines(codes, group_size)  # [n/G, G, G, N]
    G = group_size
    cos = cos * (1 - torch.eye(G, dtype=cos.dtype, device=cos.device))[None, :, :, None]  # [n/G, G, G, N] j = i: 0
    a = _groups(_wide(advantages.detach()), G).to(cos.dtype)  # [n/G, G]
    opposite = (a[:, :, None] * a[:, None, :] <= 0).to(cos.dtype)  # [n/G, G, G] pairs j of opposite sign (or 0)
    s = (cos * opposite[..., None]).sum(2) / opposite.sum(2).clamp(min=1)[..., None]  # [n/G, G, N]
    flat = (a == 0).all(1)  # [n/G] no advantage in the group
    s = torch.where(flat[:, None, None], torch.ones_like(s), s)  # [n/G, G, N]
    return s.reshape(-1, codes.shape[1])  # [n, N]


def stage_weights(codes: Tensor, advantages: Tensor, group_size: int) -> tuple[Tensor, Tensor]:
    """STAGE's (policy weight, KL weight) `[n, N]` each from code vectors `[n, N, D]` and advantages `[n]`:

        w = clamp((1 - S) / 2, 0, 1)          (L1039-1070: 1 where the codes are opposite, 0 where equal)
        m = 0.5 + 0.5 * clamp(S + 1, 0, 1)     (L1076-1078: the KL halves where S = -1, stays 1 for S >= 0)
    """
    s = stage_similarity(codes, advantages, group_size)  # [n, N]
    return ((1 - s) / 2).clamp(0, 1), 0.5 + 0.5 * (s + 1).clamp(0, 1)


def stage_entropy_reward(rewards: Tensor, entropy: Tensor, ref_entropy: Tensor, group_size: int,
                         scale: float = 0.4) -> Tensor:
    """Rewards `[n]` plus STAGE's entropy reward (L965-992) on each group's best images.

    entropy, ref_entropy `[n]`: an image's mean token entropy (of the teacher-forced conditional
    distribution) under the policy and the reference. R_ent = 1 / (1 + (H_ref - H)^2) is kept only for the
    images whose reward equals the group's maximum, centred over them, and added times `scale`:
    R_i + scale * (R_ent_i - mean over the best of R_ent). An image that is not best, or whose reward is
    NaN, keeps its reward. With one best image the bonus is 0; it separates images that tie at the top.
    """
    r = _groups(rewards, group_size)  # [n/G, G]
    bonus = _groups(1 / (1 + (_wide(ref_entropy) - _wide(entropy)) ** 2), group_size).to(r.dtype)  # [n/G, G]
    top = torch.where(r.isnan(), torch.full_like(r, -torch.inf), r).amax(1, keepdim=True)  # [n/G, 1]
    best = (r == top) & ~r.isnan()  # [n/G, G]
    total = torch.where(best, bonus, torch.zeros_like(bonus)).sum(1, keepdim=True)  # [n/G, 1]
    mean = total / best.sum(1, keepdim=True).clamp(min=1)  # [n/G, 1] over the best images
    return torch.where(best, r + scale * (bonus - mean), r).reshape(-1)  # [n]


# ---------------------------------------------------------------------------- GCPO critical tokens


def causal_smooth(entropy_map: Tensor) -> Tensor:
    """`[n, h, w]` -> the mean of each cell with its causal neighbours that exist: left, up-left, up, up-right
    (the cells decoded before it; source L827-869)."""
    x = _wide(entropy_map)
    pad = F.pad(x, (1, 1, 1, 0))  # [n, h+1, w+2]: a column each side, a row above
    ones = F.pad(torch.ones_like(x), (1, 1, 1, 0))  # [n, h+1, w+2] which cells exist
    h, w = x.shape[1:]
    shifts = [(1, 1), (1, 0), (0, 0), (0, 1), (0, 2)]  # self, left, up-left, up, up-right in the padded grid
    total = sum(pad[:, i:i + h, j:j + w] for i, j in shifts)  # [n, h, w]
    count = sum(ones[:, i:i + h, j:j + w] for i, j in shifts)  # [n, h, w]
    return total / count


def spatial_gradient(m: Tensor) -> Tensor:
    """|grad| `[n, h, w]` of a map `[n, h, w]` (h, w >= 2): central differences, one-sided at the borders
    (source L827-869)."""
    dx = torch.cat([m[:, :, 1:2] - m[:, :, :1], (m[:, :, 2:] - m[:, :, :-2]) / 2, m[:, :, -1:] - m[:, :, -2:-1]], 2)
    dy = torch.cat([m[:, 1:2] - m[:, :1], (m[:, 2:] - m[:, :-2]) / 2, m[:, -1:] - m[:, -2:-1]], 1)
    return (dx ** 2 + dy ** 2).sqrt()  # [n, h, w]


def _first_k(score: Tensor, k: int, descending: bool) -> Tensor:
    """`[n, N]` bool: the k best positions of each row; among ties the lowest position wins (a stable sort,
    where the source's topk leaves the order of ties unspecified)."""
    order = torch.sort(score, dim=1, descending=descending, stable=True).indices[:, :k]  # [n, k]
    return torch.zeros_like(score, dtype=torch.bool).scatter_(1, order, True)


def group_similarity(embeddings: Tensor, group_size: int) -> Tensor:
    """GCPO's S-bar `[n, N]`: the mean over ordered pairs j != k of a group of cos(e_j,t, e_k,t), the same value
    for every image of the group (source L586-597). embeddings: `[n, N, E]` (policy.token_embeddings)."""
    cos = _pair_cosines(embeddings, group_size)  # [n/G, G, G, N]
    G = group_size
    off = cos.sum((1, 2)) - cos.diagonal(dim1=1, dim2=2).sum(-1)  # [n/G, N] the sum over j != k
    return (off / (G * (G - 1))).repeat_interleave(G, 0)  # [n, N]


def critical_tokens(guided_entropy: Tensor, embeddings: Tensor, grid: tuple[int, int], group_size: int,
                    fraction: float = 0.1, margin: float = 0.1) -> Tensor:
    """GCPO's critical tokens M `[n, N]` bool, the union of three subsets of K = int(fraction * N) tokens:

    * the first K (source L758-763: the tokens that lay out the image);
    * the K with the largest spatial gradient of the causally smoothed entropy map, among positions
      [int(margin N), int(margin N) + int((1 - 2 margin) N)) (L827-869: the edges of uncertain regions);
      guided_entropy `[n, N]` is the entropy of the rollout's CFG-guided distribution, before temperature;
    * the K least alike across the group (lowest `group_similarity`) among the rest (L769-776).

    About 3K tokens (30%) an image. Ties go to the lowest position (`_first_k`).
    """
    n, N = guided_entropy.shape
    h, w = grid
    if h * w != N or h < 2 or w < 2:
        raise ValueError(f"grid {grid} must hold the {N} tokens and be at least 2x2")
    if not 0 < fraction <= 1 or not 0 <= margin < 0.5:
        raise ValueError(f"fraction must be in (0, 1] and margin in [0, 0.5), got {fraction}, {margin}")
    k = int(N * fraction)
    pos = torch.arange(N, device=guided_entropy.device)  # [N]
    first = (pos < k)[None].expand(n, N)  # [n, N]
    grad = spatial_gradient(causal_smooth(guided_entropy.view(n, h, w))).view(n, N)  # [n, N]
    lo, size = int(N * margin), int(N * (1 - 2 * margin))
    in_band = (pos >= lo) & (pos < lo + size)  # [N]
    edges = _first_k(torch.where(in_band, grad, -torch.inf), min(k, size), descending=True)  # [n, N]
    sim = group_similarity(embeddings, group_size)  # [n, N]
    alike = _first_k(torch.where(first | edges, torch.inf, sim), k, descending=False)  # [n, N]
    return first | edges | alike


def dynamic_advantage_weight(logprobs: Tensor, ref_logprobs: Tensor, clamp: float = 0.5) -> Tensor:
    """GCPO's dynamic advantage weight `[n, N]`: the running mean over positions j <= t of
    exp(clamp(logp_j - ref_j, -clamp, clamp)) (source L792-798). Not detached, as the source: the gradient
    flows through logp inside the clamp (pass it to grpo_loss as `advantage_weight`). The paper writes it
    without the exp; the code is followed."""
    c = (logprobs - ref_logprobs.detach()).clamp(-clamp, clamp).exp()  # [n, N]
    t = torch.arange(1, c.shape[1] + 1, dtype=c.dtype, device=c.device)  # [N]
    return c.cumsum(1) / t  # [n, N]


def critical_weights(critical: Tensor) -> tuple[Tensor, Tensor]:
    """GCPO's (policy weight, KL weight) `[n, N]` from the mask M of `critical_tokens`.

    The source's loss is sum(M * (-r A w_t + beta k3)) / sum(M) (L790-803): the policy weight is M (with
    w_t given to grpo_loss as `advantage_weight`, so that its scale is not divided away) and the KL weight
    is M * n N / sum(M), which makes the mean of m * k3 over all tokens the source's mean over the selected.
    """
    m = critical.float()  # [n, N]
    return m, m * m.numel() / m.sum().clamp(min=1)


# ---------------------------------------------------------------------------- guidance-contrastive


def guidance_contrast(cond_logprobs: Tensor, null_logprobs: Tensor) -> Tensor:
    """D `[n, N]`: the k3 estimate of KL(pi(.|prompt) || pi(.|null prompt)) at each sampled token, with the
    source's clamps (importance.py L12-14): d = clamp(null - cond, -20, 20), D = clamp(e^d - d - 1, -10, 10)
    (written expm1(d) - d, as grpo.k3_kl, the same number without the rounding near 0)."""
    d = (_wide(null_logprobs) - _wide(cond_logprobs)).clamp(-20.0, 20.0)  # [n, N]
    return (torch.expm1(d) - d).clamp(-10.0, 10.0)  # [n, N]


def average_rank(x: Tensor) -> Tensor:
    """1-based ranks `[n, N]` within each row, lowest first; tied values share the mean of their ranks
    (the source's argsort orders ties arbitrarily: equal contrasts should weigh alike)."""
    ordered = x.sort(dim=1).values  # [n, N]
    below = torch.searchsorted(ordered, x.contiguous(), right=False)  # [n, N] values < x
    upto = torch.searchsorted(ordered, x.contiguous(), right=True)  # [n, N] values <= x
    return (below + 1 + upto).to(x.dtype) / 2  # [n, N] the mean of ranks below+1 .. upto


def guidance_contrastive_weights(cond_logprobs: Tensor, null_logprobs: Tensor, top_share: float = 0.8,
                                 top_fraction: float = 0.4) -> tuple[Tensor, Tensor]:
    """Guidance-contrastive (policy weight, KL weight) `[n, N]` from each sampled token's conditional log-prob
    and its log-prob under the null prompt (importance.py L20-38, "hist"; grpo_trainer.py L1124-1125):

        q = rank(D) / N per image (`average_rank`), in (0, 1]
        alpha = ln(1 - top_share) / ln(1 - top_fraction) - 1    (0.8, 0.4: 2.1507)
        w = q^alpha, scaled to mean 1 per image                 (the top 40% of tokens carry 80% of it)
        m = 0.5 + 0.5 * clamp(2 - 2w, 0, 1)                     (1 for w <= 0.5, 0.5 for w >= 1)
    """
    if not 0 < top_fraction < top_share < 1:
        raise ValueError(f"need 0 < top_fraction < top_share < 1, got {top_fraction}, {top_share}")
    q = average_rank(guidance_contrast(cond_logprobs, null_logprobs))  # [n, N]
    q = q / q.shape[1]  # [n, N]
    alpha = math.log(1 - top_share) / math.log(1 - top_fraction) - 1
    w = q.pow(alpha)  # [n, N]
    w = w * w.shape[1] / w.sum(1, keepdim=True)  # [n, N] mean 1 per image
    return w, 0.5 + 0.5 * (2 - 2 * w).clamp(0, 1)

