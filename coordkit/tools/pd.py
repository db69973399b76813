"""The disaggregated prefill/decode runs of ``coordkit demo --pd`` and ``coordkit
replay --pd``: the same load on three clusters, side by side (docs/pd.md).

* **aggregated**: every engine runs whole requests;
* **P/D**: ``--prefill-engines`` of them prefill, the rest decode, and every request
  takes both hops (the coordinator's ``pd_mode="always"``);
* **conditional P/D**: the same engines, and a request whose prompt, less what the
  decode engine that would run it caches, is at most ``--pd-threshold`` tokens runs
  whole there (``pd_mode="conditional"``).

The engines are ``coordkit fake-engine --role`` processes; the coordinator's options
are :func:`coordinator_options`'s, refused in one line by a coordinator that does not
run P/D.
"""

from __future__ import annotations

import inspect
from dataclasses import dataclass
from typing import Any

from .. import Coordinator
from .._pd import DEFAULT_PD_THRESHOLD

__all__ = ["PDRun", "pd_runs", "coordinator_options", "DEFAULT_PD_THRESHOLD"]


@dataclass(frozen=True)
class PDRun:
    """One cluster of a P/D comparison."""

    label: str  # its column's name
    roles: tuple[str | None, ...]  # each rank's --role (None: aggregated)
    mode: str | None  # the coordinator's pd_mode (None: no P/D)
    threshold: int  # its pd_threshold, in conditional P/D

    @property
    def prefill_engines(self) -> int:
        return self.roles.count("prefill")


def pd_runs(engines: int, prefill_engines: int | None, threshold: int) -> list[PDRun]:
    """The three runs for ``engines`` engines, ``prefill_engines`` of which prefill in
    the P/D runs (half of them, rounded down, when None). ValueError when either role
    would have no engine."""
    prefills = engines // 2 if prefill_engines is None else prefill_engines
    if not 1 <= prefills < engines:
        raise ValueError(
            f"--pd needs a prefill engine and a decode engine: {prefills} of {engines} "
            "engines prefill (see --engines, --prefill-engines)"
        )
    if threshold < 0:
        raise ValueError(f"--pd-threshold must be at least 0, not {threshold}")
    roles = ("prefill",) * prefills + ("decode",) * (engines - prefills)
    split = f"{prefills}+{engines - prefills}"
    return [
        PDRun("aggregated", (None,) * engines, None, threshold),
        PDRun(f"P/D {split}", roles, "always", threshold),
        PDRun(f"conditional P/D {split}", roles, "conditional", threshold),
    ]


def coordinator_options(run: PDRun) -> dict[str, Any]:
    """The Coordinator's keyword arguments for ``run``; ValueError (one line) when this
    coordinator does not run P/D."""
    if run.mode is None:
        return {}
    if "pd_mode" not in inspect.signature(Coordinator).parameters:
        raise ValueError(
            "this coordinator does not run disaggregated prefill/decode yet "
            "(its P/D room is not wired in: docs/pd.md)"
        )
    return {"pd_mode": run.mode, "pd_threshold": run.threshold}
