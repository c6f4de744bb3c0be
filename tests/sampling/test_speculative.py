"""Speculative Jacobi decoding draws exactly the plain sampler's distribution.

On a tiny policy (a 4-code book, 2x2 tokens: 256 whole images) the plain path's probability of every image is
enumerated by teacher forcing (the product of its guided, filtered conditionals, `sampling.target_logp`), and
20,000 images drawn by the speculative sampler are tested against it with a chi-square test; a deliberately wrong
acceptance rule must fail the same test. The seeds are fixed, so each p-value is one fixed number (in a comment).
"""

import pytest
import torch
from scipy.stats import chisquare

from grpo_vision.models.llama import LlamaImagePolicy, LlamaPolicyConfig
from grpo_vision.sampling import (
    SamplingParams, sequence_logprobs, sequence_logprobs_and_entropy, speculative, target_logp,
)
from grpo_vision.sampling.speculative import (
    DraftTree, Tree, move_keys, residual, speculative_decode, speculative_uniforms,
)
from tests.helpers import peaked_llama

DRAWS = 20_000
# CFG, temperature != 1, top-k and top-p all on: top-k 3 of 4 codes, and top-p 0.85 leaves 34 of top-k's 81 images
PARAMS = SamplingParams(cfg_scale=2.0, temperature=0.8, top_k=3, top_p=0.85)


@pytest.fixture(scope="module")
def small_policy() -> LlamaImagePolicy:
    """4 codes, 2x2 tokens; weights scaled up so that conditionals are peaked and differ from token to token."""
    return peaked_llama(5.0, words=["a", "red", "circle"], max_caption_words=3, codebook_size=4, image_grid=(2, 2),
                        dim=32, n_layers=2, n_heads=4, n_kv_heads=2, ffn_dim=64)


def teacher_forced_block(policy, rows: torch.Tensor, n_tokens: int, tree: DraftTree):
    """Slow and obvious: a window's logits from full forward passes over the kept tokens and each of the tree's
    root-to-leaf paths (one for a chain), no cache."""
    leaves = [i for i in range(tree.width) if i not in tree.parent]

    def block(window, c, tokens):
        B, W = window.shape
        reps = rows.shape[0] // B
        out = None
        for leaf in leaves:
            path = [leaf]
            while tree.parent[path[-1]] >= 0:
                path.append(tree.parent[path[-1]])
            path = path[::-1]  # root first, one node a depth
            seq = tokens[:, :n_tokens + W].clone()  # [B, N + W] the kept tokens before column c
            seq.scatter_(1, (c - 1)[:, None] + torch.arange(len(path)), window[:, path])
            logits = policy.image_logits(rows, seq[:, :n_tokens].repeat(reps, 1))  # [rows, N, K]: j predicts token j
            out = logits.new_zeros(rows.shape[0], W, logits.shape[-1]) if out is None else out
            at = (c[:, None] + torch.arange(len(path))).clamp_max(n_tokens - 1).repeat(reps, 1)  # past N: garbage
            out[:, path] = logits.gather(1, at.unsqueeze(-1).expand(-1, -1, logits.shape[-1]))
        return out
    return block


@torch.no_grad()
def draw_reference(policy, prompt: str, n: int, params: SamplingParams, window: int, coupled: bool = False,
                   candidates: int = 1, branching: int = 0):
    """n images of one prompt, seeds 0..n-1, by the speculative loop over teacher-forced windows."""
    N = policy.num_image_tokens
    tree = DraftTree.build(window, candidates, branching)
    cond = policy.encode_prompts([prompt]).expand(n, -1)
    rows = torch.cat([cond, policy.null_condition(cond)]) if params.guided else cond
    first = policy.image_logits(rows, torch.zeros(rows.shape[0], N, dtype=torch.long))[:, 0]  # [rows, K]
    u = speculative_uniforms(range(n), N, window, N, cond.device)
    return speculative_decode(first, teacher_forced_block(policy, rows, N, tree), u, N, tree, params, coupled)


