"""``coordkit bench --latency``: its search and statistics on given figures, and a
smoke run through real processes at a tiny size.

The run's latencies and rates are never asserted (docs/design.md: benchmarks,
not tests); only that every point is there, its figures sane.
"""

from __future__ import annotations

import argparse
import json
import math
from array import array

import pytest

from coordkit.tools import bench
from coordkit.tools.bench import latency
from tests.test_bench_smoke import _variants


def _system(capacity: float, measured: list[int]):
    """The figures of a queue that serves ``capacity`` requests/s: 1 ms p99 below it;
    at it and above, fewer replies per second and a 100 ms p99."""

    def measure(k: int) -> dict[str, float | bool]:
        measured.append(k)
        rate = latency.rate_at(k)
        over = rate >= capacity
        return {
            "offered": rate,
            "scheduled_rate": rate,
            "send_rate": rate,
            "achieved": 0.9 * capacity if over else rate,
            "p50_us": 50_000.0 if over else 500.0,
            "p99_us": 100_000.0 if over else 1000.0,
            "generator_kept_up": True,
        }

    return measure


def _args(**options: float) -> argparse.Namespace:
    return argparse.Namespace(
        **{"min_rate": 1000.0, "max_rate": 200_000.0, "sweep_from": 0.1, **options}
    )


@pytest.mark.parametrize("capacity", [1500.0, 23_000.0, 150_000.0])
def test_sweep_finds_the_saturation_and_sweeps_from_a_tenth_of_it(capacity):
    measured: list[int] = []
    points = latency.sweep(_system(capacity, measured), _args())

    found = latency.summarize(points)
    # a rate measured twice when it chokes (to confirm it), once else
    for k in points:
        assert measured.count(k) == (2 if latency.rate_at(k) >= capacity else 1), k
    saturation = max(k for k in points if latency.rate_at(k) < capacity)
    assert found["saturation"] == latency.rate_at(saturation)
    assert found["chokes_at"] == latency.rate_at(saturation + 1)  # to one grid step
    assert found["reason"] == "achieved" and not found["generator_limited"]
    assert found["low_load_p99_us"] == 1000.0
    assert saturation + 2 in points  # past it
    start = max(k for k in points if latency.rate_at(k) <= 0.1 * found["saturation"])
    assert latency.rate_at(start + 1) > 0.1 * found["saturation"]  # from a tenth
    assert set(range(start, saturation, 2)) <= set(points)  # every other step


def test_sweep_below_the_first_rate_and_up_to_the_last():
    # chokes at --min-rate already: the search goes down
    points = latency.sweep(_system(600.0, []), _args())
    assert latency.summarize(points)["saturation"] < 600.0
    # never chokes: the search stops at --max-rate
    points = latency.sweep(_system(math.inf, []), _args(max_rate=8000.0))
    found = latency.summarize(points)
    assert found["chokes_at"] is None and found["saturation"] == 8000.0


def test_a_choke_the_second_measurement_does_not_confirm_is_noise():
    measured: list[int] = []
    system = _system(10_000.0, measured)
    stalled = latency.grid_at(4000.0)

    def measure(k: int) -> dict[str, float | bool]:
        point = system(k)
        if k == stalled and measured.count(k) == 1:  # a stall of the machine, once
            point.update(p99_us=50_000.0, p50_us=900.0)
        return point

    points = latency.sweep(measure, _args())
    assert points[stalled]["p99_us"] == 1000.0
    assert points[stalled]["discarded"]["p99_us"] == 50_000.0
    assert latency.summarize(points)["saturation"] == max(
        latency.rate_at(k) for k in points if latency.rate_at(k) < 10_000.0
    )


def test_a_choke_below_rates_that_kept_up_is_not_the_saturation():
    measured: list[int] = []
    system = _system(10_000.0, measured)
    stalled = latency.grid_at(2000.0)

    def measure(k: int) -> dict[str, float | bool]:
        point = system(k)
        if k == stalled:  # a stall of the machine, both times it was measured
            point.update(p99_us=50_000.0, p50_us=900.0)
        return point

    points = latency.sweep(measure, _args())
    points.setdefault(stalled, measure(stalled))
    found = latency.summarize(points)
    assert found["saturation"] == max(
        latency.rate_at(k) for k in points if latency.rate_at(k) < 10_000.0
    )
    assert found["isolated_chokes"] == [latency.rate_at(stalled)]


