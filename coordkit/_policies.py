"""The routing policies: their names, defaults and limits, the check of a router's
arguments, and the rules both routers follow.

Nothing here routes: ``_routing_py.Router`` (over dicts) and
``_routing_c.Router`` (over C tables) are twins that take their constants and
argument check from here and make the same decisions, bit for bit, given the
same calls. ``make constants`` writes WEIGHT_SCALE and MAX_BLOCKS into
``_constants.pxd`` for the C twin. The definitions below are the contract.

Ranks and eligibility
    A rank is an integer in ``[0, max_ranks)``. ``n_ranks`` is 1 + the highest
    rank ever added; every scan covers ``[0, n_ranks)``. A rank is *accepting*
    between ``add_rank`` and ``remove_rank``; its pending count (requests
    chosen and not yet released) survives ``remove_rank``, because the
    coordinator releases them one by one. ``eligible(r)`` is
    ``accepting(r) and (rank_cap == 0 or pending(r) < rank_cap)``.
    ``choose`` returns ``-1`` when no rank is eligible, and otherwise adds 1
    to the pending count of the rank it returns.

``round_robin``
    For ``k`` in ``0 .. n_ranks - 1``: ``r = (cursor + k) % n_ranks``; the
    first eligible ``r`` wins and ``cursor = (r + 1) % n_ranks``.

``least_loaded``
    ``start = cursor % n_ranks``; scan ``r = (start + k) % n_ranks`` for ``k``
    in ``0 .. n_ranks - 1`` and keep the first eligible rank with strictly the
    fewest pending; then ``cursor = (start + 1) % n_ranks``. The rotating
    start spreads a burst over ranks of equal load instead of sending all of
    it to rank 0. The cursor only moves when a rank is chosen (both here and
    in ``round_robin``); the policies that fall back to this one share it.

``power_of_two``
    ``members`` lists the accepting ranks: ``add_rank`` appends, and
    ``remove_rank`` moves the last member into the removed one's place.
    With ``n = len(members)``: ``n == 0`` gives ``-1``; ``n == 1`` gives
    ``a = b = members[0]``; otherwise ``i = rand() % n``,
    ``j = rand() % (n - 1)``, ``j += 1`` if ``j >= i``, ``a = members[i]``,
    ``b = members[j]``. If both are eligible the winner is ``b`` when
    ``pending(b) < pending(a)``, else ``a``; if one is, that one; if neither,
    ``least_loaded`` decides. ``rand()`` is splitmix64 over a 64-bit state
    that starts at ``seed``::

        state += 0x9E3779B97F4A7C15
        z = state
        z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9
        z = (z ^ (z >> 27)) * 0x94D049BB133111EB
        return z ^ (z >> 31)                    # all modulo 2**64

Work
    Every rank has an outstanding *work*, in work units of one block of
    ``block_size`` tokens. A ``choose`` that returns a rank charges it
    ``charged`` units, readable right after (0 after a ``choose`` that returns
    ``-1``), and adds them to ``work(r)``; ``release(r, work)`` subtracts
    ``work`` (never below 0) and 1 from the pending count. A request's *new
    blocks* on a rank are the blocks that rank would have to prefill::

        size       = m                                          with m > 0 block hashes
                   = ceil(prompt_tokens / block_size)    without
        new(r)     = min(size - depth(r), MAX_BLOCKS)           depth(r) is 0 except under prefix
        decode     = min(ceil(prefix_decode_tokens / block_size), MAX_BLOCKS)
        charged    = new(r) + decode

    so ``charged`` is an int in ``[0, 2 * MAX_BLOCKS]``, whatever the policy.
    ``work`` survives ``remove_rank`` as the pending count does.

``prefix``
    Prefix-cache affinity over the request's block hashes ``h[0 .. m-1]``
    (see :func:`coordkit.protocol.block_hashes`), priced in work. The router
    keeps a table ``hash -> (ranks, last_used)`` in LRU order; an entry is
    *live* at ``now`` when ``now - last_used <= prefix_ttl``.

    * ``depth(r)`` of an eligible rank is the number of leading hashes
      ``h[0 .. d-1]`` that all have a live entry listing ``r`` (0 when
      ``m == 0``).
    * With ``weight = round(prefix_prefill_weight * WEIGHT_SCALE)`` (an int,
      fixed when the router is built), each eligible rank costs the integer::

          cost(r) = weight * new(r) + WEIGHT_SCALE * work(r)

      the blocks it would prefill, weighted, plus the work already queued on
      it. The lowest cost wins; ties go to fewer pending, then to the first
      rank in ``least_loaded``'s rotating order (``start = cursor % n_ranks``,
      then ``start + 1``, ...), and ``cursor = (start + 1) % n_ranks``. With no
      hashes, or no match, that is the eligible rank with the least work.
    * If ``m > 0``, the chain is then recorded for the chosen rank ``r``:
      first, while the LRU-oldest entry is not live, it is deleted; then for
      each ``h[i]`` in order, a live entry gains ``r``, an expired one is
      reset to ``{r}``, and a missing one is inserted as ``{r}`` (deleting
      the LRU-oldest entry first when the table holds ``prefix_max_entries``);
      the entry's ``last_used`` becomes ``now`` and it moves to the
      most-recent end. Scoring only reads the table.
    * ``remove_rank(r)`` clears ``r`` from every entry and deletes the
      entries left empty; the others keep their LRU order.
    * ``learn(r, hashes, now)`` records the hashes of an engine's report (the
      chains of the requests routed to it lately, oldest first) for ``r``
      exactly as a decision records its chain, without counting a decision;
      under any other policy it does nothing.

Taking over
    ``hold(r)`` counts a request already at ``r`` (one a new coordinator
    adopts from an engine's report): ``pending(r) += 1``, and it is charged
    the decode share alone (``charged = decode``, its prompt unknown).

Block hashes
    ``h[0 .. m-1]`` are defined by :func:`coordkit.protocol.block_hashes`; the
    coordinator reads their frame in place.
"""