@torch.no_grad()
def exact_probabilities(policy, prompt: str, params: SamplingParams) -> torch.Tensor:
    """`[K^N]` the plain path's probability of every image, in `torch.cartesian_prod` order (the last token fastest)."""
    K, N = policy.codebook_size, policy.num_image_tokens
    seqs = torch.cartesian_prod(*[torch.arange(K)] * N)  # [K^N, N]
    cond = policy.encode_prompts([prompt]).expand(len(seqs), -1)
    logits = policy.image_logits(torch.cat([cond, policy.null_condition(cond)]), seqs.repeat(2, 1))  # [2M, N, K]
    logp = target_logp(logits[:len(seqs)], logits[len(seqs):], params)  # [M, N, K], -inf outside the filters
    return logp.gather(-1, seqs.unsqueeze(-1)).squeeze(-1).sum(-1).exp().double()  # [M]


def chi_square(tokens: torch.Tensor, probs: torch.Tensor, K: int) -> tuple[float, int]:
    """(p-value, draws outside the support) of drawn images `[n, N]` against the enumerated probabilities. The test
    is of the draws inside the support (a draw outside it is counted apart: the plain path never makes one); bins
    expecting fewer than 5 draws are pooled into one (the chi-square approximation needs about 5 a bin)."""
    index = torch.zeros(tokens.shape[0], dtype=torch.long)
    for j in range(tokens.shape[1]):
        index = index * K + tokens[:, j]
    counts = torch.bincount(index, minlength=len(probs)).double()  # [M]
    outside = int(counts[probs == 0].sum())
    expected = probs / probs.sum() * (tokens.shape[0] - outside)  # [M]
    big = expected >= 5
    small = (expected > 0) & ~big
    obs = torch.cat([counts[big], counts[small].sum().view(1)])
    exp = torch.cat([expected[big], expected[small].sum().view(1)])
    return float(chisquare(obs[exp > 0], exp[exp > 0]).pvalue), outside


# ---------------------------------------------------------------------------- the rule alone


def one_window(p: torch.Tensor, q: torch.Tensor, tree: DraftTree, n: int):
    """n rows of one window of `tree` over targets p `[W, K]` and draft distribution q `[M-1, K]`, its drafts drawn as
    the loop draws them (the main one from q, the siblings without replacement): (drafts kept, tokens `[n, M]`)."""
    from grpo_vision.sampling.speculative import draw_siblings, kept_tokens, verify, window_nodes

    g = torch.Generator().manual_seed(0)
    D, C = tree.branching, tree.candidates
    main = torch.multinomial(q, n, replacement=True, generator=g).T  # [n, M-1]
    candidates = draw_siblings(q[None, :D].expand(n, -1, -1), main[:, :D], torch.rand(n, D, C - 1, generator=g))
    t = tree.tables("cpu")
    nodes = window_nodes(torch.zeros(n, dtype=torch.long), main, candidates, t)
    kept, path, bonus = verify(p.expand(n, -1, -1), q.expand(n, -1, -1), candidates, nodes, t,
                               torch.rand(n, tree.width, generator=g), torch.rand(n, generator=g))
    return kept, kept_tokens(nodes, path, kept, bonus)


def test_one_window_keeps_the_target_distribution():
    """A single chain window, enumerated: the first token is distributed as p, whatever q the draft came from."""
    p = torch.tensor([[0.5, 0.3, 0.2, 0.0], [0.1, 0.1, 0.4, 0.4]])  # [W=2, K]
    q = torch.tensor([[0.1, 0.2, 0.3, 0.4]])  # [W-1, K] a poor draft, with mass where p has none
    n = 200_000
    kept, tokens = one_window(p, q, DraftTree.build(2), n)
    first = torch.bincount(tokens[:, 0], minlength=4).double() / n
    torch.testing.assert_close(first, p[0].double(), atol=4e-3, rtol=0)  # 4 sigma of a 200k-draw frequency
    assert (tokens[:, 0] != 3).all()  # never a token p rules out
    # the acceptance rate is sum_x min(p, q) (Leviathan et al. 2023, section 3.4)
    assert abs(kept.double().mean() - torch.minimum(p[0], q[0]).sum()) < 4e-3
    # a kept window's extra token comes from p's next position
    second = torch.bincount(tokens[kept == 1, 1], minlength=4).double() / int(kept.sum())
    torch.testing.assert_close(second, p[1].double(), atol=1e-2, rtol=0)