def test_a_choke_of_the_senders_is_theirs():
    def measure(k: int) -> dict[str, float | bool]:
        point = _system(10_000.0, [])(k)
        point["generator_kept_up"] = latency.rate_at(k) < 10_000.0
        return point

    found = latency.summarize(latency.sweep(measure, _args()))
    assert found["generator_limited"]


def test_p99_above_ten_times_the_low_load_one_is_a_choke():
    low = {"offered": 1.0, "scheduled_rate": 1.0, "achieved": 1.0, "p99_us": 100.0}
    assert not latency.choked(low, 100.0)
    assert latency.choked({**low, "p99_us": 1001.0}, 100.0)
    assert latency.choked({**low, "achieved": 0.94}, 100.0)


def test_statistics_of_the_recorded_times():
    # 1000 requests over 1 s: each sent 100 µs late, answered 2 ms after its send
    schedule = array("d", [i / 1000 for i in range(1000)])
    sent = array("d", [t + 0.0001 for t in schedule])
    received = array("d", [t + 0.002 for t in sent])
    point = latency._statistics([[schedule, sent, received]], 1000.0, 1.0)

    assert point["requests"] == 900  # the first tenth left out
    assert point["p50_us"] == point["p99_us"] == pytest.approx(2000.0)
    assert point["lag_p99_us"] == pytest.approx(100.0)
    assert point["late_1ms"] == 0.0
    assert point["scheduled_rate"] == pytest.approx(1000.0)
    assert point["send_rate"] == pytest.approx(1000.0)
    assert point["achieved"] == pytest.approx(898 / 0.9)  # the last two replies come after it
    assert point["generator_kept_up"] and point["on_schedule"]
    # the same schedule sent at half its pace: the senders fell behind
    late = array("d", [t * 2 for t in schedule])
    point = latency._statistics(
        [[schedule, late, array("d", [t + 0.002 for t in late])]], 1000.0, 1.0
    )
    assert not point["generator_kept_up"] and point["lag_max_us"] > 400_000
    assert not point["on_schedule"]


def test_a_tiny_latency_run_reports_every_point(tmp_path):
    variants = [v for v in _variants() if v in ("floor", "c", "py")]
    path, plot = tmp_path / "latency.json", tmp_path / "choke.png"
    argv = ["--latency", "--variants", *variants, "--lengths", "16", "--latency-seconds", "0.1"]
    argv += ["--min-rate", "4000", "--max-rate", "4000", "--sweep-from", "0.7"]
    assert bench.main([*argv, "--json", str(path), "--plot", str(plot)]) == 0

    result = json.loads(path.read_text())
    assert not result["failures"]
    assert plot.stat().st_size > 0
    points = result["latency"]["points"]
    assert {p["variant"] for p in points} == {"direct", *variants}
    for p in points:
        assert p["offered"] > 0 and p["requests"] > 0
        # the realised Poisson arrivals are near the rate; nothing answered or sent beyond them
        assert 0.7 * p["offered"] < p["scheduled_rate"] < 1.3 * p["offered"]
        assert 0 < p["achieved"] <= 1.1 * p["scheduled_rate"]
        assert 0 < p["send_rate"] <= 1.1 * p["scheduled_rate"]
        assert 0 < p["p50_us"] <= p["p99_us"] <= p["p999_us"] <= p["max_us"]
        assert 0 <= p["lag_p50_us"] <= p["lag_p99_us"] <= p["lag_max_us"]
        assert p["sender_cpu_us"] > 0 and p["senders"] == 1
        if p["variant"] != "direct":  # minus direct's at the same rate
            same = [d for d in points if d["variant"] == "direct" and d["offered"] == p["offered"]]
            assert len(same) == 1
            assert p["added_p99_us"] == pytest.approx(p["p99_us"] - same[0]["p99_us"])
            assert isinstance(p["direct_choked"], bool) and isinstance(p["direct_kept_up"], bool)
            assert p["coordinator_cpu_us"] > 0 and p["coordinator_switches"] >= 0
        else:
            assert "coordinator_cpu_us" not in p
    summary = result["latency"]["summary"]
    assert sorted(summary) == sorted(f"{v}/16" for v in variants)
    for row in summary.values():
        assert row["low_load_p99_us"] > 0
        assert row["saturation"] is None or row["saturation"] > 0
