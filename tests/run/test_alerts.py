"""The training alerts (run/alerts.py) on metric streams worked out by hand: at which step each fires,
and the streams that must not make it fire. Windows of W = 4 steps and 3 standard errors throughout."""

import json

import pytest

from grpo_vision.config.schema import AlertConfig, Config
from grpo_vision.run.alerts import AlertWatcher, RunAlerts, beyond, change, load_alerts, replay, report_lines

OPTS = AlertConfig(window=4)


def stream(**series) -> list[dict]:
    """Rows {step, metric: value} from equal-length lists, keyed by metric name with '__' for '/'."""
    n = len(next(iter(series.values())))
    return [{"step": i + 1, **{k.replace("__", "/"): v[i] for k, v in series.items()}} for i in range(n)]


def fired(rows, trained=("clip",), monitored=("shapes_exact",), opts=OPTS) -> list[tuple[int, str]]:
    return [(a.step, a.key) for a in replay(rows, AlertWatcher(opts, list(trained), list(monitored)))]


def test_change_is_welch_on_the_step_means():
    # before: mean 2.5, variance 5/3; after: mean 6.5, variance 5/3; se = sqrt(2 * (5/3) / 4) = 0.9129
    d, se = change([1, 2, 3, 4], [5, 6, 7, 8])
    assert d == 4 and se == pytest.approx(0.912871, abs=1e-6)
    assert beyond((d, se), 3) == 1  # 4 / 0.913 = 4.4 standard errors
    assert beyond((d, se), 5) == 0
    assert beyond((-d, se), 3) == -1
    assert change([1], [2, 3]) is None  # one value has no spread


UP = [0.50, 0.52, 0.48, 0.50, 0.60, 0.62, 0.58, 0.60]  # +0.10; each window's variance 0.0004*2/3 = 2.667e-4
DOWN = [0.30, 0.32, 0.28, 0.30, 0.20, 0.22, 0.18, 0.20]  # -0.10; se = sqrt(2 * 2.667e-4 / 4) = 0.01155: 8.7 se


def test_hacking_onset_fires_when_the_trained_reward_rises_and_a_monitored_one_falls():
    # both changes are 8.7 standard errors; two windows exist from step 8 on
    assert fired(stream(reward__clip__mean=UP, reward__shapes_exact__mean=DOWN)) == [
        (8, "hacking_onset:clip>shapes_exact")]
    # the judge's rate on the rollouts counts as a watched measure too
    assert fired(stream(reward__clip__mean=UP, judge__background=DOWN), monitored=()) == [
        (8, "hacking_onset:clip>judge/background")]


def test_hacking_onset_does_not_fire_on_a_fall_within_its_noise_or_without_a_rise():
    # steps 5-8 mean 0.29: -0.01 against se sqrt(2.667e-4/4 + 0.0024/4) = 0.0258, 0.4 se
    noisy = [0.30, 0.32, 0.28, 0.30, 0.29, 0.35, 0.23, 0.29]
    assert fired(stream(reward__clip__mean=UP, reward__shapes_exact__mean=noisy)) == []
    flat = [0.50, 0.52, 0.48, 0.50] * 2  # the trained reward does not rise: a falling judge alone is no hacking
    assert fired(stream(reward__clip__mean=flat, reward__shapes_exact__mean=DOWN)) == []
    # a monitored reward equal to judge/correct on every row is said once, not twice
    rows = stream(reward__clip__mean=UP, reward__shapes_exact__mean=DOWN, judge__correct=DOWN)
    assert fired(rows) == [(8, "hacking_onset:clip>shapes_exact")]


def test_hacking_onset_sees_a_slide_too_slow_for_neighbouring_windows():
    # three windows, each [m, m + 0.02, m - 0.02, m] (variance 2.667e-4, se between two windows 0.01155):
    # clip 0.50 -> 0.52 -> 0.54, the judge's relation 0.30 -> 0.28 -> 0.26. Neighbouring windows differ by
    # 0.02 = 1.7 se, within the noise; at step 12 the last window against the first differs by 0.04 = 3.5 se
    # on both sides: a slide. (The windows ending at 9 to 11 straddle two levels: 1.5 se or less.)
    shape = lambda *means: [m + d for m in means for d in (0.0, 0.02, -0.02, 0.0)]  # noqa: E731
    rows = stream(reward__clip__mean=shape(0.50, 0.52, 0.54), judge__relation=shape(0.30, 0.28, 0.26))
    assert fired(rows, monitored=()) == [(12, "hacking_onset:clip>judge/relation")]
    (alert,) = replay(rows, AlertWatcher(OPTS, ["clip"], []))
    assert alert.evidence["steps"] == [1, 12] and alert.evidence["watched_change"] == pytest.approx(-0.04)


