"""`grpo-vision matrix`: train on each reward, score with every reward, one table.

One run per (train reward, KL coefficient, seed), everything else as the config says. Each run is a
`grpo-vision train` process of its own, so a failed run is reported in its row and the others go on,
and `--jobs` runs several at once. The runs live in `OUT/runs/<name>`; a second invocation reuses the
finished ones and resumes the interrupted ones exactly (`train --resume`), also after a Ctrl-C or
SIGTERM, which the matrix passes on to the runs in training so that they save a checkpoint; one
matrix at a time per output folder (matrix_jobs.py). The scoring (reference once, then every run,
on the same prompts and seeds) is in matrix_score.py.

Reward specs: a name (`clip`), or a `+` mix (`clip+aesthetic`, `4*clip+aesthetic`). A mix without
explicit weights takes the config's `reward.weights` for the names it lists there, 1 otherwise; the
only reward a single-name run trains on gets weight 1.
"""

from __future__ import annotations

import json
import math
import re
import os
import sys
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field, replace
from pathlib import Path

from grpo_vision.config import MAX_SEED, Config, ConfigError, brief, derived_sizes, load_config, to_dict
from grpo_vision.tools.matrix_jobs import OutLock, PassOn, refuse_held, run_child
from grpo_vision.run.folder import read_run_config
from grpo_vision.files import check_writable, write_file
from grpo_vision.run.signals import Interrupted

DONE = "matrix_run.json"  # written into a run's directory when its train process ends: {"rc": ...}


@dataclass(frozen=True)
class RunSpec:
    reward: str  # the spec as given, e.g. "clip+aesthetic"
    weights: tuple[tuple[str, float], ...]  # (reward name, weight) it trains on
    beta: float
    seed: int
    variant: str = ""  # --variant NAME: a row of training options besides the reward (the credit-assignment sweeps)
    options: tuple[str, ...] = ()  # its key=value overrides

    @property
    def name(self) -> str:
        return f"{self.reward.replace('*', 'x')}-kl{self.beta:g}-s{self.seed}" + (f"-{self.variant}" if self.variant
                                                                                 else "")

    @property
    def label(self) -> str:
        """What a table row says it trained on: the reward, and the variant when there is one."""
        return f"{self.reward} [{self.variant}]" if self.variant else self.reward

    def overrides(self, runs_dir: Path) -> list[str]:
        weights = "{" + ", ".join(f"{k}: {w}" for k, w in self.weights) + "}"
        return [*self.options, f"run.out_dir={runs_dir}", f"run.name={self.name}", f"run.seed={self.seed}",
                f"train.beta={self.beta}", f"reward.weights={weights}", "reward.monitor=[]", "log.report=false",
                "log.sample_every=0"]


@dataclass
class RunResult:
    spec: RunSpec
    status: str  # "reused" | "trained" | "resumed" | "failed" | "stopped" (by a signal passed on)
    rc: int = 0
    log: str = ""  # the train process's output, when it ran now
    error: str = field(default="")  # the last lines of a failed run's log


def parse_reward_spec(spec: str, base_weights: dict[str, float]) -> tuple[tuple[str, float], ...]:
    """`clip`, `clip+aesthetic` or `4*clip+0.5*aesthetic` as (name, weight) pairs, each name checked."""
    from grpo_vision.rewards import available_rewards, is_registered

    terms = [t.strip() for t in spec.split("+")]
    out = []
    for term in terms:
        weight, _, name = term.rpartition("*")
        try:
            w = float(weight) if weight else (base_weights.get(name, 1.0) if len(terms) > 1 else 1.0)
        except ValueError:
            raise ConfigError(f"--rewards: {brief(term)} in {brief(spec)} is not NAME or WEIGHT*NAME") from None
        if not name or not is_registered(name):
            raise ConfigError(f"--rewards: {brief(name)} in {brief(spec)} is not a reward; registered rewards: "
                              f"{', '.join(available_rewards())}")
        out.append((name, w))
    if len({n for n, _ in out}) < len(out):
        raise ConfigError(f"--rewards: {brief(spec)} names a reward twice")
    return tuple(out)


