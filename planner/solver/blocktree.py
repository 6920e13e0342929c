"""The placement kernel's search at the smallest size (numba): a tree over the units, exact in
O(log N).

The kernel (place.py) asks, for nearly every segment, for the unit (block of the smallest size
k0) where it would end lowest: joining a group there with room for its ``p`` padded tokens, or
opening a group on a unit with a free microbatch; the lowest unit on ties. At k0 opening costs
no ring latency beyond what every microbatch pays, so both end at the unit's load plus the
segment's time: the answer is the first unit of lowest load among the *candidates*, the units
that are openable or hold a group with room >= p. A scan costs O(N) a segment, which dominated
planning at pools of hundreds of ranks, and a tree pruned by "lowest load" and "largest room"
separately degrades towards the scan whenever the lowest-load units lack room (issue 24).

Segments reach this search in non-increasing ``p`` (items.py orders them by work, which grows
with the padded length), so between placements the candidate set only grows: a unit whose room
is below the last ``p`` asked (the *threshold*) becomes a candidate only when a later, smaller
``p`` reaches its room, or when a placement changes it. The tree keeps each unit in one of two
states, and per node

- ``a_load``: the lowest load of an *active* unit below it (openable, or room >= threshold),
  +inf if none, and ``a_arg`` the first unit that has it; ``a_room``: the largest room of an
  active unit (pack mode's best fit);
- ``w_room``: the largest room of a *waiting* unit (the others).

A question for ``p`` below the threshold first activates every waiting unit of room >= p (each
found in O(log N) from the root; a unit activates at most once per change), then reads the
lowest active load at the root: its first unit is the answer unless a larger load ends equal
by rounding (the next double above it does not end higher), and then it descends to the first
unit whose end rounds to the same value (rounding is monotone, so a subtree's lowest load
gives its lowest end). A ``p`` above the threshold (never in the kernel's order with
non-negative cost coefficients) rewrites every unit against it, O(N). A placement rewrites the
units it touched and their ancestors. Answers are exactly the scan's, so plans do not change.

Layout: ``width`` leaf slots (a power of two >= the unit count); node j has children 2j and
2j + 1, node 1 is the root, unit u is leaf ``width + u``; empty slots are never active and
never wait (+inf load, room -1).
"""

from __future__ import annotations

import numpy as np
from numpy.typing import NDArray

from planner.jit import kernel, no_refcount

NO_THRESHOLD = np.iinfo(np.int64).max
"""The threshold before any question: only openable units are active."""


@kernel
def tree_width(num_units: int) -> int:
    """Leaf slots: the smallest power of two >= ``num_units``."""
    w = 1
    while w < num_units:
        w *= 2
    return w


@no_refcount
def _put(u: int, load: float, openable: bool, room: int, threshold: int, width: int,
         a_load: NDArray[np.float64], a_arg: NDArray[np.int64], a_room: NDArray[np.int64],
         w_room: NDArray[np.int64]) -> None:
    """Write unit ``u``'s leaf for ``threshold`` (ancestors are fixed by ``fix_up``)."""
    node = width + u
    a_arg[node] = u
    if openable or room >= threshold:
        a_load[node] = load
        a_room[node] = room
        w_room[node] = -1
    else:
        a_load[node] = np.inf
        a_room[node] = -1
        w_room[node] = room


@no_refcount
def fix_up(lo: int, hi: int, width: int, a_load: NDArray[np.float64], a_arg: NDArray[np.int64],
           a_room: NDArray[np.int64], w_room: NDArray[np.int64]) -> None:
    """Recompute the ancestors of leaves ``lo..hi`` (inclusive), stopping at a level where
    nothing changed (nothing above it can change then)."""
    lo += width
    hi += width
    while lo > 1:
        lo //= 2
        hi //= 2
        changed = False
        for j in range(lo, hi + 1):
            left = a_load[2 * j] <= a_load[2 * j + 1]
            ld = a_load[2 * j] if left else a_load[2 * j + 1]
            ag = a_arg[2 * j] if left else a_arg[2 * j + 1]
            ar = max(a_room[2 * j], a_room[2 * j + 1])
            rm = max(w_room[2 * j], w_room[2 * j + 1])
            if ld != a_load[j] or ag != a_arg[j] or ar != a_room[j] or rm != w_room[j]:
                a_load[j] = ld
                a_arg[j] = ag
                a_room[j] = ar
                w_room[j] = rm
                changed = True
        if not changed:
            return


@no_refcount
def _fix_one(u: int, width: int, a_load: NDArray[np.float64], a_arg: NDArray[np.int64],
             a_room: NDArray[np.int64], w_room: NDArray[np.int64]) -> None:
    """``fix_up(u, u, ...)``: one leaf's ancestors."""
    j = (width + u) // 2
    while j >= 1:
        left = a_load[2 * j] <= a_load[2 * j + 1]
        ld = a_load[2 * j] if left else a_load[2 * j + 1]
        ag = a_arg[2 * j] if left else a_arg[2 * j + 1]
        ar = max(a_room[2 * j], a_room[2 * j + 1])
        rm = max(w_room[2 * j], w_room[2 * j + 1])
        if ld == a_load[j] and ag == a_arg[j] and ar == a_room[j] and rm == w_room[j]:
            return
        a_load[j] = ld
        a_arg[j] = ag
        a_room[j] = ar
        w_room[j] = rm
        j //= 2


