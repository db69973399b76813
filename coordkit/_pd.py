"""What both loop cores share of disaggregated prefill/decode (P/D), as pure functions.

A P/D request runs in two hops the coordinator chains: a prefill engine computes its
prompt's KV and pins it, a decode engine imports it and generates (docs/pd.md). The
coordinator's state machine for it is a room of each loop core; what the twins must
decide alike, and what PR #6675's engines are told in its own words, lives here, below
both (neither imports the other):

* :func:`check_register_role`: a #6675 engine's REGISTER_ROLE held against the engines
  registered with a role -- its :class:`Registration`, or the refusal #6675 sends
  (``[29, reason]``), checked in #6675's order, each with #6675's text;
* :func:`transfer_signature`: the transfer geometry a #6675 fleet must share;
* the prefill hop's sampling params (:data:`PREFILL_OVERRIDES`, appended to the
  client's map by :func:`with_keys` without decoding it), a #6675 prefill's reply read
  for its handoff (:func:`handoff_of`), NIXL's agent blobs put back into it
  (:func:`restore_nixl_blobs`), and the texts a #6675 client is sent when the
  coordinator ends a P/D request (REQUEST_ERROR's reasons);
* :data:`DEFAULT_PD_THRESHOLD`: the prompt below which a request is not disaggregated.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, NamedTuple

from .protocol import HANDOFF_KEY, ProtocolError, packb

__all__ = [
    "DEFAULT_PD_THRESHOLD",
    "PREFILL_OVERRIDES",
    "Registration",
    "RoleCheck",
    "check_register_role",
    "transfer_signature",
    "with_keys",
    "refuses_prompt_log_probs",
    "handoff_of",
    "prompt_tokens_of",
    "restore_nixl_blobs",
    "decode_slots",
    "cannot_route",
    "removed",
    "queued_on_removed",
]

#: Conditional disaggregation: a request whose prompt, less the prefix cached at the
#: decode-capable engine that would run it, is at most this many tokens runs whole on
#: that engine. Prefilling 256 tokens takes ~26 ms at 10 000 tokens/s (an H100-class
#: 70B engine, FakeEngine's H100 model), about one decode step (20 ms): done where it
#: decodes, it delays that engine's running sequences by about one step, once. Handed
#: off, it costs a second hop, a prefill engine's queue and a KV transfer (its fixed
#: setup alone is milliseconds) for a prefill that is no longer than a step. Longer
#: prompts would hold every sequence at the decode for several steps: they go to a
#: prefill engine, where their prefill delays nobody's tokens.
DEFAULT_PD_THRESHOLD = 256

#: What the prefill hop adds to the client's sampling params, by the engine's kind:
#: a coordkit engine is told the hop is a prefill; a #6675 engine as #6675's own
#: coordinator tells it (runtime's _submit_prefill: hand off, generate nothing, no
#: prompt log probs, no total budget).
PREFILL_OVERRIDES: dict[str, dict[str, Any]] = {
    "coordkit": {HANDOFF_KEY: True},
    "megatron": {
        HANDOFF_KEY: True,
        "num_tokens_to_generate": 0,
        "skip_prompt_log_probs": True,
        "num_tokens_total": None,
    },
}

# The registration's KV transfer geometry: what every engine of a #6675 fleet shares.
_KV_GEOMETRY = (
    "tokens_per_block",
    "element_size",
    "head_dim",
    "num_layers_global",
    "num_kv_heads_global",
)
_ROLES_6675 = ("prefill", "decode")
# What #6675's REGISTER_ROLE handler turns into a refusal (its own catches KeyError,
# TypeError and ValueError; an OverflowError, int() of an infinite float, would stop
# its coordinator: here it is refused as well, as is a RecursionError, metadata nested
# past Python's limit).
_REFUSED = (KeyError, TypeError, ValueError, OverflowError, RecursionError)


@dataclass(frozen=True, slots=True)
class Registration:
    """A #6675 engine registered with a role: what the P/D room keeps of it."""

    role: str  # "prefill" or "decode"
    transport: Any  # "nixl" (the decode reads) or "nccl" (the prefill pushes on SEND_KV)
    instance_meta: list[Any]  # kept whole: a decode's goes in SEND_KV, a prefill's NIXL blobs
    signature: tuple[Any, ...]  # its transfer geometry (transfer_signature)
    request_capacity: int  # requests it holds at most (a prefill's pinned ones counted)
    ssm_capacity: int | None  # live SSM slots of a hybrid model, None for attention only
    slot_cost: int  # a prefill's SSM slots per request (0: none, and for a decode)
    # its NIXL agents and their blobs, read once (None: conflicting, refused per handoff)
    agents: dict[Any, Any] | None = None


