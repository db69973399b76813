"""Smoke test of ``coordkit bench --quick`` (and of its ``--client``,
``--end-to-end`` and ``--scale`` modes): it runs, and reports every point; and
what the bench's load is made of (its prompts, the ids its generators read).

Timings and ratios are never asserted (docs/design.md: benchmarks, not tests);
only that every variant and prompt length produced positive figures.
"""

from __future__ import annotations

import argparse
import importlib.metadata
import json
import multiprocessing
import os
import re
import subprocess
import sys
import threading
from pathlib import Path

import pytest
import zmq

import coordkit
from coordkit._shared import COPY_BELOW
from coordkit.protocol import packb, unpackb
from coordkit.tools import bench
from coordkit.tools.bench.load import engine_child, megatron_reply, read_rid, submitter
from coordkit.tools.bench.workload import (
    EDGE_MARGIN,
    MEGATRON_BODIES,
    MEGATRON_LENGTHS,
    POOLED_FROM,
    SAMPLING,
    SUBMIT_FIELDS,
    THRESHOLDS,
    Prompt,
    parse_prompt,
    reply_body,
)
from tests.support.implementations import REQUIRE_EXTENSION
from tests.support.processes import ROOT


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
    prompts = bench.standard_prompts(single_frame=False)
    assert list(summary) == [p.key for p in prompts]  # in the order of their bytes
    for prompt in prompts:
        point = summary[prompt.key]
        assert sorted(point) == sorted(variants), prompt
        for variant, figures in point.items():
            for key in ("total_us", "requests_per_s"):
                assert figures[key] > 0, (prompt, variant, key)
            assert figures["user_us"] >= 0 and figures["sys_us"] >= 0
            assert (figures["tokens"], figures["ids"]) == (prompt.tokens, prompt.ids)
            # mono speaks single frames: its frame holds the whole request
            assert figures["frame_bytes"] >= figures["prompt_bytes"] == prompt.packed_bytes()
    runs = result["runs"]
    assert len(runs) == len(variants) * len(prompts)
    memory = {m["variant"]: m for m in result["memory"]}
    for variant in {"c", "py"} & set(variants):
        assert memory[variant]["inflight"] > 0
        assert memory[variant]["rss_with"] > memory[variant]["rss_before"] > 0


def test_quick_run_in_megatron_mains_layout(tmp_path):
    """--dialect megatron-core --megatron-version main: main's five-field SUBMITs, c and
    py serving main's engines, mono decoding all five."""
    variants = _variants()
    path = tmp_path / "main.json"
    argv = ["--quick", "--dialect", "megatron-core", "--megatron-version", "main"]
    argv += ["--lengths", "16", "2000", "--inflight", "0", "--variants", *variants]
    assert bench.main([*argv, "--json", str(path)]) == 0

    result = json.loads(path.read_text())
    assert not result["failures"]
    assert result["config"]["megatron_version"] == "main"
    for key in ("16", "2000"):
        for variant, figures in result["summary"][key].items():
            assert figures["total_us"] > 0, (key, variant)
            # the whole five-field SUBMIT: 0.19's frame and the nil multi_modal_data
            assert figures["frame_bytes"] == Prompt(int(key)).frame_bytes(True) + 1


def test_quick_run_of_the_megatron_workload(tmp_path):
    """--workload megatron: replies at once, small (~200 B) and realistic (~1.5 KB)
    bodies, and per request the coordinator's system calls (perf, where it may) and
    context switches beside its CPU."""
    path = tmp_path / "megatron.json"
    lengths = ["16/small", "2000:range/realistic", "2000/small", "2000/realistic"]
    argv = ["--quick", "--workload", "megatron", "--inflight", "0", "--json", str(path)]
    assert bench.main([*argv, "--lengths", *lengths]) == 0

    result = json.loads(path.read_text())
    assert not result["failures"]
    config = result["config"]
    assert config["workload"] == "megatron" and config["reply_at_once"]
    assert 150 <= config["reply_body_bytes"] == config["reply_bodies_bytes"]["small"] <= 250
    assert 1200 <= config["reply_bodies_bytes"]["realistic"] <= 1600
    assert sorted(result["summary"]) == sorted(lengths)
    for key, point in result["summary"].items():
        assert {figures["body"] for figures in point.values()} == {key.partition("/")[2]}
        assert sorted(point) == ["c", "floor"], key
        for variant, figures in point.items():
            assert figures["total_us"] > 0 and figures["switches_per_request"] >= 0
            syscalls = figures["syscalls_per_request"]
            assert syscalls is None or syscalls > 0, (key, variant)
        assert point["c"]["reply_batch"] >= 1  # the engine's replies, grouped as they came


