"""coordkit._pd: a #6675 engine's REGISTER_ROLE judged as PR #6675 judges it, and the
other pure parts of P/D both loop cores share.

The registration cases are PR #6675's own unit tests (its coordinator runtime's,
flow control's and routing's), read as a spec of what goes on the wire: the refusal
a REGISTER_ROLE gets is REQUEST_ERROR ``[29, str(error)]``, ``error`` the first the
PR's register_engine raises. Where a flow-control case registers metadata without
the KV geometry, the runtime's geometry check would fire first on the wire: those
cases carry the geometry, so that the check they are about is the one reached.
"""

from __future__ import annotations

import msgpack
import pytest

from coordkit import _pd
from coordkit._pd import Registration, check_register_role
from coordkit.protocol import HANDOFF_KEY, ProtocolError

GEOMETRY = {
    "tokens_per_block": 256,
    "element_size": 2,
    "head_dim": 128,
    "num_layers_global": 4,
    "num_kv_heads_global": 8,
}


def meta(rank: int = 0, request_capacity: object = 32, **values: object) -> dict:
    """One model-parallel rank's descriptor, as the PR's runtime test builds it."""
    return {"global_rank": rank, "request_capacity": request_capacity, **GEOMETRY, **values}


def ssm(kind_layers: tuple[int, int] = (0, 2), element_size: object = 2, **dims: int) -> dict:
    start, count = kind_layers
    layout = {"layer_start": start, "num_layers": count, "dims": {"nheads": 8, **dims}}
    return {"element_size": element_size, "ssm_layout": layout}


def register(
    fleet: dict[bytes, Registration],
    identity: bytes,
    role: object,
    transport: object,
    instance_meta: object,
) -> tuple[str | None, bool]:
    """Register as the PR's handler does: the fleet as it is after (a replaced engine
    removed first); the refusal's text, and whether it replaced one."""
    check = check_register_role([27, role, transport, instance_meta], identity, fleet)
    if check.replaces:
        del fleet[identity]
    if check.registration is not None:
        fleet[identity] = check.registration
    return check.refusal, check.replaces


@pytest.fixture
def fleet() -> dict[bytes, Registration]:
    """The PR runtime test's _runtime(): a prefill and a decode, NIXL, capacity 32."""
    engines: dict[bytes, Registration] = {}
    assert register(engines, b"prefill", "prefill", "nixl", [meta(0)]) == (None, False)
    assert register(engines, b"decode", "decode", "nixl", [meta(1)]) == (None, False)
    return engines


# -- coordinator runtime (test_disagg_coordinator_runtime.py) ----------------------------


def test_what_a_registration_keeps(fleet):
    prefill = fleet[b"prefill"]
    assert (prefill.role, prefill.transport, prefill.instance_meta) == (
        "prefill",
        "nixl",
        [meta(0)],
    )
    assert (prefill.request_capacity, prefill.ssm_capacity, prefill.slot_cost) == (32, None, 0)
    assert prefill.signature == fleet[b"decode"].signature == (tuple(GEOMETRY.values()), ())


def test_registration_rejects_mixed_transports(fleet):
    refusal = register(fleet, b"decode-2", "decode", "nccl", fleet[b"decode"].instance_meta)
    assert refusal == ("prefill and decode engines must use the same state transport", False)
    assert b"decode-2" not in fleet


def test_registration_rejects_incompatible_transfer_geometry(fleet):
    incompatible = [meta(1, head_dim=64)]
    refusal = register(fleet, b"decode-2", "decode", "nixl", incompatible)
    assert refusal == ("prefill and decode engines have incompatible transfer geometry", False)


def test_reconnection_replaces_stale_engine_accounting(fleet):
    """The same identity, role and transport again: the old one removed (its requests
    ended as at its death), the new one registered with fresh accounting."""
    assert register(fleet, b"decode", "decode", "nixl", [meta(1, request_capacity=1)]) == (
        None,
        True,
    )
    assert fleet[b"decode"].request_capacity == 1


