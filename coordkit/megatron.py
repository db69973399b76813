"""Megatron-Core's data-parallel coordinator (0.19's and main's), served by coordkit.

Megatron-Core sends every coordinator message as one msgpack frame (see
docs/megatron.md). :func:`entrypoint` has the signature of
``DataParallelInferenceCoordinator.entrypoint`` at ``core_v0.19.0`` and on main
(d98e8a6, megatron-core 0.20: the same arguments) and does what it does, with a
:class:`coordkit.Coordinator` speaking that dialect (``dialect="megatron-core"``)
in place of Megatron's own loop. One assignment, made in the process that starts
the engines and before they start listening, swaps it in::

    from megatron.core.inference.data_parallel_inference_coordinator import (
        DataParallelInferenceCoordinator,
    )
    import coordkit.megatron

    DataParallelInferenceCoordinator.entrypoint = coordkit.megatron.entrypoint

The engine's ``start_listening_to_data_parallel_coordinator`` then spawns
coordkit where it spawned its own coordinator; the function is pickled by
name, so the spawned process imports ``coordkit.megatron`` itself. It can
also be passed as the target of any process that expects 0.19's entrypoint
(``multiprocessing.Process(target=coordkit.megatron.entrypoint, kwargs=...)``).

Which release it serves (``megatron_version``, coordkit's one keyword of its own):
the engines that spawn it are the Megatron installed where it runs, so by default
it asks that installation: main's ``megatron.core.inference.headers`` has
ABORT_REQUEST, 0.19's has not. Where ``megatron.core`` is not importable it
serves 0.19's layouts, which every engine parses. It logs which one it serves,
and why. ``functools.partial(entrypoint, megatron_version="main")`` names it.

What each argument becomes:

* ``pipe_connection``, ``ready_event``, ``data_parallel_size``,
  ``inference_coordinator_port``, ``hostname``: as in 0.19. The coordinator
  binds ``tcp://{hostname or socket.gethostname()}:{port}`` (another port,
  with a warning, when that one is taken or none is given), sends the bound
  address through the pipe and closes it, waits until ``data_parallel_size``
  engines have registered, sets ``ready_event``, and serves until a client
  sends SHUTDOWN (or the process gets SIGINT). Engines that register later
  are taken too, as in 0.19.
* ``tokenizer``: a detokenizer ``tokens -> tokenizer.detokenize(tokens)``
  (the coordinator's ``detokenizer`` option), or none when it is None.
  0.19 also strips end-of-document tokens unless the request's sampling
  params say ``detokenize_stop_sequence``; coordkit's detokenizer sees only
  the tokens.
* ``enable_prefix_caching`` with ``block_size_tokens``: the ``prefix``
  policy over blocks of ``block_size_tokens`` (the coordinator hashes a
  token-id prompt itself; a str prompt is routed by load, where 0.19
  tokenizes it). Without either, or with the ``LOAD_BALANCED`` coordinator
  policy, ``least_loaded``, 0.19's load-balanced routing.
* ``prefix_caching_coordinator_policy``: ``LOAD_BALANCED`` as above; the
  prefix policies (``FIRST_PREFIX_BLOCK``, the default, and the longest-prefix
  one) both become coordkit's ``prefix`` policy, which scores the depth of
  the cached prefix. An enum member, its name or its value.
* ``prefix_caching_routing_alpha`` (α): 0.19 scores
  ``α·match + (1 − α)·free capacity``; coordkit's ``prefix_prefill_weight``
  weighs a block to prefill against a block of queued work, so the ratio of
  affinity to load is carried over: ``prefix_prefill_weight = 32·α / (1 − α)``
  (coordkit's default of 32 for 0.19's default of 0.5; the router's maximum
  when α ≥ 1); α ≤ 0 routes by load alone.
* ``max_requests``: accepted, and not a cap. 0.19's coordinator never refuses
  a request (it uses ``max_requests`` only to normalize the load term of its
  prefix score; an engine queues what it cannot schedule), and a request a
  cap refused would be dropped without a word, since a Megatron client cannot
  parse coordkit's ERROR: its future would never resolve.
* ``deterministic_mode``: accepted and ignored; coordkit's routing is
  deterministic already, in the order the engines registered.
* ``schedule_output_path``: accepted and ignored (logged): coordkit keeps no
  schedule records; ``Coordinator.stats()`` counts what it routed.
"""

from __future__ import annotations

import errno
import importlib
import socket
import threading
import time
from typing import Any, Protocol

import zmq

from ._policies import DEFAULT_PREFILL_WEIGHT, MAX_PREFILL_WEIGHT
from ._shared import logger
from .coordinator import Coordinator

__all__ = ["entrypoint", "installed_version"]


#: Tokens per block when 0.19 passes no block_size_tokens.
DEFAULT_BLOCK_SIZE = 16

#: Seconds between looks at the engines registered, before ready_event is set.
_POLL = 0.01


class _Pipe(Protocol):
    def send(self, obj: Any) -> None: ...
    def close(self) -> None: ...


class _Event(Protocol):
    def set(self) -> None: ...