class RoleCheck(NamedTuple):
    """A REGISTER_ROLE judged: the registration or the refusal's text; ``replaces``:
    the identity was registered, and is removed first whatever the outcome (its
    requests ended as at its death), as #6675 does."""

    registration: Registration | None
    refusal: str | None
    replaces: bool


def check_register_role(
    message: Sequence[Any],
    identity: bytes,
    fleet: Mapping[bytes, Registration],
    disaggregated: bool = True,
) -> RoleCheck:
    """Judge a REGISTER_ROLE ``message`` (``[27, role, transport, instance_meta]``,
    decoded) from ``identity`` against the engines registered with a role (``fleet``),
    as PR #6675's coordinator does, in its order and with its texts:

    1. a coordinator that does not serve P/D (``disaggregated`` False) refuses it;
    2. a message not of four elements: Python's unpacking error;
    3. an identity registered already is replaced, but may not change its role or
       transport;
    4. the transport must be the fleet's;
    5. the instance metadata must describe one geometry (:func:`transfer_signature`),
    6. the fleet's;
    7. the role must be "prefill" or "decode", and the capacities it advertises whole
       and positive (requests; SSM slots, and a prefill's slots per handoff, when hybrid).
    """
    if not disaggregated:
        return RoleCheck(None, "REGISTER_ROLE requires a disaggregated coordinator", False)
    try:
        _, role, transport, instance_meta = message
    except _REFUSED as error:
        return RoleCheck(None, str(error), False)
    replaces = identity in fleet
    try:
        registration = _register(identity, role, transport, instance_meta, fleet)
    except _REFUSED as error:
        return RoleCheck(None, str(error), replaces)
    return RoleCheck(registration, None, replaces)


def _register(
    identity: bytes, role: Any, transport: Any, meta: Any, fleet: Mapping[bytes, Registration]
) -> Registration:
    before = fleet.get(identity)
    if before is not None and (before.role != role or before.transport != transport):
        raise ValueError(f"engine {identity!r} cannot change disaggregated role or transport")
    others = [registration for name, registration in fleet.items() if name != identity]
    if others and transport not in [other.transport for other in others]:
        raise ValueError("prefill and decode engines must use the same state transport")
    signature = transfer_signature(meta)
    if others and signature != others[0].signature:
        raise ValueError("prefill and decode engines have incompatible transfer geometry")
    if role not in _ROLES_6675:
        raise ValueError(f"unknown disaggregated role {role!r}")
    slots = _least(meta, "ssm_slot_capacity", "SSM slot capacity", required=False)
    requests = _least(meta, "request_capacity", "Request capacity", required=True)
    assert requests is not None  # required
    cost = _slot_cost(meta) if role == "prefill" else 0
    return Registration(
        role, transport, meta, signature, requests, slots, cost, _agents_or_none(meta)
    )


def _least(entries: list[dict[Any, Any]], key: str, what: str, required: bool) -> int | None:
    """The smallest of ``key`` over the model-parallel ranks: each advertises it or
    none does (``required``: each must), and it is at least 1."""
    values = [int(entry[key]) for entry in entries if entry.get(key) is not None]
    if (values or required) and len(values) != len(entries):
        raise ValueError(f"{what} is missing from part of an engine's model-parallel metadata")
    if not values:
        return None
    least = min(values)
    if least < 1:
        raise ValueError(f"{what} must be positive, got {least}")
    return least


