"""Megatron-LM PR #6675 (head b0a1727) on the wire: its P/D engines and its client.

PR #6675 ("Disaggregated Inference: End2End") has its coordinator run both hops of
a request: a prefill engine computes the prompt's KV and pins it, the coordinator
intercepts that reply and hands the request (the same server id) to a decode
engine, which imports the KV and generates. These peers do what the PR's engines
and client do on the wire, each behaviour marked with the PR's file and line it
comes from (docs/pd.md and docs/megatron.md say what coordkit serves of it); the
layouts (single msgpack frames, as main's):

    REGISTER_ROLE      engine -> coord   m([27, role, transport, instance_meta])
    REGISTER_ROLE_ACK  coord -> engine   m([2])
    REQUEST_ERROR      coord -> engine   m([29, reason])            (a refusal)
    SUBMIT_REQUEST     coord -> engine   m([20, rid, prompt, sampling_params])
    ENGINE_REPLY       engine -> coord   m([21, [finished_request, ...]])
    ENGINE_REPLY_PARTIAL                 m([22, [{"request_id", "new_tokens"}, ...]])
    SUBMIT_REQUEST_WITH_KV coord -> dec  m([24, rid, prompt, sampling_params, kv_meta,
                                            src_block_ids])
    KV_TRANSFER_READY  decode -> coord   m([30, rid, cached_prefix_blocks])   (nccl)
    SEND_KV            coord -> prefill  m([26, rid, decode_instance_meta, cached_prefix_blocks])
    KV_READ_DONE       decode -> coord   m([28, rid])
    RELEASE_KV         coord -> prefill  m([25, rid])
    ABORT_REQUEST      coord -> engine   m([23, rid])
    REQUEST_ERROR      engine -> coord   m([29, rid, reason, source_safe])
    REQUEST_ABORTED    engine -> coord   m([31, rid, source_safe])
    DISCONNECT         engine -> coord   m([60])                    (graceful shutdown only)

and the client's (``InferenceClient``): CONNECT m([0]) / CONNECT_ACK m([1]);
SUBMIT m([20, crid, prompt, sampling_params]) (four elements: the PR's client has no
multimodal field); finals m([21, crid, reply]), partials m([22, crid, partial]),
errors m([29, crid, reason, source_safe]), aborts m([31, crid, source_safe]);
ABORT m([23, crid]); RELEASE_KV m([25, rid]).

``PDEngine`` is one engine (its MP-coordinator socket, identity
``{role}_s{index}_dp{dp}``) that registers as the PR's engine does and then acts as
its prefill or decode does, with deterministic tokens (:func:`token_at`) and no
GPU: KV "blocks" hold the prompt's token chunks, and the KV moves between peers
over a data plane of their own (ipc sockets named by the engine's first global
rank, the ``global_rank`` its transfer descriptors carry): a NIXL decode reads the
prefill's pinned blocks, an NCCL prefill pushes them on SEND_KV. A read of blocks
the prefill has already unpinned, or a push before the decode said
KV_TRANSFER_READY, is caught (``violations``) as the real transfer would corrupt or
hang. ``PDClient`` is the PR's ``InferenceClient`` on the wire, its receive loop's
parsing included. Both run on a thread or as a process (``python -m
tests.support.megatron_pd --help``); neither imports coordkit.
"""

from __future__ import annotations

import argparse
import base64
import contextlib
import hashlib
import itertools
import json
import math
import os
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections import deque
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import zmq

from .peers import WAIT, SingleFramePeer, m, um, wait_for

# -- #6675's headers.py, spelled out (these peers stand for the PR, not coordkit) ----

CONNECT = 0
CONNECT_ACK = 1
REGISTER_ROLE_ACK = 2  # new in #6675
SUBMIT = 20
REPLY = 21
PARTIAL = 22
ABORT = 23
SUBMIT_KV = 24
RELEASE_KV = 25
SEND_KV = 26
REGISTER_ROLE = 27  # new
KV_READ_DONE = 28  # new
REQUEST_ERROR = 29  # new
KV_TRANSFER_READY = 30  # new
REQUEST_ABORTED = 31  # new
PAUSE = 40
UNPAUSE = 41
SUSPEND = 42
RESUME = 43
SET_GENERATION_EPOCH = 44
STOP = 45
START_CUDA_PROFILER = 46
STOP_CUDA_PROFILER = 47
DISCONNECT = 60
SHUTDOWN = 61
TP_BROADCAST = 80
KV_HANDOFF_COMPLETE = 81

#: Every value #6675's ``Headers(value)`` decodes; any other raises UnknownHeaderError.
HEADERS_PD = frozenset({0, 1, 2, *range(20, 32), *range(40, 48), 60, 61, 80, 81})
CONTROL = frozenset(range(40, 48))

#: The PR engine's refusal of a prompt on a decode (dynamic_engine.py:2970-2978).
DECODE_REFUSES_PROMPT = "A disaggregated decode engine cannot accept prompt prefill requests"
#: What ``torch.tensor(prompt, dtype=torch.int64)`` raises on a str prompt, the
#: decode's first use of the prompt (inference_state_handoff.py:810).
STR_PROMPT_ERROR = "new(): invalid data type 'str'"


def sampling_params(**overrides: Any) -> dict[str, Any]:
    """``SamplingParams(**overrides).serialize()`` of #6675 (sampling_params.py): every
    field, its ``__post_init__`` applied."""
    params: dict[str, Any] = {
        "temperature": 1.0,
        "top_k": 0,
        "top_p": 0.0,
        "return_log_probs": False,
        "skip_prompt_log_probs": False,
        "return_segments": False,
        "num_tokens_to_generate": None,
        "num_tokens_total": None,
        "termination_id": None,
        "top_n_logprobs": 0,
        "return_prompt_top_n_logprobs": False,
        "add_BOS": False,
        "stop_words": None,
        "detokenize_stop_sequence": False,
        "return_prompt_tokens": False,
        "streaming": False,
        "streaming_interval": 1,
        "do_kv_handoff": False,
    }
    unknown = set(overrides) - set(params)
    assert not unknown, f"SamplingParams has no field {sorted(unknown)}"
    params.update(overrides)
    if params["top_n_logprobs"] > 0:
        params["return_prompt_top_n_logprobs"] = not params["skip_prompt_log_probs"]
    else:
        params["return_prompt_top_n_logprobs"] = False
    return params


# -- deterministic model ---------------------------------------------------------------


def tokenize(prompt: Any) -> list[int]:
    """The peers' tokenizer: a str prompt's UTF-8 bytes; token ids as they are."""
    if isinstance(prompt, str):
        return list(prompt.encode("utf-8"))
    return [int(token) for token in prompt]


def token_at(prompt_tokens: Sequence[int], index: int) -> int:
    """The ``index``-th token any of these engines generates for the prompt (the first,
    index 0, is sampled at the prefill), the same on a prefill, a decode or one engine."""
    return 1000 + (sum(prompt_tokens) * 31 + len(prompt_tokens) * 17 + index * 7) % 9000


def log_prob_at(index: int) -> float:
    return -round(0.01 * (index + 1), 4)


def expected_tokens(prompt: Any, count: int) -> list[int]:
    """What a request of ``count`` tokens (no termination id) generates, P/D or not."""
    tokens = tokenize(prompt)
    return [token_at(tokens, i) for i in range(count)]


