"""What coordkit refuses of its caller's arguments, and the one text of each refusal.

Addresses (every endpoint and the coordinator), prompts and sampling params
(both client cores) are checked here, so that the C core and its Python twin
raise the same exception with the same message, and every entry point the
same one for the same mistake:

* an address is ``tcp://HOST:PORT``, ``ipc:///path`` or ``inproc://name``; a
  client's or an engine's may be several, split by commas (the coordinators it
  may follow);
* a prompt is a ``str``, a bytes-like object (sent as it is) or token ids: a
  sequence (a list, a tuple, a ``range``...) or an integer buffer (numpy,
  ``array.array``, anything with ``tolist()``) of ints in ``[0, 2**32)``;
* sampling params are a map (a ``dict``, or any ``Mapping``) or None;
* a tenant is a str of 1 to MAX_TENANT_BYTES bytes in UTF-8, or None; a request's
  priority an int in [PRIORITY_MIN, PRIORITY_MAX], its deadline seconds (a real
  number > 0) or None.

The C core checks token ids itself, inside its packing loop, and comes here
only when that loop stopped at something it does not take: to pack what
needs converting (an ``IntEnum``, numpy integers in a list), or to raise the
error naming the token.
"""

from __future__ import annotations

import math
import numbers
import operator
from collections.abc import Mapping, Sequence
from typing import Any

import zmq

from ._shared import MAX_TENANT_WEIGHT, MIN_TENANT_WEIGHT
from .protocol import (
    INT64_MAX,
    MAX_CAPACITY,
    MAX_TENANT_BYTES,
    PRIORITY_MAX,
    PRIORITY_MIN,
    STREAM_KEY,
    packb,
    valid_tenant,
)

__all__ = [
    "ADDRESS_FORMS",
    "BYTES_LIKE",
    "TOKEN_LIMIT",
    "check_address",
    "check_addresses",
    "check_capacity",
    "check_params",
    "check_tenant",
    "check_tenant_weights",
    "qos_fields",
    "pack_params",
    "prompt_error",
    "streaming_params",
    "token_ids",
]

#: The endpoints coordkit binds and connects, as the error texts show them.
ADDRESS_FORMS = "tcp://HOST:PORT, ipc:///path or inproc://name"

#: Prompts sent as they are: raw bytes, not token ids.
BYTES_LIKE = (bytes, bytearray, memoryview, zmq.Frame)

#: Token ids are below this: a u32, as the block hashes and every engine read them.
TOKEN_LIMIT = 1 << 32

_TOKEN_RULE = "an int in [0, 2**32)"
_PROMPT_FORMS = "a str, a bytes-like object, or token ids (a sequence of ints in [0, 2**32))"
_EMPTY_PARAMS = packb({})


def _type_name(obj: object) -> str:
    kind = type(obj)
    module = kind.__module__
    return kind.__qualname__ if module == "builtins" else f"{module}.{kind.__qualname__}"


def _short(obj: object, limit: int = 40) -> str:
    text = repr(obj)
    return text if len(text) <= limit else text[: limit - 3] + "..."


# -- addresses ------------------------------------------------------------------------


def check_address(address: object) -> str:
    """``address`` when it has the form of an endpoint coordkit speaks on.

    ValueError (TypeError for what is not a str) in one line showing the forms
    otherwise. Only the form is checked: whether the host resolves or the
    path can be bound is libzmq's to say, when it binds or connects.
    """
    if not isinstance(address, str):
        kind = _type_name(address)
        raise TypeError(f"coordkit: an address is a str ({ADDRESS_FORMS}), not {kind}")
    transport, separator, rest = address.partition("://")
    if not separator:
        problem = "no transport"
    elif transport == "tcp":
        host, colon, port = rest.rpartition(":")
        if not colon or not host:
            problem = "no HOST:PORT"
        elif not (port == "*" or (port.isdigit() and int(port) <= 65535)):
            problem = f"port {port!r} is not 0-65535 or *"
        else:
            return address
    elif transport in ("ipc", "inproc"):
        if rest:
            return address
        problem = f"no {'path' if transport == 'ipc' else 'name'}"
    else:
        problem = f"unknown transport {transport!r}"
    raise ValueError(f"coordkit: bad address {address!r} ({problem}): expected {ADDRESS_FORMS}")


