"""``data_list`` entries that are not a plain relative tar path listed once: refused in one line
naming the wdinfo, the index and the entry, by every wdinfo parser (the vectorised scanner,
pyarrow's JSON reader, ``json``), and by the commands that read a dataset."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

from ray_ingest.catalog.arrays import _strings
from ray_ingest.catalog.entries import MAX_ENTRY_BYTES, MAX_PART_BYTES, check_entries
from ray_ingest.catalog.wdinfo import (
    FAST_PARSE_BYTES,
    _fast_parse,
    _scan_parse,
    parse_wdinfo,
    read_wdinfo,
)
from ray_ingest.cli.main import main
from ray_ingest.errors import CatalogError, UnsafePathError

BAD_AT = 7  # the hostile entry's index in data_list

# case -> (entry, what the refusal says)
UNSAFE = {
    "file_url": ("file:///data/ds/image/part_000000/000000.tar", "a URL scheme or fsspec chain"),
    "gs_url": ("gs://bucket/ds/part_000000/000000.tar", "a URL scheme or fsspec chain"),
    "scheme_only": ("file:part_000000/000000.tar", "a URL scheme or fsspec chain"),
    "fsspec_chain": ("part_000000/zip::000000.tar", "a URL scheme or fsspec chain"),
    "inner_url": ("part_000000/s3://000000.tar", "a URL scheme or fsspec chain"),
    "dotdot": ("part_000000/../../x.tar", "a '..' part that climbs out of the folder"),
    "absolute": ("/etc/x.tar", "an absolute path"),
    "nul": ("part_000000/0\x00.tar", "a NUL byte in the name"),
    "control": ("part_000000/0\x1b[2J.tar", "a control character (U+001B)"),
    "newline": ("part_000000/0\n.tar", "a control character (U+000A)"),
    "del": ("part_000000/0\x7f.tar", "a control character (U+007F)"),
    "c1": ("part_000000/0\u0085.tar", "a control character (U+0085)"),
    "backslash": ("part_000000\\000000.tar", "a backslash"),
    "overlong": ("p/" * 600 + "x.tar", f"over the limit of {MAX_ENTRY_BYTES}"),
    "long_part": ("part/" + "x" * 300 + ".tar", f"over the limit of {MAX_PART_BYTES}"),
    "the_folder": ("./", "no file name"),
}
# case -> (entry, index of the entry it repeats)
DUPLICATES = {
    "same": ("part_000000/000002.tar", 2),
    "dot_part": ("./part_000000/000002.tar", 2),
    "inner_dot": ("part_000000/./000003.tar", 3),
    "double_slash": ("part_000000//000001.tar", 1),
    "trailing_slash": ("part_000000/000000.tar/", 0),
}


def _doc(entry: str, n: int) -> dict:
    data_list = [f"part_{i // 1000:06d}/{i % 1000:06d}.tar" for i in range(n)]
    data_list[BAD_AT] = entry
    return {"data_list": data_list, "data_list_key_count": [2] * n, "total_key_count": 2 * n,
            "data_keys": ["image", "caption"], "root": "."}


def _big(entry: str) -> bytes:
    """A wdinfo over FAST_PARSE_BYTES, written the way the sharder writes it (indent 2)."""
    n = FAST_PARSE_BYTES // 30
    raw = json.dumps(_doc(entry, n), indent=2, ensure_ascii=False).encode()
    assert len(raw) >= FAST_PARSE_BYTES
    return raw


def _parsers(raw: bytes, url: str) -> dict:
    args = (url, None, "dset: 0", "wdinfo")
    return {"scan": lambda: _scan_parse(raw, *args), "pyarrow": lambda: _fast_parse(raw, *args),
            "json": lambda: parse_wdinfo(json.loads(raw), url)}


def _refusal(url: str, index: int, entry: str, why: str) -> str:
    shown = repr(entry) if len(entry) <= 200 else re.escape(repr(entry[:100])) + r"\.\.\. \(\d+"
    if len(entry) <= 200:
        shown = re.escape(shown)
    return (rf"{re.escape(url)}: field 'data_list\[{index}\]': unsafe path {shown}.*"
            rf"{re.escape(why)}.*; refused")


@pytest.mark.parametrize("case", list(UNSAFE))
def test_every_parser_refuses_the_entry_in_one_line(case):
    entry, why = UNSAFE[case]
    url = "/data/ds/wdinfo.json"
    raw = _big(entry)
    ran = []
    for name, parse in _parsers(raw, url).items():
        try:
            parse()
        except UnsafePathError as exc:
            text = str(exc)
            assert "\n" not in text and re.fullmatch(_refusal(url, BAD_AT, entry, why), text), \
                (name, text)
            ran.append(name)
            continue
        # the scanner takes plain ASCII without escapes only; pyarrow may decline odd input:
        # either hands the document on (None), never accepts it
        assert name in ("scan", "pyarrow"), name
    assert "json" in ran
    plain = entry.isascii() and min(map(ord, entry)) >= 0x20 and "\\" not in entry
    assert ("scan" in ran) == plain, ran  # the scanner's path is exercised where it applies
    assert "pyarrow" in ran or not plain, ran


@pytest.mark.parametrize("size", ["small", "big"])
@pytest.mark.parametrize("case", list(UNSAFE))
def test_read_wdinfo_refuses(tmp_path, case, size):
    entry, why = UNSAFE[case]
    url = tmp_path / "wdinfo.json"
    if size == "big":
        url.write_bytes(_big(entry))
    else:
        url.write_text(json.dumps(_doc(entry, 10)))
    with pytest.raises(UnsafePathError) as info:
        read_wdinfo(str(url))
    assert re.fullmatch(_refusal(str(url), BAD_AT, entry, why), str(info.value)), info.value


@pytest.mark.parametrize("case", list(DUPLICATES))
def test_a_shard_listed_twice_is_refused_by_every_parser(case):
    entry, first = DUPLICATES[case]
    url = "gs://bucket/ds/wdinfo.json"
    raw = _big(entry)
    want = (rf"{re.escape(url)}: field 'data_list\[{BAD_AT}\]': {re.escape(repr(entry))} names "
            rf"the same tar as data_list\[{first}\] \('part_000000/{first:06d}\.tar'\); every "
            rf"shard is listed once; refused")
    for name, parse in _parsers(raw, url).items():
        with pytest.raises(CatalogError) as info:
            parse()
        assert re.fullmatch(want, str(info.value)), (name, str(info.value))


def test_duplicates_found_in_any_order_and_length():
    """The vectorised check: sorted equal-length lists, shuffled, mixed lengths, hash
    collisions aside; the first repeat reported is the earliest second occurrence."""
    import random

    rng = random.Random(5)
    for trial in range(60):
        n = rng.choice([2, 3, 17, 500, 4000])
        pool = [f"p{rng.randrange(10 ** rng.randrange(1, 4))}/{i}.tar" for i in range(n)]
        if trial % 3 == 0:
            pool = [f"part_{i:06d}.tar" for i in range(n)]
        if trial % 2:
            rng.shuffle(pool)
        dups = rng.randrange(3)
        for _ in range(dups):
            pool[rng.randrange(n)] = pool[rng.randrange(n)]
        seen: dict[str, int] = {}
        want = None
        for j, p in enumerate(pool):
            i = seen.setdefault(p, j)
            if i != j:
                want = (i, j)
                break
        if want is None:
            check_entries("w", _strings(pool))
            continue
        with pytest.raises(CatalogError,
                           match=rf"data_list\[{want[1]}\]'.*data_list\[{want[0]}\]"):
            check_entries("w", _strings(pool))


@pytest.mark.parametrize("entry", ["part..1/a..b.tar", "part/a:b.tar", "part_000000/000000.tar",
                                   "é/ü.tar", "x" * MAX_PART_BYTES, "a/b.tar/", "a/./b.tar"])
def test_plain_entries_are_taken(entry):
    check_entries("w", _strings(["ok.tar", entry]))


def test_a_colon_is_a_scheme_only_at_the_start():
    with pytest.raises(UnsafePathError, match="a URL scheme"):
        check_entries("w", _strings(["ok.tar", "c:/x.tar"]))


def test_cat_and_info_refuse_a_file_url_in_one_line(tmp_path, capsys):
    """The issue's case: a ``file://`` entry ended in ``ValueError: Protocol not known``."""
    from ray_ingest.tools.synth import synth_dataset

    root = tmp_path / "ds"
    synth_dataset(str(root), samples=4, shard_size=2, seed=1, min_side=16, max_side=24)
    doc = json.loads((root / "wdinfo.json").read_text())
    url = (root / "image" / doc["data_list"][1]).as_uri()
    doc["data_list"][1] = url
    (root / "wdinfo.json").write_text(json.dumps(doc))
    for cmd in ("cat", "info", "index"):
        rc = main([cmd, str(root)])
        err = capsys.readouterr().err
        assert rc == 2 and err.count("\n") == 1, err
        assert err.startswith(f"ray-ingest: error: {root / 'wdinfo.json'}: field "
                              f"'data_list[1]': unsafe path {url!r}: a URL scheme"), err
        assert "Traceback" not in err and "Protocol" not in err


def test_duplicates_through_the_cli(tmp_path, capsys):
    from ray_ingest.tools.synth import synth_dataset

    root = tmp_path / "ds"
    synth_dataset(str(root), samples=6, shard_size=2, seed=1, min_side=16, max_side=24)
    doc = json.loads((root / "wdinfo.json").read_text())
    doc["data_list"][2] = "./" + doc["data_list"][0]
    Path(root / "wdinfo.json").write_text(json.dumps(doc))
    assert main(["cat", str(root)]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "'data_list[2]'" in err and "data_list[0]" in err, err
