"""Numba kernel that splits a JSONL chunk into lines and reads each record's length field.

The kernel is a strict JSON validator for one line at a time, written so that whenever it calls a
line ``OK`` with length L, ``json.loads`` of that line accepts it and ``planner.sources.jsonl``
reads L
from it. Whatever it is unsure about -- an error, ``NaN``, a duplicate or escaped candidate key,
a non-positive length, nesting deeper than ``MAX_DEPTH`` -- it marks ``CHECK`` and leaves to
the Python reference checker, which also writes the error messages. Being stricter than Python
is always safe (it only costs a slow re-check); being laxer never is.

Worked example (fields ``input_ids, tokens, length, num_tokens``)::

    {"input_ids": [5, 6, 7], "text": "x"}   -> OK 3
    {"input_ids": null, "length": 2}          -> OK 2   (null counts as absent)
    \\t                                        -> BLANK
    {"length": 0}  /  {"length": 1.5}  /  [1] -> CHECK (the reference reports the problem)
"""

from __future__ import annotations

from typing import Any

import numpy as np
from numpy.typing import NDArray

from planner.jit import kernel as _typed_kernel

# The scanner's helpers carry no annotations (numba infers their types): as before, calls to them
# are untyped for mypy.
kernel: Any = _typed_kernel

BLANK, OK, CHECK = 0, 1, 2
"""Line states."""
KIND_LIST, KIND_INT, KIND_EITHER = 0, 1, 2
"""What a candidate field may hold: a token list, an integer length, or either."""
MAX_DEPTH = 64

_SP, _TAB, _CR, _NL = 32, 9, 13, 10
_QUOTE, _BACKSLASH, _COMMA, _COLON, _MINUS = 34, 92, 44, 58, 45
_LBRACE, _RBRACE, _LBRACKET, _RBRACKET = 123, 125, 91, 93


@kernel
def _ws(a, i, e):  # type: ignore[no-untyped-def]
    """First index >= i that is not JSON whitespace (a line holds no newline)."""
    while i < e and (a[i] == _SP or a[i] == _TAB or a[i] == _CR):
        i += 1
    return i


@kernel
def _string(a, i, e):  # type: ignore[no-untyped-def]
    """End of the string opening at a[i], or -1. Raw control characters are invalid (strict)."""
    i += 1
    while i < e:
        c = a[i]
        if c == _QUOTE:
            return i + 1
        if c < 32:
            return -1
        if c != _BACKSLASH:
            i += 1
            continue
        if i + 1 >= e:
            return -1
        d = a[i + 1]
        if d == 117:  # \uXXXX: exactly four hex digits
            if i + 6 > e:
                return -1
            for k in range(i + 2, i + 6):
                h = a[k]
                if not (48 <= h <= 57 or 65 <= h <= 70 or 97 <= h <= 102):
                    return -1
            i += 6
        elif d in (34, 92, 47, 98, 102, 110, 114, 116):  # " \ / b f n r t
            i += 2
        else:
            return -1
    return -1


@kernel
def _number(a, i, e):  # type: ignore[no-untyped-def]
    """(end or -1, is an integer, value, more than 18 digits) of the JSON number at a[i]."""
    negative = a[i] == _MINUS
    if negative:
        i += 1
    if i >= e or not 48 <= a[i] <= 57:
        return -1, False, 0, False  # also NaN/-Infinity: Python accepts them, so defer
    value = 0
    digits = 0
    if a[i] == 48:  # no leading zeros: a digit after "0" is invalid and fails in the caller
        i += 1
        digits = 1
    else:
        while i < e and 48 <= a[i] <= 57:
            if digits < 18:
                value = value * 10 + (int(a[i]) - 48)
            digits += 1
            i += 1
    is_int = True
    if i < e and a[i] == 46:  # fraction: "." and at least one digit
        is_int = False
        i += 1
        if i >= e or not 48 <= a[i] <= 57:
            return -1, False, 0, False
        while i < e and 48 <= a[i] <= 57:
            i += 1
    if i < e and (a[i] == 101 or a[i] == 69):  # exponent
        is_int = False
        i += 1
        if i < e and (a[i] == 43 or a[i] == _MINUS):
            i += 1
        if i >= e or not 48 <= a[i] <= 57:
            return -1, False, 0, False
        while i < e and 48 <= a[i] <= 57:
            i += 1
    return i, is_int, -value if negative else value, digits > 18