def check_addresses(address: object) -> tuple[str, ...]:
    """The coordinator addresses an endpoint may follow: ``address`` split at its commas
    (spaces around each are dropped), each checked as :func:`check_address` does."""
    if not isinstance(address, str) or "," not in address:
        return (check_address(address),)
    parts = tuple(part.strip() for part in address.split(","))
    if "" in parts or len(set(parts)) < len(parts):
        problem = "an empty address" if "" in parts else "an address twice"
        raise ValueError(f"coordkit: bad address list {address!r} ({problem})")
    return tuple(check_address(part) for part in parts)


# -- prompts --------------------------------------------------------------------------


def _where(prompt_index: int | None) -> str:
    """Which prompt an error is about: the one of submit()/stream(), or one of submit_many()'s."""
    return "prompt" if prompt_index is None else f"prompt {prompt_index}"


def prompt_error(prompt: object, prompt_index: int | None = None) -> TypeError:
    """The error for a prompt that is none of the forms taken."""
    return TypeError(
        f"coordkit: {_where(prompt_index)}: {_type_name(prompt)} is not {_PROMPT_FORMS}"
    )


def _token_error(index: int, value: object, prompt_index: int | None) -> Exception:
    where = _where(prompt_index)
    if type(value) is int:
        return ValueError(f"coordkit: {where}: token {index} is {value}, not {_TOKEN_RULE}")
    return TypeError(
        f"coordkit: {where}: token {index} is {_short(value)} ({_type_name(value)}), "
        f"not {_TOKEN_RULE}"
    )


def _token(index: int, value: Any, prompt_index: int | None) -> int:
    if type(value) is not int:
        if isinstance(value, bool):  # True is 1 to Python, never a token id
            raise _token_error(index, value, prompt_index)
        try:
            value = operator.index(value)  # an IntEnum, a numpy integer
        except TypeError:
            raise _token_error(index, value, prompt_index) from None
    if not 0 <= value < TOKEN_LIMIT:
        raise _token_error(index, value, prompt_index)
    return int(value)


def _plain(items: list[Any] | tuple[Any, ...]) -> bool:
    """Every item a plain int below TOKEN_LIMIT: checked without a Python call per item."""
    return not items or (
        set(map(type, items)) == {int} and min(items) >= 0 and max(items) < TOKEN_LIMIT
    )


def token_ids(tokens: Any, prompt_index: int | None = None) -> list[int] | tuple[int, ...]:
    """A token-id prompt as a list (or tuple) of plain ints in ``[0, 2**32)``.

    A list or tuple is taken as it is, an object with ``tolist()`` (numpy
    arrays, ``array.array``, torch tensors) by its list, any other
    ``Sequence`` by its items; anything else, or a token that is not an int in
    range, raises (TypeError, ValueError for an int out of range) naming the
    token's index and value. Integers that are not plain ints (an ``IntEnum``,
    numpy's) are converted, so that both cores pack the same bytes.
    ``prompt_index`` is the prompt's place in a ``submit_many`` call.
    """
    items: Any
    if isinstance(tokens, (list, tuple)):
        items = tokens
    elif isinstance(tokens, (str, *BYTES_LIKE, Mapping)):
        raise prompt_error(tokens, prompt_index)  # callers take str and bytes first
    elif hasattr(tokens, "tolist"):
        items = tokens.tolist()
        if not isinstance(items, list):  # a 0-d array: one int, not a prompt
            raise prompt_error(tokens, prompt_index)
    elif isinstance(tokens, Sequence):
        items = list(tokens)
    else:
        raise prompt_error(tokens, prompt_index)
    if _plain(items):
        return items
    return [_token(i, value, prompt_index) for i, value in enumerate(items)]


# -- sampling params ------------------------------------------------------------------


def check_params(sampling_params: Any) -> Mapping[Any, Any] | None:
    """``sampling_params`` when it is a map or None; TypeError otherwise."""
    if sampling_params is None or isinstance(sampling_params, Mapping):
        return sampling_params
    raise TypeError(
        f"coordkit: sampling_params must be a map (a dict) or None, "
        f"not {_type_name(sampling_params)}"
    )


def pack_params(sampling_params: Any) -> bytes:
    """The params' frame bytes (``{}`` for None); TypeError or ValueError, naming
    the params, when they are not a map or hold what msgpack cannot pack."""
    params = check_params(sampling_params)
    if params is None:
        return _EMPTY_PARAMS
    try:
        return packb(params if isinstance(params, dict) else dict(params))
    except TypeError as exc:
        raise TypeError(f"coordkit: sampling_params cannot be packed: {exc}") from None
    except (ValueError, OverflowError) as exc:
        raise ValueError(f"coordkit: sampling_params cannot be packed: {exc}") from None