def test_a_second_candidate_keeps_the_target_distribution_and_is_kept_more_often():
    """Two drafts at the first position (a tree: the main one, and a sibling drawn from q without it), tested in turn
    by recursive rejection: the first token is still distributed as p, and a draft is kept more often than one
    draft is (worked by hand: p = (.5, .3, .2, 0), q = (.1, .2, .3, .4); one draft is kept with probability
    sum min(p, q) = 0.1 + 0.2 + 0.2 = 0.5). The sibling is a leaf: its token is followed by p at its own slot."""
    p = torch.tensor([[0.5, 0.3, 0.2, 0.0], [0.1, 0.1, 0.4, 0.4], [0.7, 0.1, 0.1, 0.1]])  # root, main, sibling
    q = torch.tensor([[0.1, 0.2, 0.3, 0.4]])
    tree = DraftTree.build(3, candidates=2, branching=1)
    assert (tree.parent, tree.rank, tree.depth) == ((-1, 0, 0), (0, 0, 1), (0, 1, 1))
    n = 200_000
    kept, tokens = one_window(p, q, tree, n)
    first = torch.bincount(tokens[:, 0], minlength=4).double() / n
    torch.testing.assert_close(first, p[0].double(), atol=4e-3, rtol=0)
    assert kept.double().mean() > 0.5 + 0.1  # 0.5 for one draft
    # after a kept draft, the next token comes from the target at that draft's own node (the main's or the sibling's)
    second = tokens[kept == 1, 1]
    assert 0.1 < (second == 0).double().mean() < 0.7  # a mix of p[1]'s 0.1 and p[2]'s 0.7


def test_residual_is_the_positive_part_and_falls_back_to_p():
    p, q = torch.tensor([0.5, 0.3, 0.2]), torch.tensor([0.2, 0.5, 0.3])
    torch.testing.assert_close(residual(p, q), torch.tensor([0.3, 0.0, 0.0]))
    torch.testing.assert_close(residual(p, p.clone()), p)  # no mass left: a rejection had probability 0


# ---------------------------------------------------------------------------- whole images on a tiny model


@pytest.mark.parametrize("window,coupled,tree", [(3, False, (1, 0)), (2, False, (1, 0)), (5, False, (1, 0)),
                                                (3, True, (1, 0)), (7, True, (2, 2)), (5, False, (3, 1))],
                         ids=["W3", "W2", "W5-past-the-image", "W3-coupled", "W7-coupled-tree-2x2", "W5-tree-3x1"])
def test_speculative_images_follow_the_plain_distribution(small_policy, window, coupled, tree):
    probs = exact_probabilities(small_policy, "a red circle", PARAMS)
    assert abs(float(probs.sum()) - 1) < 1e-5 and (probs == 0).sum() > 0  # the filters rule images out
    rollout, stats = draw_reference(small_policy, "a red circle", DRAWS, PARAMS, window, coupled, *tree)
    pvalue, outside = chi_square(rollout.tokens, probs, small_policy.codebook_size)
    assert outside == 0
    # fixed seeds, so fixed p-values: W3 0.14, W2 0.90, W5 0.32, W3 coupled 0.33, tree 2x2 0.56, tree 3x1 0.96 (34
    # images, 20,000 draws)
    assert pvalue > 1e-3, pvalue
    assert stats.forwards.max() <= small_policy.num_image_tokens and stats.batch_forwards == stats.forwards.max()


WRONG = {"accept every draft": ("accept_draft", lambda p_x, q_x, u: torch.ones_like(p_x, dtype=torch.bool)),
         "redraw from p, not the residual": ("residual", lambda p, q: p),
         # a tree's sibling was drawn from q less its elders' tokens, and tested against q itself
         "a sibling tested against the q it was not drawn from": ("_without", lambda q, tokens: q)}


@pytest.mark.parametrize("wrong,tree", [("accept every draft", (1, 0)), ("redraw from p, not the residual", (1, 0)),
                                        ("a sibling tested against the q it was not drawn from", (3, 1))],
                         ids=lambda x: x if isinstance(x, str) else f"tree-{x[0]}x{x[1]}")
def test_a_wrong_rule_fails_the_same_test(small_policy, monkeypatch, wrong, tree):
    monkeypatch.setattr(speculative, *WRONG[wrong])
    probs = exact_probabilities(small_policy, "a red circle", PARAMS)
    rollout, _ = draw_reference(small_policy, "a red circle", DRAWS, PARAMS, 5 if tree[0] > 1 else 3, False, *tree)
    pvalue, outside = chi_square(rollout.tokens, probs, small_policy.codebook_size)
    # 0.0 in float64 for the chain's two, 6e-194 for the sibling's; accepting every draft also draws 2,921 images off
    # the support
    assert pvalue < 1e-6, pvalue


