"""Alerts while training: four ways a run goes wrong, told at the step they start rather than in the
report at the end. Each is a pure check over the run's metrics rows (metrics.jsonl), so the
same code watches a live run, rebuilds its state on resume, and replays a finished run's metrics
(`grpo-vision alerts RUN_DIR`).

    flat_reward        most groups have no reward spread over a window (advantages 0), or every trained
                       reward's trend is flat over two windows while its within-group spread is there
    hacking_onset      a trained reward rises while a monitored reward or a judge rate on the rollouts
                       falls, both beyond their noise (Gao et al. 2022; RealGen's tracker, #11, saw it at step 300)
    variance_collapse  a trained reward's within-group std falls to a small fraction of its first
                       window's (RewardDance watches the reward's variance)
    ratio_drift        the importance ratio's mean leaves 1 by more than its noise, or a clip fraction
                       rises (GRPO-Guard: the ratio's mean drifting below 1)

"Beyond its noise": each step's value (a mean over its B*G images) is one draw; two adjacent windows
of W steps are compared by the change of their means against its standard error (Welch, normal
approximation: se = sqrt(var_a / n_a + var_b / n_b)), and the change counts when it exceeds
`log.alerts.sigmas` standard errors. Consecutive steps are correlated (the policy moves slowly) and the
test runs at every step, so 3 rather than 1.96: at 1.96 a 300-step run of pure noise fires a few times
by chance. An alert fires once per onset: again only after its condition has been false for a window.
"""

from __future__ import annotations

import json
import math
from dataclasses import asdict, dataclass, field
from pathlib import Path
from statistics import fmean, variance

from grpo_vision.config.schema import AlertConfig
from grpo_vision.files import FolderError, open_kept, write_file
from grpo_vision.run.metrics import read_step_rows, step_rows

ADVICE = {
    "flat_reward:zero_spread": "most groups give all their images the same reward, so they teach nothing: raise "
                               "sample.group_size (more draws per prompt), sample.temperature, or use a reward "
                               "with finer grades",
    "flat_reward:trend": "the groups have a spread but the policy does not move: raise train.lr, or the adapter's "
                         "scale (train.adapter_alpha / train.adapter_rank), or sample.group_size",
    "hacking_onset": "the policy may be learning what the trained reward scores rather than what the prompts ask: "
                     "look at the latest samples/ grid; raise train.beta (KL to the reference), lower train.lr, "
                     "put the falling measure into reward.weights, or keep the last checkpoint before this step",
    "variance_collapse": "the images of a group score alike (the policy collapses onto one answer, or the reward "
                         "saturates): raise train.beta or sample.temperature, or stop at an earlier checkpoint",
    "ratio_drift": "the policy moves further within a step's updates than the clip allows for, or sampler and "
                   "trainer disagree: lower train.lr or train.num_iterations / minibatches_per_pass, and check "
                   "rollout/logp_drift",
}


@dataclass
class Alert:
    step: int  # the step whose metrics row made it fire
    name: str  # one of ALERT_NAMES
    key: str  # name plus what it is about (e.g. hacking_onset:clip>judge/background): one onset per key
    message: str  # the console line, without the step
    evidence: dict = field(default_factory=dict)  # the numbers it rests on
    advice: str = ""  # what to try

    def line(self) -> str:
        return f"ALERT step {self.step} {self.name}: {self.message}. Try: {self.advice}"

    def to_json(self) -> str:
        return json.dumps(asdict(self))


def _values(rows: list[dict], key: str) -> list[float]:
    """The finite values of `key` in `rows` (a missing key, None or NaN: skipped)."""
    out = []
    for r in rows:
        v = r.get(key)
        if isinstance(v, (int, float)) and math.isfinite(v):
            out.append(float(v))
    return out


def change(before: list[float], after: list[float]) -> tuple[float, float] | None:
    """(mean(after) - mean(before), its standard error), each value one draw (Welch); None with fewer
    than two values on a side."""
    if len(before) < 2 or len(after) < 2:
        return None
    return fmean(after) - fmean(before), math.sqrt(variance(before) / len(before) + variance(after) / len(after))


def beyond(c: tuple[float, float] | None, sigmas: float) -> int:
    """+1 / -1 when the change exceeds `sigmas` standard errors up / down, else 0. A change with no
    noise at all (se 0: constant windows) counts when it is not 0."""
    if c is None:
        return 0
    d, se = c
    return 0 if abs(d) <= sigmas * se or d == 0 else (1 if d > 0 else -1)