def block_hashes(tokens: Sequence[int], block_size: int) -> list[int]:
    """Chained hashes of a prompt's full blocks (the decode's prefix cache keys)."""
    hashes, parent = [], 0
    for start in range(0, len(tokens) - block_size + 1, block_size):
        digest = hashlib.sha1(repr((parent, tuple(tokens[start : start + block_size]))).encode())
        parent = int.from_bytes(digest.digest()[:8], "big") >> 1
        hashes.append(parent)
    return hashes


def chunks(tokens: Sequence[int], block_size: int) -> list[list[int]]:
    """The prompt's blocks, a partial tail included: what its KV blocks hold here."""
    return [list(tokens[i : i + block_size]) for i in range(0, len(tokens), block_size)]


# -- transfer descriptors (the registration's instance metadata) -----------------------


SSM_DIMS = {"nheads": 8, "headdim": 16, "d_state": 16, "ngroups": 1, "d_conv": 4}


@dataclass
class Geometry:
    """An engine's model and parallel layout, as its transfer descriptors advertise it.
    The first five fields are the KV signature the coordinator compares."""

    tokens_per_block: int = 4
    element_size: int = 2
    head_dim: int = 128
    num_layers_global: int = 4
    num_kv_heads_global: int = 8
    tp: int = 1
    pp: int = 1
    hybrid: bool = False  # SSM state too (a Mamba hybrid)
    num_blocks: int = 512
    ssm_dims: dict[str, int] = field(default_factory=lambda: dict(SSM_DIMS))
    num_ssm_layers: int = 2


def agent_name(role: str, rank: int, identity: bytes) -> str:
    """``f"{role}-rank{rank}-{uuid4().hex}"`` (inference_state_handoff.py:278), its
    uuid made from the identity so that runs repeat."""
    return f"{role}-rank{rank}-{hashlib.md5(identity + bytes([rank % 256])).hexdigest()}"


def agent_blob(name: str) -> str:
    """A NIXL agent's metadata blob (``agent_metadata_b64``) for ``name``."""
    return base64.b64encode(f"nixl-agent-metadata:{name}".encode()).decode()


def kv_descriptor(
    geometry: Geometry, global_rank: int, tp_rank: int, pp_rank: int, transport: str, agent: str
) -> dict[str, Any]:
    """One rank's KV ``export_meta()``: export_geometry_meta's schema (transfer
    backends' base.py), NIXL's agent record added."""
    layers = geometry.num_layers_global // geometry.pp
    heads = geometry.num_kv_heads_global // geometry.tp
    bytes_per_slice = geometry.tokens_per_block * heads * geometry.head_dim * geometry.element_size
    meta: dict[str, Any] = {
        "base_addr": 0x7F0000000000 + global_rank * 0x100000000,
        "outer_stride_bytes": geometry.num_blocks * bytes_per_slice,
        "device_id": 0,
        "num_outer": 2 * layers,
        "bytes_per_slice": bytes_per_slice,
        "blocks_axis": 2,
        "num_blocks": geometry.num_blocks,
        "heads_per_partition": heads,
        "head_dim": geometry.head_dim,
        "tokens_per_block": geometry.tokens_per_block,
        "element_size": geometry.element_size,
        "global_rank": global_rank,
        "tp_size": geometry.tp,
        "tp_rank": tp_rank,
        "pp_size": geometry.pp,
        "pp_rank": pp_rank,
        "num_layers_global": geometry.num_layers_global,
        "num_kv_heads_global": geometry.num_kv_heads_global,
        "layer_start": pp_rank * layers,
        "layer_end": (pp_rank + 1) * layers,
    }
    if transport == "nixl":
        meta["agent_name"] = agent
        meta["agent_metadata_b64"] = agent_blob(agent)
    return meta