@pytest.mark.parametrize("params", [PARAMS, SamplingParams(cfg_scale=2.0, temperature=0.8, top_k=3,
                                                           logprob_mode="conditional")], ids=["guided", "conditional"])
def test_returned_logprobs_are_the_teacher_forced_ones(small_policy, params):
    rollout, _ = draw_reference(small_policy, "a red circle", 64, params, 3)
    cond = small_policy.encode_prompts(["a red circle"]).expand(64, -1)
    with torch.no_grad():
        logp, entropy = sequence_logprobs_and_entropy(small_policy, cond, rollout, params)
    torch.testing.assert_close(rollout.logprobs, logp, atol=1e-5, rtol=0)
    if params.logprob_mode == "guided":  # the entropy of the distribution sampled, as the plain path returns it
        torch.testing.assert_close(rollout.entropy, entropy, atol=1e-5, rtol=0)


# ---------------------------------------------------------------------------- the cached path (decode_block)


@torch.no_grad()
def check_decode_block(policy, cond: torch.Tensor, W: int = 4, atol: float = 1e-5) -> None:
    """A policy's decode_block: rows at different positions of one cache, over stale keys a rejected window left,
    give the logits of a full forward pass at the same positions (any kind: llama here, janus and llamagen in
    their own test files); and a tree window's nodes give the logits of their own paths (`check_decode_tree`).
    Needs N >= 2W + 1."""
    B, L, N = cond.shape[0], cond.shape[1], policy.num_image_tokens
    tokens = torch.randint(0, policy.codebook_size, (B, N), generator=torch.Generator().manual_seed(0))
    full = policy.image_logits(cond, tokens)  # [B, N, K]: column j predicts token j
    cache = policy.new_cache(B, static=True, extra=W)
    chain = Tree.chain(W)
    torch.testing.assert_close(policy.prefill(cond, cache), full[:, 0], atol=atol, rtol=0)
    starts = torch.full((B,), L)
    torch.testing.assert_close(policy.decode_block(tokens[:, :W], cache, starts, chain), full[:, 1:W + 1], atol=atol,
                               rtol=0)
    stale = torch.randint(0, policy.codebook_size, (B, W), generator=torch.Generator().manual_seed(1))
    policy.decode_block(stale, cache, starts + W, chain)  # a rejected window's keys, past where the rows go on
    shift = torch.arange(B) % W + 1  # each row's next window starts at its own token
    window = torch.stack([tokens[b, s:s + W] for b, s in enumerate(shift.tolist())])  # [B, W]
    logits = policy.decode_block(window, cache, L + shift, chain)
    expected = torch.stack([full[b, s + 1:s + W + 1] for b, s in enumerate(shift.tolist())])
    torch.testing.assert_close(logits, expected, atol=atol, rtol=0)
    check_decode_tree(policy, cond, atol)