def test_quick_run_with_kv_events_flowing(tmp_path, capsys):
    """c-kv-events beside c: the engine's events reach the coordinator (a BlockStored per
    request, each of its full blocks new; evictions once its LRU is full), the CPU of the
    thread decoding them and of the loop's thread are counted apart, and both rows are in
    the table."""
    if "c-kv-events" not in _variants():
        pytest.skip("c-kv-events runs on the C core")
    path = tmp_path / "kv.json"
    argv = ["--quick", "--lengths", "16", "2000", "--inflight", "0"]
    argv += ["--variants", "floor", "c", "c-kv-events", "--json", str(path)]
    assert bench.main(argv) == 0

    result = json.loads(path.read_text())
    assert not result["failures"]
    for key in ("16", "2000"):
        point = result["summary"][key]
        assert sorted(point) == ["c", "c-kv-events", "floor"], key
        kv = point["c-kv-events"]
        assert kv["total_us"] > 0 and point["c"]["total_us"] > 0
        assert "kv_records_per_request" not in point["c"]
        # one BlockStored per request, and a BlockRemoved for most once the LRU is full;
        # a batch per reply of 8 (short ones at the end of a load)
        assert 1 <= kv["kv_records_per_request"] <= 3, key
        assert 1 / 8 <= kv["kv_batches_per_request"] <= 1 / 4, key
        assert 0 < kv["kv_thread_us_per_request"] < kv["total_us"]
        # the loop's own thread, apart from the events' and libzmq's
        for variant in ("c", "c-kv-events"):
            assert 0 < point[variant]["main_us"] < point[variant]["total_us"], variant
        assert kv["main_us"] + kv["kv_thread_us_per_request"] < kv["total_us"]
    table = capsys.readouterr().out
    for key in ("16", "2000"):
        # tokens, ids, bytes, body, then the variant
        rows = {line.split()[4] for line in table.splitlines() if line.split()[:1] == [key]}
        assert {"c", "c-kv-events"} <= rows, table


def test_quick_run_of_the_pd_cost(tmp_path):
    """--pd: the same client load through a prefill and a decode FakeEngine (both hops
    per request) and through two engines without a role, side by side."""
    path = tmp_path / "pd.json"
    assert bench.main(["--pd", "--quick", "--lengths", "16", "--json", str(path)]) == 0

    result = json.loads(path.read_text())
    assert not result["failures"]
    (row,) = result["pd"]["summary"]
    assert row["tokens"] == 16
    assert row["aggregated_total_us"] > 0 and row["pd_total_us"] > 0
    assert row["pd_per_aggregated"] > 0


def test_megatron_version_needs_the_dialect(capsys):
    with pytest.raises(SystemExit):
        bench.main(["--quick", "--megatron-version", "main"])
    assert "--megatron-version main needs --dialect megatron-core" in capsys.readouterr().err


@pytest.mark.parametrize(("version", "fields"), [("0.19", 4), ("main", 5)])
def test_the_load_speaks_each_releases_submit(version, fields):
    assert SUBMIT_FIELDS[version] == fields
    prompt = Prompt(300)
    (frame,) = submitter(True, prompt, False, fields)(1234)
    expected = [20, 1234, prompt.token_ids(), SAMPLING] + [None] * (fields - 4)
    assert unpackb(frame) == expected  # main's text request: multi_modal_data nil
    assert len(frame) == prompt.frame_bytes(True, fields) + 2  # a 3-byte rid, not 1
    assert read_rid(frame) == 1234


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


def test_the_standard_prompts_cross_every_threshold_of_the_loop():
    for single_frame, fields in ((False, 4), (True, 4), (True, 5)):
        prompts = bench.standard_prompts(single_frame, fields)
        sizes = [p.frame_bytes(single_frame, fields) for p in prompts]
        assert sizes == sorted(sizes)
        for threshold in THRESHOLDS.values():
            margin = EDGE_MARGIN  # just below and just above: within twice the margin
            below = [s for s in sizes if threshold - 2 * margin <= s <= threshold - margin]
            above = [s for s in sizes if threshold + margin <= s <= threshold + 2 * margin]
            assert below and above, (single_frame, fields, threshold, sizes)
    # small ids pack smaller: 2000 of them sit below the copy threshold, random ones above
    assert Prompt(2000, "range").packed_bytes() < COPY_BELOW < Prompt(2000).packed_bytes()
    assert Prompt(2000, "range").token_ids() == list(range(2000))
    assert Prompt(16).token_ids() == Prompt(2000).token_ids()[:16]  # prefixes of one sequence