def _spread_key(name: str) -> str:
    """A reward's within-group std (`group_std`): the spread its advantages come from, not the std over the
    whole step (`std`), which also counts the spread between prompts."""
    return f"reward/{name}/group_std"


def _r(x: float) -> float:
    return float(f"{x:.4g}")


def _steps(rows: list[dict]) -> str:
    return f"{rows[0]['step']}-{rows[-1]['step']}"


# ------------------------------------------------------------------- the four checks: (key, message, evidence)


def flat_reward(rows: list[dict], o: AlertConfig, trained: list[str]) -> list[tuple[str, str, dict]]:
    W, out = o.window, []
    last = rows[-W:]
    zero = _values(last, "adv/frac_zero_std")
    if len(rows) >= W and len(zero) >= 2 and fmean(zero) >= o.flat_zero_std:
        out.append(("flat_reward:zero_spread",
                    f"{100 * fmean(zero):.0f}% of the groups had no reward spread over steps {_steps(last)} "
                    f"(log.alerts.flat_zero_std {o.flat_zero_std})",
                    {"frac_zero_std": _r(fmean(zero)), "steps": [last[0]["step"], last[-1]["step"]]}))
    elif len(rows) >= 2 * W and trained:
        prev, flat = rows[-2 * W:-W], {}
        for name in trained:
            key = f"reward/{name}/mean"
            c = change(_values(prev, key), _values(last, key))
            spread = _values(last, _spread_key(name))
            if c is None or not spread or fmean(spread) <= 0:
                return out  # a reward without numbers or without spread: not this check's case
            if beyond(c, o.sigmas) or abs(c[0]) >= o.flat_change * fmean(spread):
                return out  # it moves
            since = change(_values(rows[:W], key), _values(last, key))
            if since and (beyond(since, o.sigmas) > 0 or since[0] >= o.flat_change * fmean(spread)):
                return out  # it rose since the first window (as `moves` above) and stalled: a plateau or a pause
            flat[name] = {"change": _r(c[0]), "se": _r(c[1]), "spread": _r(fmean(spread))}
        out.append(("flat_reward:trend",
                    "the trained reward" + ("s" if len(flat) > 1 else "") + " did not move between steps "
                    f"{_steps(prev)} and {_steps(last)}: " + "; ".join(
                        f"{n} {v['change']:+.3g} (se {v['se']:.2g}, within-group std {v['spread']:.3g})"
                        for n, v in flat.items()), {"rewards": flat, "steps": [prev[0]["step"], last[-1]["step"]]}))
    return out


def watched_keys(monitored: list[str], judge: list[str], twin: bool) -> list[str]:
    """The measures a trained reward must not win against: monitored rewards' means and the judge's rates
    on the rollouts (`judge/<attribute>`); `judge/correct` is left out when a monitored reward is that
    same rate (`twin`: ShapesWorld's shapes_exact), which would say everything twice."""
    return [f"reward/{m}/mean" for m in monitored] + [k for k in judge if not (k == "judge/correct" and twin)]


def hacking_onset(rows: list[dict], o: AlertConfig, trained: list[str], watched: list[str]) -> list[tuple]:
    """A trained reward up and a watched measure down, each beyond its noise, from the window before the last
    (an onset) or from the run's first window (a slide too slow for two neighbouring windows to show)."""
    W, out = o.window, []
    if len(rows) < 2 * W:
        return out
    last = rows[-W:]
    bases = [rows[-2 * W:-W]] + ([rows[:W]] if len(rows) >= 3 * W else [])
    for t in trained:
        for w in watched:
            for base in bases:
                ct = change(_values(base, f"reward/{t}/mean"), _values(last, f"reward/{t}/mean"))
                cw = change(_values(base, w), _values(last, w))
                if beyond(ct, o.sigmas) > 0 and beyond(cw, o.sigmas) < 0:
                    label = w.removeprefix("reward/").removesuffix("/mean")
                    out.append((f"hacking_onset:{t}>{label}",
                                f"trained {t} rose {ct[0]:+.3g} (se {ct[1]:.2g}) while {label} fell {cw[0]:+.3g} "
                                f"(se {cw[1]:.2g}), steps {_steps(base)} -> {_steps(last)}",
                                {"trained": t, "trained_change": _r(ct[0]), "trained_se": _r(ct[1]), "watched": label,
                                 "watched_change": _r(cw[0]), "watched_se": _r(cw[1]),
                                 "steps": [base[0]["step"], last[-1]["step"]]}))
                    break  # one alert per pair: the onset's numbers where both bases show it
    return out