@torch.no_grad()
def check_decode_tree(policy, cond: torch.Tensor, atol: float = 1e-5) -> None:
    """A tree window (2 drafts at each of 2 depths: a main chain of 5 and two siblings) at per-row positions: each
    node's logits are a full forward pass's over its own path; then each row keeps a path (the main one, one through
    a sibling, or a sibling alone), `move_keys` puts the kept nodes' keys where their depths go, and the next window
    reads the same logits as a full forward pass over the kept tokens. A mask that let siblings see each other, or a
    move left out, fails it. Needs N >= 9."""
    B, L, N = cond.shape[0], cond.shape[1], policy.num_image_tokens
    tree = DraftTree.build(7, candidates=2, branching=2)
    assert (tree.parent, tree.depth) == ((-1, 0, 1, 2, 3, 0, 1), (0, 1, 2, 3, 4, 1, 2))
    g = torch.Generator().manual_seed(2)
    prefix = torch.randint(0, policy.codebook_size, (B, N), generator=g)
    nodes = torch.randint(0, policy.codebook_size, (B, tree.width), generator=g)
    shift = torch.arange(B) % 3 + 1  # tokens kept before each row's window root (node 0 is token shift - 1)
    cache = policy.new_cache(B, static=True, extra=tree.width)
    policy.prefill(cond, cache)
    policy.decode_block(prefix[:, :N - 1], cache, torch.full((B,), L), Tree.chain(N - 1))  # keys of the prefix
    logits = policy.decode_block(nodes, cache, L + shift - 1, tree.layout(None))  # [B, W, K]

    def forward(b, kept):  # a full pass over row b's prefix before its window, then `kept`
        seq = torch.cat([prefix[b, :shift[b] - 1], kept, prefix.new_zeros(N)])[:N]
        return policy.image_logits(cond[b:b + 1], seq[None])[0]  # [N, K]: column j predicts token j

    paths = {0: [0], 1: [0, 1], 2: [0, 1, 2], 3: [0, 1, 2, 3], 4: [0, 1, 2, 3, 4], 5: [0, 5], 6: [0, 1, 6]}
    for b in range(B):
        for i, path in paths.items():
            want = forward(b, nodes[b, path])[shift[b] + len(path) - 1]
            torch.testing.assert_close(logits[b, i], want, atol=atol, rtol=0)
    kept = [[paths[2], paths[6], paths[5]][b % 3] for b in range(B)]  # some rows keep siblings: their keys move
    assert B >= 3
    slots = torch.tensor([(path + [2, 2])[1:3] for path in kept])  # [B, 2] the kept slots of depths 1 and 2
    move_keys(cache, L + shift - 1, slots)
    after = torch.randint(0, policy.codebook_size, (B, 3), generator=g)  # the next window: its root, two drafts
    n = torch.tensor([len(path) for path in kept])  # the next root's depth
    logits = policy.decode_block(after, cache, L + shift - 1 + n, Tree.chain(3))
    for b in range(B):
        at = shift[b] + n[b]
        want = forward(b, torch.cat([nodes[b, kept[b]], after[b]]))[at:at + 3]
        torch.testing.assert_close(logits[b], want, atol=atol, rtol=0)


def check_speculative_sampler(policy, cond: torch.Tensor, params: SamplingParams, W: int = 4, atol: float = 1e-5):
    """sample(decode=speculative) on any kind, with a chain window and a tree of drafts: log-probs and entropies the
    teacher-forced ones, a row's image independent of its batch, the same rollout however often the host looks."""
    from dataclasses import replace

    from grpo_vision.sampling import sample

    B = cond.shape[0]
    for spec in (replace(params, decode="speculative", speculative_window=W, speculative_candidates=1,
                         speculative_branching=0),
                 replace(params, decode="speculative", speculative_window=W + 4, speculative_candidates=3,
                         speculative_branching=2)):
        rollout = sample(policy, cond, list(range(B)), spec)
        with torch.no_grad():
            logp, entropy = sequence_logprobs_and_entropy(policy, cond, rollout, params)
        torch.testing.assert_close(rollout.logprobs, logp, atol=atol, rtol=0)
        torch.testing.assert_close(rollout.entropy, entropy, atol=atol, rtol=0)
        assert torch.equal(sample(policy, cond[B - 1:], [B - 1], spec).tokens, rollout.tokens[B - 1:])
        every, speculative.CPU_CHECK_EVERY = speculative.CPU_CHECK_EVERY, 3  # the host looks every 3 passes
        try:
            seldom = sample(policy, cond, list(range(B)), spec)
        finally:
            speculative.CPU_CHECK_EVERY = every
        assert torch.equal(seldom.tokens, rollout.tokens) and torch.equal(seldom.forwards, rollout.forwards)


