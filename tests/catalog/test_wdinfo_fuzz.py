"""Differential fuzzing of the wdinfo parsers against ``json.loads``.

Random wdinfo documents (unicode and escaped strings, control characters, surrogates, numbers
at the edges of int64 and of floats, nested extras, fields of the wrong type) are written with
random white space between their tokens (or by ``json.dumps`` in its layouts), then sometimes
mutated byte by byte. Then:

* the vectorised scanner (:func:`ray_ingest.catalog.scan.scan_wdinfo`) either declines (None)
  or gives exactly what ``json.loads`` gives;
* each fast parser of :mod:`ray_ingest.catalog.wdinfo` (the scanner's and pyarrow's) either
  declines or gives the same :class:`Wdinfo`, or the same one-line error, as the ``json``
  path (``json.loads`` + ``parse_wdinfo``), the reference;
* :func:`read_wdinfo` (the whole loading, over fsspec) gives that same outcome whichever parser
  its size picks, and fails only with a one-line :class:`CatalogError`/``IngestError``.

Never another exception, never a hang. The budget is ``tests/support/fuzz.py``'s.
"""

from __future__ import annotations

import json
from typing import Any

import fsspec
import pytest
from hypothesis import given
from hypothesis import strategies as st

from ray_ingest.catalog import wdinfo as wd
from ray_ingest.catalog.scan import scan_wdinfo
from ray_ingest.errors import IngestError
from tests.support.fuzz import fuzz_settings, tally, within

pytestmark = pytest.mark.fuzz

URL = "memory://fuzz_wdinfo/ds/wdinfo.json"

# --- documents --------------------------------------------------------------------------------

EDGE_INTS = [0, 1, 2, 7, 10, 99, 10**17, 10**18 - 1, 10**18, 2**53, 2**53 + 1, 2**63 - 1, 2**63,
             2**64, -1, -(2**63), 10**30, 10**400]
numbers = st.one_of(st.sampled_from(EDGE_INTS), st.integers(-5, 5000),
                    st.floats(allow_nan=False, allow_infinity=False),
                    st.sampled_from([0.0, -0.0, 1.0, 1e308, 5e-324, 1e18, 2.5]))
texts = st.one_of(
    st.sampled_from(["part_000000/000000.tar", "a.tar", "é/ü.tar", "a/b.tar", "x", "",
                     "data_list", "]", ",", '", "', "\\", "a\\/b.tar", "\u2028.tar",
                     "file:///x.tar", "../x.tar", "a\0b.tar", "\ud800.tar", "😀.tar"]),
    st.text(max_size=12),
    st.text(st.sampled_from('ab/._,[]":\\ \t\néü\x01'), max_size=10),
)
scalars = st.one_of(st.none(), st.booleans(), numbers, texts)
values = st.recursive(scalars, lambda inner: st.one_of(st.lists(inner, max_size=3),
                                                       st.dictionaries(texts, inner, max_size=3)),
                      max_leaves=6)


COUNT_EDGES = [0, 1, 10**18 - 1, 10**18, 2**53 + 1, 2**63 - 1, 2**63]
counts_ok = st.one_of(st.integers(0, 1000), st.sampled_from(COUNT_EDGES))
names_ok = st.one_of(st.sampled_from(["image", "caption", "umt5", "depth", "é"]),
                     st.text(st.characters(codec="utf-8", blacklist_characters="/\0"),
                             min_size=1, max_size=8))


@st.composite
def documents(draw: Any) -> Any:
    """wdinfo-shaped objects: well-typed ones (numbers at their edges), ones with fields of
    every type, and any JSON value."""
    mode = draw(st.sampled_from(["typed", "typed", "typed", "wild", "value"]))
    if mode == "value":
        return draw(values)  # not an object at all, or any JSON value
    typed = mode == "typed"
    n = draw(st.integers(1, 12))
    plain = draw(st.booleans())
    paths = ([f"part_{i // 10:06d}/{i:06d}.tar" for i in range(n)] if plain
             else draw(st.lists(texts, min_size=1 if typed else 0, max_size=n)))
    doc: dict[str, Any] = {"data_list": paths}
    if draw(st.booleans()):
        item = counts_ok if typed else st.one_of(st.integers(0, 1000), numbers, st.just(None))
        extra = 0 if typed else draw(st.integers(0, 1))
        doc["data_list_key_count"] = draw(st.lists(item, min_size=len(paths),
                                                   max_size=len(paths) + extra))
    doc["total_key_count"] = draw(counts_ok if typed else st.one_of(numbers, scalars))
    fields = {"chunk_size": st.one_of(st.integers(1, 100), st.sampled_from(COUNT_EDGES)),
              "root": st.sampled_from([".", "/abs", "gs://b/x", "..", "sub", "", "é"]),
              "data_keys": st.lists(names_ok, max_size=3), "extra": values}
    for key, strategy in fields.items():
        if draw(st.booleans()):
            doc[key] = draw(strategy if typed or key == "extra" else st.one_of(strategy, values))
    order = draw(st.permutations(list(doc)))
    return {k: doc[k] for k in order}