def test_a_reconnecting_engine_may_not_change_its_role(fleet):
    """Removed first, then refused: the identity is registered no more."""
    refusal = register(fleet, b"decode", "prefill", "nixl", [meta(1)])
    assert refusal == ("engine b'decode' cannot change disaggregated role or transport", True)
    assert b"decode" not in fleet
    refusal = register(fleet, b"prefill", "prefill", "nccl", [meta(0)])
    assert refusal == ("engine b'prefill' cannot change disaggregated role or transport", True)
    assert fleet == {}


def test_the_geometry_is_the_fleets_until_the_fleet_is_gone(fleet):
    """The signature is reset only when every engine is gone: the last engine may come
    back with another geometry, which is then the fleet's."""
    del fleet[b"decode"]
    assert register(fleet, b"prefill", "prefill", "nixl", [meta(0, head_dim=64)]) == (None, True)
    refusal = register(fleet, b"decode", "decode", "nixl", [meta(1)])
    assert refusal == ("prefill and decode engines have incompatible transfer geometry", False)


# -- flow control (test_disagg_coordinator_flow_control.py) ------------------------------


def test_registration_uses_conservative_model_parallel_limits():
    check = check_register_role(
        [27, "decode", "nixl", [meta(0, ssm_slot_capacity=12), meta(1, 24, ssm_slot_capacity=10)]],
        b"decode",
        {},
    )
    assert check.registration is not None
    assert (check.registration.ssm_capacity, check.registration.request_capacity) == (10, 24)


def test_invalid_advertised_capacity_is_rejected():
    check = check_register_role([27, "decode", "nixl", [meta(ssm_slot_capacity=0)]], b"d", {})
    assert check.refusal == "SSM slot capacity must be positive, got 0"
    check = check_register_role([27, "decode", "nixl", [meta(request_capacity=0)]], b"d", {})
    assert check.refusal == "Request capacity must be positive, got 0"


@pytest.mark.parametrize(
    ("instance_meta", "reason"),
    [
        (None, "state transfer metadata must be a non-empty list"),
        ([], "state transfer metadata must be a non-empty list"),
        ([None], "every model-parallel transfer descriptor must be a dictionary"),
    ],
)
def test_malformed_engine_metadata_is_rejected(instance_meta, reason):
    assert check_register_role([27, "decode", "nixl", instance_meta], b"d", {}).refusal == reason


def test_partially_advertised_model_parallel_capacity_is_rejected():
    partial = [meta(0, ssm_slot_capacity=4), meta(1)]
    check = check_register_role([27, "decode", "nixl", partial], b"d", {})
    assert (
        check.refusal
        == "SSM slot capacity is missing from part of an engine's model-parallel metadata"
    )
    partial = [meta(0), meta(1, request_capacity=None)]
    check = check_register_role([27, "decode", "nixl", partial], b"d", {})
    assert check.refusal == (
        "Request capacity is missing from part of an engine's model-parallel metadata"
    )


def test_prefill_reservations_use_the_advertised_handoff_bound():
    hybrid = [meta(request_capacity=1, ssm_slot_capacity=1, ssm_handoff_max_slots=1)]
    check = check_register_role([27, "prefill", "nixl", hybrid], b"p", {})
    assert check.registration is not None and check.registration.slot_cost == 1
    check = check_register_role([27, "decode", "nixl", hybrid], b"d", {})
    assert check.registration is not None and check.registration.slot_cost == 0
    no_bound = [meta(ssm_slot_capacity=1)]
    check = check_register_role([27, "prefill", "nixl", no_bound], b"p", {})
    assert check.refusal == (
        "SSM handoff slot demand is missing from part of a prefill engine's model-parallel metadata"
    )
    zero = [meta(ssm_slot_capacity=1, ssm_handoff_max_slots=0)]
    check = check_register_role([27, "prefill", "nixl", zero], b"p", {})
    assert check.refusal == "SSM handoff slot demand must be positive, got 0"


# -- routing (test_disagg_coordinator_routing.py) ----------------------------------------


def test_both_is_not_a_role_of_6675():
    check = check_register_role([27, "both", "nixl", [meta()]], b"e", {})
    assert check.refusal == "unknown disaggregated role 'both'"