def ssm_descriptor(
    geometry: Geometry, global_rank: int, tp_rank: int, pp_rank: int, kind: str, transport: str,
    agent: str,
) -> dict[str, Any]:  # fmt: skip
    """One rank's SSM ``export_meta()`` for a state kind ("conv" or "recurrent")."""
    dims = geometry.ssm_dims
    width = dims["nheads"] // geometry.tp
    state_dim = dims["headdim"] * dims["d_state"] if kind == "recurrent" else dims["d_conv"]
    meta: dict[str, Any] = {
        "base_addr": 0x7E0000000000 + global_rank * 0x100000000 + (kind == "conv") * 0x1000000,
        "outer_stride_bytes": geometry.num_blocks * width * state_dim * geometry.element_size,
        "device_id": 0,
        "num_outer": geometry.num_ssm_layers // geometry.pp,
        "bytes_per_slice": width * state_dim * geometry.element_size,
        "blocks_axis": 1,
        "num_blocks": geometry.num_blocks,
        "heads_per_partition": width,
        "head_dim": state_dim,
        "tokens_per_block": 1,
        "element_size": geometry.element_size,
        "ssm_layout": {
            "global_rank": global_rank,
            "tp_size": geometry.tp,
            "tp_rank": tp_rank,
            "layer_start": pp_rank * (geometry.num_ssm_layers // geometry.pp),
            "num_layers": geometry.num_ssm_layers // geometry.pp,
            "dims": dict(dims),
        },
    }
    if transport == "nixl":
        meta["agent_name"] = f"{agent}-ssm-{kind}"
        meta["agent_metadata_b64"] = agent_blob(f"{agent}-ssm-{kind}")
    return meta


def strip_agent_blobs(value: Any) -> Any:
    """What a NIXL prefill does to its handoff's kv_meta: agent blobs left out, the
    coordinator having them from the registration (handoff_wire_protocol.py:13-27)."""
    if isinstance(value, dict):
        agent = "agent_name" in value
        return {
            k: strip_agent_blobs(v)
            for k, v in value.items()
            if not (agent and k == "agent_metadata_b64")
        }
    if isinstance(value, list):
        return [strip_agent_blobs(v) for v in value]
    return value


def global_ranks(value: Any) -> list[int]:
    """Every "global_rank" in a descriptor tree (an engine's data plane is its lowest)."""
    found: list[int] = []
    if isinstance(value, dict):
        for key, child in value.items():
            if key == "global_rank" and isinstance(child, int):
                found.append(child)
            else:
                found.extend(global_ranks(child))
    elif isinstance(value, list):
        for child in value:
            found.extend(global_ranks(child))
    return found


def agent_records(value: Any) -> list[dict[str, Any]]:
    """Every dict carrying an "agent_name" in a descriptor tree."""
    found: list[dict[str, Any]] = []
    if isinstance(value, dict):
        if "agent_name" in value:
            found.append(value)
        for child in value.values():
            found.extend(agent_records(child))
    elif isinstance(value, list):
        for child in value:
            found.extend(agent_records(child))
    return found


def default_kv_dir() -> str:
    """Where the peers' data-plane sockets live unless told (short: ipc paths are)."""
    return os.path.join(tempfile.gettempdir(), f"coordkit-pd-{os.getuid()}")


#: First global ranks for engines not given one: per process apart, as their data-plane
#: sockets are named by them (an engine thread and an engine process must not meet).
_next_rank = itertools.count(1000 + (os.getpid() % 50000) * 64)


# -- the engine ------------------------------------------------------------------------


@dataclass
class _Job:
    """A request on this engine: a prefill, an import, or one it generates."""

    rid: int
    prompt: Any
    tokens: list[int]
    params: dict[str, Any]
    state: str  # prefilling | deferred | reading | awaiting_push | imported | active
    due: float = 0.0
    generated: list[int] = field(default_factory=list)
    log_probs: list[float] = field(default_factory=list)
    target: int = 0
    emitted: int = 0
    cancel: bool = False
    # an import's
    kv_meta: Any = None
    src_blocks: list[int] = field(default_factory=list)
    cached: int = 0
    failure: str | None = None
    source_rank: int | None = None


class PDEngine:
    """A #6675 engine's MP-coordinator socket (a DEALER) and the engine behind it.

    ``role`` is "prefill" or "decode" as the PR's engines take (or anything else, to
    be refused; "both" serves either hop). ``transport`` is "nixl" (the decode reads)
    or "nccl" (the prefill pushes on SEND_KV). ``capacity`` is the request capacity
    it declares (``context.max_requests``; a hybrid's SSM slot capacity too).
    ``tensor_prompt_tokens``: its records' ``prompt_tokens`` in Megatron's tensor form.
    ``prefill_seconds`` / ``step_seconds`` pace its work; ``import_delay`` holds a
    NIXL read back; ``hold()`` stops all progress until ``proceed()``.

    Hooks: ``log`` (every message in and out, decoded), ``received()`` / ``sent()``,
    ``pins()`` (request id -> pinned block ids), ``releases`` (RELEASE_KVs as they
    came), ``pushes`` / ``reads``, ``violations`` (what the PR's engine would raise
    on, or a transfer the real one would corrupt or hang on), ``over_capacity``
    (a request arriving past the declared capacity), ``kill()`` (gone without a
    DISCONNECT), ``stop()`` (the engine's shutdown: DISCONNECT, then gone).
    """

    def __init__(
        self,
        address: str,
        role: str,
        *,
        transport: str = "nixl",
        index: int = 0,
        dp_rank: int = 0,
        rank: int | None = None,
        capacity: int = 4,
        geometry: Geometry | None = None,
        kv_dir: str | None = None,
        identity: bytes | None = None,
        prefill_seconds: float = 0.0,
        step_seconds: float = 0.0,
        import_delay: float = 0.0,
        read_timeout: float = 2.0,
        max_sequence_length: int = 256,
        instance_meta: list[Any] | None = None,
        tensor_prompt_tokens: bool = False,
        ctx: zmq.Context | None = None,
    ):
        self.role = role
        # a record's prompt_tokens as Megatron's serialize() writes a tensor,
        # ["tensor", [ids...]], rather than a plain list
        self.tensor_prompt_tokens = tensor_prompt_tokens
        self.transport = transport
        self.capacity = capacity
        self.geometry = geometry or Geometry()
        self.block_size = self.geometry.tokens_per_block
        self.rank0 = next(_next_rank) if rank is None else rank
        self.identity = identity or f"{role}_s{index}_dp{dp_rank}".encode()
        self.kv_dir = kv_dir or default_kv_dir()
        os.makedirs(self.kv_dir, exist_ok=True)
        self.prefill_seconds = prefill_seconds
        self.step_seconds = step_seconds
        self.import_delay = import_delay
        self.read_timeout = read_timeout
        self.max_sequence_length = max_sequence_length
        self.can_prefill = role in ("prefill", "both")
        self.can_decode = role in ("decode", "both")
        self.hybrid = self.geometry.hybrid
        self.agent = agent_name(role, self.rank0, self.identity)
        self._stage_kv, self._stage_ssm = self._static_metas()
        self.instance_meta = self._instance_meta() if instance_meta is None else instance_meta

        self._ctx = ctx or zmq.Context.instance()
        self.sock = self._ctx.socket(zmq.DEALER)
        self.sock.setsockopt(zmq.LINGER, 0)
        self.sock.setsockopt(zmq.IDENTITY, self.identity)
        self.sock.connect(address)
        self._kv = self._ctx.socket(zmq.ROUTER)
        self._kv.setsockopt(zmq.LINGER, 0)
        self._kv.bind(self.data_endpoint(self.rank0))
        self._dealers: dict[int, zmq.Socket] = {}

        self._lock = threading.RLock()
        self.log: list[tuple[float, str, Any]] = []
        self.violations: list[str] = []
        self.over_capacity: list[int] = []
        self.releases: list[int] = []
        self.pushes: list[tuple[int, list[int], int]] = []  # (rid, blocks, to rank)
        self.reads: list[tuple[int, list[int]]] = []  # reads served: (rid, blocks)
        self.registered = False
        self.refusal: str | None = None
        self._jobs: dict[int, _Job] = {}
        self._deferred: deque[int] = deque()
        self._pins: dict[int, list[int]] = {}
        self._pin_slots: dict[int, int] = {}
        self._blocks: dict[int, list[int]] = {}  # allocated block id -> its tokens
        self._free_blocks = list(range(1, self.geometry.num_blocks))  # block 0: the dummy
        self._free_slots = list(range(capacity))
        self._prefix_cache: set[int] = set()
        self._early_pushes: dict[int, list[Any]] = {}
        self._held = False
        self._dead = False
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    # -- registration ------------------------------------------------------------

    def data_endpoint(self, rank: int) -> str:
        return f"ipc://{self.kv_dir}/kv{rank}"

    def _static_metas(self) -> tuple[list[Any], list[dict[str, Any]]]:
        """Each PP stage's KV descriptors (one dict at TP=1, a list at TP>1, as
        setup_kv_transfer keeps them) and each stage's SSM descriptors by kind."""
        g = self.geometry
        stage_kv: list[Any] = []
        stage_ssm: list[dict[str, Any]] = []
        for pp_rank in range(g.pp):
            kv: list[dict[str, Any]] = []
            ssm: dict[str, list[dict[str, Any]]] = {"conv": [], "recurrent": []}
            for tp_rank in range(g.tp):
                rank = self.rank0 + pp_rank * g.tp + tp_rank
                agent = agent_name(self.role, rank, self.identity)
                kv.append(kv_descriptor(g, rank, tp_rank, pp_rank, self.transport, agent))
                if g.hybrid:
                    for kind in ("conv", "recurrent"):
                        ssm[kind].append(
                            ssm_descriptor(g, rank, tp_rank, pp_rank, kind, self.transport, agent)
                        )
            stage_kv.append(kv[0] if g.tp == 1 else kv)
            if g.hybrid:
                stage_ssm.append({k: (v[0] if g.tp == 1 else v) for k, v in ssm.items()})
            else:
                stage_ssm.append({})
        return stage_kv, stage_ssm

    def _instance_meta(self) -> list[dict[str, Any]]:
        """``_build_instance_transfer_meta`` (disaggregation/engine.py:40-68): one entry
        per model-parallel rank, PP-major."""
        entries = []
        for kv_stage, ssm_stage in zip(self._stage_kv, self._stage_ssm, strict=True):
            kv_ranks = kv_stage if isinstance(kv_stage, list) else [kv_stage]
            for tp_index, kv_meta in enumerate(kv_ranks):
                entry = dict(kv_meta)
                entry["request_capacity"] = self.capacity
                rank_ssm = {
                    kind: (metas[tp_index] if isinstance(metas, list) else metas)
                    for kind, metas in ssm_stage.items()
                }
                if rank_ssm:
                    entry["ssm"] = rank_ssm
                if self.hybrid:
                    entry["ssm_slot_capacity"] = self.capacity
                    entry["ssm_handoff_max_slots"] = 1
                entries.append(entry)
        return entries

    def register(self, timeout: float = WAIT) -> list[Any]:
        """Send REGISTER_ROLE as the PR's engine does and take the one reply it reads:
        REGISTER_ROLE_ACK ([2]) registers it; anything else (a refusal, [29, reason])
        is what the PR's engine raises RuntimeError on (dynamic_engine.py:896-916)."""
        self._send([REGISTER_ROLE, self.role, self.transport, self.instance_meta])
        if not self.sock.poll(int(timeout * 1000)):
            raise TimeoutError("Timed out waiting for disaggregated role registration")
        reply = um(self.sock.recv())
        self._note("in", reply)
        if reply == [REGISTER_ROLE_ACK]:
            self.registered = True
        else:
            assert reply and reply[0] == REQUEST_ERROR and len(reply) == 2, reply
            self.refusal = str(reply[1])
        return reply

    # -- running -----------------------------------------------------------------

    def start(self, register: bool = True) -> PDEngine:
        """Register (which must be acknowledged), then serve on a thread of its own."""
        if register:
            reply = self.register()
            assert reply == [REGISTER_ROLE_ACK], f"refused: {reply!r}"
        self._thread = threading.Thread(target=self.serve, name=self.identity.decode())
        self._thread.daemon = True
        self._thread.start()
        return self

    def serve(self, stop: threading.Event | None = None) -> None:
        """The engine loop, until ``stop`` (or ``self.stop()`` / ``kill()``)."""
        stop = stop or self._stop
        poller = zmq.Poller()
        poller.register(self.sock, zmq.POLLIN)
        poller.register(self._kv, zmq.POLLIN)
        known: set[zmq.Socket] = set()
        while not stop.is_set() and not self._stop.is_set():
            for dealer in self._dealers.values():
                if dealer not in known:
                    poller.register(dealer, zmq.POLLIN)
                    known.add(dealer)
            ready = dict(poller.poll(self._timeout_ms()))
            with self._lock:
                if self.sock in ready:
                    self._drain(self.sock, self._on_message)
                if self._kv in ready:
                    self._drain_router()
                for rank, dealer in list(self._dealers.items()):
                    if dealer in ready:
                        self._drain(dealer, lambda data, rank=rank: self._on_data(data, rank))
                self._progress(time.monotonic())

    def _timeout_ms(self) -> int:
        with self._lock:
            if self._held:
                return 20
            dues = [job.due for job in self._jobs.values() if job.due]
        if not dues:
            return 20
        return max(0, min(20, int((min(dues) - time.monotonic()) * 1000) + 1))

    def _drain(self, sock: zmq.Socket, handle: Any) -> None:
        while True:
            try:
                frame = sock.recv(zmq.NOBLOCK)
            except zmq.Again:
                return
            handle(um(frame))

    def _drain_router(self) -> None:
        while True:
            try:
                sender, frame = self._kv.recv_multipart(zmq.NOBLOCK)
            except zmq.Again:
                return
            self._on_data_request(sender, um(frame))

    def stop(self, timeout: float = WAIT) -> None:
        """The PR engine's shutdown (dynamic_engine.py:3112-3143): DISCONNECT, then closed."""
        self._halt(timeout)
        if not self._dead:
            with contextlib.suppress(zmq.ZMQError):
                self._send([DISCONNECT])
            # The PR closes with linger=0 right after (a DISCONNECT it may lose); these
            # peers let it go out, so that a graceful leave is one.
            self.sock.setsockopt(zmq.LINGER, 1000)
        self._dead = True
        self.sock.close()
        for sock in [self._kv, *self._dealers.values()]:
            sock.close(linger=0)

    def kill(self, timeout: float = WAIT) -> None:
        """Gone without a word, as a process killed: its sockets closed, no DISCONNECT."""
        self._dead = True
        self._halt(timeout)
        self.close()

    def _halt(self, timeout: float) -> None:
        self._stop.set()
        if self._thread is not None and self._thread is not threading.current_thread():
            self._thread.join(timeout)

    def close(self) -> None:
        for sock in [self.sock, self._kv, *self._dealers.values()]:
            sock.close(linger=0)

    def hold(self) -> None:
        """No prefill completes, no import is admitted, no token is generated, until
        ``proceed()`` (messages are still taken and answered where the PR answers at once)."""
        with self._lock:
            self._held = True

    def proceed(self) -> None:
        with self._lock:
            self._held = False
            now = time.monotonic()
            for job in self._jobs.values():
                if job.due:
                    job.due = min(job.due, now)

    # -- hooks -------------------------------------------------------------------

    def pins(self) -> dict[int, list[int]]:
        with self._lock:
            return {rid: list(blocks) for rid, blocks in self._pins.items()}

    def received(self, header: int | None = None) -> list[Any]:
        with self._lock:
            return [msg for _, way, msg in self.log if way == "in" and _is(msg, header)]

    def sent(self, header: int | None = None) -> list[Any]:
        with self._lock:
            return [msg for _, way, msg in self.log if way == "out" and _is(msg, header)]

    def headers(self, way: str = "in") -> list[int]:
        with self._lock:
            return [msg[0] for _, w, msg in self.log if w == way]

    def requests(self) -> dict[int, str]:
        """The requests this engine holds and their state (pinned ones as "pinned")."""
        with self._lock:
            held = {rid: job.state for rid, job in self._jobs.items()}
            held.update({rid: "pinned" for rid in self._pins if rid not in held})
            return held

    def status(self) -> dict[str, Any]:
        """Everything a test reads, as plain data (a process writes it to its status file)."""
        with self._lock:
            return {
                "identity": self.identity.decode(),
                "registered": self.registered,
                "refusal": self.refusal,
                "pins": {str(rid): blocks for rid, blocks in self._pins.items()},
                "requests": {str(rid): state for rid, state in self.requests().items()},
                "log": [[t, way, msg] for t, way, msg in self.log],
                "violations": list(self.violations),
                "over_capacity": list(self.over_capacity),
                "releases": list(self.releases),
                "pushes": [list(p) for p in self.pushes],
                "reads": [list(r) for r in self.reads],
            }

    # -- the coordinator's messages ----------------------------------------------

    def _send(self, msg: list[Any]) -> None:
        self.sock.send(m(msg))
        self._note("out", msg)

    def _note(self, way: str, msg: Any) -> None:
        with self._lock:
            self.log.append((time.monotonic(), way, msg))

    def _violation(self, text: str) -> None:
        self.violations.append(text)

    def _on_message(self, data: Any) -> None:
        self._note("in", data)
        if not isinstance(data, list) or not data or data[0] not in HEADERS_PD:
            self._violation(f"UnknownHeaderError: {data!r}")
            return
        header = data[0]
        if header == SUBMIT:
            self._on_submit(data)
        elif header == SUBMIT_KV:
            self._on_submit_kv(data)
        elif header == RELEASE_KV:
            self._on_release(int(data[1]))
        elif header == SEND_KV:
            self._on_send_kv(data)
        elif header == ABORT:
            self._on_abort(int(data[1]))
        elif header in CONTROL:
            pass  # taken as the PR's engine does; these peers keep running
        elif header in (REGISTER_ROLE_ACK, REQUEST_ERROR):
            self._violation(f"a registration reply after registration: {data!r}")
        else:  # 21, 22, 28, 30, 31, 60, 61, 80, 81, 0, 1, 27: no engine takes these
            self._violation(f"the PR's engine raises UnknownHeaderError on {data!r}")

    def _holding(self) -> int:
        return len(self._jobs) + sum(1 for rid in self._pins if rid not in self._jobs)

    def _on_submit(self, data: list[Any]) -> None:
        if len(data) != 4:  # request_id, prompt, sampling_params = data[1:]
            self._violation(f"SUBMIT_REQUEST with {len(data) - 1} fields: ValueError")
            return
        rid, prompt, params = int(data[1]), data[2], data[3]
        if not self.can_prefill:
            self._send([REQUEST_ERROR, rid, DECODE_REFUSES_PROMPT, True])
            return
        if not isinstance(params, dict) or not isinstance(prompt, (str, list)):
            self._violation(f"SUBMIT_REQUEST {rid}: prompt {prompt!r}, params {params!r}")
            return
        if self._holding() >= self.capacity:
            self.over_capacity.append(rid)
        params = dict(params)
        if params.get("num_tokens_total") is not None:  # _add_request
            params["num_tokens_to_generate"] = params["num_tokens_total"] - len(tokenize(prompt))
            params["num_tokens_total"] = None
        job = _Job(rid, prompt, tokenize(prompt), params, "prefilling")
        job.due = time.monotonic() + self.prefill_seconds
        self._jobs[rid] = job

    def _on_submit_kv(self, data: list[Any]) -> None:
        if len(data) != 6:  # request_id, prompt, sampling_params, kv_meta, src_block_ids
            self._violation(f"SUBMIT_REQUEST_WITH_KV with {len(data) - 1} fields: ValueError")
            return
        rid, prompt, params, kv_meta, src_blocks = int(data[1]), *data[2:]
        if not self.can_decode:
            # a prefill-role engine has no import path to post (no decode agent set up)
            self._send([REQUEST_ERROR, rid, "KV handoff received on a prefill engine", True])
            return
        error = self._import_error(prompt, params, kv_meta, src_blocks)
        if error is not None:  # add_request_with_kv_handoff raised (dynamic_engine.py:2987-2992)
            self._send([REQUEST_ERROR, rid, error, True])
            return
        if self._holding() >= self.capacity:
            self.over_capacity.append(rid)
        job = _Job(rid, prompt, tokenize(prompt), dict(params), "deferred")
        job.kv_meta, job.src_blocks = kv_meta, list(src_blocks)
        job.generated = [int(t) for t in kv_meta["resume_tokens"]][:1]
        job.log_probs = [float(p) for p in kv_meta.get("resume_log_probs", [])]
        self._jobs[rid] = job
        if self._deferred or not self._try_start_import(job):
            self._deferred.append(rid)  # FIFO: NCCL needs the receive order kept

    def _import_error(self, prompt: Any, params: Any, kv_meta: Any, src_blocks: Any) -> str | None:
        """What add_request_with_kv_handoff raises on (inference_state_handoff.py:760-823)."""
        if not isinstance(params, dict) or not isinstance(kv_meta, dict):
            return "malformed handoff"
        ssm = kv_meta.get("ssm")
        if self.hybrid and ssm is None:
            return (
                "Decode has SSM state transfer agents but the handoff contains no "
                "SSM metadata; prefill and decode must use the same hybrid model"
            )
        if self.hybrid and not all(kind in (ssm or {}) for kind in ("conv", "recurrent")):
            return "SSM handoff metadata is missing state kinds"
        if not self.hybrid and ssm is not None:
            return "Transformer decode received SSM metadata from a hybrid prefill"
        resume = kv_meta.get("resume_tokens", [])
        if len(resume) != 1:
            return (
                "Decode-only handoff requires one sampled token plus the configured "
                f"MTP proposals: expected 1, got {len(resume)}"
            )
        if params.get("top_n_logprobs", 0) > 0:
            return "Decode-only handoff does not yet transfer top-token log probabilities"
        if params.get("return_log_probs") and not params.get("skip_prompt_log_probs"):
            return "Decode-only handoff does not transfer prompt log probabilities"
        if isinstance(prompt, str):
            return STR_PROMPT_ERROR  # torch.tensor(prompt, dtype=torch.int64)
        expected = math.ceil(len(prompt) / self.block_size)
        if not isinstance(src_blocks, list) or len(src_blocks) != expected:
            got = len(src_blocks) if isinstance(src_blocks, list) else src_blocks
            return (
                "Decode-only handoff requires every prompt KV block, including the partial "
                f"tail: expected {expected}, got {got}"
            )
        return None

    def _try_start_import(self, job: _Job) -> bool:
        """_try_start_kv_handoff_import: reserve blocks, find the cached prefix, then
        post the receive (nccl: KV_TRANSFER_READY first) or start the read (nixl)."""
        needed = len(job.src_blocks)
        if len(self._free_blocks) < needed or (self.hybrid and not self._free_slots):
            return False
        hashes = block_hashes(job.tokens, self.block_size)[:needed]
        cached = 0
        while cached < len(hashes) and hashes[cached] in self._prefix_cache:
            cached += 1
        job.cached = cached
        ranks = global_ranks(job.kv_meta if self.transport == "nixl" else [])
        job.source_rank = min(ranks) if ranks else None
        job.due = time.monotonic() + self.read_timeout
        if self.transport == "nccl":
            job.state = "awaiting_push"
            self._send([KV_TRANSFER_READY, job.rid, cached])
            early = self._early_pushes.pop(job.rid, None)
            if early is not None:
                self._on_push(early)
        else:
            missing = self._missing_agent_blobs(job.kv_meta)
            if missing:  # NIXL cannot load a remote agent without its metadata blob
                job.failure = f"NIXL agent {missing!r} has no agent metadata to load"
                job.state = "imported"
                job.due = time.monotonic()
            else:
                job.state = "reading"  # the read starts when due
                job.due = time.monotonic() + self.import_delay
        return True

    def _missing_agent_blobs(self, kv_meta: Any) -> str | None:
        for record in agent_records(kv_meta):
            if record.get("agent_metadata_b64") != agent_blob(record["agent_name"]):
                return record["agent_name"]
        return None

    def _start_read(self, job: _Job) -> None:
        if job.source_rank is None:
            job.failure = "KV handoff metadata names no source rank"
            return
        blocks = job.src_blocks[job.cached :]
        dealer = self._dealer(job.source_rank)
        dealer.send(m(["READ", job.rid, blocks]))
        job.state = "reading_sent"
        job.due = time.monotonic() + self.read_timeout

    def _dealer(self, rank: int) -> zmq.Socket:
        dealer = self._dealers.get(rank)
        if dealer is None:
            dealer = self._ctx.socket(zmq.DEALER)
            dealer.setsockopt(zmq.LINGER, 0)
            dealer.connect(self.data_endpoint(rank))
            self._dealers[rank] = dealer
        return dealer

    def _on_release(self, rid: int) -> None:
        """release_handoff_blocks: unpin; an unknown request id is a no-op."""
        self.releases.append(rid)
        blocks = self._pins.pop(rid, None)
        slot = self._pin_slots.pop(rid, None)
        for block in blocks or []:
            self._blocks.pop(block, None)
            self._free_blocks.append(block)
        self._free_blocks.sort()
        if slot is not None:
            self._free_slots.append(slot)

    def _on_send_kv(self, data: list[Any]) -> None:
        """push_handoff_kv (inference_state_handoff.py:426-483; dynamic_engine.py:2997-3010)."""
        rid = int(data[1])
        decode_metas = data[2] if len(data) > 2 else None
        cached = int(data[3]) if len(data) > 3 else 0
        blocks = self._pins.get(rid)
        if not blocks:
            self._violation(f"SEND_KV for request {rid} with no pinned hand-off blocks")
            return  # the PR logs a warning and skips: nothing is sent
        if not 0 <= cached <= len(blocks):
            reason = f"Invalid cached prefix length {cached} for {len(blocks)} handoff blocks"
            self._send([REQUEST_ERROR, rid, reason, True])
            return
        ranks = global_ranks(decode_metas)
        if not ranks:
            self._send([REQUEST_ERROR, rid, "Decode metadata names no destination", True])
            return
        contents = [self._blocks.get(block) for block in blocks[cached:]]
        self._dealer(min(ranks)).send(m(["PUSH", rid, self.rank0, contents]))
        self.pushes.append((rid, blocks[cached:], min(ranks)))

    def _on_abort(self, rid: int) -> None:
        """dynamic_engine.py:3015-3034 and abort_kv_handoff."""
        job = self._jobs.get(rid)
        if job is None:
            return
        if job.state == "deferred":
            self._deferred.remove(rid)
            del self._jobs[rid]
            self._send([REQUEST_ABORTED, rid, True])
            return
        if job.state in ("reading", "reading_sent", "awaiting_push", "imported"):
            job.cancel = True  # answered once the transfer is over
            return
        # sampling_params.num_tokens_to_generate = len(generated_tokens): done next step
        job.params["num_tokens_to_generate"] = len(job.generated)
        job.target = len(job.generated)
        if self.role != "prefill":
            self._send([REQUEST_ABORTED, rid, True])

    # -- the data plane ----------------------------------------------------------

    def _on_data_request(self, sender: bytes, data: list[Any]) -> None:
        if data[0] == "READ":  # a decode reads pinned blocks
            rid, blocks = int(data[1]), list(data[2])
            pinned = set(self._pins.get(rid, ()))
            contents = [self._blocks.get(b) if b in pinned else None for b in blocks]
            if any(b not in pinned for b in blocks):
                self._violation(f"a read of request {rid}'s blocks {blocks} that are not pinned")
            self.reads.append((rid, blocks))
            self._kv.send_multipart([sender, m(["DATA", rid, contents])])
        elif data[0] == "PUSH":
            self._on_push(data)

    def _on_push(self, data: list[Any]) -> None:
        rid = int(data[1])
        job = self._jobs.get(rid)
        if job is None or job.state != "awaiting_push":
            if job is None or job.state == "deferred":
                self._violation(f"a push of request {rid} before its KV_TRANSFER_READY")
                self._early_pushes[rid] = data
            else:
                self._violation(f"a push of request {rid} in state {job.state}")
            return
        self._transfer_done(job, data[3])

    def _on_data(self, data: list[Any], rank: int) -> None:
        if data[0] != "DATA":
            return
        job = self._jobs.get(int(data[1]))
        if job is not None and job.state == "reading_sent":
            self._transfer_done(job, data[2])

    def _transfer_done(self, job: _Job, contents: list[Any]) -> None:
        expected = chunks(job.tokens, self.block_size)[job.cached :]
        if [list(c) if c is not None else None for c in contents] != expected:
            job.failure = f"KV handoff transfer of request {job.rid} read wrong or freed blocks"
            self._violation(job.failure)
        job.state = "imported"
        job.due = time.monotonic()

    # -- progress ----------------------------------------------------------------

    def _progress(self, now: float) -> None:
        if self._held:
            return
        replies: list[dict[str, Any]] = []
        after: list[list[Any]] = []  # messages after this step's replies and partials
        for rid in list(self._jobs):
            job = self._jobs.get(rid)
            if job is None or not job.due or job.due > now:
                continue
            if job.state == "prefilling":
                replies.extend(self._finish_prefill(job))
            elif job.state == "reading":
                self._start_read(job)
            elif job.state in ("reading_sent", "awaiting_push"):
                job.failure = f"KV handoff transfer of request {rid} timed out"
                job.state = "imported"
                job.due = now
                self._admit(job, replies, after)
            elif job.state == "imported":
                self._admit(job, replies, after)
            elif job.state == "active":
                self._step(job, replies)
        while self._deferred:  # _drain_deferred_kv_handoffs
            job = self._jobs[self._deferred[0]]
            if not self._try_start_import(job):
                break
            self._deferred.popleft()
        if replies:
            self._send([REPLY, replies])
        self._send_partials()
        for msg in after:
            self._send(msg)

    def _finish_prefill(self, job: _Job) -> list[dict[str, Any]]:
        first = token_at(job.tokens, 0)
        params = job.params
        if not params.get("do_kv_handoff"):  # a whole request on this engine
            job.target = self._target(job)
            job.generated = [first][: job.target]
            log_probs = [log_prob_at(0)] if params.get("return_log_probs") else []
            job.log_probs = log_probs[: job.target]
            job.state = "active"
            return self._after_token(job)
        del self._jobs[job.rid]
        count = math.ceil(len(job.tokens) / self.block_size)
        if len(self._free_blocks) < count:
            return [self._record(job, status="FAILED")]
        blocks, self._free_blocks = self._free_blocks[:count], self._free_blocks[count:]
        for block, tokens in zip(blocks, chunks(job.tokens, self.block_size), strict=True):
            self._blocks[block] = tokens
        self._pins[job.rid] = blocks
        slot = self._free_slots.pop(0) if self.hybrid and self._free_slots else None
        if slot is not None:
            self._pin_slots[job.rid] = slot
        kv_meta = self._handoff_kv_meta(blocks, first, slot, params)
        handoff = {"request_id": job.rid, "block_ids": blocks, "kv_meta": kv_meta}
        return [self._record(job, disaggregated_params=handoff)]

    def _handoff_kv_meta(
        self, blocks: list[int], first: int, slot: int | None, params: dict[str, Any]
    ) -> dict[str, Any]:
        """_prepare_handoff_metadata_batch and _capture_handoff_meta
        (inference_state_handoff.py:520-706)."""
        if self.geometry.pp > 1:
            kv_meta: dict[str, Any] = {
                "pp_metas": [{"tp_metas": stage, "block_ids": blocks} for stage in self._stage_kv]
            }
        elif isinstance(self._stage_kv[0], list):
            kv_meta = {"tp_metas": list(self._stage_kv[0])}
        else:
            kv_meta = dict(self._stage_kv[0])
        kv_meta["resume_tokens"] = [first]
        if params.get("return_log_probs"):
            kv_meta["resume_log_probs"] = [log_prob_at(0)]
        if self.hybrid and slot is not None:
            stages = [
                {
                    kind: (
                        [{**meta, "block_ids": [slot]} for meta in metas]
                        if isinstance(metas, list)
                        else {**metas, "block_ids": [slot]}
                    )
                    for kind, metas in stage.items()
                }
                for stage in self._stage_ssm
            ]
            if self.geometry.pp > 1:
                kv_meta["ssm"] = {
                    kind: {"pp_metas": [{"tp_metas": stage[kind]} for stage in stages]}
                    for kind in ("conv", "recurrent")
                }
            else:
                kv_meta["ssm"] = stages[0]
        if self.transport == "nixl":
            kv_meta = strip_agent_blobs(kv_meta)
        return kv_meta

    def _target(self, job: _Job) -> int:
        target = job.params.get("num_tokens_to_generate")
        if target is None:
            target = self.max_sequence_length - len(job.tokens)
        return min(int(target), self.max_sequence_length - len(job.tokens))

    def _admit(self, job: _Job, replies: list[dict[str, Any]], after: list[list[Any]]) -> None:
        """_admit_pending_kv_imports and _finalize_kv_handoff_import (1141-1240)."""
        rid = job.rid
        if job.cancel:
            self._free_import(job)
            after.append([REQUEST_ABORTED, rid, True])
            return
        if job.failure is not None:
            self._free_import(job)
            after.append([REQUEST_ERROR, rid, job.failure, True])
            return
        active = sum(1 for j in self._jobs.values() if j.state == "active")
        if active >= self.capacity:
            job.due = time.monotonic() + 0.005  # can_admit_prefilled_decode: wait
            return
        hashes = block_hashes(job.tokens, self.block_size)
        self._prefix_cache.update(hashes[: len(job.src_blocks)])
        job.target = self._target(job)
        termination = job.params.get("termination_id")
        if job.generated and termination is not None and job.generated[0] == termination:
            job.target = len(job.generated)
        if not job.params.get("return_log_probs"):
            job.log_probs = []
        job.state = "active"
        if len(job.generated) >= job.target:  # _complete_handoff_request_without_forward
            del self._jobs[rid]
            self._send([REPLY, [self._record(job)]])
        else:
            job.due = time.monotonic() + self.step_seconds
            self._send_partials()  # _try_send_streaming_partials, then the read is done
        self._send([KV_READ_DONE, rid])

    def _free_import(self, job: _Job) -> None:
        self._jobs.pop(job.rid, None)

    def _step(self, job: _Job, replies: list[dict[str, Any]]) -> None:
        if len(job.generated) < job.target:
            index = len(job.generated)
            job.generated.append(token_at(job.tokens, index))
            if job.params.get("return_log_probs"):
                job.log_probs.append(log_prob_at(index))
        replies.extend(self._after_token(job))

    def _after_token(self, job: _Job) -> list[dict[str, Any]]:
        termination = job.params.get("termination_id")
        if job.generated and termination is not None and job.generated[-1] == termination:
            job.target = len(job.generated)
        if len(job.generated) >= job.target:
            del self._jobs[job.rid]
            return [self._record(job)]
        job.due = time.monotonic() + self.step_seconds
        return []

    def _send_partials(self) -> None:
        """_try_send_streaming_partials (dynamic_engine.py:2471-2517): per streaming
        request the tokens not yet sent, once there are ``streaming_interval`` of them."""
        partials = []
        for rid, job in self._jobs.items():
            if job.state != "active" or not job.params.get("streaming"):
                continue
            total = len(job.generated)
            if total - job.emitted >= int(job.params.get("streaming_interval") or 1):
                partial: dict[str, Any] = {
                    "request_id": rid,
                    "new_tokens": job.generated[job.emitted : total],
                }
                if job.params.get("return_log_probs"):
                    partial["new_log_probs"] = job.log_probs[job.emitted : total]
                    partial["new_top_n_logprobs"] = []
                partials.append(partial)
                job.emitted = total
        if partials:
            self._send([PARTIAL, partials])

    def _record(
        self, job: _Job, status: str = "COMPLETED", disaggregated_params: Any = None
    ) -> dict[str, Any]:
        """A finished request as the engine serializes it (a few of its fields)."""
        record: dict[str, Any] = {
            "request_id": job.rid,
            "prompt": job.prompt if isinstance(job.prompt, str) else None,
            "sampling_params": job.params,
            "generated_tokens": list(job.generated),
            "generated_length": len(job.generated),
            "generated_text": None,
            "generated_log_probs": list(job.log_probs) if job.log_probs else None,
            "status": status,
            "events": [],
            "disaggregated_params": disaggregated_params,
        }
        if job.params.get("return_prompt_tokens"):
            tokens = list(job.tokens)
            record["prompt_tokens"] = ["tensor", tokens] if self.tensor_prompt_tokens else tokens
        return record


def _is(msg: Any, header: int | None) -> bool:
    return header is None or (isinstance(msg, list) and bool(msg) and msg[0] == header)


# -- the client ------------------------------------------------------------------------


@dataclass
class Outcome:
    """What one request of a PR client got, in order."""

    partials: list[dict[str, Any]] = field(default_factory=list)
    final: dict[str, Any] | None = None
    error: tuple[str, bool] | None = None  # (reason, source_safe)
    aborted: list[bool] = field(default_factory=list)  # REQUEST_ABORTED's source_safe
    terminals: list[int] = field(default_factory=list)  # 21 / 29 / 31 as they came

    @property
    def done(self) -> bool:
        return self.final is not None or self.error is not None or bool(self.aborted)

    @property
    def tokens(self) -> list[int]:
        """The partials' tokens, in order."""
        return [t for partial in self.partials for t in partial["new_tokens"]]


class PDClient(SingleFramePeer):
    """The PR's ``InferenceClient`` on the wire (inference_client.py): a DEALER, its
    own request ids from 0, and its receive loop's parsing (``violations`` holds what
    that loop would raise on, or a message for a request it never sent)."""

    def __init__(self, address: str, ctx: zmq.Context | None = None):
        super().__init__(ctx or zmq.Context.instance(), address, connect=False)
        self.sock.setsockopt(zmq.SNDHWM, 0)
        self.sock.setsockopt(zmq.RCVHWM, 0)
        self.sock.connect(address)
        self.next_request_id = 0
        self.outcomes: dict[int, Outcome] = {}
        self.log: list[tuple[float, str, Any]] = []
        self.violations: list[str] = []

    def connect(self, timeout: float = WAIT) -> PDClient:
        self._send([CONNECT])
        if not self.sock.poll(int(timeout * 1000)):
            raise TimeoutError("Timed out connecting to the Megatron inference coordinator")
        reply = um(self.sock.recv())
        self.log.append((time.monotonic(), "in", reply))
        assert reply[0] == CONNECT_ACK, reply  # assert Headers(reply[0]) == Headers.CONNECT_ACK
        return self

    def _send(self, msg: list[Any]) -> None:
        self.sock.send(m(msg))
        self.log.append((time.monotonic(), "out", msg))

    def _new(self) -> int:
        rid = self.next_request_id
        self.next_request_id += 1
        self.outcomes[rid] = Outcome()
        return rid

    def submit(self, prompt: Any, params: dict[str, Any] | None = None, **overrides: Any) -> int:
        """add_request: m([20, rid, prompt, sampling_params]); the request id."""
        rid = self._new()
        self._send([SUBMIT, rid, prompt, params or sampling_params(**overrides)])
        return rid

    def submit_streaming(
        self, prompt: Any, params: dict[str, Any] | None = None, **overrides: Any
    ) -> int:
        """add_request_streaming: the same, "streaming" set."""
        params = dict(params or sampling_params(**overrides))
        params["streaming"] = True
        return self.submit(prompt, params)

    def submit_with_kv(
        self, prompt: Any, params: dict[str, Any], kv_meta: Any, src_block_ids: list[int]
    ) -> int:
        """add_request_with_kv_handoff: m([24, rid, prompt, params, kv_meta, blocks])."""
        rid = self._new()
        self._send([SUBMIT_KV, rid, prompt, params, kv_meta, list(src_block_ids)])
        return rid

    def release_handoff(self, request_id: int) -> None:
        """m([25, request_id]): a number the coordinator broadcasts as it came."""
        self._send([RELEASE_KV, int(request_id)])

    def abort(self, rid: int) -> None:
        """abort_request / abort_request_and_wait: m([23, rid])."""
        self._send([ABORT, int(rid)])

    def signal(self, header: int, *args: Any) -> None:
        self._send([header, *args])

    def pump(self, timeout: float = 0.05) -> int:
        """Take every message that arrives within ``timeout`` of the last; how many."""
        frames = self.recv_frames(timeout)
        for frame in frames:
            self._on_message(um(frame))
        return len(frames)

    def wait(self, rid: int, timeout: float = WAIT) -> Outcome:
        """Pump until request ``rid`` has its terminal reply."""
        deadline = time.monotonic() + timeout
        while not self.outcomes[rid].done:
            left = deadline - time.monotonic()
            if left <= 0:
                raise TimeoutError(f"request {rid} got no terminal reply: {self.outcomes[rid]}")
            if self.sock.poll(int(min(left, 0.05) * 1000)):
                self._on_message(um(self.sock.recv()))
        return self.outcomes[rid]

    def _on_message(self, data: Any) -> None:
        self.log.append((time.monotonic(), "in", data))
        if not isinstance(data, list) or not data or data[0] not in HEADERS_PD:
            self.violations.append(f"UnknownHeaderError: {data!r}")
            return
        header = data[0]
        try:
            if header == REPLY:
                rid, reply = data[1:]
                assert isinstance(reply, dict), "reply['latency'] = ...: a map"
                self._outcome(rid).final = reply
                self._outcome(rid).terminals.append(REPLY)
            elif header == PARTIAL:
                rid, partial = data[1:]
                self._outcome(rid).partials.append(partial)
            elif header == REQUEST_ERROR:
                rid, reason, source_safe = data[1:]
                self._outcome(rid).error = (str(reason), bool(source_safe))
                self._outcome(rid).terminals.append(REQUEST_ERROR)
            elif header == REQUEST_ABORTED:
                rid, source_safe = int(data[1]), bool(data[2])
                self._outcome(rid).aborted.append(source_safe)
                self._outcome(rid).terminals.append(REQUEST_ABORTED)
        except (ValueError, TypeError, AssertionError, IndexError) as error:
            self.violations.append(f"the PR's client raises on {data!r}: {error!r}")

    def _outcome(self, rid: Any) -> Outcome:
        if rid not in self.outcomes:
            self.violations.append(f"a reply for request {rid!r}, which this client never sent")
            self.outcomes[rid] = Outcome()
        return self.outcomes[rid]


# -- threads and processes -------------------------------------------------------------


@contextlib.contextmanager
def engine_thread(address: str, role: str, **options: Any) -> Iterator[PDEngine]:
    """A registered PDEngine serving on a thread; stopped (DISCONNECT) at exit unless
    the test killed or stopped it first."""
    engine = PDEngine(address, role, **options).start()
    try:
        yield engine
    finally:
        if not engine._stop.is_set():
            engine.stop()


def engine_command(address: str, role: str, status: str, *options: str) -> list[str]:
    return [sys.executable, "-m", "tests.support.megatron_pd", "engine", "--address", address,
            "--role", role, "--status", status, *options]  # fmt: skip


class EngineProcess:
    """A PDEngine in a child process; ``status()`` reads what it last wrote."""

    def __init__(self, process: subprocess.Popen, status_path: Path):
        self.process = process
        self.status_path = status_path

    def status(self) -> dict[str, Any]:
        try:
            return json.loads(self.status_path.read_text())
        except (FileNotFoundError, json.JSONDecodeError):
            return {}

    def wait_registered(self, timeout: float = WAIT) -> dict[str, Any]:
        wait_for(
            lambda: bool(self.status().get("registered") or self.status().get("refusal")), timeout
        )
        return self.status()

    def kill(self) -> None:
        """SIGKILL: no DISCONNECT, its sockets closed by the kernel."""
        self.process.kill()
        self.process.wait()

    def stop(self) -> None:
        """SIGTERM: the engine's shutdown, DISCONNECT sent."""
        self.process.send_signal(signal.SIGTERM)
        self.process.wait(WAIT)


@contextlib.contextmanager
def engine_process(
    address: str, role: str, status_path: Path, *options: str, cwd: Path | None = None
) -> Iterator[EngineProcess]:
    """``python -m tests.support.megatron_pd engine ...`` (options as its CLI takes
    them), killed at exit. ``cwd``: the directory ``tests`` is imported from."""
    root = cwd or Path(__file__).resolve().parents[2]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(root),
           os.environ.get("PYTHONPATH")]))}  # fmt: skip
    command = engine_command(address, role, str(status_path), *options)
    process = subprocess.Popen(command, cwd=root, env=env)
    try:
        yield EngineProcess(process, status_path)
    finally:
        if process.poll() is None:
            process.kill()
        process.wait()