def test_ratio_drift_fires_once_per_onset_and_again_after_a_quiet_window():
    # steps 1-4 average 0.96: -0.04 from 1 with se sqrt((4 * 0.01^2 / 3) / 4) = 0.00577 (6.9 se) and beyond the
    # 0.01 tolerance: fires at step 4. Windows ending at 5, 6, 7 are within 3 se (2.7, 1.6) or the tolerance,
    # step 8's is exactly 1: the alert re-arms at step 8 (4 steps after step 4, the last that held). Steps 13-16
    # drift again; windows ending at 13, 14, 15 are at 1.0, 1.6 and 2.8 se; step 16's fires again.
    ratio = [0.95, 0.97, 0.95, 0.97] + [1.0] * 8 + [0.95, 0.97, 0.95, 0.97]
    assert fired(stream(loss__ratio_mean=ratio)) == [(4, "ratio_drift:mean"), (16, "ratio_drift:mean")]
    # it holds at every step from 4 to 12 and is said once
    assert fired(stream(loss__ratio_mean=[0.95, 0.97] * 6)) == [(4, "ratio_drift:mean")]


def test_ratio_drift_does_not_fire_within_noise_or_within_the_tolerance():
    assert fired(stream(loss__ratio_mean=[1.004, 0.996] * 4)) == []  # mean exactly 1
    assert fired(stream(loss__ratio_mean=[0.995, 0.996] * 4)) == []  # -0.0045: 7.8 se, under the 0.01 tolerance


def test_ratio_drift_fires_when_a_clip_fraction_rises():
    # 0.015 -> 0.065: +0.05 > clip_rise 0.02, se sqrt(2 * (4 * 0.005^2 / 3) / 4) = 0.00408, 12 se
    assert fired(stream(loss__clip_frac_high=[0.01, 0.02, 0.01, 0.02, 0.06, 0.07, 0.06, 0.07])) == [
        (8, "ratio_drift:clip_frac_high")]
    # +0.01: 0.01 / 0.00408 = 2.4 se, within its noise, and under clip_rise either way
    assert fired(stream(loss__clip_frac_low=[0.02, 0.03, 0.02, 0.03, 0.03, 0.04, 0.03, 0.04])) == []


def test_variance_collapse_fires_when_the_within_group_std_falls_under_a_fifth_of_its_start():
    # the first window's mean is 0.1, the limit 0.02; windows ending at 8 (0.05), 9 (0.04) and 10 (0.0275)
    # are above it, the one ending at 11 (0.05 + 3 * 0.005) / 4 = 0.01625 is under: fires at step 11
    std = [0.1] * 4 + [0.05] * 4 + [0.005] * 4
    assert fired(stream(reward__clip__group_std=std)) == [(11, "variance_collapse:clip")]
    # a monitored reward's collapse is not this alert's (a judge that is always right is no problem)
    assert fired(stream(reward__shapes_exact__group_std=std)) == []
    # the std over the whole step also counts the spread between prompts: it does not stand in
    assert fired(stream(reward__clip__std=std)) == []


def test_flat_reward_fires_when_most_groups_have_no_spread():
    # the window's mean fraction of zero-spread groups: (0.25 + 0.5 + 0.75 + 0.75) / 4 = 0.5625 >= 0.5
    assert fired(stream(adv__frac_zero_std=[0.25, 0.5, 0.75, 0.75])) == [(4, "flat_reward:zero_spread")]
    assert fired(stream(adv__frac_zero_std=[0.25, 0.5, 0.5, 0.25])) == []  # 0.375


def test_flat_reward_fires_when_the_trained_reward_does_not_move_while_its_groups_spread():
    # +0.01 between the windows: 0.87 se, and under flat_change 0.1 x the within-group std 0.2 = 0.02
    rows = stream(reward__clip__mean=[0.50, 0.52, 0.48, 0.50, 0.51, 0.49, 0.53, 0.51], reward__clip__group_std=[0.2] * 8,
                  adv__frac_zero_std=[0.0] * 8)
    assert fired(rows) == [(8, "flat_reward:trend")]
    # +0.03: 2.6 se (within noise) but 0.03 >= 0.02, so it moves
    rows = stream(reward__clip__mean=[0.50, 0.52, 0.48, 0.50, 0.53, 0.51, 0.55, 0.53], reward__clip__group_std=[0.2] * 8,
                  adv__frac_zero_std=[0.0] * 8)
    assert fired(rows) == []
    # the same +0.01 with a within-group std of 0.05 (limit 0.005) is a move
    rows = stream(reward__clip__mean=[0.50, 0.52, 0.48, 0.50, 0.51, 0.49, 0.53, 0.51], reward__clip__group_std=[0.05] * 8)
    assert fired(rows) == []