WS = st.sampled_from(["", " ", "\n", "\t", "\r\n", "  ", "\n    "])


def dump(obj: Any, ws: list[str], ascii_only: bool, at: list[int]) -> str:
    """JSON text of ``obj`` with the white space ``ws`` (cycled) between every two tokens."""
    def gap() -> str:
        at[0] += 1
        return ws[at[0] % len(ws)] if ws else ""

    if isinstance(obj, dict):
        items = [f"{gap()}{json.dumps(k, ensure_ascii=ascii_only)}{gap()}:{gap()}"
                 f"{dump(v, ws, ascii_only, at)}{gap()}" for k, v in obj.items()]
        return "{" + ",".join(items) + gap() + "}"
    if isinstance(obj, list):
        return "[" + ",".join(f"{gap()}{dump(v, ws, ascii_only, at)}{gap()}"
                              for v in obj) + gap() + "]"
    return json.dumps(obj, ensure_ascii=ascii_only)


@st.composite
def raw_documents(draw: Any) -> bytes:
    doc = draw(documents())
    ascii_only = draw(st.booleans())
    if draw(st.booleans()):
        layout = draw(st.sampled_from([{"indent": 2}, {}, {"separators": (",", ":")},
                                       {"indent": "\t"}, {"indent": 0}]))
        text = json.dumps(doc, ensure_ascii=ascii_only, **layout)
    else:
        text = dump(doc, draw(st.lists(WS, min_size=1, max_size=draw(st.sampled_from([1, 5])))),
                    ascii_only, [0])
    raw = text.encode("utf-8", "surrogatepass")
    edit = st.tuples(st.integers(0, 2), st.integers(0, 10**6),
                     st.sampled_from(b'"[]{},:\\ \n0123456789-.eEtfnua\x00\xff\xc3'))
    edits = draw(st.lists(edit, min_size=1, max_size=3)) if draw(st.integers(0, 2)) == 0 else []
    for kind, at, byte in edits:
        at %= len(raw) + 1
        if kind == 0 and at < len(raw):
            raw = raw[:at] + bytes([byte]) + raw[at + 1:]
        elif kind == 1:
            raw = raw[:at] + bytes([byte]) + raw[at:]
        else:
            raw = raw[:at] + raw[at + 1:]
    if draw(st.integers(0, 29)) == 0:
        raw = b"[" * 100_000 + raw  # nested past the recursion limit
    return raw


# --- the scanner against json.loads -------------------------------------------------------------


def _json(raw: bytes) -> tuple[bool, Any]:
    try:
        return True, json.loads(raw)
    except (ValueError, RecursionError):
        return False, None


@fuzz_settings(ci_examples=600)
@given(raw=raw_documents())
def test_the_scanner_reads_what_json_reads_or_declines(raw):
    with within(10, "scan_wdinfo"):
        got = scan_wdinfo(raw)
    if got is None:
        tally("wdinfo scanner (scan) vs json.loads", "declined")
        return
    ok, doc = _json(raw)
    assert ok, ("taken where json.loads fails", raw[:200])
    off = got.offsets
    paths = [got.data[off[i]:off[i + 1]].decode() for i in range(len(off) - 1)]
    counts = None if got.counts is None else got.counts.tolist()
    assert isinstance(doc, dict) and doc["data_list"] == paths, raw[:200]
    assert doc.get("data_list_key_count") == counts, raw[:200]
    want_rest = dict(doc, data_list=[])
    if counts is not None:
        want_rest["data_list_key_count"] = []
    assert got.rest == want_rest
    tally("wdinfo scanner (scan) vs json.loads", "same")


# --- every wdinfo parser against the json path ------------------------------------------------


def _outcome(parse: Any) -> Any:
    """A parser's result in comparable form: None (declined), the fields of the Wdinfo, or the
    error (type and text; one line)."""
    try:
        w = parse()
    except IngestError as exc:
        text = str(exc)
        assert "\n" not in text and text.startswith(URL), text
        return ("error", type(exc).__name__, text)
    if w is None:
        return None
    return ("wdinfo", w.paths.to_pylist(), None if w.counts is None else w.counts.tolist(),
            w.count_source, w.total_key_count, w.chunk_size, w.root, w.wdinfo_root,
            w.listed_modalities, w.modalities, w.bucket)


def _reference(raw: bytes) -> Any:
    ok, doc = _json(raw)
    if not ok:
        return ("error", "CatalogError", "malformed")  # compared by kind only
    return _outcome(lambda: wd.parse_wdinfo(doc, URL))


def _same(got: Any, want: Any) -> bool:
    if got is None or want is None:
        return got == want
    if want[2] == "malformed":
        return got[:2] == want[:2] and "malformed JSON" in got[2]
    return got == want


