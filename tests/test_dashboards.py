"""The Grafana dashboards of dashboards/ against a real Prometheus scraping a coordinator.

A coordinator with metrics on (each engine's histograms too: the engine dashboard
has a panel over them), two fake engine processes and a client load; a
Prometheus server (Debian's ``prometheus``) scraping it every second on
loopback, its storage in tmp_path. Then every panel's query of every dashboard
goes through Prometheus's HTTP API, its template variables given real values:
each must parse and return data. So a panel over a name the collector does
not export, or a label it does not have, fails here.
"""

from __future__ import annotations

import contextlib
import json
import re
import shutil
import socket
import subprocess
import time
import urllib.error
import urllib.parse
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from coordkit.metrics import scrape
from tests.support.load import client_load
from tests.support.processes import ROOT, engine_processes

DASHBOARDS = sorted((ROOT / "dashboards").glob("*.json"))

SCRAPE_INTERVAL = "1s"
#: What Grafana puts for $__rate_interval: at least four scrape intervals.
RATE_INTERVAL = "5s"
DEADLINE = 40.0  # seconds for every query to have returned data


def panel_queries(dashboard: dict[str, Any]) -> Iterator[tuple[str, str]]:
    """(panel title, PromQL expression) of every target of every panel."""
    for panel in dashboard["panels"]:
        for target in panel.get("targets", []):
            yield panel["title"], target["expr"]


def test_panels_use_the_names_a_scrape_gives_and_the_docs_list(make_coordinator):
    # the latency histograms measured, each engine's too
    coord = make_coordinator(metrics_port=0, engine_histograms=True)
    try:
        exported = set(re.findall(r"^# TYPE (\w+)", scrape(coord), re.M))
    finally:
        coord.stop()
    table = (ROOT / "docs" / "deploying.md").read_text()
    documented = set(re.findall(r"^\| `(coordkit_\w+)`", table, re.M))
    assert {path.stem for path in DASHBOARDS} == {"fleet", "engine", "latency"}
    for path in DASHBOARDS:
        queries = list(panel_queries(json.loads(path.read_text())))
        assert queries, path
        for title, expr in queries:
            for name in re.findall(r"\bcoordkit_\w+", expr):
                family = re.sub(r"_(bucket|sum|count)$", "", name) if "seconds" in name else name
                assert family in exported, f"{path.name}: {title}: {name} is not exported"
                assert family in documented, f"{path.name}: {title}: {name} is not in the docs"


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def get(url: str) -> dict[str, Any]:
    with urllib.request.urlopen(url, timeout=5) as answer:
        return json.load(answer)


@contextlib.contextmanager
def prometheus(target: str, directory: Path) -> Iterator[str]:
    """A Prometheus server scraping ``target`` (host:port), its HTTP API's URL once ready."""
    config = directory / "prometheus.yml"
    config.write_text(
        f"global:\n  scrape_interval: {SCRAPE_INTERVAL}\n  evaluation_interval: {SCRAPE_INTERVAL}\n"
        "scrape_configs:\n  - job_name: coordkit\n"
        f"    static_configs:\n      - targets: ['{target}']\n"
    )
    address = f"127.0.0.1:{free_port()}"
    command = [
        "prometheus",
        f"--config.file={config}",
        f"--storage.tsdb.path={directory / 'data'}",
        f"--web.listen-address={address}",
        "--log.level=warn",
    ]
    log = (directory / "prometheus.log").open("w")
    server = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT)
    url = f"http://{address}"
    try:
        deadline = time.monotonic() + 20
        while True:
            assert server.poll() is None, (directory / "prometheus.log").read_text()
            with contextlib.suppress(OSError):
                urllib.request.urlopen(f"{url}/-/ready", timeout=1).close()
                break
            assert time.monotonic() < deadline, "prometheus not ready within 20 s"
            time.sleep(0.2)
        yield url
    finally:
        server.terminate()
        server.wait(10)
        log.close()


def substitute(expr: str, values: dict[str, str]) -> str:
    for name, value in values.items():
        expr = expr.replace(f"${name}", value)
    assert "$" not in expr, f"a template variable without a value: {expr}"
    return expr


def query(url: str, expr: str) -> list[Any]:
    """The result of an instant query; a query Prometheus refuses fails the test."""
    try:
        answer = get(f"{url}/api/v1/query?" + urllib.parse.urlencode({"query": expr}))
    except urllib.error.HTTPError as exc:  # 400: it does not parse
        pytest.fail(f"{expr}: {exc.read().decode()}")
    assert answer["status"] == "success", (expr, answer)
    return answer["data"]["result"]


def label_values(url: str, definition: str, values: dict[str, str]) -> list[str]:
    """What Grafana lists for a ``label_values(SELECTOR, LABEL)`` template variable."""
    match = re.fullmatch(r"label_values\((.+), (\w+)\)", substitute(definition, values))
    assert match, definition
    selector, label = match.groups()
    answer = get(
        f"{url}/api/v1/label/{label}/values?" + urllib.parse.urlencode({"match[]": selector})
    )
    assert answer["status"] == "success", answer
    return answer["data"]


def test_every_panel_query_returns_data(make_cluster, tmp_path, impl):
    if shutil.which("prometheus") is None:
        pytest.skip("no prometheus binary (apt-get install prometheus): dashboards not queried")
    with make_cluster(
        transport="tcp", policy="prefix", metrics_port=0, engine_histograms=True
    ) as c:
        target = f"127.0.0.1:{c.coord.metrics_port}"
        # capacity 1 each, under four clients' requests: some wait (the queue's panels)
        engines = engine_processes(
            c.coord.address, 2, "--quiet", "--latency", "0.005", "--batch", "1"
        )
        with engines, client_load(c.coord.address, engines=2) as load:
            with prometheus(target, tmp_path) as url:
                values = {"instance": target, "__rate_interval": RATE_INTERVAL}
                pending = {
                    (path.name, title, expr)
                    for path in DASHBOARDS
                    for title, expr in panel_queries(json.loads(path.read_text()))
                }
                deadline = time.monotonic() + DEADLINE
                while pending and time.monotonic() < deadline:
                    for dashboard in DASHBOARDS:
                        for variable in json.loads(dashboard.read_text())["templating"]["list"]:
                            if variable["type"] == "query":
                                found = label_values(url, variable["definition"], values)
                                if found:
                                    values[variable["name"]] = sorted(found)[0]
                    for key in sorted(pending):
                        if "$engine" in key[2] and "engine" not in values:
                            continue
                        if query(url, substitute(key[2], values)):
                            pending.discard(key)
                    time.sleep(0.5)
            assert not load.failures, load.failures
            assert load.completed > 0
    assert values["engine"] == "engine-0"
    assert not pending, "\n".join(
        f"{d}: {title}: no data from {expr}" for d, title, expr in pending
    )