@no_refcount
def put_units(lo: int, hi: int, load: NDArray[np.float64], count: NDArray[np.int64],
              room: NDArray[np.int64], num_mb: int, state: NDArray[np.int64], width: int,
              a_load: NDArray[np.float64], a_arg: NDArray[np.int64],
              a_room: NDArray[np.int64], w_room: NDArray[np.int64]) -> None:
    """Units ``lo..hi`` changed (their ``load``, ``count`` or ``room``): rewrite them.

    ``state[0]`` is the threshold. ``load``/``count``/``room`` are indexed by unit (the kernel's
    level-0 block arrays).
    """
    for u in range(lo, hi + 1):
        _put(u, load[u], count[u] < num_mb, room[u], state[0], width, a_load, a_arg, a_room,
             w_room)
    if lo == hi:
        _fix_one(lo, width, a_load, a_arg, a_room, w_room)
    else:
        fix_up(lo, hi, width, a_load, a_arg, a_room, w_room)


@no_refcount
def lowest_unit(p: int, t: float, num_units: int, load: NDArray[np.float64],
                count: NDArray[np.int64], room: NDArray[np.int64], num_mb: int,
                state: NDArray[np.int64], width: int, a_load: NDArray[np.float64],
                a_arg: NDArray[np.int64], a_room: NDArray[np.int64],
                w_room: NDArray[np.int64]) -> tuple[int, float]:
    """(unit, end) of the first candidate unit of lowest ``load + t`` for ``p`` padded tokens:
    room >= p or count < num_mb; (-1, inf) when no unit is a candidate."""
    if p > state[0]:
        # Rare: the candidate set may shrink, so every unit is sorted again.
        state[0] = p
        put_units(0, num_units - 1, load, count, room, num_mb, state, width, a_load, a_arg,
                  a_room, w_room)
    else:
        state[0] = p
        while w_room[1] >= p:
            node = 1
            while node < width:
                node = 2 * node + (w_room[2 * node] < p)
            u = node - width
            a_load[node] = load[u]
            a_room[node] = room[u]
            w_room[node] = -1
            _fix_one(u, width, a_load, a_arg, a_room, w_room)
    low = a_load[1]
    if low == np.inf:
        return -1, np.inf
    end = low + t
    if np.nextafter(low, np.inf) + t > end:
        # No other load ends as low: the first unit of the lowest load is the answer.
        return a_arg[1], end
    # The first unit whose end rounds to ``end``: a subtree's lowest load gives its lowest end.
    node = 1
    while node < width:
        node = 2 * node + (a_load[2 * node] + t > end)
    return node - width, end


@no_refcount
def tightest(bb: int, p: int, room_cap: int, blk_ng: NDArray[np.int64],
             blk_g: NDArray[np.int64], g_fill: NDArray[np.int64]) -> int:
    """The least room a group of block ``bb`` (flat index) has left after taking ``p`` tokens
    (``room_cap`` when none holds them)."""
    room = room_cap
    for r in range(blk_ng[bb]):
        left = room_cap - g_fill[blk_g[bb, r]] - p
        if 0 <= left < room:
            room = left
    return room


@no_refcount
def best_fit(p: int, t: float, limit: float, off: int, width: int, first: int, room_cap: int,
             t_load: NDArray[np.float64], t_room: NDArray[np.int64], check_room: bool,
             load: NDArray[np.float64], blk_ng: NDArray[np.int64], blk_g: NDArray[np.int64],
             g_fill: NDArray[np.int64], stack: NDArray[np.int64]) -> tuple[int, float]:
    """Pack mode's best fit: (block, end) of the lowest (room a group has left after taking
    ``p``, block) among blocks with a group that holds ``p`` and ``load + t <= limit``; (-1, inf)
    when there is none.

    Walks a tree (nodes at ``off``, ``width`` leaves, block b's arrays at ``first + b``) whose
    ``t_load`` is, at a node, at most the load of every candidate below it (+inf at a leaf that
    is none) and, with ``check_room``, whose ``t_room`` is at least their rooms (a leaf's: its
    own), leftmost leaves first, skipping subtrees that cannot hold a candidate; an exact fit
    (no room left) ends the walk, since later blocks cannot beat it.
    """
    best_b = -1
    best_room = room_cap + 1
    best_end = np.inf
    top = 0
    stack[0] = 1
    while top >= 0:
        node = stack[top]
        top -= 1
        low = t_load[off + node]
        if low == np.inf or low + t > limit or (check_room and t_room[off + node] < p):
            continue
        if node < width:
            stack[top + 1] = 2 * node + 1
            stack[top + 2] = 2 * node
            top += 2
            continue
        b = node - width
        room = tightest(first + b, p, room_cap, blk_ng, blk_g, g_fill)
        if room < best_room:
            best_room = room
            best_b = b
            best_end = load[first + b] + t
            if room == 0:
                break
    return best_b, best_end