def test_disabled_alerts_never_fire():
    rows = stream(loss__ratio_mean=[0.95, 0.97] * 6)
    assert fired(rows, opts=AlertConfig(window=4, enabled=False)) == []


def test_a_resumed_run_writes_the_alerts_an_uninterrupted_run_writes(tmp_path):
    """RunAlerts rebuilds its watcher from the metrics rows up to the resumed step, and drops alerts.jsonl's
    lines past it (a run that died after writing them): its file equals the straight run's."""
    ratio = [0.95, 0.97, 0.95, 0.97] + [1.0] * 8 + [0.95, 0.97, 0.95, 0.97]
    rows = stream(loss__ratio_mean=ratio)
    watcher = lambda: AlertWatcher(OPTS, ["clip"], [])  # noqa: E731
    said = []
    straight = RunAlerts(tmp_path / "a", 0, watcher(), [], [])
    for row in rows:
        straight.observe(row, said.append)
    straight.close()
    assert len(said) == 2 and said[0].startswith("ALERT step 4 ratio_drift: loss/ratio_mean averaged 0.9600")
    # the second run died after step 16's alert was written, with its checkpoint at step 6
    interrupted = RunAlerts(tmp_path / "b", 0, watcher(), [], [])
    for row in rows:
        interrupted.observe(row, lambda _: None)
    interrupted.close()
    resumed = RunAlerts(tmp_path / "b", 6, watcher(), rows, [])
    assert [a["step"] for a in load_alerts(tmp_path / "b")] == [4]
    for row in rows[6:]:
        resumed.observe(row, lambda _: None)
    resumed.close()
    assert (tmp_path / "b" / "alerts.jsonl").read_text() == (tmp_path / "a" / "alerts.jsonl").read_text()
    alerts = load_alerts(tmp_path / "a")
    assert [(a["step"], a["name"]) for a in alerts] == [(4, "ratio_drift"), (16, "ratio_drift")]
    assert alerts[0]["evidence"]["ratio_mean"] == 0.96 and "train.lr" in alerts[0]["advice"]


def test_stop_on_names_the_alert_that_stops(tmp_path):
    for stop_on, expected in ((["ratio_drift"], [None, None, None, 4, None, None]), (["hacking_onset"], [None] * 6)):
        run_alerts = RunAlerts(tmp_path / str(stop_on), 0, AlertWatcher(OPTS, ["clip"], []), [], stop_on)
        stops = [run_alerts.observe(row, lambda _: None) for row in stream(loss__ratio_mean=[0.95, 0.97] * 3)]
        assert [s and s.step for s in stops] == expected


def test_report_lines_list_each_alert():
    lines = report_lines([{"step": 8, "name": "hacking_onset", "message": "trained clip rose", "advice": "look"}])
    assert lines[0] == "## Alerts during training" and "- step 8, **hacking_onset**: trained clip rose. Try: look" in lines
    assert report_lines([]) == []