# -- the handler and the order of the checks (pd-6675 spec, section 3.3) -----------------


def test_a_coordinator_that_does_not_serve_pd_refuses_first():
    check = check_register_role([27], b"e", {}, disaggregated=False)
    assert check == (None, "REGISTER_ROLE requires a disaggregated coordinator", False)


@pytest.mark.parametrize(
    ("message", "reason"),
    [
        ([27, "decode", "nixl"], "not enough values to unpack (expected 4, got 3)"),
        ([27, "decode", "nixl", [meta()], 5], "too many values to unpack (expected 4)"),
    ],
)
def test_a_message_of_another_length_gets_pythons_unpacking_error(fleet, message, reason):
    assert check_register_role(message, b"decode", fleet) == (None, reason, False)


def test_the_checks_come_in_6675s_order(fleet):
    both_wrong = [meta(1, head_dim=64)]
    assert register(fleet, b"x", "router", "nccl", both_wrong)[0] == (
        "prefill and decode engines must use the same state transport"
    )
    assert register(fleet, b"x", "router", "nixl", both_wrong)[0] == (
        "prefill and decode engines have incompatible transfer geometry"
    )
    assert register(fleet, b"x", "router", "nixl", [meta(1, request_capacity=0)])[0] == (
        "unknown disaggregated role 'router'"
    )
    # the SSM slot capacity is read before the request capacity
    both = [meta(1, request_capacity=0, ssm_slot_capacity=0)]
    assert (
        register({}, b"x", "decode", "nixl", both)[0] == "SSM slot capacity must be positive, got 0"
    )


KV = "model-parallel ranks advertise inconsistent KV transfer geometry"
CONV = "model-parallel ranks advertise inconsistent conv SSM geometry"
NO_CONV = "model-parallel metadata is missing conv SSM geometry"
NO_START = {"element_size": 2, "ssm_layout": {"num_layers": 1, "dims": {}}}
NOT_INT = "int() argument must be a string, a bytes-like object or a real number, not 'list'"


@pytest.mark.parametrize(
    ("entries", "reason"),
    [
        ([meta(0), meta(1, head_dim=64)], KV),
        ([meta(0, head_dim=None)], KV),
        ([{k: v for k, v in meta().items() if k != "element_size"}], KV),
        ([meta(ssm=[1])], "SSM transfer metadata must be a dictionary"),
        ([meta(ssm={"conv": {"element_size": 2}})], NO_CONV),
        ([meta(0, ssm={"conv": ssm()}), meta(1, ssm={})], NO_CONV),
        ([meta(0, ssm={"conv": ssm()}), meta(1, ssm={"conv": ssm((2, 2), d_conv=4)})], CONV),
        ([meta(0, ssm={"conv": ssm(element_size=None)})], CONV),
        (
            [meta(ssm={"recurrent": ssm((2, 2))})],
            "model-parallel recurrent SSM layers are not contiguous",
        ),
        ([meta(0, ssm={"conv": NO_START})], "'layer_start'"),
        ([meta(request_capacity="many")], "invalid literal for int() with base 10: 'many'"),
        ([meta(request_capacity=[4])], NOT_INT),
        ([meta(head_dim=[128])], "unhashable type: 'list'"),
        ([meta(request_capacity=float("inf"))], "cannot convert float infinity to integer"),
    ],
)
def test_each_refusal_has_6675s_text(entries, reason):
    assert check_register_role([27, "decode", "nixl", entries], b"d", {}).refusal == reason


def test_a_hybrid_fleet_covers_its_layers_across_ranks():
    """Pipeline stages each hold a span of the SSM layers: together from 0, no gap."""
    staged = [meta(0, ssm={"conv": ssm((0, 2))}), meta(1, ssm={"conv": ssm((2, 2))})]
    check = check_register_role([27, "decode", "nixl", staged], b"d", {})
    assert check.registration is not None
    assert check.registration.signature[1] == (("conv", (2, (("nheads", 8),)), 4),)
    with_attention = [meta(0)]
    check = check_register_role(
        [27, "prefill", "nixl", with_attention], b"p", {b"d": check.registration}
    )
    assert check.refusal == "prefill and decode engines have incompatible transfer geometry"