@kernel
def _literal(a, i, e, word):  # type: ignore[no-untyped-def]
    """End of the literal ``word`` (true/false/null as a byte tuple) at a[i], or -1."""
    if i + len(word) > e:
        return -1
    for k in range(len(word)):
        if a[i + k] != word[k]:
            return -1
    return i + len(word)


@kernel
def _scalar(a, i, e):  # type: ignore[no-untyped-def]
    """End of the string, number or literal at a[i], or -1."""
    c = a[i]
    if c == _QUOTE:
        return _string(a, i, e)
    if c == _MINUS or 48 <= c <= 57:
        return _number(a, i, e)[0]
    if c == 116:
        return _literal(a, i, e, (116, 114, 117, 101))
    if c == 102:
        return _literal(a, i, e, (102, 97, 108, 115, 101))
    if c == 110:
        return _literal(a, i, e, (110, 117, 108, 108))
    return -1


@kernel
def _key(a, i, e):  # type: ignore[no-untyped-def]
    """Index after the member key at a[i] and its colon, or -1."""
    if i >= e or a[i] != _QUOTE:
        return -1
    i = _string(a, i, e)
    if i < 0:
        return -1
    i = _ws(a, i, e)
    if i >= e or a[i] != _COLON:
        return -1
    return i + 1


@kernel
def _value(a, i, e, stack):  # type: ignore[no-untyped-def]
    """End of the JSON value at a[i] (validated, any nesting up to MAX_DEPTH), or -1."""
    depth = 0
    while True:
        # A value starts at i.
        i = _ws(a, i, e)
        if i >= e:
            return -1
        c = a[i]
        if c in (_LBRACE, _LBRACKET):
            i = _ws(a, i + 1, e)
            if i < e and a[i] == c + 2:  # "{}" or "[]" ("}" = "{" + 2, "]" = "[" + 2)
                i += 1
            else:
                if depth == MAX_DEPTH:
                    return -1
                stack[depth] = c
                depth += 1
                if c == _LBRACE:  # a key and a colon come before the member's value
                    i = _key(a, i, e)
                    if i < 0:
                        return -1
                continue
        else:
            i = _scalar(a, i, e)
            if i < 0:
                return -1
        # A value ended at i: close containers until one continues with a comma.
        while True:
            if depth == 0:
                return i
            i = _ws(a, i, e)
            if i >= e:
                return -1
            top = stack[depth - 1]
            if a[i] == top + 2:
                depth -= 1
                i += 1
                continue
            if a[i] != _COMMA:
                return -1
            i = _ws(a, i + 1, e)
            if top == _LBRACE:
                i = _key(a, i, e)
                if i < 0:
                    return -1
            break


@kernel
def _int_list(a, i, e):  # type: ignore[no-untyped-def]
    """(end or -1, element count) of an array of JSON integers at a[i] == "[".

    The hot loop of token-list files, so it skips digits without computing values; a fraction,
    an exponent or anything else that is not an integer gives -1 (the reference names it).
    """
    i = _ws(a, i + 1, e)
    if i < e and a[i] == _RBRACKET:
        return i + 1, 0
    count = 0
    while i < e:
        if a[i] == _MINUS:
            i += 1
        if i >= e or a[i] < 48 or a[i] > 57:
            return -1, 0
        if a[i] == 48:  # "0" may not be followed by a digit (no leading zeros)
            i += 1
        else:
            i += 1
            while i < e and 48 <= a[i] <= 57:
                i += 1
        count += 1
        while i < e and (a[i] == _SP or a[i] == _TAB or a[i] == _CR):
            i += 1
        if i >= e:
            return -1, 0
        c = a[i]
        i += 1
        if c == _RBRACKET:
            return i, count
        if c != _COMMA:
            return -1, 0
        while i < e and (a[i] == _SP or a[i] == _TAB or a[i] == _CR):
            i += 1
    return -1, 0