def variance_collapse(rows: list[dict], o: AlertConfig, trained: list[str]) -> list[tuple]:
    W, out = o.window, []
    if len(rows) < 2 * W:
        return out
    for t in trained:
        key = _spread_key(t)
        start, now = _values(rows[:W], key), _values(rows[-W:], key)
        if start and now and fmean(start) > 0 and fmean(now) < o.collapse_fraction * fmean(start):
            out.append((f"variance_collapse:{t}",
                        f"{t}'s within-group std fell to {fmean(now):.3g}, {100 * fmean(now) / fmean(start):.0f}% "
                        f"of its {fmean(start):.3g} over the first {W} steps (log.alerts.collapse_fraction "
                        f"{o.collapse_fraction})",
                        {"reward": t, "metric": key, "start": _r(fmean(start)), "now": _r(fmean(now)),
                         "steps": [rows[-W]["step"], rows[-1]["step"]]}))
    return out


def ratio_drift(rows: list[dict], o: AlertConfig) -> list[tuple]:
    W, out = o.window, []
    if len(rows) < W:
        return out
    last = rows[-W:]
    ratio = _values(last, "loss/ratio_mean")
    if len(ratio) >= 2:
        d, se = fmean(ratio) - 1, math.sqrt(variance(ratio) / len(ratio))
        if abs(d) > o.sigmas * se and abs(d) > o.ratio_tolerance:
            out.append(("ratio_drift:mean", f"loss/ratio_mean averaged {1 + d:.4f} over steps {_steps(last)}, "
                                            f"{d:+.2g} from 1 (se {se:.2g}; log.alerts.ratio_tolerance "
                                            f"{o.ratio_tolerance})",
                        {"ratio_mean": _r(1 + d), "se": _r(se), "steps": [last[0]["step"], last[-1]["step"]]}))
    if len(rows) >= 2 * W:
        prev = rows[-2 * W:-W]
        for key in ("loss/clip_frac_low", "loss/clip_frac_high"):
            c = change(_values(prev, key), _values(last, key))
            if beyond(c, o.sigmas) > 0 and c[0] > o.clip_rise:
                out.append((f"ratio_drift:{key.split('/')[-1]}",
                            f"{key} rose {c[0]:+.3g} (se {c[1]:.2g}) from steps {_steps(prev)} to {_steps(last)} "
                            f"(log.alerts.clip_rise {o.clip_rise})",
                            {"metric": key, "change": _r(c[0]), "se": _r(c[1]),
                             "steps": [prev[0]["step"], last[-1]["step"]]}))
    return out


# ------------------------------------------------------------------- the watcher


class AlertWatcher:
    """Feed it each step's metrics row (`observe`); it returns the alerts that start at that step. Its
    state is the rows it has seen, so replaying a run's rows rebuilds it exactly (resume)."""

    def __init__(self, opts: AlertConfig, trained: list[str], monitored: list[str]):
        self.opts, self.trained, self.monitored = opts, list(trained), list(monitored)
        self.rows: list[dict] = []
        self.active: dict[str, int] = {}  # alert key -> the last step its condition held
        self.judge: list[str] = []  # the judge rates the rows have had (judge/<attribute>)
        self.twins = {f"reward/{m}/mean" for m in monitored}  # monitored rewards equal to judge/correct so far

    def observe(self, row: dict) -> list[Alert]:
        self.rows.append(row)
        self.judge += sorted(k for k in row if k.startswith("judge/") and k not in self.judge)
        self.twins = {k for k in self.twins if row.get(k) == row.get("judge/correct")}
        if not self.opts.enabled:
            return []
        step, rows, o = row["step"], self.rows, self.opts
        watched = watched_keys(self.monitored, self.judge, bool(self.twins) and "judge/correct" in self.judge)
        held = [*flat_reward(rows, o, self.trained), *hacking_onset(rows, o, self.trained, watched),
                *variance_collapse(rows, o, self.trained), *ratio_drift(rows, o)]
        fired = []
        for key, message, evidence in held:
            if key not in self.active:
                name = key.split(":")[0]
                fired.append(Alert(step, name, key, message, evidence, ADVICE.get(key, ADVICE.get(name, ""))))
            self.active[key] = step
        for key, last in list(self.active.items()):  # re-armed once false for a whole window
            if step - last >= o.window:
                del self.active[key]
        return fired