def entrypoint(
    pipe_connection: _Pipe,
    ready_event: _Event,
    data_parallel_size: int,
    tokenizer: Any,
    max_requests: Any,
    inference_coordinator_port: int | None = None,
    deterministic_mode: bool = False,
    block_size_tokens: int | None = None,
    enable_prefix_caching: bool = False,
    prefix_caching_coordinator_policy: Any = "first_prefix_block",
    prefix_caching_routing_alpha: float = 0.5,
    schedule_output_path: str | None = None,
    hostname: str | None = None,
    *,
    megatron_version: str | None = None,
) -> None:
    """Run a coordkit coordinator as Megatron-Core's coordinator process.

    The signature of ``DataParallelInferenceCoordinator.entrypoint`` at
    ``core_v0.19.0`` and on main, and ``megatron_version`` ("0.19" or "main"; by
    default the installed Megatron's); the module docstring says what each
    argument becomes. Swap it in with
    ``DataParallelInferenceCoordinator.entrypoint = coordkit.megatron.entrypoint``.
    Returns once a client sent SHUTDOWN, or on SIGINT.
    """
    del max_requests, deterministic_mode  # see the module docstring
    if megatron_version is None:
        megatron_version, why = installed_version()
    else:
        why = "as asked"
    if schedule_output_path:
        logger.warning("coordkit: no schedule is recorded, %s is not written", schedule_output_path)
    policy, prefill_weight = _routing(
        enable_prefix_caching,
        block_size_tokens,
        prefix_caching_coordinator_policy,
        prefix_caching_routing_alpha,
    )
    coord = _bind(
        hostname or socket.gethostname(),
        inference_coordinator_port,
        dialect="megatron-core",
        megatron_version=megatron_version,
        block_size=block_size_tokens or DEFAULT_BLOCK_SIZE,
        policy=policy,
        prefix_prefill_weight=prefill_weight,
        detokenizer=_detokenizer(tokenizer),
    )
    pipe_connection.send(coord.address)
    pipe_connection.close()
    logger.info(
        "coordkit: serving Megatron-Core %s engines (%s); waiting for %d at %s",
        megatron_version,
        why,
        data_parallel_size,
        coord.address,
    )
    served = threading.Event()
    watcher = threading.Thread(
        target=_set_when_registered,
        args=(coord, data_parallel_size, ready_event, served),
        name="coordkit-ready",
        daemon=True,
    )
    watcher.start()
    try:
        coord.serve_forever()
    except KeyboardInterrupt:
        logger.info("coordkit: coordinator interrupted, exiting")
    finally:
        served.set()
    watcher.join()
    logger.info("coordkit: coordinator shut down")


def installed_version() -> tuple[str, str]:
    """The Megatron-Core release whose layouts this process's Megatron speaks, and why:
    "main" when its headers have ABORT_REQUEST (main adds it with the five-field
    SUBMIT, partial replies and the KV handoff), else "0.19"."""
    try:
        headers = importlib.import_module("megatron.core.inference.headers")
    except ImportError:
        return "0.19", "megatron.core is not importable here"
    if hasattr(headers.Headers, "ABORT_REQUEST"):
        return "main", "the installed megatron.core has ABORT_REQUEST"
    return "0.19", "the installed megatron.core has no ABORT_REQUEST"


def _bind(host: str, port: int | None, **options: Any) -> Coordinator:
    """A coordinator on ``tcp://host:port``, or on another port when none is given
    or that one cannot be bound, whatever the reason: 0.19's rule (a bad option is
    not a bind's failure: it raises)."""
    if port is not None:
        try:
            return Coordinator(f"tcp://{host}:{port}", **options)
        except zmq.ZMQError as exc:
            taken = exc.errno == errno.EADDRINUSE
            reason = "is already in use" if taken else f"could not be bound ({exc!r})"
            logger.warning("coordkit: port %s %s, binding to another one", port, reason)
    return Coordinator(f"tcp://{host}:0", **options)


def _routing(
    prefix_caching: bool, block_size: int | None, policy: Any, alpha: float
) -> tuple[str, float]:
    """The coordkit policy and prefix_prefill_weight for 0.19's routing arguments."""
    names = {str(getattr(policy, attr, policy)).lower() for attr in ("name", "value")}
    if not prefix_caching or block_size is None or "load_balanced" in names or alpha <= 0:
        return "least_loaded", DEFAULT_PREFILL_WEIGHT
    if alpha >= 1:
        return "prefix", MAX_PREFILL_WEIGHT
    return "prefix", min(DEFAULT_PREFILL_WEIGHT * alpha / (1 - alpha), MAX_PREFILL_WEIGHT)


def _detokenizer(tokenizer: Any) -> Any:
    if tokenizer is None:
        return None

    def detokenize(tokens: list[int]) -> str:
        return str(tokenizer.detokenize(tokens))

    return detokenize


def _set_when_registered(
    coord: Coordinator, engines: int, ready_event: _Event, served: threading.Event
) -> None:
    """Set ``ready_event`` once ``engines`` engines have registered (at once for 0),
    unless the coordinator stopped first."""
    while not served.is_set():
        try:
            registered = len(coord.stats()["engines"])
        except Exception:  # the coordinator closed between the check and the read
            return
        if registered >= engines:
            ready_event.set()
            return
        time.sleep(_POLL)