@pytest.mark.parametrize("wrong", [False, True], ids=["as_built", "done_rows_not_masked"])
@torch.no_grad()
def test_the_static_loop_draws_the_same_rollout_however_often_the_host_looks(tiny_policy, monkeypatch, wrong):
    """The speculative loop reads "every row is done" every `check_every` iterations (a CUDA graph replays several
    before the host looks): rows that are done run masked iterations, so tokens, log-probs and each row's forward
    passes are the same for any `check_every`. A loop whose done rows count their masked passes is caught."""
    policy, W, N = tiny_policy, 3, tiny_policy.num_image_tokens
    cond = policy.encode_prompts(["a red circle", "a blue square left of a red circle", "a blue circle"] * 2)
    params = SamplingParams(cfg_scale=2.0, top_k=8)

    def run(every):
        rows = torch.cat([cond, policy.null_condition(cond)])
        cache = policy.new_cache(rows.shape[0], static=True, extra=W)
        first = policy.prefill(rows, cache)
        block = lambda window, c, _: policy.decode_block(window.repeat(2, 1), cache,  # noqa: E731
                                                         (cond.shape[1] + c - 1).repeat(2), Tree.chain(W))
        u = speculative_uniforms(range(6), N, W, N, cond.device)
        return speculative_decode(first, block, u, N, DraftTree.build(W), params, coupled=True, check_every=every)

    reference, stats = run(1)  # the host looks after every iteration, as the eager loop did
    assert stats.forwards.unique().numel() > 1  # rows finish at different passes: some run masked iterations
    if wrong:
        real = speculative.iterate

        def unmasked(s, *args):  # done rows count the passes they sit through
            done = s.c >= N
            real(s, *args)
            s.forwards.add_(done)
        monkeypatch.setattr(speculative, "iterate", unmasked)
    runs = {every: run(every) for every in (3, 7)}
    same = [torch.equal(r.tokens, reference.tokens) and torch.equal(r.logprobs, reference.logprobs)
            and torch.equal(r.forwards, reference.forwards) for r, _ in runs.values()]
    assert same == ([False, False] if wrong else [True, True])
    assert runs[7][1].batch_forwards >= stats.batch_forwards  # the masked iterations after the last row ran


def test_decode_block_equals_teacher_forcing_at_per_row_positions(tiny_policy):
    check_decode_block(tiny_policy, tiny_policy.encode_prompts(["a red circle", "a blue square left of a red circle",
                                                                "a blue circle"]))


@pytest.mark.parametrize("tree", [(5, 1, 0), (9, 3, 2)], ids=["chain", "tree-3x2"])
@pytest.mark.parametrize("params", [PARAMS, SamplingParams(cfg_scale=3.0),
                                    SamplingParams(temperature=1.3, top_k=8, logprob_mode="conditional")], ids=str)
@torch.no_grad()
def test_the_cached_sampler_draws_the_teacher_forced_loops_tokens(tiny_policy, params, tree, monkeypatch):
    """sample(decode=speculative) is the loop above over decode_block: the same tokens for the same seeds as over
    full forward passes (a tree's kept siblings' keys moved in the cache, `move_keys`), its log-probs the
    teacher-forced ones, and a row's image independent of its batch."""
    from dataclasses import replace

    from grpo_vision.sampling import sample

    policy, (W, C, D), N = tiny_policy, tree, tiny_policy.num_image_tokens
    prompts = ["a red circle", "a blue square left of a red circle", "a blue circle"] * 2
    cond = policy.encode_prompts(prompts)
    spec = replace(params, decode="speculative", speculative_window=W, speculative_candidates=C,
                   speculative_branching=D)  # MC-SJD's coupled drafts, the default
    shape, verify, siblings_kept = DraftTree.build(W, C, D, N), speculative.verify, []

    def spy(*args):  # how many passes keep a sibling, whose keys then move
        n, path, bonus = verify(*args)
        siblings_kept.append(int((path >= shape.main).any(1).sum()))
        return n, path, bonus
    monkeypatch.setattr(speculative, "verify", spy)
    fast = sample(policy, cond, list(range(6)), spec)
    assert (sum(siblings_kept) > 0) == (C > 1), siblings_kept
    rows = torch.cat([cond, policy.null_condition(cond)]) if params.guided else cond
    first = policy.image_logits(rows, torch.zeros(rows.shape[0], N, dtype=torch.long))[:, 0]
    u = speculative_uniforms(range(6), N, shape.width, N, cond.device)
    slow, _ = speculative_decode(first, teacher_forced_block(policy, rows, N, shape), u, N, shape, params,
                                 coupled=True)
    assert torch.equal(fast.tokens, slow.tokens)
    torch.testing.assert_close(fast.logprobs, sequence_logprobs(policy, cond, fast, params), atol=1e-5, rtol=0)
    alone = sample(policy, cond[4:5], [4], spec)
    assert torch.equal(alone.tokens, fast.tokens[4:5])
    assert not torch.equal(fast.tokens, sample(policy, cond, list(range(6)), params).tokens)  # other tokens, same law


@pytest.mark.parametrize("draft,tree", [("jacobi", (1, 0)), ("coupled", (1, 0)), ("coupled", (3, 1))],
                         ids=["jacobi", "coupled", "coupled-tree-3x1"])