def watcher_for(cfg) -> AlertWatcher:
    """The watcher of a run's config: its trained rewards (weight not 0) and monitored ones."""
    trained = [n for n, w in cfg.reward.weights.items() if w]
    return AlertWatcher(cfg.log.alerts, trained, [m for m in cfg.reward.monitor if m not in trained])


def replay(rows: list[dict], watcher: AlertWatcher) -> list[Alert]:
    """Every alert `rows` (metrics.jsonl's, in step order) make `watcher` fire."""
    return [a for row in rows for a in watcher.observe(row)]


class RunAlerts:
    """A run's alerts as it trains: each printed as one line when it fires and appended to alerts.jsonl.
    On resume the lines past the checkpoint's step are dropped and the watcher replays the kept metrics
    rows (`rows`) silently, so that it goes on as the uninterrupted run would."""

    def __init__(self, run_dir: Path, start: int, watcher: AlertWatcher, rows: list[dict], stop_on: list[str]):
        self.path, self.watcher, self.stop_on = Path(run_dir) / "alerts.jsonl", watcher, set(stop_on)
        keep = [a for a in load_alerts(run_dir) if a["step"] <= start]
        write_file(self.path, "".join(json.dumps(a) + "\n" for a in keep))  # replaces a link, never follows it
        replay([r for r in rows if r["step"] <= start], watcher)
        self.file = open_kept(self.path)

    def observe(self, row: dict, say) -> Alert | None:
        """Watch one step's row (its "step" and metrics, as metrics.jsonl holds it); `say(line)` prints.
        Returns the first alert that fired and that log.stop_on names, else None."""
        stop = None
        for alert in self.watcher.observe(row):
            say(alert.line())
            self.file.write(alert.to_json() + "\n")
            self.file.flush()
            if stop is None and alert.name in self.stop_on:
                stop = alert
        return stop

    def close(self) -> None:
        self.file.close()


def load_alerts(run_dir: Path) -> list[dict]:
    """alerts.jsonl's alerts (a line cut short by a crash mid-write is skipped)."""
    return step_rows(Path(run_dir) / "alerts.jsonl")


def report_lines(alerts: list[dict]) -> list[str]:
    """report.md's section: one bullet per alert, in step order (empty without alerts)."""
    if not alerts:
        return []
    return ["## Alerts during training", "",
            "Raised while the run trained (alerts.jsonl; docs/usage.md, \"Watching a run\"): each at the step its "
            "condition first held.", "",
            *[f"- step {a['step']}, **{a['name']}**: {a['message']}. Try: {a['advice']}" for a in alerts], ""]


SKIPPED_SHOWN = 5  # lines named one by one when `replay_run` skips some; the rest are counted


def replay_run(run_dir: str | Path, overrides: list[str] | tuple = (), say=lambda line: None) -> list[Alert]:
    """The alerts a run's metrics.jsonl makes fire under its config's log.alerts (with `overrides`, e.g.
    log.alerts.window=20): what a finished run would have said under other thresholds. `say(line)` hears how
    many rows were read and which lines were skipped (file, line and why); FolderError when no row reads, since
    no alert from no rows would look like a healthy run."""
    from grpo_vision.run.folder import read_run_config

    cfg = read_run_config(run_dir, overrides)
    path = Path(run_dir) / "metrics.jsonl"
    rows, skipped = read_step_rows(path)
    if not rows:  # one line: the first line skipped, and how many more
        more = f", and {len(skipped) - 1} more lines skipped" if len(skipped) > 1 else ""
        found = (f"skipped {skipped[0]}{more}" if skipped else "no line" if path.exists() else "no such file")
        raise FolderError(f"{path} holds no step's row to replay ({found}); alerts replays the steps a run has "
                          "logged: give a run folder that train has written at least one step in")
    for why in skipped[:SKIPPED_SHOWN]:
        say(f"skipped {why}")
    if len(skipped) > SKIPPED_SHOWN:
        say(f"skipped {len(skipped) - SKIPPED_SHOWN} more lines of {path}")
    say(f"read {len(rows)} step rows of {path}" + (f" ({len(skipped)} lines skipped)" if skipped else ""))
    return replay(rows, watcher_for(cfg))
