"""Smoke test of ``coordkit bench --quick`` (and of its ``--client`` and
``--end-to-end`` modes): it runs, and reports every point.

Timings and ratios are never asserted (docs/design.md: benchmarks, not tests);
only that every variant and prompt length produced positive figures.
"""

from __future__ import annotations

import json

import coordkit
from coordkit.tools import bench
from tests.support.implementations import REQUIRE_EXTENSION


def _variants() -> list[str]:
    try:
        coordkit.load_implementation("c")
    except ImportError:
        if REQUIRE_EXTENSION:
            raise
        # as the [c] tests are skipped
        return [v for v in bench.VARIANTS if bench.IMPLEMENTATIONS.get(v) != "c"]
    return list(bench.VARIANTS)


def test_quick_run_reports_every_point(tmp_path):
    variants = _variants()
    path = tmp_path / "cost.json"
    assert bench.main(["--quick", "--variants", *variants, "--json", str(path)]) == 0

    result = json.loads(path.read_text())
    assert not result["failures"]
    assert result["environment"]["libzmq"]
    summary = result["summary"]
    assert sorted(summary, key=int) == [str(t) for t in bench.LENGTHS]
    for tokens, point in summary.items():
        assert sorted(point) == sorted(variants), tokens
        for variant, figures in point.items():
            for key in ("total_us", "requests_per_s"):
                assert figures[key] > 0, (tokens, variant, key)
            assert figures["user_us"] >= 0 and figures["sys_us"] >= 0
    runs = result["runs"]
    assert len(runs) == len(variants) * len(bench.LENGTHS)
    memory = {m["variant"]: m for m in result["memory"]}
    for variant in {"c", "py"} & set(variants):
        assert memory[variant]["inflight"] > 0
        assert memory[variant]["rss_with"] > memory[variant]["rss_before"] > 0


def test_quick_endpoint_runs_report_every_point(tmp_path):
    path = tmp_path / "endpoints.json"
    assert bench.main(["--quick", "--client", "--end-to-end", "--json", str(path)]) == 0

    result = json.loads(path.read_text())
    assert not result["failures"]
    assert "runs" not in result  # the coordinator table is not measured in these modes
    clients = result["client"]["summary"]
    for peer in bench.endpoints.PEERS:
        for variant in bench.endpoints.CLIENT_VARIANTS:
            for tokens in (16, 2000):
                figures = clients[f"{peer}/{variant}/{tokens}"]
                assert figures["client_us"] > 0 and figures["requests_per_s"] > 0
                # the main thread is part of the process (libzmq's I/O thread the rest)
                assert 0 < figures["client_main_us"] <= 1.1 * figures["client_us"]  # clocks differ
                # the stand-in grants batches to coordkit's client; plain never asks
                if peer == "echo" or variant == "plain":
                    assert figures["batch"] is (variant != "plain")
    end_to_end = result["end_to_end"]["summary"]
    for variant in bench.endpoints.END_TO_END_VARIANTS:
        for tokens in (16, 2000):
            figures = end_to_end[f"{variant}/{tokens}"]
            for key in ("requests_per_s", "client_us", "coordinator_us", "engines_us"):
                assert figures[key] > 0, (variant, tokens, key)
            assert len(figures["engine_us"]) == 2