def _slot_cost(entries: list[dict[Any, Any]]) -> int:
    """The SSM slots a hybrid prefill holds per handoff: the most any rank says."""
    hybrid = [entry for entry in entries if entry.get("ssm_slot_capacity") is not None]
    if not hybrid:
        return 0
    costs = [
        int(entry["ssm_handoff_max_slots"])
        for entry in hybrid
        if entry.get("ssm_handoff_max_slots") is not None
    ]
    if len(costs) != len(hybrid):
        raise ValueError(
            "SSM handoff slot demand is missing from part of a prefill "
            "engine's model-parallel metadata"
        )
    if max(costs) < 1:
        raise ValueError(f"SSM handoff slot demand must be positive, got {max(costs)}")
    return max(costs)


def transfer_signature(instance_meta: Any) -> tuple[Any, ...]:
    """The transfer geometry of a #6675 engine's REGISTER_ROLE metadata (one dict per
    model-parallel rank): its KV geometry, which every rank must advertise alike, and
    per SSM state kind of a hybrid model the state's geometry and its layers, which the
    ranks must cover from 0 without a gap. ValueError (#6675's texts) when it is not
    one; KeyError or TypeError when a layout lacks a field or holds what cannot be
    compared, as #6675's own reading raises."""
    if not isinstance(instance_meta, list) or not instance_meta:
        raise ValueError("state transfer metadata must be a non-empty list")
    if any(not isinstance(entry, dict) for entry in instance_meta):
        raise ValueError("every model-parallel transfer descriptor must be a dictionary")
    kv = {tuple(entry.get(key) for key in _KV_GEOMETRY) for entry in instance_meta}
    if len(kv) > 1 or None in next(iter(kv)):
        raise ValueError("model-parallel ranks advertise inconsistent KV transfer geometry")
    states = [entry.get("ssm") or {} for entry in instance_meta]
    if any(not isinstance(state, dict) for state in states):
        raise ValueError("SSM transfer metadata must be a dictionary")
    kinds = []
    for kind in sorted({kind for state in states for kind in state}):
        geometries, spans = set(), set()
        for state in states:
            descriptor = state.get(kind)
            layout = descriptor.get("ssm_layout") if isinstance(descriptor, dict) else None
            dims = layout.get("dims") if isinstance(layout, dict) else None
            if not isinstance(dims, dict):
                raise ValueError(f"model-parallel metadata is missing {kind} SSM geometry")
            assert isinstance(descriptor, dict) and isinstance(layout, dict)
            geometries.add((descriptor.get("element_size"), tuple(sorted(dims.items()))))
            spans.add((int(layout["layer_start"]), int(layout["num_layers"])))
        if len(geometries) > 1 or next(iter(geometries))[0] is None:
            raise ValueError(f"model-parallel ranks advertise inconsistent {kind} SSM geometry")
        layers = 0
        for start, count in sorted(spans):
            if start != layers:
                raise ValueError(f"model-parallel {kind} SSM layers are not contiguous")
            layers = max(layers, start + count)
        kinds.append((kind, next(iter(geometries)), layers))
    return next(iter(kv)), tuple(kinds)


#: Why a P/D request whose sampling params are not a map ends (hop 1 adds a key to them).
PARAMS_NOT_A_MAP = "sampling params: not a map"


def map_head(params: bytes | memoryview) -> tuple[int, int] | None:
    """``(count, head size)`` of the msgpack map head ``params`` starts with; None when
    it starts with none (a P/D request's params then end it: PARAMS_NOT_A_MAP)."""
    data = bytes(params[:5])
    if data[:1] and 0x80 <= data[0] <= 0x8F:
        return data[0] & 0x0F, 1
    if data[:1] == b"\xde" and len(data) >= 3:
        return int.from_bytes(data[1:3], "big"), 3
    if data[:1] == b"\xdf" and len(data) >= 5:
        return int.from_bytes(data[1:5], "big"), 5
    return None