def test_alerts_command_replays_a_run_folder(tmp_path, capsys):
    from grpo_vision.cli import main
    from grpo_vision.config import save_config

    run = tmp_path / "run"
    run.mkdir()
    cfg = Config()
    cfg.reward.weights, cfg.reward.monitor = {"clip": 1.0}, ["shapes_exact"]
    save_config(cfg, run / "config.yaml")
    rows = stream(reward__clip__mean=UP, reward__shapes_exact__mean=DOWN)
    (run / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    main(["alerts", str(run)])  # the default window, 12 steps: 8 steps are too few
    assert capsys.readouterr().out == ""
    main(["alerts", str(run), "log.alerts.window=4"])
    out = [json.loads(ln) for ln in capsys.readouterr().out.splitlines()]
    assert [(a["step"], a["name"], a["evidence"]["watched"]) for a in out] == [(8, "hacking_onset", "shapes_exact")]
    assert out[0]["evidence"]["trained_change"] == pytest.approx(0.1) and out[0]["advice"]


def test_alerts_names_the_lines_it_skips_and_refuses_a_run_with_no_readable_row(tmp_path, capsys):
    """Before: one line that was not UTF-8 or nested 100,000 deep was a traceback; a metrics.jsonl with
    no readable line, a FIFO or a folder printed nothing and exited 0, the answer of a healthy run."""
    import os

    from grpo_vision.cli import main
    from grpo_vision.config import save_config
    from tests.helpers import within

    run = tmp_path / "run"
    run.mkdir()
    cfg = Config()
    cfg.reward.weights, cfg.reward.monitor = {"clip": 1.0}, ["shapes_exact"]
    save_config(cfg, run / "config.yaml")
    good = [json.dumps(r).encode() for r in stream(reward__clip__mean=UP, reward__shapes_exact__mean=DOWN)]
    bad = [b'{"step": 99, "note": "\xff"}', b"[" * 100_000 + b"]" * 100_000, b'{"note": "no step"}']
    metrics = run / "metrics.jsonl"
    metrics.write_bytes(b"\n".join(good[:3] + bad + good[3:]) + b'\n{"step": 9, "reward/clip/mean": ')  # cut short
    main(["alerts", str(run), "log.alerts.window=4"])
    out, err = capsys.readouterr()
    assert [(a["step"], a["name"]) for a in map(json.loads, out.splitlines())] == [(8, "hacking_onset")]  # as before
    assert err.splitlines() == [
        f"[alerts] skipped {metrics}, line 4: not UTF-8 text (byte 0xff)",
        f"[alerts] skipped {metrics}, line 5: lists and objects nested more than 100 levels deep; write flatter JSON",
        f"[alerts] skipped {metrics}, line 6: not a step's row (a JSON object with a whole-number 'step')",
        f"[alerts] skipped {metrics}, line 12: not valid JSON (Expecting value at column 33)",
        f"[alerts] read 8 step rows of {metrics} (4 lines skipped)"]
    cases = [(lambda: metrics.write_bytes(b"\n".join(bad) + b"\n"),
              f"no step's row to replay (skipped {metrics}, line 1: not UTF-8 text (byte 0xff), and 2 more lines "
              "skipped); alerts replays the steps a run has logged: give a run folder that train has written at least "
              "one step in"),
             (lambda: os.mkfifo(metrics), "is a FIFO (named pipe), not a file: a run's metrics.jsonl is the per-step "
                                          "log train writes; move this one away and run again"),
             (metrics.mkdir, "is a folder, not a file: a run's metrics.jsonl is the per-step log train writes")]
    for make, problem in cases:
        metrics.rmdir() if metrics.is_dir() else metrics.unlink()
        make()
        with within(20), pytest.raises(SystemExit) as exit_:
            main(["alerts", str(run)])
        out, err = capsys.readouterr()
        assert exit_.value.code == 2 and out == "" and err.startswith(f"grpo-vision: error: {metrics} ")
        assert problem in err and err.count("\n") == 1


def test_a_reward_that_rose_and_levelled_off_is_a_plateau_not_a_flat_reward():
    # windows of 4: 0.30 (steps 1-4), 0.50 (5-8), 0.51 (9-12). At step 12 the last two windows differ by
    # +0.01 (flat), but the last is +0.21 over the first, 18 se (se sqrt(2 * 0.000267 / 4) = 0.0116): the
    # reward rose and levelled off, which is what a run that learnt looks like. Before step 12 every pair of
    # windows still differs by far more than the flat limit 0.1 x 0.2 = 0.02.
    means = [0.30, 0.32, 0.28, 0.30, 0.50, 0.52, 0.48, 0.50, 0.51, 0.49, 0.53, 0.51]
    rows = stream(reward__clip__mean=means, reward__clip__group_std=[0.2] * 12, adv__frac_zero_std=[0.0] * 12)
    assert fired(rows) == []


def test_a_reward_that_rose_by_the_flat_limit_and_paused_is_not_flat():
    # a noisy first window (0.40 / 0.60, mean 0.50, variance 0.0133), then 0.53 and 0.535: the last two
    # windows differ by +0.005, flat; against the first, +0.035 is within its noise (se 0.058, 0.6 se) but
    # above flat_change x group_std = 0.1 x 0.2 = 0.02: the reward has moved since the start, it paused
    means = [0.40, 0.60, 0.40, 0.60, 0.53, 0.55, 0.51, 0.53, 0.54, 0.56, 0.52, 0.52]
    rows = stream(reward__clip__mean=means, reward__clip__group_std=[0.2] * 12, adv__frac_zero_std=[0.0] * 12)
    assert fired(rows) == []
