"""``coordkit bench --pd``: the coordinator's CPU per disaggregated request, against the
same requests run whole.

The same coordinator (``c``) and the same client load as the cost table, served by
two :class:`~coordkit.tools.fake_engine.FakeEngine` ranks in one engine process,
free of model time: ``aggregated``, two engines without a role, each request
dispatched once; ``pd``, a prefill and a decode engine with ``pd_mode="always"``,
each request taking both hops (the prefill's handoff intercepted, the decode
chosen, the import, the release to the prefill). Issue #29's bound is two
dispatches: ``pd`` at most twice ``aggregated``, which the cost table puts at the
floor. With ``--dialect megatron-core --megatron-version pr6675`` both modes are served
by Megatron-LM PR #6675's engines as the coordinator sees them (pd6675.py): its
single-frame hops, a record decoded per handoff, one id per KV_READ_DONE and
RELEASE_KV; aggregated, engines without a role.
"""

from __future__ import annotations

import argparse
import functools
import statistics
from typing import Any

from .session import Session, run_interleaved

#: Each mode's engine roles and coordinator options.
MODES: dict[str, tuple[tuple[str | None, ...], dict[str, Any]]] = {
    "aggregated": ((None, None), {}),
    "pd": (("prefill", "decode"), {"pd_mode": "always"}),
}


#: A #6675 fleet's (``--megatron-version pr6675``): no option set, its engines' roles
#: alone give every request both hops.
MODES_6675: dict[str, tuple[tuple[str | None, ...], dict[str, Any]]] = {
    "aggregated": ((None, None), {}),
    "pd": (("prefill", "decode"), {}),
}


ENGINES = {False: "FakeEngine", True: "PR #6675 engine"}


def measure_pd(
    args: argparse.Namespace,
    directory: str,
    runs: list[dict[str, Any]],
    failures: dict[str, str],
) -> None:
    """Each mode's session, interleaved within each repetition."""
    modes = MODES_6675 if args.megatron_version == "pr6675" else MODES
    starts = {
        mode: functools.partial(Session, "c", args, directory, options, roles=roles)
        for mode, (roles, options) in modes.items()
    }
    run_interleaved(args, starts, runs, failures, "mode", prefix="pd ")


def summarize(runs: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Per prompt length: each mode's medians, and pd against aggregated."""
    rows = []
    for tokens in sorted({r["tokens"] for r in runs}):
        row: dict[str, Any] = {"tokens": tokens}
        for mode in MODES:
            group = [r for r in runs if r["tokens"] == tokens and r["mode"] == mode]
            if group:
                for key in ("total_us", "user_us", "sys_us", "requests_per_s"):
                    row[f"{mode}_{key}"] = statistics.median(r[key] for r in group)
        if "pd_total_us" in row and "aggregated_total_us" in row:
            row["pd_per_aggregated"] = row["pd_total_us"] / row["aggregated_total_us"]
        rows.append(row)
    return rows


def print_pd(args: argparse.Namespace, rows: list[dict[str, Any]]) -> None:
    if not rows:
        return
    print(
        f"\ncoordinator CPU per request, aggregated and disaggregated, median of "
        f"{args.repeat} ({args.transport}, c, two {ENGINES[args.megatron_version == 'pr6675']} "
        f"ranks free of model time, "
        f"window {args.window})"
    )
    print(f"{'tokens':>6}  {'aggregated µs':>13} {'user':>7}  {'pd µs':>8} {'user':>7}  pd/agg")
    for row in rows:
        ratio = row.get("pd_per_aggregated")
        print(
            f"{row['tokens']:>6}  {row.get('aggregated_total_us', 0):13.2f} "
            f"{row.get('aggregated_user_us', 0):7.2f}  {row.get('pd_total_us', 0):8.2f} "
            f"{row.get('pd_user_us', 0):7.2f}  {'-' if ratio is None else f'{ratio:.2f}'}"
        )