def streaming_params(sampling_params: Any) -> dict[Any, Any]:
    """The params of :meth:`Client.stream`: the caller's, with ``{STREAM_KEY: True}``."""
    params = check_params(sampling_params)
    return {**(params or {}), STREAM_KEY: True}


# -- tenants, priorities and deadlines ------------------------------------------------

_TENANT_RULE = f"a str of 1 to {MAX_TENANT_BYTES} bytes in UTF-8"
_PRIORITY_RULE = f"an int in [{PRIORITY_MIN}, {PRIORITY_MAX}] (lower is served first)"
_DEADLINE_RULE = "seconds (a number > 0) or None"


def check_tenant(tenant: object) -> str | None:
    """``tenant`` when it may name one (or is None); TypeError or ValueError otherwise."""
    if tenant is None or valid_tenant(tenant):
        return tenant  # type: ignore[return-value]
    if not isinstance(tenant, str):
        raise TypeError(f"coordkit: tenant must be {_TENANT_RULE}, not {_type_name(tenant)}")
    raise ValueError(f"coordkit: tenant must be {_TENANT_RULE}, not {_short(tenant)}")


def check_tenant_weights(weights: object) -> tuple[tuple[str, float], ...]:
    """The ``(name, weight)`` pairs of a map of tenant names to weights (None: none),
    each weight a real number in [lowest, highest]; TypeError or ValueError naming the
    tenant otherwise."""
    if weights is None:
        return ()
    if not isinstance(weights, Mapping):
        raise TypeError(
            f"coordkit: tenant_weights must be a map of tenant names to weights, "
            f"not {_type_name(weights)}"
        )
    rule = f"a number in [{MIN_TENANT_WEIGHT:g}, {MAX_TENANT_WEIGHT:g}]"
    pairs = []
    for name, weight in weights.items():
        check_tenant(name)
        if isinstance(weight, bool) or not isinstance(weight, numbers.Real):
            raise TypeError(
                f"coordkit: tenant {name!r}: its weight must be {rule}, not {_type_name(weight)}"
            )
        value = float(weight)
        if not MIN_TENANT_WEIGHT <= value <= MAX_TENANT_WEIGHT:
            raise ValueError(f"coordkit: tenant {name!r}: its weight must be {rule}, not {weight}")
        pairs.append((name, value))
    return tuple(pairs)


def check_capacity(capacity: object) -> int:
    """An engine's capacity: an int in [0, MAX_CAPACITY] (0: none declared)."""
    rule = f"an int in [0, {MAX_CAPACITY}] (0: none)"
    if isinstance(capacity, bool) or not isinstance(capacity, int):
        raise TypeError(f"coordkit: capacity must be {rule}, not {_type_name(capacity)}")
    if not 0 <= capacity <= MAX_CAPACITY:
        raise ValueError(f"coordkit: capacity must be {rule}, not {capacity}")
    return capacity


def _priority(priority: object) -> int:
    if isinstance(priority, bool) or not isinstance(priority, numbers.Integral):
        raise TypeError(f"coordkit: priority must be {_PRIORITY_RULE}, not {_type_name(priority)}")
    value = int(priority)
    if not PRIORITY_MIN <= value <= PRIORITY_MAX:
        raise ValueError(f"coordkit: priority must be {_PRIORITY_RULE}, not {value}")
    return value


def _deadline_ms(deadline: object) -> int:
    """A deadline in whole milliseconds, rounded up (at least 1); 0 for None."""
    if deadline is None:
        return 0
    if isinstance(deadline, bool) or not isinstance(deadline, numbers.Real):
        raise TypeError(f"coordkit: deadline must be {_DEADLINE_RULE}, not {_type_name(deadline)}")
    seconds = float(deadline)
    if not (0 < seconds < math.inf and math.ceil(seconds * 1000) <= INT64_MAX):
        raise ValueError(f"coordkit: deadline must be {_DEADLINE_RULE}, not {deadline!r}")
    return math.ceil(seconds * 1000)


def qos_fields(priority: object, deadline: object) -> bytes:
    """A request's QoS fields as they follow its rid on the wire, ``priority,
    deadline_ms`` packed (SUBMIT_REQUEST_QOS); empty for the defaults (priority 0, no
    deadline), which are not sent. TypeError or ValueError, in one line, for a priority
    or a deadline coordkit does not take."""
    if deadline is None and priority.__class__ is int and priority == 0:
        return b""  # the defaults, most requests': no check to pay for
    value, ms = _priority(priority), _deadline_ms(deadline)
    if value == 0 and ms == 0:
        return b""
    return packb(value) + packb(ms)