from __future__ import annotations

__all__ = [
    "POLICIES",
    "DEFAULT_PREFILL_WEIGHT",
    "DEFAULT_DECODE_TOKENS",
    "DEFAULT_BLOCK_SIZE",
    "WEIGHT_SCALE",
    "MAX_BLOCKS",
    "MAX_PREFILL_WEIGHT",
    "MAX_RANKS_LIMIT",
    "MAX_PREFIX_ENTRIES_LIMIT",
    "U64_MASK",
    "SPARSE_RANKS",
    "WALK_MAX",
    "check_args",
]

#: The routing policies, in the order the error message names them.
POLICIES = ("round_robin", "least_loaded", "power_of_two", "prefix")
#: Bounds that keep every count in a C int and every mask word count small.
MAX_RANKS_LIMIT = 1 << 16
MAX_PREFIX_ENTRIES_LIMIT = (1 << 31) - 1

#: The prefix policy's defaults (docs/routing.md says why these).
DEFAULT_PREFILL_WEIGHT = 32.0
DEFAULT_DECODE_TOKENS = 512
DEFAULT_BLOCK_SIZE = 16
#: The prefill weight counts in steps of 1 / WEIGHT_SCALE: costs stay integers.
WEIGHT_SCALE = 256
#: A request's new blocks are capped here, and so is the decode share: a charge
#: fits 2 * MAX_BLOCKS, and 2**30 requests' work times WEIGHT_SCALE fits int64.
MAX_BLOCKS = 1 << 23
MAX_PREFILL_WEIGHT = 65536.0

U64_MASK = (1 << 64) - 1  # the rng state and seeds are uint64

#: How both routers find prefix's winner without pricing every rank (docs/scaling.md):
#: an entry of at most SPARSE_RANKS ranks is read rank by rank, and the walk down the
#: ranking hides at most WALK_MAX ranks before it gives way to the full scan. Neither
#: changes a decision, only what it costs.
SPARSE_RANKS = 16
WALK_MAX = 16


def check_args(
    policy: object,
    max_ranks: int,
    seed: int,
    rank_cap: int,
    prefix_prefill_weight: float,
    prefix_decode_tokens: int,
    block_size: int,
    prefix_max_entries: int,
) -> tuple[int, int]:
    """Validate the constructor's arguments (the same for both routers);
    the prefill weight in units of 1 / WEIGHT_SCALE and the decode share in blocks."""
    if policy not in POLICIES:
        names = ", ".join(repr(p) for p in POLICIES)
        raise ValueError(f"policy must be one of {names}, not {policy!r}")
    if not 1 <= max_ranks <= MAX_RANKS_LIMIT:
        raise ValueError(f"max_ranks must be in [1, {MAX_RANKS_LIMIT}], not {max_ranks}")
    if not 0 <= seed <= U64_MASK:
        raise ValueError(f"seed must be in [0, 2**64), not {seed}")
    if not 0 <= rank_cap < 1 << 63:
        raise ValueError(f"rank_cap must be in [0, 2**63), not {rank_cap}")
    if not 0.0 <= prefix_prefill_weight <= MAX_PREFILL_WEIGHT:  # False for NaN
        raise ValueError(
            f"prefix_prefill_weight must be in [0, {MAX_PREFILL_WEIGHT:g}], "
            f"not {prefix_prefill_weight}"
        )
    if not 0 <= prefix_decode_tokens <= 1 << 31:
        raise ValueError(f"prefix_decode_tokens must be in [0, 2**31], not {prefix_decode_tokens}")
    if not 1 <= block_size <= 1 << 31:
        raise ValueError(f"block_size must be in [1, 2**31], not {block_size}")
    if not 1 <= prefix_max_entries <= MAX_PREFIX_ENTRIES_LIMIT:
        raise ValueError(
            f"prefix_max_entries must be in [1, {MAX_PREFIX_ENTRIES_LIMIT}], "
            f"not {prefix_max_entries}"
        )
    weight = round(float(prefix_prefill_weight) * WEIGHT_SCALE)
    return weight, min(-(-prefix_decode_tokens // block_size), MAX_BLOCKS)