@fuzz_settings(ci_examples=600)
@given(raw=raw_documents())
def test_every_wdinfo_parser_agrees_with_the_json_path(raw):
    args = (URL, None, "dset: 0", "wdinfo")
    with within(20, "wdinfo parsers"):
        want = _reference(raw)
        outcomes = {"scan": _outcome(lambda: wd._scan_parse(raw, *args)),
                    "pyarrow": _outcome(lambda: wd._fast_parse(raw, *args))}
        fs = fsspec.filesystem("memory")
        fs.pipe(URL.removeprefix("memory://"), raw)
        small = _outcome(lambda: wd.read_wdinfo(URL))  # json only below FAST_PARSE_BYTES
        threshold = wd.FAST_PARSE_BYTES
        wd.FAST_PARSE_BYTES = 0  # as a big file: the fast parsers first
        try:
            big = _outcome(lambda: wd.read_wdinfo(URL))
        finally:
            wd.FAST_PARSE_BYTES = threshold
    for name, got in outcomes.items():
        assert got is None or _same(got, want), (name, got, want, raw[:300])
        tally(f"wdinfo {name} parser vs json path",
              "declined" if got is None else ("same wdinfo" if got[0] == "wdinfo"
                                              else "same error"))
    assert _same(small, want) and _same(big, want), (small, big, want, raw[:300])
    tally("read_wdinfo (whole loading) vs json path",
          "same wdinfo" if want[0] == "wdinfo" else "same error")


# --- divergences found, one regression example each ---------------------------------------------

_PLAIN_LIST = '{"data_list": ["part_000000/000000.tar"], '
REGRESSIONS = {
    # json.loads of the scanner's skeleton raised RecursionError out of scan_wdinfo
    "deep_nesting_scanner": (b"[" * 100_000 + b'{"data_list": ["a.tar"]}',
                             "malformed JSON (nested too deeply to read)"),
    # pyarrow 26's JSON reader crashed the process (SIGSEGV) on these two
    "top_level_null": (b"null", "expected a JSON object, got NoneType"),
    "deep_nesting_pyarrow": ((_PLAIN_LIST + '"total_key_count": 1, "x": ' + "[" * 30_000
                              + "]" * 30_000 + "}").encode(),
                             "malformed JSON (nested too deeply to read)"),
    # a key that is not UTF-8: UnicodeDecodeError out of pyarrow's column names
    "key_not_utf8": (b'{"\xffata_list": [], "total_key_count": 0}', "malformed JSON"),
    # data_keys [null] was read as the folder 'None' (json) and as no key (pyarrow)
    "data_keys_null": ((_PLAIN_LIST + '"total_key_count": 1, "data_keys": [null]}').encode(),
                       "field 'data_keys[0]' must be a string, got None"),
    # a lone surrogate spelled with an escape: UnicodeEncodeError traceback
    "lone_surrogate": (b'{"data_list": ["\\ud800.tar"], "total_key_count": 1}',
                       "field 'data_list[0]' is not valid Unicode (a lone surrogate)"),
    # counts past int64: OverflowError tracebacks (numpy, float division)
    "total_2_63": ((_PLAIN_LIST + '"total_key_count": 9223372036854775808}').encode(),
                   "field 'total_key_count' must be <= 9223372036854775807"),
    "total_huge": ((_PLAIN_LIST + '"total_key_count": 1' + "0" * 400 + ', "root": 5}').encode(),
                   "field 'total_key_count' must be <= 9223372036854775807"),
    "counts_sum_past_int64": (b'{"data_list": ["a.tar", "b.tar"], "data_list_key_count": '
                              b'[9223372036854775807, 9223372036854775807], '
                              b'"total_key_count": 1}', "sums to 18446744073709551614"),
}

_PROBE = """
import sys
from ray_ingest.catalog import wdinfo as wd
from ray_ingest.errors import IngestError
raw = open(sys.argv[1], "rb").read()
url = sys.argv[1]
wd.FAST_PARSE_BYTES = int(sys.argv[2])
try:
    w = wd.read_wdinfo(url)
    print("ok", w.paths.to_pylist()[:1])
except IngestError as exc:
    print("error", type(exc).__name__, str(exc))
"""


@pytest.mark.parametrize("case", list(REGRESSIONS))
def test_regressions(tmp_path, case):
    """Each found divergence, read whole (json path) and as a big file (fast parsers first) in
    a child process (two of them used to crash the process)."""
    import subprocess
    import sys

    raw, words = REGRESSIONS[case]
    path = tmp_path / "wdinfo.json"
    path.write_bytes(raw)
    outs = []
    for threshold in (1 << 40, 0):
        res = subprocess.run([sys.executable, "-c", _PROBE, str(path), str(threshold)],
                             capture_output=True, text=True, timeout=120)
        assert res.returncode == 0, (case, res.returncode, res.stderr[-2000:])
        (line,) = res.stdout.splitlines()
        outs.append(line)
        assert words in line and (words == "ok") == line.startswith("ok "), line
    assert outs[0] == outs[1], outs