def test_capacities_are_read_as_6675_reads_them():
    """int() of what came: a float is cut, a numeric str taken, True is 1."""
    check = check_register_role([27, "decode", "nixl", [meta(request_capacity="3")]], b"d", {})
    assert check.registration is not None and check.registration.request_capacity == 3
    check = check_register_role([27, "decode", "nixl", [meta(request_capacity=2.9)]], b"d", {})
    assert check.registration is not None and check.registration.request_capacity == 2


# -- the prefill hop and the handoff ------------------------------------------------------


def test_the_prefill_hop_params_are_the_clients_with_keys_appended():
    params = {"temperature": 0.5, "num_tokens_to_generate": 8, "streaming": True}
    for overrides in _pd.PREFILL_OVERRIDES.values():
        spliced = _pd.with_keys(msgpack.packb(params), overrides)
        assert msgpack.unpackb(spliced) == {**params, **overrides}
    megatron = msgpack.unpackb(
        _pd.with_keys(msgpack.packb(params), _pd.PREFILL_OVERRIDES["megatron"])
    )
    assert megatron[HANDOFF_KEY] is True and megatron["num_tokens_to_generate"] == 0
    assert megatron["skip_prompt_log_probs"] is True and megatron["num_tokens_total"] is None


@pytest.mark.parametrize("size", [0, 14, 15, 16, 65534, 65535, 65536])
def test_with_keys_rewrites_the_maps_head_at_every_width(size):
    params = {f"k{i}": i for i in range(size)}
    spliced = _pd.with_keys(msgpack.packb(params), {HANDOFF_KEY: True})
    assert msgpack.unpackb(spliced) == {**params, HANDOFF_KEY: True}
    assert len(msgpack.unpackb(spliced)) == size + 1


@pytest.mark.parametrize("params", [b"", msgpack.packb([1]), b"\xde\x00", msgpack.packb(None)])
def test_with_keys_takes_maps_only(params):
    with pytest.raises(ProtocolError, match="not a map"):
        _pd.with_keys(params, {HANDOFF_KEY: True})


def test_prompt_log_probs_are_refused_before_the_prefill():
    assert _pd.refuses_prompt_log_probs({"return_log_probs": True, "skip_prompt_log_probs": False})
    assert not _pd.refuses_prompt_log_probs({"return_log_probs": True})  # absent: skipped
    assert not _pd.refuses_prompt_log_probs(
        {"return_log_probs": True, "skip_prompt_log_probs": True}
    )
    assert not _pd.refuses_prompt_log_probs(["not", "a", "map"])
    assert _pd.PROMPT_LOG_PROBS == (
        "prompt log probabilities are not supported by native disaggregation"
    )


NONE = "prefill reply carried no handoff metadata"
INVALID = "prefill reply carried invalid handoff metadata"


@pytest.mark.parametrize(
    ("finished", "handoff"),
    [
        ({"disaggregated_params": {"kv_meta": {"a": 1}, "block_ids": [3, 4]}}, ({"a": 1}, [3, 4])),
        ({"status": "FAILED"}, NONE),
        ({"disaggregated_params": None}, NONE),
        ("not a map", NONE),
        ({"disaggregated_params": {"block_ids": [3]}}, INVALID),
        ({"disaggregated_params": {"kv_meta": {}}}, INVALID),
        ({"disaggregated_params": {"kv_meta": {}, "block_ids": "3"}}, INVALID),
        ({"disaggregated_params": {"kv_meta": {}, "block_ids": [True]}}, INVALID),
    ],
)
def test_a_6675_prefills_reply_read_for_its_handoff(finished, handoff):
    assert _pd.handoff_of(finished) == handoff