# what the matrix sets for every run itself: a variant may not (its value would be overridden, or the table lie)
MATRIX_SETS = ("run.", "reward.weights", "reward.monitor", "train.beta", "log.report", "log.sample_every")


def parse_variant(text: str) -> tuple[str, tuple[str, ...]]:
    """`NAME:key=value,key=value` (`NAME:` for the config as it is) as (name, overrides)."""
    name, sep, rest = text.partition(":")
    if not sep or not re.fullmatch(r"[a-z0-9_]{1,40}", name):
        raise ConfigError(f"--variant {brief(text)}: expected NAME:key=value[,key=value] with NAME of lower-case "
                          "letters, digits and _, e.g. stage:train.token_weighting=stage (base: for the config as is)")
    options = tuple(o.strip() for o in re.split(r",(?![^\[{]*[\]}])", rest) if o.strip())  # not inside [..] / {..}
    for option in options:
        if "=" not in option or option.startswith(MATRIX_SETS):
            raise ConfigError(f"--variant {name}: {brief(option)} is not a training option key=value the matrix "
                              f"leaves free (it sets {', '.join(MATRIX_SETS)} itself; train.beta: --kl)")
    return name, options


def plan(cfg: Config, rewards: list[str], betas: list[float] | None, seeds: list[int],
         variants: list[str] = ()) -> list[RunSpec]:
    """Every (train reward, variant, KL, seed), in table order (no KL given: the config's train.beta; no
    variant: the config as it is); a value given twice is refused (its runs would share one folder, or
    train the same thing twice)."""
    betas = [cfg.train.beta] if betas is None else betas
    if not rewards or not betas or not seeds:
        raise ConfigError("matrix needs at least one train reward, KL coefficient and seed")
    for beta in betas:
        if not (math.isfinite(beta) and beta >= 0):
            raise ConfigError(f"--kl {beta:g}: KL coefficients must be finite numbers >= 0")
        if beta > 0 and cfg.train.reference == "none":
            raise ConfigError(f"--kl {beta} needs a reference: the config has train.reference: none")
    for seed in seeds:
        if not 0 <= seed <= MAX_SEED:  # run.seed's range (config/schema.py)
            raise ConfigError(f"--seeds {seed}: seeds must be whole numbers from 0 to {MAX_SEED}")
    _refuse_twice("--kl", [f"{b:g}" for b in betas], "KL coefficient")  # as run folders name them
    _refuse_twice("--seeds", [str(s) for s in seeds], "seed")
    mixes = [parse_reward_spec(r, cfg.reward.weights) for r in rewards]
    _refuse_twice("--rewards", rewards, "reward mix", [tuple(sorted(m)) for m in mixes])
    parsed = [parse_variant(v) for v in variants] or [("", ())]
    _refuse_twice("--variant", [name for name, _ in parsed], "variant name")
    return [RunSpec(r, m, b, s, name, options) for r, m in zip(rewards, mixes) for name, options in parsed
            for b in betas for s in seeds]


def _refuse_twice(option: str, given: list[str], what: str, keys: list | None = None) -> None:
    """ConfigError naming the first entry of `given` whose key (itself by default) repeats an earlier one."""
    first = {}
    for text, key in zip(given, keys or given):
        if key in first:
            raise ConfigError(f"{option}: {text} is given twice; give each {what} once" if first[key] == text else
                              f"{option}: {first[key]} and {text} are the same {what}; give it once")
        first[key] = text


def run_config(config: str, overrides: list[str], spec: RunSpec, runs_dir: Path) -> Config:
    return load_config(config, [*overrides, *spec.overrides(runs_dir)])


def _same_config(a: Config, b: Config) -> bool:
    da, db = to_dict(a), to_dict(b)
    for d in (da, db):
        d["run"].pop("out_dir")  # the same runs, whether --out was given as a relative or an absolute path
    return da == db


