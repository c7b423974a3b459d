"""The vectorized wdinfo reader: whatever it accepts, ``json.loads`` reads the same way; what it
declines is left to the full parsers. Checked on many layouts and on random corruptions."""

from __future__ import annotations

import json
import random

import numpy as np
import pytest

from ray_ingest.catalog.scan import (
    Scanned,
    scan_wdinfo,
)


def _as_json(scanned: Scanned) -> tuple[dict, list[str], list[int] | None]:
    off, data = scanned.offsets, scanned.data
    paths = [data[off[i]:off[i + 1]].decode() for i in range(len(off) - 1)]
    counts = None if scanned.counts is None else scanned.counts.tolist()
    assert scanned.counts is None or scanned.counts.dtype == np.int64
    return scanned.rest, paths, counts


def _agrees(raw: bytes) -> Scanned | None:
    """Scan ``raw``; when accepted, json.loads must give the same document."""
    got = scan_wdinfo(raw)
    if got is None:
        return None
    doc = json.loads(raw)  # raises if the scanner accepted something json does not
    rest, paths, counts = _as_json(got)
    assert doc["data_list"] == paths
    assert doc.get("data_list_key_count") == counts
    want_rest = dict(doc, data_list=[])
    if counts is not None:
        want_rest["data_list_key_count"] = []
    assert rest == want_rest
    return got


def _doc(rng: random.Random, n: int, *, same_length: bool, with_counts: bool) -> dict:
    if same_length:
        paths = [f"part_{i // 100:06d}/{i % 100:06d}.tar" for i in range(n)]
    else:
        paths = [f"p{rng.randrange(10 ** rng.randrange(1, 6))}/{i}, [x].tar" for i in range(n)]
    doc: dict = {"data_keys": ["image", "caption"], "data_list": paths}
    if with_counts:
        doc["data_list_key_count"] = [rng.choice([0, 7, 10, 999, 1000, 10**18 - 1]) for _ in paths]
    doc["total_key_count"] = 5 * n
    doc["chunk_size"] = 5
    doc["root"] = "."
    doc["extra"] = {"nested": [1, "x", None, 2.5], "data_list_key": "]["}
    return doc


LAYOUTS = [
    {"indent": 2},  # PiD's writer
    {"indent": 4},
    {},  # json.dumps defaults: ", " between entries
    {"separators": (",", ":")},
    {"indent": "\t"},
    {"indent": 1, "separators": (" ,", " : ")},
]


@pytest.mark.parametrize("layout", range(len(LAYOUTS)))
@pytest.mark.parametrize("same_length", [True, False])
@pytest.mark.parametrize("n", [1, 2, 3, 257])
def test_plain_documents_are_taken_and_read_like_json(layout, same_length, n):
    rng = random.Random(n * 100 + layout)
    for with_counts in (True, False):
        doc = _doc(rng, n, same_length=same_length, with_counts=with_counts)
        keys = list(doc)
        rng.shuffle(keys)  # any field order
        raw = json.dumps({k: doc[k] for k in keys}, **LAYOUTS[layout]).encode()
        assert _agrees(raw) is not None, raw[:200]


@pytest.mark.parametrize(("raw", "why"), [
    (b'{"data_list": ["a\\u0062.tar"], "total_key_count": 1}', "an escape"),
    ('{"data_list": ["\u00e9.tar"], "total_key_count": 1}'.encode(), "not ASCII"),
    (b'{"data_list": ["a.tar",  "b.tar", "c.tar"], "total_key_count": 1}', "two separators"),
    (b'{"data_list": [], "total_key_count": 1}', "empty"),
    (b'{"data_list": ["a.tar", ["b.tar"]], "total_key_count": 1}', "nested list"),
    (b'{"data_list": ["a.tar", 3], "total_key_count": 1}', "a number"),
    (b'{"data_list": ["a\tb.tar"], "total_key_count": 1}', "a control character"),
    (b'{"meta": {"data_list": ["a.tar"]}, "total_key_count": 1}', "not top level"),
    (b'{"data_list": ["a.tar"], "data_list": ["b.tar"]}', "the key twice"),
    (b'{"data_list": ["data_list"], "total_key_count": 1}', "the key as a path"),
    (b'{"data_list": ["a.tar"], "data_list_key_count": [01]}', "a leading zero"),
    (b'{"data_list": ["a.tar"], "data_list_key_count": [-1]}', "a sign"),
    (b'{"data_list": ["a.tar"], "data_list_key_count": [1.0]}', "a float"),
    (b'{"data_list": ["a.tar"], "data_list_key_count": [true]}', "a bool"),
    (b'{"data_list": ["a.tar"], "data_list_key_count": [1234567890123456789]}', "19 digits"),
    (b'{"data_list": ["a.tar"], "data_list_key_count": [1 2]}', "no comma"),
    (b'{"data_list": ["a.tar"], "data_list_key_count": [1,,2]}', "two commas"),
    (b'{"data_list": ["a.tar", "b"], "data_list_key_count": [1,]}', "a trailing comma"),
    (b'{"data_list": ["a.tar",","], "x": 1}', "a string equal to the separator"),
    (b'{"data_list": ["a.tar"] "total_key_count": 1}', "broken outside the arrays"),
    (b'["data_list", ["a.tar"]]', "not an object"),
    (b'{"data_list" : "a.tar"}', "not an array"),
])
def test_declined_documents(raw, why):
    assert scan_wdinfo(raw) is None, why


def test_tricky_documents_that_are_taken():
    raw = (b'{"x": "\\"data_list\\"", "data_list": ["a].tar", ", b", "c,"],'
           b' "data_list_key_count": [0, 10, 123456789012345678]}')
    assert scan_wdinfo(raw) is None  # a backslash anywhere: declined
    raw = raw.replace(b'"\\"data_list\\""', b'"[data_list]"')
    got = _agrees(raw)
    assert got is not None and got.counts.tolist() == [0, 10, 123456789012345678]


def test_random_corruptions_are_read_like_json_or_declined():
    """Byte edits of plain documents: every accepted one must be valid JSON with the same
    content; with a mutation of the checks (e.g. no separator check) this fails."""
    rng = random.Random(7)
    alphabet = b'"[],: \n\t0123456789a.-\\{}e'
    accepted = declined_valid = 0
    for trial in range(3000):
        doc = _doc(rng, rng.randrange(1, 6), same_length=rng.random() < 0.5,
                   with_counts=rng.random() < 0.8)
        raw = bytearray(json.dumps(doc, **LAYOUTS[trial % len(LAYOUTS)]).encode())
        for _ in range(rng.randrange(1, 3)):
            at = rng.randrange(len(raw))
            kind = rng.randrange(3)
            if kind == 0:
                raw[at] = rng.choice(alphabet)
            elif kind == 1:
                raw.insert(at, rng.choice(alphabet))
            else:
                del raw[at]
        raw = bytes(raw)
        try:
            json.loads(raw)
            valid = True
        except ValueError:
            valid = False
        got = _agrees(raw) if valid else scan_wdinfo(raw)
        assert valid or got is None, raw
        accepted += got is not None
        declined_valid += valid and got is None
    assert accepted > 300  # the fuzz reaches the accepting path, not only declines