def test_nixl_blobs_are_put_back_from_the_prefills_registration():
    registered = [
        {
            "agent_name": "p0",
            "agent_metadata_b64": "blob0",
            "ssm": {"conv": {"agent_name": "p0-c", "agent_metadata_b64": "c"}},
        }
    ]
    kv_meta = {
        "tp_metas": [{"agent_name": "p0", "head_dim": 128}],
        "ssm": {"conv": {"agent_name": "p0-c"}},
        "resume_tokens": [7],
    }
    restored = _pd.restore_nixl_blobs(kv_meta, registered)
    assert restored == {
        "tp_metas": [{"agent_name": "p0", "head_dim": 128, "agent_metadata_b64": "blob0"}],
        "ssm": {"conv": {"agent_name": "p0-c", "agent_metadata_b64": "c"}},
        "resume_tokens": [7],
    }
    assert _pd.restore_nixl_blobs(
        {"agent_name": "p0", "agent_metadata_b64": "blob0"}, registered
    ) == {"agent_name": "p0", "agent_metadata_b64": "blob0"}
    with pytest.raises(ValueError, match="NIXL agent 'p9' is absent from instance registration"):
        _pd.restore_nixl_blobs({"agent_name": "p9"}, registered)
    with pytest.raises(
        ValueError, match="NIXL agent 'p0' handoff metadata differs from its registration"
    ):
        _pd.restore_nixl_blobs({"agent_name": "p0", "agent_metadata_b64": "other"}, registered)
    conflicting = [
        {"agent_name": "p0", "agent_metadata_b64": "a"},
        {"agent_name": "p0", "agent_metadata_b64": "b"},
    ]
    with pytest.raises(ValueError, match="NIXL agent 'p0' has conflicting registered metadata"):
        _pd.restore_nixl_blobs({}, conflicting)
    assert _pd.restore_nixl_blobs(("x", [1]), []) == ("x", [1])  # fmt: skip
    deep: list = []
    for _ in range(1020):  # msgpack decodes it; Python's recursion limit is below
        deep = [deep]
    msgpack.unpackb(msgpack.packb(deep))  # within what a peer may send
    with pytest.raises(ValueError, match="metadata nested too deeply"):
        _pd.restore_nixl_blobs({"tp_metas": deep}, registered)
    with pytest.raises(ValueError, match="metadata nested too deeply"):
        _pd.restore_nixl_blobs({}, [{"agent_name": "p0", "nested": deep}])


def test_the_coordinators_own_reasons():
    assert _pd.cannot_route("decode") == "cannot route to decode: no decode engines registered"
    assert _pd.removed(b"prefill_s0_dp0") == "engine b'prefill_s0_dp0' removed"
    assert _pd.queued_on_removed(b"d") == "queued on removed engine b'd'"
    assert (
        _pd.decode_slots({"ssm": {"conv": {}}}),
        _pd.decode_slots({}),
        _pd.decode_slots(None),
    ) == (1, 0, 0)


def test_a_registrations_nixl_agents_are_read_once():
    """check_register_role keeps the agents it read (the room restores each handoff's
    blobs from them); where they conflict it keeps none, and every handoff is refused
    as #6675 refuses it. What names no agent comes back as it came, not copied."""
    registered = [meta(agent_name="p0", agent_metadata_b64="blob0")]
    check = check_register_role([27, "prefill", "nixl", registered], b"p", {})
    assert check.registration is not None and check.registration.agents == {"p0": "blob0"}
    kv_meta = {"agent_name": "p0", "resume_tokens": [3]}
    restored = _pd.restore_nixl_blobs(kv_meta, registered, check.registration.agents)
    assert restored == {**kv_meta, "agent_metadata_b64": "blob0"}
    assert "agent_metadata_b64" not in kv_meta  # a copy: what came is not changed
    plain = {"resume_tokens": [3], "tp_metas": [{"head_dim": 128}]}
    assert _pd.restore_nixl_blobs(plain, registered, check.registration.agents) is plain
    conflicting = [registered[0], meta(1, agent_name="p0", agent_metadata_b64="other")]
    check = check_register_role([27, "prefill", "nixl", conflicting], b"q", {})
    assert check.registration is not None and check.registration.agents is None
    with pytest.raises(ValueError, match="NIXL agent 'p0' has conflicting registered metadata"):
        _pd.restore_nixl_blobs(kv_meta, conflicting, check.registration.agents)