def test_the_megatron_workload_crosses_every_threshold_with_both_ids_and_bodies():
    """Its default table: at each of MEGATRON_LENGTHS random and small ids, the prompts
    just either side of each threshold, each point with both bodies."""
    for fields in set(SUBMIT_FIELDS.values()):
        prompts = bench.megatron_prompts(True, fields)
        sizes = [p.frame_bytes(True, fields) for p in prompts]
        assert sizes == sorted(sizes)
        for threshold in THRESHOLDS.values():
            assert any(threshold - 2 * EDGE_MARGIN <= s <= threshold - EDGE_MARGIN for s in sizes)
            assert any(threshold + EDGE_MARGIN <= s <= threshold + 2 * EDGE_MARGIN for s in sizes)
        shapes = {(p.tokens, p.ids) for p in prompts}
        assert {(n, ids) for n in MEGATRON_LENGTHS for ids in ("random", "range")} <= shapes
        for tokens, ids in shapes:
            bodies = {p.body for p in prompts if (p.tokens, p.ids) == (tokens, ids)}
            assert bodies == set(MEGATRON_BODIES), (tokens, ids)
    assert parse_prompt("2000:range/realistic") == Prompt(2000, "range", "realistic")
    assert parse_prompt("16/small").key == "16/small"
    with pytest.raises(argparse.ArgumentTypeError, match="expected TOKENS"):
        parse_prompt("16/huge")


def test_the_bench_engine_answers_with_the_body_it_is_told(tmp_path):
    """The body of a point reaches the client: the engine switches between two points."""
    ours, theirs = multiprocessing.Pipe()
    address = f"ipc://{tmp_path}/engine"
    held = multiprocessing.Value("q", 0, lock=False)
    args = (theirs, "direct", False, address, 1, False, None, held, "megatron")
    engine = threading.Thread(target=engine_child, args=args, daemon=True)
    engine.start()
    context = zmq.Context()
    try:
        assert ours.recv()[0] == "ready"
        client = context.socket(zmq.DEALER)
        client.connect(address)
        submit = submitter(False, Prompt(16), False)
        for rid, body in enumerate(["", "realistic", "small"]):
            if body:
                ours.send(("body", reply_body("megatron", body)))
                assert ours.recv() == ("body",)
            client.send_multipart(submit(rid))
            assert client.poll(10_000)
            metadata, reply = client.recv_multipart()
            assert read_rid(metadata) == rid
            assert reply == reply_body("megatron", body), body
    finally:
        ours.send(("stop",))
        engine.join(10)
        context.destroy(linger=0)
    assert not engine.is_alive()


def test_the_pool_threshold_is_the_loops():
    header = (Path(coordkit.__file__).parent / "includes" / "framepool.h").read_text()
    shift = int(re.search(r"#define CK_BUFFER_MIN_SHIFT (\d+)", header).group(1))
    assert "size < ((size_t)1 << CK_BUFFER_MIN_SHIFT) / 2" in header  # pooled from half of it
    assert POOLED_FROM == (1 << shift) // 2


@pytest.mark.parametrize("rid", [0, 1, 127, 128, 255, 256, 65535, 65536, 2**32 - 1, 2**32, 2**63])
def test_the_load_generators_read_request_ids_as_msgpack_does(rid):
    for frame in (packb([20, rid, {"a": 1}]), packb([21, rid]), packb([21, rid, {}])):
        assert read_rid(frame) == read_rid(memoryview(frame)) == rid
    negative = -min(rid, 2**63 - 1) - 1  # not as the peers write them: the general reader
    assert read_rid(packb([20, negative, {}])) == negative


@pytest.mark.parametrize("n", [1, 15, 16, 17, 300])
def test_the_engines_single_frame_replies_are_megatrons(n):
    body = reply_body()
    reply = unpackb(megatron_reply(list(range(1000, 1000 + n)), body))
    assert reply == [21, [{"request_id": 1000 + i, **unpackb(body)} for i in range(n)]]
    assert list(reply[1][0])[0] == "request_id"