def _write_status(engine: PDEngine, path: str) -> None:
    tmp = f"{path}.tmp"
    with open(tmp, "w") as out:
        json.dump(engine.status(), out, default=repr)
    os.replace(tmp, path)


def _run_engine(args: argparse.Namespace) -> None:
    geometry = Geometry(
        tokens_per_block=args.block_size, head_dim=args.head_dim, tp=args.tp, pp=args.pp,
        hybrid=args.hybrid,
    )  # fmt: skip
    engine = PDEngine(
        args.address, args.role, transport=args.transport, index=args.index, dp_rank=args.dp,
        rank=args.rank, capacity=args.capacity, geometry=geometry, kv_dir=args.kv_dir,
        prefill_seconds=args.prefill_seconds, step_seconds=args.step_seconds,
        import_delay=args.import_delay, ctx=zmq.Context(),
    )  # fmt: skip
    stop = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: stop.set())
    engine.register(args.register_timeout)
    _write_status(engine, args.status)
    if engine.refusal is not None:
        engine.close()
        return
    thread = threading.Thread(target=engine.serve, args=(stop,), daemon=True)
    thread.start()
    written = -1
    while not stop.wait(0.02):
        if len(engine.log) != written:
            written = len(engine.log)
            _write_status(engine, args.status)
    thread.join(WAIT)
    engine.stop()
    _write_status(engine, args.status)