def with_keys(params: bytes | memoryview, keys: Mapping[str, Any]) -> bytes:
    """A msgpack map's bytes with ``keys`` appended, the map itself not decoded: its
    head counts them, their pairs follow it. Decoded, each key appended wins over the
    same key in the map (a decoder keeps the last). ProtocolError when ``params`` is
    not a map's head. The C room splices the same bytes."""
    return _splice(params, _packed_pairs(keys))


def _packed_pairs(keys: Mapping[str, Any]) -> tuple[int, bytes]:
    return len(keys), b"".join(packb(key) + packb(value) for key, value in keys.items())


def _splice(params: bytes | memoryview, pairs: tuple[int, bytes]) -> bytes:
    """with_keys of pairs packed once (their count, their bytes)."""
    data = bytes(params)
    found = map_head(data)
    if found is None:
        raise ProtocolError(PARAMS_NOT_A_MAP)
    count, head = found
    count += pairs[0]
    if count <= 0x0F:
        out = bytes([0x80 | count])
    elif count <= 0xFFFF:
        out = b"\xde" + count.to_bytes(2, "big")
    else:
        out = b"\xdf" + count.to_bytes(4, "big")
    return out + data[head:] + pairs[1]


def refuses_prompt_log_probs(params: Any) -> bool:
    """Whether #6675 refuses a request before its prefill: prompt log probabilities
    asked for (``return_log_probs`` without ``skip_prompt_log_probs``, which counts
    as set when absent), which a handoff does not carry."""
    return (
        isinstance(params, dict)
        and bool(params.get("return_log_probs"))
        and not params.get("skip_prompt_log_probs", True)
    )


#: REQUEST_ERROR's reasons when the coordinator ends a P/D request, #6675's texts.
PROMPT_LOG_PROBS = "prompt log probabilities are not supported by native disaggregation"
NO_HANDOFF = "prefill reply carried no handoff metadata"
BAD_HANDOFF = "prefill reply carried invalid handoff metadata"
UNEXPECTED_READINESS = "unexpected KV transfer readiness notification"
#: coordkit's own (#6675 has no lease): the pins' lease ran out before the decode read
#: them, and no retry was left.
LEASE_EXPIRED = "the KV handoff's lease expired before its decode read it"


def cannot_route(role: str) -> str:
    """No engine of ``role`` ("prefill" or "decode") to take a hop."""
    return f"cannot route to {role}: no {role} engines registered"


def removed(identity: bytes) -> str:
    """The engine holding a hop of the request left."""
    return f"engine {identity!r} removed"


def queued_on_removed(identity: bytes) -> str:
    """The engine a request waited for (its queue) left."""
    return f"queued on removed engine {identity!r}"


def handoff_of(finished: Any) -> tuple[dict[Any, Any], list[int]] | str:
    """A #6675 prefill's finished request (a map of its ENGINE_REPLY) read for its
    handoff: ``disaggregated_params``'s ``kv_meta`` and ``block_ids``, or the reason
    #6675 fails the request with (a FAILED prefill carries none)."""
    handoff = finished.get("disaggregated_params") if isinstance(finished, dict) else None
    if not isinstance(handoff, dict):
        return NO_HANDOFF
    kv_meta, blocks = handoff.get("kv_meta"), handoff.get("block_ids")
    if not isinstance(kv_meta, dict) or not isinstance(blocks, list):
        return BAD_HANDOFF
    if any(type(block) is not int for block in blocks):
        return BAD_HANDOFF
    return kv_meta, blocks


_AGENT, _BLOB = "agent_name", "agent_metadata_b64"


def _agents(instance_meta: Any) -> dict[Any, Any]:
    """Every NIXL agent a registration names, with its metadata blob, in the order
    met (a blob that differs from one met before is refused)."""
    agents: dict[Any, Any] = {}

    def visit(value: Any) -> None:
        if isinstance(value, dict):
            name, blob = value.get(_AGENT), value.get(_BLOB)
            if name is not None and blob is not None and agents.setdefault(name, blob) != blob:
                raise ValueError(f"NIXL agent {name!r} has conflicting registered metadata")
            children: Any = value.values()
        elif isinstance(value, (list, tuple)):
            children = value
        else:
            return
        for child in children:
            visit(child)

    visit(instance_meta)
    return agents


