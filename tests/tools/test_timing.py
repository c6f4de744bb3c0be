"""The benches' clock (tools/timing.py): medians after an untimed warm-up, interleaved rounds, significant
digits. Seconds come from a clock the test advances, so the figures are exact."""

from types import SimpleNamespace

from grpo_vision.tools import timing


def test_rates_keep_their_significant_digits():
    assert timing.sig(2 / 1020) == 0.00196 and timing.sig(1234.5678) == 1230.0 and timing.sig(0.5) == 0.5


def test_the_median_leaves_the_warm_up_out_and_rounds_interleave(monkeypatch):
    now = [0.0]
    monkeypatch.setattr(timing, "time", SimpleNamespace(perf_counter=lambda: now[0]))
    costs = iter([10.0, 3.0, 1.0, 2.0])  # the warm-up (a compile, say), then three timed calls

    def call():
        now[0] += next(costs)

    assert timing.median_seconds(call, 3, first=True) == (2.0, 10.0)  # median of 3, 1, 2; the warm-up's own
    order = []

    def run(name, cost):
        def fn():
            order.append(name)
            now[0] += cost
        return fn

    times = timing.interleaved({"a": run("a", 1.0), "b": run("b", 2.0)}, 2)
    assert times == {"a": [1.0, 1.0], "b": [2.0, 2.0]}
    assert order == ["a", "b"] * 3  # an untimed call of each, then two rounds calling each once
    order.clear()
    assert timing.interleaved({"a": run("a", 1.0), "b": run("b", 2.0)}, 1, warm=False) == {"a": [1.0], "b": [2.0]}
    assert order == ["a", "b"]  # the caller made the untimed calls (bench_sampler: a failing path is a line)