@kernel
def _match(a, i, j, names, bounds):  # type: ignore[no-untyped-def]
    """Index of the candidate whose name is a[i:j], -1 for none, -2 if the key has escapes."""
    for k in range(i, j):
        if a[k] == _BACKSLASH:
            return -2
    for f in range(len(bounds) - 1):
        lo, hi = bounds[f], bounds[f + 1]
        if hi - lo != j - i:
            continue
        k = 0
        while k < hi - lo and names[lo + k] == a[i + k]:
            k += 1
        if k == hi - lo:
            return f
    return -1


@kernel
def _line(a, s, e, names, bounds, kinds, stack, status, values):  # type: ignore[no-untyped-def]
    """(state, length) of the line a[s:e]; status/values are per-field scratch arrays."""
    i = _ws(a, s, e)
    if i == e:
        return BLANK, 0
    if a[i] != _LBRACE:
        return CHECK, 0
    status[:] = 0  # per candidate: 0 absent, 1 null, 2 holds values[f]
    i = _ws(a, i + 1, e)
    if i < e and a[i] == _RBRACE:
        i += 1
    else:
        while True:
            if i >= e or a[i] != _QUOTE:
                return CHECK, 0
            j = _string(a, i, e)
            if j < 0:
                return CHECK, 0
            f = _match(a, i + 1, j - 1, names, bounds)
            i = _ws(a, j, e)
            if f == -2 or i >= e or a[i] != _COLON:
                return CHECK, 0
            i = _ws(a, i + 1, e)
            if i >= e:
                return CHECK, 0
            if f < 0:
                i = _value(a, i, e, stack)
            elif status[f] != 0:  # duplicate key: Python keeps the last one
                return CHECK, 0
            elif a[i] == _LBRACKET and kinds[f] != KIND_INT:
                i, count = _int_list(a, i, e)
                values[f] = count
                status[f] = 2
            elif (a[i] == _MINUS or 48 <= a[i] <= 57) and kinds[f] != KIND_LIST:
                i, is_int, value, big = _number(a, i, e)
                if not is_int or big:
                    return CHECK, 0
                values[f] = value
                status[f] = 2
            else:
                i = _literal(a, i, e, (110, 117, 108, 108))  # only null is left for a field
                status[f] = 1
            if i < 0:
                return CHECK, 0
            i = _ws(a, i, e)
            if i < e and a[i] == _COMMA:
                i = _ws(a, i + 1, e)
                continue
            if i < e and a[i] == _RBRACE:
                i += 1
                break
            return CHECK, 0
    if _ws(a, i, e) != e:
        return CHECK, 0
    for f in range(len(kinds)):
        if status[f] == 2:
            return (OK, values[f]) if values[f] > 0 else (CHECK, 0)
    return CHECK, 0


@kernel
def scan_chunk(a, ends, names, bounds, kinds, states, lengths):  # type: ignore[no-untyped-def]
    """Classify each line of a chunk into ``states`` (BLANK/OK/CHECK) and ``lengths`` (if OK).

    Args:
        a: the chunk's bytes as uint8; ends: the index of every newline in ``a``.
        names, bounds: candidate field names, concatenated UTF-8, name f = names[bounds[f]:
            bounds[f + 1]], in precedence order; kinds: KIND_* per name.
        states, lengths: outputs, one entry per line.
    """
    stack = np.zeros(MAX_DEPTH, dtype=np.uint8)
    status = np.zeros(len(kinds), dtype=np.int8)
    values = np.zeros(len(kinds), dtype=np.int64)
    s = 0
    for line in range(len(ends)):
        e = ends[line]
        state, length = _line(a, s, e, names, bounds, kinds, stack, status, values)
        states[line] = state
        lengths[line] = length
        s = e + 1


def encode_fields(fields: tuple[str, ...], list_fields: frozenset[str],
                  int_fields: frozenset[str]) -> tuple[
                      NDArray[np.uint8], NDArray[np.int64], NDArray[np.int8]]:
    """(names, bounds, kinds) arrays for ``scan_chunk``."""
    encoded = [f.encode() for f in fields]
    names = np.frombuffer(b"".join(encoded), dtype=np.uint8).copy()
    bounds = np.concatenate([[0], np.cumsum([len(b) for b in encoded])]).astype(np.int64)
    kinds = np.array([KIND_LIST if f in list_fields else KIND_INT if f in int_fields
                      else KIND_EITHER for f in fields], dtype=np.int8)
    return names, bounds, kinds