def _agents_or_none(instance_meta: Any) -> dict[Any, Any] | None:
    """A registration's agents, or None where they conflict (or nest too deeply):
    restore_nixl_blobs then reads them again and refuses each handoff, as #6675 does."""
    try:
        return _agents(instance_meta)
    except (ValueError, RecursionError):
        return None


def restore_nixl_blobs(
    kv_meta: Any, instance_meta: Any, agents: dict[Any, Any] | None = None
) -> Any:
    """A NIXL prefill's ``kv_meta`` with each agent's metadata blob put back from the
    prefill's registration (the prefill leaves them out of every handoff); ``agents``:
    the registration's, read once (Registration.agents). ValueError when an agent was
    not registered or its blob differs; the room ends the request with
    ``"invalid NIXL handoff metadata: " + str(error)``, as #6675 does. Metadata nested
    past Python's recursion limit (msgpack decodes deeper) is a ValueError too: a
    peer's message never stops the loop. What names no agent is returned as it came,
    not copied (the room packs it at once)."""
    try:
        return _restored(kv_meta, _agents(instance_meta) if agents is None else agents)
    except RecursionError:
        raise ValueError("metadata nested too deeply") from None


_NESTED = (dict, list, tuple)


def _restored(value: Any, agents: dict[Any, Any]) -> Any:
    if isinstance(value, (list, tuple)):
        items = [_restored(item, agents) if isinstance(item, _NESTED) else item for item in value]
        if all(new is old for new, old in zip(items, value, strict=True)):
            return value
        return items if isinstance(value, list) else tuple(items)
    if not isinstance(value, dict):
        return value
    out: dict[Any, Any] | None = None
    for key, item in value.items():
        if isinstance(item, _NESTED):
            new = _restored(item, agents)
            if new is not item:
                out = dict(value) if out is None else out
                out[key] = new
    name = value.get(_AGENT)
    if name is None:
        return value if out is None else out
    try:
        registered = name in agents
    except TypeError:  # a list or a map names no agent a registration can hold
        registered = False
    if not registered:
        raise ValueError(f"NIXL agent {name!r} is absent from instance registration")
    if value.get(_BLOB) is not None and value[_BLOB] != agents[name]:
        raise ValueError(f"NIXL agent {name!r} handoff metadata differs from its registration")
    out = dict(value) if out is None else out
    out[_BLOB] = agents[name]
    return out


def decode_slots(kv_meta: Any) -> int:
    """The SSM slots a handoff takes at its decode: 1 when it carries SSM state."""
    return int(isinstance(kv_meta, dict) and bool(kv_meta.get("ssm")))


# -- what both rooms send, and their options ----------------------------------------------

#: ``pd_mode``: "conditional" runs a short or cached prompt whole (DEFAULT_PD_THRESHOLD),
#: "always" takes both hops whenever a prefill and a decode engine are up.
PD_MODES = ("conditional", "always")
#: Seconds a prefill's pins may wait for their decode's read before they are released.
DEFAULT_PD_LEASE = 60.0
#: Re-prefills and re-handoffs a request may take after an engine's death.
DEFAULT_PD_RETRIES = 2
#: The hop stages of a request of the room (0: not the room's, or run whole).
QUEUED_PREFILL, PREFILL, QUEUED_DECODE, DECODE, READ = 1, 2, 3, 4, 5
#: The transfer domain of every #6675 engine (one transport and geometry per fleet,
#: check_register_role keeps it so); coordkit's domains are names an engine says.
MEGATRON_DOMAIN = "\x00pr6675"
#: A #6675 decode's text for a prompt it is sent (it refuses prefill work).
ABORTED_TEXT = "request aborted"
TIMED_OUT_TEXT = "request timed out"


#: The rooms' counts (stats()["pd"]["counts"]).
PD_COUNTS = (
    "requests",  # took both hops
    "whole",  # conditional: run whole on one engine
    "handoffs",
    "reprefilled",
    "rehanded",
    "pins_released",
    "leases_expired",
    "roles_refused",
    "stray",  # hop messages from an engine that does not hold that hop
)