def test_the_cached_sampler_follows_the_plain_distribution(small_policy, draft, tree):
    from dataclasses import replace

    from grpo_vision.sampling import sample

    probs = exact_probabilities(small_policy, "a red circle", PARAMS)
    cond = small_policy.encode_prompts(["a red circle"]).expand(DRAWS, -1)
    params = replace(PARAMS, decode="speculative", speculative_window=5 if tree[0] > 1 else 3, speculative_draft=draft,
                     speculative_candidates=tree[0], speculative_branching=tree[1])
    rollout = sample(small_policy, cond, list(range(DRAWS)), params)
    pvalue, outside = chi_square(rollout.tokens, probs, small_policy.codebook_size)
    # the teacher-forced loop's p-values (its draws, token for token): jacobi 0.14, coupled 0.33; tree 3x1 0.74
    assert outside == 0 and pvalue > 1e-3, pvalue


def test_bench_sampler_reports_forwards_and_wall_clock(tmp_path, capsys):
    import json

    from grpo_vision.cli import main
    from grpo_vision.tools.bench import BENCH_WORDS

    LlamaImagePolicy(LlamaPolicyConfig(words=BENCH_WORDS, codebook_size=32, image_grid=(3, 3), dim=32, n_layers=1,
                                       n_heads=2, n_kv_heads=1, ffn_dim=64)).save_pretrained(tmp_path / "p")
    main(["bench", "sampler", "--json", "--policy", str(tmp_path / "p"), "--decode", "static,speculative",
          "--speculative-window", "4", "--speculative-tree", "1,0", "--group-size", "2", "--repeats", "1", "--top-k",
          "0", "--no-generate", "--device", "cpu"])
    result = json.loads(capsys.readouterr().out)
    assert (result["image_tokens"], result["images"], result["window"]) == (9, 8, 4)
    assert result["tree"] == {"candidates": 1, "branching": 0}
    paths = result["paths"]
    assert (paths["static"]["forwards_per_image"], paths["static"]["tokens_per_forward"]) == (9, 1)  # N, one a pass
    for draft in ("speculative", "speculative_jacobi"):
        r = paths[draft]
        assert 9 / 4 <= r["forwards_per_image"] <= r["forwards_per_batch"] <= 9  # at most W tokens a forward
        assert r["tokens_per_forward"] == pytest.approx(9 / r["forwards_per_image"], rel=0.01)
        assert r["seconds"] > 0 and r["wall_clock_vs_plain"] > 0
    assert result["baselines"]["teacher_forced"]["forwards_per_image"] == 1 and "generate" not in result["baselines"]
    assert (result["device"], result["plain_decode"]) == ("cpu", "static")


@pytest.mark.skipif(torch.cuda.is_available(), reason="a machine with a GPU runs --device cuda")
def test_bench_sampler_on_a_device_that_is_not_here_is_one_line(capsys):
    from tests.helpers import run_cli

    out = run_cli("bench", "sampler", "--speculative-window", "4", "--device", "cuda", timeout=120)
    assert out.returncode == 2 and out.stderr.strip().splitlines() == [
        "grpo-vision: error: bench sampler --device cuda: this machine has no CUDA device; use --device cpu"], out.stderr


def test_bench_sampler_runs_a_trained_runs_checkpoint_at_its_own_settings(micro_run, capsys):
    import json

    from grpo_vision.cli import main
    from grpo_vision.run.folder import read_run_config

    s = read_run_config(micro_run).sample
    args = ["bench", "sampler", "--json", "--run", str(micro_run), "--decode", "speculative", "--group-size", "1",
            "--repeats", "1", "--no-generate", "--device", "cpu"]
    main(args)
    result = json.loads(capsys.readouterr().out)
    assert (result["cfg_scale"], result["temperature"], result["top_k"], result["window"]) == (
        s.cfg_scale, s.temperature, s.top_k, s.speculative_window)
    assert result["images"] == 4 and result["paths"]["speculative"]["forwards_per_image"] <= result["image_tokens"]
    main([*args, "--top-k", "3", "--speculative-window", "2", "--speculative-tree", "1,0"])
    flagged = json.loads(capsys.readouterr().out)
    assert (flagged["top_k"], flagged["window"]) == (3, 2)  # a flag given wins over the run's setting
    with pytest.raises(SystemExit) as refused:  # a window too small for the run's tree: one line naming both flags
        main([*args, "--speculative-window", "2"])
    assert refused.value.code == 2