def test_a_quick_scale_run_reports_every_point(tmp_path):
    variants = [v for v in _variants() if v in ("floor", "c", "py")]
    path = tmp_path / "scale.json"
    argv = ["--scale", "--variants", *variants, "--scale-engines", "2", "16", "--scale-clients"]
    argv += ["1", "8", "--scale-inflight", "256", "--requests", "1000", "--repeat", "1"]
    argv += ["--scale-policies", "power_of_two"]  # the client axis: --policy, least_loaded
    assert bench.main([*argv, "--json", str(path)]) == 0

    result = json.loads(path.read_text())
    assert not result["failures"]
    rows = {(r["axis"], r["count"], r["variant"]): r for r in result["scale"]["summary"]}
    coordinators = [v for v in variants if v != "floor"]
    expected = {("engines", n, "floor") for n in (2, 16)}
    expected |= {("clients", n, "floor") for n in (1, 8)}
    for variant in coordinators:
        expected |= {("engines", n, f"{variant} power_of_two") for n in (2, 16)}
        expected |= {("clients", n, f"{variant} least_loaded") for n in (1, 8)}
    assert set(rows) == expected
    for (axis, count, variant), row in rows.items():
        assert row["total_us"] > 0 and row["requests_per_s"] > 0, (axis, count, variant)
        assert row["to_first"] > 0 and row["first_count"] == (2 if axis == "engines" else 1)
        assert row["to_floor"] > 0
        # libzmq's I/O threads' CPU apart
        assert 0 < row["io_us"] < row["total_us"]
        assert row["loop_us"] == pytest.approx(row["total_us"] - row["io_us"], rel=0.05)
        assert row["loop_to_first"] > 0
        # every rank answers in full batches (short ones only at the end of a load); the floor
        # echoes each request
        assert row["reply_batch"] == 1.0 if variant == "floor" else row["reply_batch"] > 4


@pytest.mark.slow
@pytest.mark.timeout(900)
def declared(extra: str | None) -> list[str]:
    """The requirements coordkit's metadata declares for ``extra`` (None: the runtime's),
    an extra it names of its own (``coordkit[ha]``) replaced by that extra's: an index
    has no coordkit to resolve it from."""
    requirements = []
    for requirement in importlib.metadata.requires("coordkit") or []:
        name, _, marker = (part.strip() for part in requirement.partition(";"))
        if marker != ("" if extra is None else f'extra == "{extra}"'):
            continue
        own = re.fullmatch(r"coordkit\[(.+)\]", name)
        requirements += (
            [r for named in own.group(1).split(",") for r in declared(named)] if own else [name]
        )
    return requirements


def test_quick_run_with_the_bench_extra_alone(tmp_path):
    """``coordkit bench --quick`` in a fresh virtualenv holding the runtime dependencies
    and the ``bench`` extra's, nothing else: the variant that needs the ``metrics``
    extra is skipped with one line saying why, the rest run. This checkout is imported
    as it is (PYTHONPATH): its in-place build stands for what ``pip install`` builds."""
    requirements = declared(None) + declared("bench")  # the runtime's, the bench extra's
    assert any(r.startswith("matplotlib") for r in requirements), requirements
    venv = tmp_path / "venv"
    subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True, timeout=300)
    python = str(venv / "bin" / "python")
    install = [python, "-m", "pip", "install", "-q", "--disable-pip-version-check"]
    subprocess.run([*install, *requirements], check=True, timeout=600)
    env = {key: value for key, value in os.environ.items() if key != "VIRTUAL_ENV"}
    env["PYTHONPATH"] = str(ROOT)
    probe = [python, "-c", "import prometheus_client"]
    assert subprocess.run(probe, env=env, capture_output=True).returncode == 1  # not there

    path = tmp_path / "cost.json"
    result = subprocess.run(
        # one point and no memory test: what is asked is which variants run
        [python, "-m", "coordkit", "bench", "--quick", "--lengths", "16", "--inflight", "0"]
        + ["--json", str(path)],
        env=env,
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert result.returncode == 0, result.stderr
    assert "Traceback" not in result.stderr
    skipped = "coordkit bench: skipping c-metrics: it needs prometheus_client "
    skipped += "(pip install 'coordkit[metrics]')\n"
    assert result.stderr.count(skipped) == 1
    summary = json.loads(path.read_text())["summary"]
    for point in summary.values():
        assert "c-metrics" not in point and {"floor", "py"} <= set(point)