def _run_client(args: argparse.Namespace) -> None:
    client = PDClient(args.address, zmq.Context()).connect()
    params = sampling_params(num_tokens_to_generate=args.tokens, streaming=args.streaming)
    rids = [client.submit(json.loads(prompt), params) for prompt in args.prompt]
    results = {}
    for rid in rids:
        outcome = client.wait(rid, args.timeout)
        results[rid] = {
            "final": outcome.final, "error": outcome.error, "aborted": outcome.aborted,
            "partials": outcome.partials, "terminals": outcome.terminals,
        }  # fmt: skip
    print(json.dumps({"results": results, "violations": client.violations}, default=repr))
    client.close()


def _main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description="Megatron PR #6675's P/D peers, on the wire")
    sub = parser.add_subparsers(dest="command", required=True)
    engine = sub.add_parser("engine", help="a prefill or decode engine (SIGTERM: shutdown)")
    engine.add_argument("--address", required=True)
    engine.add_argument("--role", required=True)
    engine.add_argument("--status", required=True, help="the JSON file it keeps its state in")
    engine.add_argument("--transport", default="nixl")
    engine.add_argument("--index", type=int, default=0)
    engine.add_argument("--dp", type=int, default=0)
    engine.add_argument("--rank", type=int, default=None, help="its first global rank")
    engine.add_argument("--capacity", type=int, default=4)
    engine.add_argument("--block-size", type=int, default=4)
    engine.add_argument("--head-dim", type=int, default=128)
    engine.add_argument("--tp", type=int, default=1)
    engine.add_argument("--pp", type=int, default=1)
    engine.add_argument("--hybrid", action="store_true")
    engine.add_argument("--kv-dir", default=None)
    engine.add_argument("--prefill-seconds", type=float, default=0.0)
    engine.add_argument("--step-seconds", type=float, default=0.0)
    engine.add_argument("--import-delay", type=float, default=0.0)
    engine.add_argument("--register-timeout", type=float, default=WAIT)
    client = sub.add_parser("client", help="submit prompts, print what came back as JSON")
    client.add_argument("--address", required=True)
    client.add_argument("--prompt", action="append", required=True, help="a JSON prompt")
    client.add_argument("--tokens", type=int, default=4)
    client.add_argument("--streaming", action="store_true")
    client.add_argument("--timeout", type=float, default=WAIT)
    args = parser.parse_args(argv)
    if args.command == "engine":
        _run_engine(args)
    else:
        _run_client(args)


if __name__ == "__main__":
    _main()