def run_state(run_dir: Path, log: Path, expected: Config) -> str:
    """"new", "finished", "failed" or "interrupted"; ConfigError when the directory holds another run,
    RunLockedError when a live train holds it or its log."""
    refuse_held(run_dir, log)
    if not (run_dir / "config.yaml").is_file():
        return "new"
    # as `train --resume` will read it (its relative paths resolved through origin.json): the matrix
    # passes --trust-run to that resume, so what it resolves to must be what this matrix gives the run (its rewards
    # are the matrix's own, registered here, so the run's rewards.json restores none of them)
    if not _same_config(read_run_config(run_dir), expected):
        raise ConfigError(f"{run_dir} holds a run with another config than this matrix gives it; "
                          "choose another --out, or remove that directory to train it again")
    done = run_dir / DONE
    if done.is_file():
        return "finished" if json.loads(done.read_text())["rc"] == 0 else "failed"
    return "interrupted"


def check_options(config: str, overrides: list[str], cfg: Config, specs: list[RunSpec], images: int | None) -> None:
    """What training and scoring need, checked before anything trains: every run's config, two images
    per prompt (diversity is a distance between a prompt's images), the config's own rewards (scored
    though no run trains on them), the eval prompts."""
    from grpo_vision.splits import prompt_lists
    from grpo_vision.rewards import available_rewards, is_registered
    from grpo_vision.rewards import check_options as check_registered_options

    check_registered_options(cfg)  # reward.options and policy.options, as `train` checks them
    for spec in specs:
        run_cfg = run_config(config, overrides, spec, Path("runs"))
        check_registered_options(run_cfg)  # its own reward.weights: a reward that reads plans needs sample.plan
        derived_sizes(run_cfg, 1)
    if (images or cfg.log.eval_images) < 2:
        given = f"--images {images}" if images else f"log.eval_images={cfg.log.eval_images} (the default of --images)"
        raise ConfigError(f"{given}: matrix measures diversity between a prompt's images, so it needs at least 2; "
                          "give --images 2 or more")
    for name in [*cfg.reward.weights, *cfg.reward.monitor]:
        if not is_registered(name):
            raise ConfigError(f"the config's reward {name!r} (scored for every run) is not a reward; registered "
                              f"rewards: {', '.join(available_rewards())}")
    prompt_lists(cfg)


def train_one(config: str, overrides: list[str], spec: RunSpec, out: Path, threads: int, stop: PassOn) -> RunResult:
    """Train one run in its own process (fresh, or resumed where a previous invocation stopped)."""
    runs_dir = out / "runs"
    run_dir, log = runs_dir / spec.name, out / "logs" / f"{spec.name}.log"
    state = run_state(run_dir, log, run_config(config, overrides, spec, runs_dir))
    if state == "finished":
        return RunResult(spec, "reused")
    if stop.received:
        return RunResult(spec, "stopped")
    print(f"[matrix] {spec.name}: {'training' if state == 'new' else 'resuming'}", flush=True)
    log.parent.mkdir(parents=True, exist_ok=True)
    # run_state found the run's config to be the one this matrix gives it: its rewards are the user's own
    args = (["--resume", str(run_dir), "--trust-run"] if state in ("interrupted", "failed") else
            [config, *overrides, *spec.overrides(runs_dir)])
    env = {**os.environ, "OMP_NUM_THREADS": str(threads), "MKL_NUM_THREADS": str(threads)}
    (run_dir / DONE).unlink(missing_ok=True)  # from a failed attempt: this one decides
    rc, signalled = run_child([sys.executable, "-m", "grpo_vision.cli", "train", *args], log, run_dir, env, stop)
    if rc is None or (signalled and rc):  # stopped by a signal passed on: interrupted, not failed
        return RunResult(spec, "stopped", rc or 0, str(log))
    if run_dir.is_dir():
        write_file(run_dir / DONE, json.dumps({"rc": rc, "log": str(log)}))
    status = "failed" if rc else ("resumed" if state != "new" else "trained")
    tail = "\n".join(log.read_text(errors="replace").splitlines()[-5:]) if rc else ""
    return RunResult(spec, status, rc, str(log), tail)