def check_options(mode: str, threshold: int, lease: float, retries: int) -> None:
    """The P/D options of a Coordinator, refused in one line each."""
    if mode not in PD_MODES:
        raise ValueError(f"pd_mode must be one of {', '.join(PD_MODES)}, not {mode!r}")
    if type(threshold) is not int or threshold < 0:
        raise ValueError(f"pd_threshold must be an int of at least 0, not {threshold!r}")
    if not lease > 0:
        raise ValueError(f"pd_lease must be above 0 seconds, not {lease!r}")
    if type(retries) is not int or retries < 0:
        raise ValueError(f"pd_retries must be an int of at least 0, not {retries!r}")


def _array_head(count: int) -> bytes:
    if count <= 0x0F:
        return bytes([0x90 | count])
    return b"\xdc" + count.to_bytes(2, "big")


def prompt_tokens_of(record: Any) -> list[int] | None:
    """A #6675 prefill's record read for its prompt's tokens (asked for a str prompt):
    a list of ints, or a tensor as Megatron's ``serialize()`` writes one,
    ``["tensor", [ids...]]``; None when it carries none a decode could read."""
    tokens = record.get("prompt_tokens") if isinstance(record, dict) else None
    if isinstance(tokens, list) and len(tokens) == 2 and tokens[0] == "tensor":
        tokens = tokens[1]
    if isinstance(tokens, list) and all(type(token) is int for token in tokens):
        return tokens
    return None


def str_prompt(prompt: bytes | memoryview) -> bool:
    """Whether a packed prompt is a msgpack str (a #6675 decode cannot take one)."""
    first = prompt[0] if len(prompt) else 0
    return 0xA0 <= first <= 0xBF or first in (0xD9, 0xDA, 0xDB)


def prefill_frames(
    megatron: bool, rid: int, prompt: bytes, params: bytes, tokens_back: bool
) -> list[bytes]:
    """Hop 1, the frames after the prefill's routing id: to a #6675 engine one frame
    ``[20, rid, prompt, params + #6675's overrides]`` (``tokens_back``: a str prompt,
    whose tokens the record brings back for hop 2), to a coordkit engine
    ``[20, rid, params + do_kv_handoff]`` and the prompt frame."""
    if megatron:
        body = prompt + _splice(params, _MEGATRON_PAIRS[tokens_back])
        return [_array_head(4) + packb(20) + packb(rid) + body]
    head = _array_head(3) + packb(20) + packb(rid)
    return [head + with_keys(params, PREFILL_OVERRIDES["coordkit"]), prompt]


# #6675's prefill overrides packed once, a str prompt's with return_prompt_tokens too.
_MEGATRON_PAIRS = {
    tokens_back: _packed_pairs(
        {**PREFILL_OVERRIDES["megatron"], **({"return_prompt_tokens": True} if tokens_back else {})}
    )
    for tokens_back in (False, True)
}


def decode_frames(
    megatron: bool, rid: int, prompt: bytes, params: bytes, kv_meta: bytes, blocks: bytes
) -> list[bytes]:
    """Hop 2, the frames after the decode's routing id: to a #6675 engine
    ``[24, rid, prompt, params, kv_meta, src_block_ids]`` in one frame, to a coordkit
    engine ``[24, rid, params, kv_meta]``, the prompt and the block-ids frame. The
    client's own params: the prefill's overrides are not the decode's."""
    if megatron:
        return [_array_head(6) + packb(24) + packb(rid) + prompt + params + kv_meta + blocks]
    return [_array_head(4) + packb(24) + packb(rid) + params + kv_meta, prompt, blocks]


def send_kv_message(rid: int, decode_meta: Any, cached: int) -> bytes:
    """SEND_KV to a pushing prefill: ``[26, rid, decode_meta, cached_prefix_blocks]``."""
    return packb([26, rid, decode_meta, cached])


def uncached_tokens(tokens: int, depth: int, block_size: int) -> int:
    """A prompt's tokens not in the cached prefix of ``depth`` blocks."""
    return max(tokens - depth * block_size, 0)
