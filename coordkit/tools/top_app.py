"""``coordkit top``'s reading and screen (the ``top`` extra: textual, prometheus_client):
:class:`Source` reads the snapshots, :mod:`coordkit.tools.top` computes what is
shown from them, :class:`Top` lays it out and refreshes it."""

from __future__ import annotations

import argparse
import asyncio
import time
import urllib.error
import urllib.request

from prometheus_client.parser import text_string_to_metric_families
from rich.table import Table
from textual.app import App, ComposeResult
from textual.widgets import DataTable, Footer, Static

from ..client import Client
from .top import (
    CLIENT_COLUMNS,
    ENGINE_COLUMNS,
    LATENCY_HISTOGRAMS,
    Buckets,
    History,
    Snapshot,
    client_rows,
    engine_rows,
    figures,
    measured_latency,
)

__all__ = ["Source", "Top", "run"]


def run(args: argparse.Namespace) -> int:
    """``coordkit top``: the view until ``q``. A bad address or metrics URL, nothing
    answering: raised before the screen starts, one line (:mod:`coordkit.tools.options`)."""

    async def main() -> int:
        async with await Client.connect(args.address, timeout=args.timeout) as client:
            source = Source(client, args.metrics, args.timeout)
            history = History(args.window)
            history.add(await source.snapshot())
            app = Top(args.address, source, history, args.interval)
            await app.run_async()
            return app.return_code or 0

    return asyncio.run(main())


def read_latency(url: str, timeout: float) -> dict[str, Buckets]:
    """The histograms of LATENCY_HISTOGRAMS from a Prometheus text endpoint."""
    try:
        with urllib.request.urlopen(url, timeout=timeout) as answer:
            text = answer.read().decode()
    except urllib.error.URLError as exc:  # refused, no such host, HTTP 404
        raise ConnectionError(f"cannot read metrics at {url}: {exc.reason}") from None
    by_family = {family.name: family for family in text_string_to_metric_families(text)}
    latency = {}
    for name, (family_name, _) in LATENCY_HISTOGRAMS.items():
        family = by_family.get(family_name)
        if family is None:
            raise ValueError(f"{url} has no {family_name}: is it a coordinator's --metrics-port?")
        buckets = [
            (float(sample.labels["le"]), sample.value)
            for sample in family.samples
            if sample.name.endswith("_bucket")
        ]
        latency[name] = sorted(buckets)
    return latency


class Source:
    """Where the snapshots come from: a connected client, and the metrics URL if any
    (else the histograms come with the stats, STATS with {"metrics": 1})."""

    def __init__(self, client: Client, metrics: str | None, timeout: float):
        self.client = client
        self.metrics = metrics
        self.timeout = timeout

    async def snapshot(self) -> Snapshot:
        if self.metrics is None:
            stats = await self.client.stats(timeout=self.timeout, metrics=True)
            latency = measured_latency(stats.pop("metrics"))
        else:
            stats = await self.client.stats(timeout=self.timeout)
            latency = await asyncio.to_thread(read_latency, self.metrics, self.timeout)
        return Snapshot(time.monotonic(), stats, latency)


class Top(App[int]):
    """The coordinator at ``address``: a title line, the fleet's figures, the engines,
    the clients with the most in flight."""

    TITLE = "coordkit top"
    BINDINGS = [("q", "quit", "Quit")]
    CSS = """
    #title { background: $primary; color: $text; padding: 0 1; }
    #figures { padding: 1 1 0 1; height: auto; }
    #status { color: $text-muted; padding: 0 1; }
    DataTable { height: 1fr; }
    """

    def __init__(self, address: str, source: Source, history: History, interval: float):
        super().__init__()
        self.address = address
        self.source = source
        self.history = history
        self.interval = interval
        self.problem: str | None = None  # the last refresh's failure, shown until one works

    def compose(self) -> ComposeResult:
        yield Static(id="title")
        yield Static(id="figures")
        yield Static(id="status")
        for table_id, columns in (("engines", ENGINE_COLUMNS), ("clients", CLIENT_COLUMNS)):
            table: DataTable[str] = DataTable(id=table_id, cursor_type="row", zebra_stripes=True)
            table.add_columns(*columns)
            yield table
        yield Footer()

    def on_mount(self) -> None:
        self.show()
        self.set_interval(self.interval, self.refresh_view)

    async def refresh_view(self) -> None:
        try:
            self.history.add(await self.source.snapshot())
            self.problem = None
        except (OSError, ValueError) as exc:  # lost, no answer in time, metrics unreadable
            self.problem = str(exc).removeprefix("coordkit: ")
        self.show()

    def show(self) -> None:
        stats = self.history.newest.stats
        self.query_one("#title", Static).update(
            f"coordkit {self.address}   implementation {stats['implementation']}   "
            f"policy {stats['policy']}   control {stats['control_state']}"
        )
        grid = Table.grid(padding=(0, 3))
        shown = figures(self.history)
        shown += [("", "")] * (len(shown) % 2)  # two columns of figures
        half = len(shown) // 2
        for (left, left_value), (right, right_value) in zip(
            shown[:half], shown[half:], strict=True
        ):
            grid.add_row(left, f"[b]{left_value}[/b]", right, f"[b]{right_value}[/b]")
        self.query_one("#figures", Static).update(grid)
        when = time.strftime("%H:%M:%S")
        window = f"rates over the last {self.history.seconds:.0f} s"
        if self.history.newest.latency is None:
            window += "; latency not measured (its --metrics-port)"
        status = f"{when}  {window}" if self.problem is None else f"{when}  {self.problem}"
        self.query_one("#status", Static).update(status)
        for table_id, rows in (
            ("engines", engine_rows(self.history)),
            ("clients", client_rows(stats)),
        ):
            table = self.query_one(f"#{table_id}", DataTable)
            cursor = table.cursor_row
            table.clear()
            table.add_rows(rows)
            if table.row_count:
                table.move_cursor(row=min(cursor, table.row_count - 1))