def train_all(config: str, overrides: list[str], specs: list[RunSpec], out: Path, jobs: int,
              stop: PassOn) -> list[RunResult]:
    """Train every run not finished yet, `jobs` at a time; the CPU's cores are shared among them. A
    signal is passed on to the runs in training, and no more start (`stop`)."""
    threads = max(1, (os.cpu_count() or 1) // jobs)
    for spec in specs:  # a run directory holding another run, or held by a train, is refused before anything trains
        run_state(out / "runs" / spec.name, out / "logs" / f"{spec.name}.log",
                  run_config(config, overrides, spec, out / "runs"))

    def one(spec: RunSpec) -> RunResult:
        result = train_one(config, overrides, spec, out, threads, stop)
        if result.status != "stopped":
            print(f"[matrix] {spec.name}: {result.status}" + (f" (rc {result.rc}, log {result.log})" if result.rc
                                                                else ""), flush=True)
        return result

    stop.forwarding = True
    try:
        with ThreadPoolExecutor(max_workers=jobs) as pool:
            results = list(pool.map(one, specs))
    finally:
        stop.forwarding = False
    if stop.received:
        raise Interrupted(stop.received[0])
    return results


def run_matrix(config: str, overrides: list[str], rewards: list[str], betas: list[float] | None, seeds: list[int],
               out: Path, jobs: int = 1, images: int | None = None, command: str = "",
               variants: list[str] = (), against: Path | None = None, against_reward: str | None = None) -> dict:
    """Train every run (reusing and resuming), score them and the reference, write the outputs.
    Interrupted (a KeyboardInterrupt) after SIGINT or SIGTERM, once the runs in training have stopped."""
    stop = PassOn()  # from here on a signal ends in Interrupted: at once, or once the runs in training stopped
    try:
        cfg = load_config(config, overrides)
        specs = plan(cfg, rewards, betas, seeds, variants)
        check_options(config, overrides, cfg, specs, images)
        if against is not None:  # a damaged OTHER is refused now, not after every run trained and scored
            from grpo_vision.splits import prompt_lists

            read_against(against, {k: [e.prompt for e in v] for k, v in prompt_lists(cfg).scored().items()},
                         images or cfg.log.eval_images)
        if out.exists() and not out.is_dir():
            raise ConfigError(f"--out {out} is a file; give a folder")
        check_writable(out, "make it writable, or choose another --out")
        out.mkdir(parents=True, exist_ok=True)
        lock = OutLock(out)
        try:
            results = train_all(config, overrides, specs, out, jobs, stop)
            return score_and_write(cfg, config, overrides, specs, results, out, images, command, against,
                                   against_reward)
        finally:
            lock.release()
    finally:
        stop.restore()


def score_and_write(cfg: Config, config: str, overrides: list[str], specs: list[RunSpec], results: list[RunResult],
                    out: Path, images: int | None, command: str, against: Path | None = None,
                    against_reward: str | None = None) -> dict:
    """Score the reference and every run that trained, then write matrix.json, matrix.md and matrix.png."""
    from grpo_vision.tools.matrix_report import write_outputs
    from grpo_vision.tools.matrix_score import Scorer, against_baseline, pool_seeds, score_runs

    scorer = Scorer(cfg, images or cfg.log.eval_images)
    scorer.use_rewards([name for spec in specs for name, _ in spec.weights])
    reference, summaries, raw = score_runs(scorer, out, [(r.spec.name, out / "runs" / r.spec.name) for r in results
                                                         if r.status != "failed"])
    runs = [{"name": r.spec.name, "reward": r.spec.label, "weights": dict(r.spec.weights), "beta": r.spec.beta,
             "seed": r.spec.seed, "variant": r.spec.variant, "options": list(r.spec.options), "status": r.status,
             "rc": r.rc, "log": r.log, "error": r.error, "summary": summaries.get(r.spec.name)} for r in results]
    groups: dict[tuple, list[dict]] = {}  # runs that differ only in their seed, scored
    for run in runs:
        if run["summary"] is not None:
            groups.setdefault((run["reward"], run["beta"]), []).append(run)
    pooled = [{"reward": reward, "beta": beta, "seeds": [r["seed"] for r in group],
               "sets": pool_seeds(scorer, raw["reference"], [raw[r["name"]] for r in group])}
              for (reward, beta), group in groups.items() if len(group) > 1]
    compared = compare_variants(specs, runs, lambda base, other: against_baseline(
        scorer, [raw[r["name"]] for r in base], [raw[r["name"]] for r in other]))
    if against is not None:
        compared += compare_matrices(scorer, against, runs, raw, against_reward)
    header = {"command": command or f"grpo-vision matrix {config}", "config": config, "overrides": overrides,
              "steps": cfg.train.steps, "images_per_prompt": scorer.n, "temperature": scorer.params.temperature,
              "embedding": scorer.embedding, "sets": {k: [e.prompt for e in v] for k, v in scorer.sets.items()},
              "captions": {k: len(set(v)) for k, v in scorer.captions.items()}}
    write_outputs(out, header, reference, runs, [e.prompt for e in scorer.sets["test"]], pooled, compared)
    return {"reference": reference, "runs": runs, "pooled": pooled, "compared": compared}


def read_against(other: Path, sets: dict[str, list[str]], n: int) -> tuple[dict, dict]:
    """`--against OTHER`'s matrix.json and the per-image scores it reads ({"reference" and each run that matrix
    scored: its scores/NAME.json}; runs/ is never read), checked against this matrix's `sets` (per eval set, its
    prompts) and `n` images per prompt; a ConfigError naming the first file that is missing, unreadable or
    shaped otherwise, so a damaged folder is one line (checked before anything trains, and again when compared)."""
    def load(name: str, fix: str):
        path = other / name
        try:
            return json.loads(path.read_text())
        except FileNotFoundError:
            raise ConfigError(f"--against {other}: {name} is missing; {fix}") from None
        except (OSError, ValueError) as err:  # unreadable, not UTF-8, or not JSON (a torn or edited copy)
            raise ConfigError(f"--against {other}: {name} is not readable JSON ({brief(str(err), 60)}); {fix}") from None

    rerun = "run that matrix's command again (it scores what scores/ lacks), or give another matrix's --out"
    header = load("matrix.json", "give the --out folder of a finished matrix")
    runs = header.get("runs") if isinstance(header, dict) else None
    if not isinstance(runs, list) or not all(isinstance(r, dict) and isinstance(r.get("name"), str)
                                             and Path(r["name"]).name == r["name"] not in ("", ".", "..") for r in runs):
        raise ConfigError(f"--against {other}: matrix.json lists no runs (not a finished matrix's); "
                          "give the --out folder of a finished matrix")
    if header.get("sets") != sets:
        raise ConfigError(f"--against {other}: that matrix scored other prompts; run both on the same config data")
    if header.get("images_per_prompt") != n:
        raise ConfigError(f"--against {other}: that matrix scored {header.get('images_per_prompt')} images per "
                          f"prompt, this one {n}; give both the same --images")
    theirs = {}
    for name in ["reference", *(r["name"] for r in runs if r.get("summary") is not None)]:
        scores = load(f"scores/{name}.json", rerun)
        if problem := _scores_problem(scores, sets, n):
            raise ConfigError(f"--against {other}: scores/{name}.json {problem}; {rerun}")
        theirs[name] = scores
    return header, theirs


def _scores_problem(scores, sets: dict[str, list[str]], n: int) -> str | None:
    """What keeps `scores` (a model's scores/NAME.json) from pairing with this matrix's, or None: per eval set,
    every measure a list of one value per image (diversity: per prompt), as matrix_score.Scorer.score writes."""
    if not isinstance(scores, dict) or not isinstance(scores.get("sets"), dict):
        return "holds no per-set scores"
    for set_name, prompts in sets.items():
        s = scores["sets"].get(set_name)
        if not isinstance(s, dict):
            return f"has no scores of the {set_name} prompts"
        sized = {"entropy": len(prompts) * n, "kl": len(prompts) * n, "diversity": len(prompts)}
        lists = [(k, s.get(k), size) for k, size in sized.items()]
        for group in ("rewards", "judge"):
            if not isinstance(s.get(group), dict):
                return f"has no {group} of the {set_name} prompts"
            lists += [(f"{group}/{k}", v, len(prompts) * n) for k, v in s[group].items()]
        for key, values, size in lists:
            if not (isinstance(values, list) and len(values) == size
                    and all(v is None or isinstance(v, (int, float)) for v in values)):
                return f"does not hold {size} numbers for {key} of the {set_name} prompts"
    return None


def compare_matrices(scorer, other: Path, runs: list[dict], raw: dict, their_reward: str | None = None) -> list[dict]:
    """`--against OTHER`: this matrix's runs minus OTHER's runs of the same name (reward, KL, seed, variant), paired
    per image and per seed (matrix_score.against_baseline), and this reference minus OTHER's: what a change of
    sampling (a text plan, say) does, which one matrix cannot show, since it scores all its runs alike. With
    `their_reward` (`--against-reward`), each run is paired with OTHER's run of that reward instead (the same KL,
    seed and variant): what swapping or adding a reward did, seed by seed. OTHER must have scored the same
    prompts."""
    from grpo_vision.tools.matrix_score import against_baseline

    _, theirs = read_against(other, {k: [e.prompt for e in v] for k, v in scorer.sets.items()}, scorer.n)
    label = f"{other.name}{f' [{their_reward}]' if their_reward else ''} (--against)"
    rows = [{"reward": "reference", "beta": 0.0, "variant": "", "baseline": label, "seeds": [],
             "sets": against_baseline(scorer, [theirs["reference"]], [raw["reference"]])}]

    def partner(run: dict) -> str:  # OTHER's run this one is compared with
        if their_reward is None:
            return run["name"]
        return RunSpec(their_reward, (), run["beta"], run["seed"], run.get("variant", "")).name

    groups: dict[tuple, list[dict]] = {}
    for run in runs:
        if run["summary"] is not None and partner(run) in theirs:
            groups.setdefault((run["reward"], run["beta"]), []).append(run)
    if their_reward is not None and not groups:
        raise ConfigError(f"--against-reward {brief(their_reward)}: {other} holds no scored run of that reward with "
                          f"this matrix's KL and seeds; its runs: {', '.join(sorted(set(theirs) - {'reference'}))}")
    for (reward, beta), group in groups.items():
        rows.append({"reward": reward, "beta": beta, "variant": "", "baseline": label,
                     "seeds": [r["seed"] for r in group],
                     "sets": against_baseline(scorer, [theirs[partner(r)] for r in group],
                                              [raw[r["name"]] for r in group])})
    return rows


def compare_variants(specs: list[RunSpec], runs: list[dict], difference) -> list[dict]:
    """Each variant against the first (`--variant`'s baseline) for every reward and KL they share, on the
    seeds both have scored: `difference(baseline runs, variant runs)`, the runs paired by seed."""
    if not any(spec.variant for spec in specs):
        return []
    baseline = specs[0].variant
    scored = {r["name"]: r for r in runs if r["summary"] is not None}
    rows: dict[tuple, list[tuple[dict, dict, int]]] = {}
    for spec in specs:
        base = replace(spec, variant=baseline).name  # the same reward, KL and seed, trained as the baseline
        if spec.variant != baseline and spec.name in scored and base in scored:
            rows.setdefault((spec.label, spec.beta, spec.variant), []).append((scored[base], scored[spec.name],
                                                                               spec.seed))
    return [{"reward": label, "beta": beta, "variant": variant, "baseline": baseline, "seeds": [s for *_, s in pairs],
             "sets": difference([b for b, _, _ in pairs], [v for _, v, _ in pairs])}
            for (label, beta, variant), pairs in rows.items()]
