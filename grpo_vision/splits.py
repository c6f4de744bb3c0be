"""Which prompts a run trains on and which it is scored on, never trained on (PromptSets).

The files named by `data.*`, else the policy kind's own splits; a resumed run reads the sets it saved.
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass, field, replace
from pathlib import Path

import torch

from grpo_vision.config import Config, ConfigError, GrpoVisionWarning
from grpo_vision.policy import Bundle, policy_kind, prompt_problem
from grpo_vision.prompts import PromptEntry, PromptsError, load_prompts

KIND_PROMPTS = "the policy kind's prompts"
SPLIT_SEED = 0  # the seed that holds back a prompts file's test set: the same split for every run.seed


@dataclass
class PromptSets:
    """A run's prompts: what it trains on and its two evaluation sets, neither ever trained on.

    `test` is the headline (GenEval's practice): prompts of the training distribution held back from
    training. `heldout` is the transfer row: compositions no model trained on (empty when the kind or
    the config names none). `train_sample`: some of the training prompts, scored beside both, so that a
    reader sees what RL did on what it trained on against what it never saw."""
    train: list[PromptEntry]
    test: list[PromptEntry]
    heldout: list[PromptEntry] = field(default_factory=list)
    train_sample: list[PromptEntry] = field(default_factory=list)

    def named(self) -> dict[str, list[PromptEntry]]:
        """The evaluation sets that have prompts (never trained on), the headline first."""
        return {k: v for k, v in (("test", self.test), ("heldout", self.heldout)) if v}

    def scored(self) -> dict[str, list[PromptEntry]]:
        """What the report and the matrix score: the evaluation sets, then the sample of training prompts."""
        return {**self.named(), **({"train_sample": self.train_sample} if self.train_sample else {})}

    def all(self) -> list[PromptEntry]:
        return [*self.train, *self.test, *self.heldout]


def prompt_lists(cfg: Config, given: dict[str, list[PromptEntry]] | None = None) -> PromptSets:
    """A run's prompts without loading a model: the files of `data.*`, else the policy kind's own sets.
    Without `data.eval_prompts`, a prompts file's test set is `data.test_prompts` of its prompts, held
    back with a fixed seed. Both evaluation sets are removed from the training prompts. `given` "train" and
    "eval" entries (GRPOTrainer's, in memory) take the place of data.train_prompts and data.eval_prompts."""
    d, given = cfg.data, given or {}
    if given.get("train") is not None and d.train_prompts or given.get("eval") is not None and d.eval_prompts:
        raise ConfigError("prompts given in memory and in data.train_prompts / data.eval_prompts: give one")
    if given.get("train") is not None:
        return _sets(cfg, given["train"], given.get("eval"), "the prompts given to GRPOTrainer", None)
    splits = policy_kind(cfg.policy.kind).prompts if not d.train_prompts else None  # a policy in memory may have none
    if not d.train_prompts and splits is None:
        raise ConfigError(f"data.train_prompts is required: policy.kind {cfg.policy.kind!r} brings no prompts "
                          "of its own")
    own = splits(cfg) if not d.train_prompts else None
    train = load_prompts(d.train_prompts, column=d.column("train")) if d.train_prompts else own.train
    test = load_prompts(d.eval_prompts, column=d.column("eval")) if d.eval_prompts else given.get("eval")
    return _sets(cfg, train, test, d.train_prompts, own)


def _sets(cfg: Config, train: list[PromptEntry], test: list[PromptEntry] | None, source: str, own) -> PromptSets:
    """The sets from the training prompts, the test prompts (None: the kind's own, else held back from
    `train`, read from `source`) and the kind's own sets `own` (None without)."""
    d = cfg.data
    test_given = test is not None  # else the kind's own, or drawn from the training prompts themselves by design
    if test is None:
        test = own.test if own else _hold_back(train, d.test_prompts, source)
    heldout = load_prompts(d.heldout_prompts, column=d.column("heldout")) if d.heldout_prompts else (own.heldout if own else [])
    unseen = {e.prompt for e in (*test, *heldout)}
    sets = PromptSets([e for e in train if e.prompt not in unseen], test, heldout)
    if not sets.train:  # else the first step fails deep in numpy, after the run folder is written
        raise ConfigError(_nothing_to_train(cfg, train, sets, own is not None))
    named = f"data.eval_prompts ({d.eval_prompts})" if d.eval_prompts else "the evaluation prompts given"
    given = {named: {e.prompt for e in test} if test_given else set(),
             f"data.heldout_prompts ({d.heldout_prompts})": {e.prompt for e in heldout} if d.heldout_prompts else set()}
    dropped = sum(any(e.prompt in v for v in given.values()) for e in train)  # also evaluation prompts given
    if dropped:
        where = " and ".join(k for k, v in given.items() if v & {e.prompt for e in train})
        are, left = "is" if dropped == 1 else "are", len(sets.train)  # "1 of the 3 ... is"; "1 remains"
        line = (f"{dropped} of the {len(train)} training prompts of {source or KIND_PROMPTS} {are} also in {where} "
                f"and {are} not trained on (evaluation prompts never are); {left} remain{'s' if left == 1 else ''}")
        if len({e.prompt for e in sets.train}) < cfg.sample.prompts_per_step:
            raise ConfigError(f"{line}, fewer than sample.prompts_per_step={cfg.sample.prompts_per_step}: train on "
                              "other prompts, evaluate on others, or lower sample.prompts_per_step")
        warnings.warn(line, GrpoVisionWarning, stacklevel=3)
    kept = {e.prompt for e in sets.train}
    sets.train_sample = [e for e in own.train_sample if e.prompt in kept] if own and own.train_sample else \
        _draw(sets.train, d.eval_size)
    return sets


def _nothing_to_train(cfg: Config, train: list[PromptEntry], sets: PromptSets, kind: bool) -> str:
    """Why `train` (the prompts before both evaluation sets were removed) leaves nothing to train on."""
    d = cfg.data
    source = f"data.train_prompts ({d.train_prompts})" if d.train_prompts else KIND_PROMPTS
    if not train:
        return f"no prompt of {source} is left to train on: it has none; give data.train_prompts"
    names = {"test": f"data.eval_prompts ({d.eval_prompts})" if d.eval_prompts else
             "the policy kind's test set" if kind else "its held-back test set",
             "heldout": f"data.heldout_prompts ({d.heldout_prompts})" if d.heldout_prompts else
             "the policy kind's held-out set"}
    trained = {e.prompt for e in train}
    where = " or ".join(names[k] for k, v in sets.named().items() if trained & {e.prompt for e in v})
    return (f"no prompt of {source} is left to train on: all {len(train)} of its prompts are in {where}, and evaluation "
            "prompts are never trained on: train on other prompts (data.train_prompts), or evaluate on others "
            "(data.eval_prompts, data.heldout_prompts)")


def _hold_back(entries: list[PromptEntry], n: int, source: str) -> list[PromptEntry]:
    """`n` distinct prompts of `entries`, drawn with SPLIT_SEED, as the test set."""
    if len({e.prompt for e in entries}) < 2 * n:
        raise ConfigError(f"{source} has {len({e.prompt for e in entries})} distinct prompts: too few to hold back "
                          f"data.test_prompts={n} as the test set and train on the rest; give data.eval_prompts (a "
                          "test set of your own) or lower data.test_prompts")
    return _draw(entries, n)


def _draw(entries: list[PromptEntry], n: int) -> list[PromptEntry]:
    """`n` distinct prompts of `entries` drawn with SPLIT_SEED, in the order they come in."""
    distinct = list({e.prompt: e for e in entries}.values())
    order = torch.randperm(len(distinct), generator=torch.Generator().manual_seed(SPLIT_SEED))[:n]
    return [distinct[i] for i in sorted(order.tolist())]


def run_prompt_sets(cfg: Config, run_dir: str | Path | None = None, given: dict | None = None,
                    draw: int = 1) -> PromptSets:
    """The prompts a run saved at its start (`run_dir`/prompts/*.jsonl), so that a resumed run trains on
    what it trained on, and eval and the report score what it scored, whatever a later version of a kind's draw
    gives; else `prompt_lists(cfg, given)`. `draw` 2, 3, ... (`eval --draw`): the test and held-out sets of the
    policy kind's draw `draw` in place of the run's (data.eval_draw; the training prompts stay the run's)."""
    folder = Path(run_dir) / "prompts" if run_dir else None
    files = [folder / f"{name}.jsonl" for name in ("train", "test", "heldout", "train_sample")] if folder else []
    # a link is never read as the run's own (files.py): such a folder falls back to its config's prompts
    if not files or not files[0].is_file() or any(f.is_symlink() for f in (folder, *files)):
        sets = prompt_lists(cfg, given)
    else:  # save_prompts wrote them with the key 'prompt', whatever column each source named (data.*prompt_column)
        sets = PromptSets(*(load_prompts(f, column="prompt") if f.is_file() else [] for f in files))
    if draw == 1:
        return sets
    d = cfg.data
    drawn = prompt_lists(replace(cfg, data=replace(d, eval_draw=draw)))
    if d.eval_prompts or d.heldout_prompts or d.train_prompts or [e.prompt for e in drawn.train] != [
            e.prompt for e in sets.train]:
        raise ConfigError(f"--draw {draw}: {run_dir} takes its eval sets from prompts files, or trained on other "
                          "prompts than its policy kind draws now (prompts/train.jsonl); give the prompts to score "
                          "with --prompts")
    return PromptSets(sets.train, drawn.test, drawn.heldout)


def checked_prompt_sets(cfg: Config, bundle: Bundle, run_dir: str | Path | None = None,
                        given: dict | None = None) -> PromptSets:
    """`run_prompt_sets`, each prompt checked against the loaded policy: an unknown word stops the run
    before it starts, naming the prompt and its line (it would be trained on as <unk>)."""
    d = cfg.data
    sets = run_prompt_sets(cfg, run_dir, given)
    # without data.eval_prompts, a train file's test set is held back from it (and named by its lines)
    for entries, source in ((sets.train, d.train_prompts), (sets.test, d.eval_prompts or d.train_prompts),
                            (sets.heldout, d.heldout_prompts)):
        for e in entries:
            problem = prompt_problem(bundle.policy, e.prompt)
            if problem:
                raise PromptsError(f"{source or ('the prompts given to GRPOTrainer' if given else KIND_PROMPTS)}, "
                                   f"line {e.line}: {problem}")
    return sets
