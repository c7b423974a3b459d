"""A vectorized reader for the two big arrays of a wdinfo.json.

PiD datasets list millions of tars. Any JSON parser spends seconds there building one object
per entry (10M shards: pyarrow's reader 6-8 s, ``json.loads`` plus arrays 4-9 s). The paths are
found here from the positions of the quote characters, and only the small rest of the document
(every field but the two arrays) goes through ``json.loads``.

Only plainly written documents take this path: ASCII, no backslash anywhere, and one
separator (such as ``",\\n    "``) between all the strings of ``data_list``. Any other
document gives None, and the caller parses it with a full JSON parser, which also names what is
wrong. numpy and json only; no Ray, no torch.
"""

from __future__ import annotations

import json

import attrs
import numpy as np

_WS = b" \t\n\r"
_CHUNK = 1 << 24  # bytes compared at a time: bounded scratch memory
_QUOTE = 0x22
#: what the bytes of an n-digit number add up to beyond its value: 0x30 * 11...1
_DIGIT_SUMS = np.array([0x30 * (10**n - 1) // 9 for n in range(19)], dtype=np.int64)


@attrs.frozen
class Scanned:
    """A wdinfo document split into its arrays and the rest."""

    #: every field but the arrays, which are ``[]`` here
    rest: dict
    #: ``data_list`` as Arrow-style string buffers: entry i is ``data[offsets[i]:offsets[i+1]]``
    offsets: np.ndarray
    data: bytes
    #: ``data_list_key_count`` when present (int64, not checked for sign or length)
    counts: np.ndarray | None


def scan_wdinfo(raw: bytes) -> Scanned | None:
    """Split a plainly written wdinfo; None when the document is not one (see module doc)."""
    if b"\\" in raw or not raw.isascii() or b"\0" in raw[:4]:
        return None
    view = np.frombuffer(raw, dtype=np.uint8)
    quotes = _positions(view, _QUOTE)
    if quotes.size % 2:
        return None
    spans = {}
    for key in ("data_list", "data_list_key_count"):
        span = _array_span(raw, quotes, key)
        if span is False:
            return None
        spans[key] = span
    paths, counts = spans["data_list"], spans["data_list_key_count"]
    if paths is None:
        return None
    strings = _string_body(raw, view, quotes, *paths)
    if strings is None:
        return None
    count_values = None
    if counts is not None:
        count_values = _int_body(raw, *counts)
        if count_values is None:
            return None
    skeleton = bytearray()
    end = 0
    for a, b in sorted(s for s in spans.values() if s is not None):
        skeleton += raw[end:a + 1]
        end = b
    skeleton += raw[end:]
    try:
        rest = json.loads(bytes(skeleton))
    except (ValueError, RecursionError):  # (nested past the recursion limit: json's to name)
        return None
    # the keys must be the document's own (not in a nested object), with the arrays cut out
    if not isinstance(rest, dict) or rest.get("data_list") != []:
        return None
    if counts is not None and rest.get("data_list_key_count") != []:
        return None
    return Scanned(rest, *strings, count_values)


def max_nesting(raw: bytes) -> int:
    """An upper bound of how deep ``[`` and ``{`` nest in ``raw`` (brackets inside strings
    counted too, so it errs high), a chunk at a time. pyarrow's JSON reader recurses once per
    level in C++ and crashes the process (a stack overflow, SIGSEGV) some thousands of levels
    down: documents nested deeper than a wdinfo ever is are left to ``json``, which raises."""
    view = np.frombuffer(raw, dtype=np.uint8)
    depth, deepest = 0, 0
    for s in range(0, view.size, _CHUNK):
        chunk = view[s:s + _CHUNK]
        step = ((chunk == 0x5B) | (chunk == 0x7B)).astype(np.int32)
        step -= ((chunk == 0x5D) | (chunk == 0x7D))
        levels = np.cumsum(step, dtype=np.int64) + depth
        if levels.size:
            deepest = max(deepest, int(levels.max()))
            depth = int(levels[-1])
    return deepest


def _positions(view: np.ndarray, byte: int) -> np.ndarray:
    """Positions of ``byte`` in ``view`` (ascending; int32 below 2 GiB), a chunk at a time:
    the scratch memory is reused (fresh pages are slow to fault in at 10M shards)."""
    kind = np.int32 if view.size < 2**31 else np.int64
    found = [np.flatnonzero(view[s:s + _CHUNK] == byte).astype(kind) + kind(s)
             for s in range(0, view.size, _CHUNK)]
    return np.concatenate(found) if found else np.empty(0, dtype=kind)


def _digit_runs(view: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(starts, ends) of the runs of bytes >= ``0``, ends exclusive (in a body of digits,
    commas and white space: the numbers)."""
    starts, ends = [], []
    before = np.zeros(min(view.size, _CHUNK), dtype=bool)
    for s in range(0, view.size, _CHUNK):
        digit = view[s:s + _CHUNK] >= 0x30
        prev = before[:digit.size]
        prev[0] = bool(view[s - 1] >= 0x30) if s else False
        prev[1:] = digit[:-1]
        starts.append(np.flatnonzero(digit > prev) + s)
        ends.append(np.flatnonzero(prev > digit) + s)
    if view.size and view[-1] >= 0x30:
        ends.append(np.array([view.size]))
    empty = np.empty(0, dtype=np.int64)
    return np.concatenate(starts or [empty]), np.concatenate(ends or [empty])


def _count_below(view: np.ndarray, limit: int) -> int:
    return sum(int(np.count_nonzero(view[s:s + _CHUNK] < limit))
               for s in range(0, view.size, _CHUNK))


def _array_span(raw: bytes, quotes: np.ndarray, key: str) -> tuple[int, int] | None | bool:
    """(position of ``[``, position of its ``]``) of the array value of the one ``"key"``
    string; None when no string is ``key``; False when it is not one key with an array of
    scalars."""
    token = f'"{key}"'.encode()
    found = []
    at = raw.find(token)
    while at >= 0:
        i = int(np.searchsorted(quotes, at))
        if i % 2 == 0 and i < quotes.size and quotes[i] == at:  # an opening quote
            found.append(at)
        at = raw.find(token, at + 1)
    if not found:
        return None
    if len(found) > 1:
        return False
    at = _skip_ws(raw, found[0] + len(token))
    if raw[at:at + 1] != b":":
        return False
    start = _skip_ws(raw, at + 1)
    if raw[start:start + 1] != b"[":
        return False
    at = start
    while True:  # the first "]" outside a string ends an array of scalars
        at = raw.find(b"]", at + 1)
        if at < 0:
            return False
        i = int(np.searchsorted(quotes, at))
        if i % 2 == 0:
            return start, at
        at = int(quotes[i])


def _skip_ws(raw: bytes, at: int) -> int:
    while at < len(raw) and raw[at] in _WS:
        at += 1
    return at


def _string_body(raw: bytes, view: np.ndarray, quotes: np.ndarray, start: int,
             end: int) -> tuple[np.ndarray, bytes] | None:
    """(offsets, data) of the strings between ``[`` at ``start`` and ``]`` at ``end``."""
    q = quotes[np.searchsorted(quotes, start):np.searchsorted(quotes, end)]
    n = q.size // 2
    if n == 0:
        return None
    opens, closes = q[0::2], q[1::2]
    first, last = int(q[0]), int(q[-1])
    if raw[start + 1:first].strip(_WS) or raw[last + 1:end].strip(_WS):
        return None
    lengths = closes - opens - 1
    sep = b""
    if n > 1:
        sep = raw[int(closes[0]) + 1:int(opens[1])]
        if sep.strip(_WS) != b",":
            return None
    # no control character inside a string (JSON forbids them): the count in the body is
    # the separators' own, once every separator is known to be ``sep`` (checked below)
    ctrl = sum(c < 0x20 for c in raw[start + 1:first] + raw[last + 1:end])
    if _count_below(view[start + 1:end], 0x20) != ctrl + (n - 1) * sum(c < 0x20 for c in sep):
        return None
    period = int(lengths[0]) + 2 + len(sep)
    if n > 1 and (lengths == lengths[0]).all() and (opens[1:] - opens[:-1] == period).all():
        # equal lengths and separators: the body is periodic and every string a strided row
        rows = np.lib.stride_tricks.as_strided(
            view[first + 1:], shape=(n, int(lengths[0])), strides=(period, 1), writeable=False)
        seps = np.lib.stride_tricks.as_strided(
            view[int(closes[0]) + 1:], shape=(n - 1, len(sep)), strides=(period, 1),
            writeable=False)
        if not (seps == np.frombuffer(sep, dtype=np.uint8)).all():
            return None
        data = rows.tobytes()
    else:
        # '"' + sep + '"' occurs only between two strings, or around a string whose text is
        # sep: with none of those, replace() removes each separator once, and the length says
        # that every one of them was sep
        if n > 1 and _any_string_is(view, opens, lengths, sep):
            return None
        data = raw[first + 1:last]
        if n > 1:
            data = data.replace(b'"' + sep + b'"', b"")
        if len(data) != int(lengths.sum()):
            return None
    offsets = np.zeros(n + 1, dtype=np.int64)
    np.cumsum(lengths, out=offsets[1:])
    return offsets, data


def _any_string_is(view: np.ndarray, opens: np.ndarray, lengths: np.ndarray,
                   text: bytes) -> bool:
    at = opens[lengths == len(text)] + 1
    for j, byte in enumerate(text):
        at = at[view[at + j] == byte]
        if at.size == 0:
            return False
    return True


def _int_body(raw: bytes, start: int, end: int) -> np.ndarray | None:
    """The integers between ``[`` at ``start`` and ``]`` at ``end``; None unless the body is
    JSON integers (no sign, no leading zero, at most 18 digits) split by single commas."""
    body = raw[start + 1:end]
    if body.translate(None, b"0123456789," + _WS):
        return None
    v = np.frombuffer(body, dtype=np.uint8)
    starts, ends = _digit_runs(v)
    lengths = ends - starts
    commas = _positions(v, 0x2C)
    if commas.size != max(starts.size - 1, 0):
        return None
    if not ((starts[:-1] < commas) & (commas < starts[1:])).all():
        return None
    if starts.size and (lengths.max() > 18 or ((v[starts] == 0x30) & (lengths > 1)).any()):
        return None
    values = np.zeros(starts.size, dtype=np.int64)
    digit = np.empty(starts.size, dtype=np.uint8)
    groups = np.flatnonzero(np.bincount(lengths)).tolist()
    for length in groups:
        rows = np.flatnonzero(lengths == length) if len(groups) > 1 else slice(None)
        at, value = (starts[rows] if len(groups) > 1 else starts), values[rows]
        for _ in range(length):  # Horner, one digit column at a time, adding the bytes
            value *= 10
            np.take(v, at, out=digit[:at.size])
            value += digit[:at.size]
            at += 1
        values[rows] = value
    values -= _DIGIT_SUMS[lengths]  # each digit was added as its byte, 0x30 more than it is
    return values
