"""Twin expansion: strict / merge / index over real tars with dropped, extra, duplicated and
reordered members, checked against an independent model of each mode."""

from __future__ import annotations

import itertools
import re
import tarfile
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from ray_ingest.catalog.shard import TarSample
from ray_ingest.errors import AlignmentError, ConfigError, OversizedMemberError
from ray_ingest.twintar.reader import (
    ReadOptions,
    read_shard,
)
from ray_ingest.twintar.tario import Member
from ray_ingest.twintar.twin import (
    ERROR,
    INDEX,
    KEY,
    SHARD,
    AlignStats,
    expand,
    ext_column,
)
from tests.datagen import member_name, parse_payload, write_tar, write_twin

SHARD_PATH = "part_000000/000000.tar"
PROPERTY = settings(max_examples=120, deadline=None,
                    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
_counter = itertools.count()


# --------------------------------------------------------------------------- generated cases


def _insert(draw, seq: list[str], items: list[str]) -> list[str]:
    for item in items:
        seq.insert(draw(st.integers(0, len(seq))), item)
    return seq


@st.composite
def twin_case(draw, max_keys: int = 10):
    """Driver key list plus secondaries derived from it by drops, extras, dups, reorders."""
    n = draw(st.integers(0, max_keys))
    keys = [f"k{i:02d}" for i in range(n)]
    driver = list(keys)
    if driver and draw(st.booleans()):  # driver duplicates, placed after the original
        for _ in range(draw(st.integers(1, 2))):
            i = draw(st.integers(0, len(driver) - 1))
            driver.insert(draw(st.integers(i + 1, len(driver))), driver[i])
    n_secondaries = draw(st.integers(1, 2))
    secondaries: dict[str, list[str]] = {}
    for m in ("caption", "umt5")[:n_secondaries]:
        keep = draw(st.lists(st.integers(0, 4), min_size=n, max_size=n))
        seq = [k for k, x in zip(keys, keep, strict=True) if x != 0]  # drop ~1 in 5
        extras = [f"x{i}" for i in draw(st.lists(st.integers(0, 4), max_size=3))]
        seq = _insert(draw, seq, extras)
        if seq and draw(st.booleans()):
            for _ in range(draw(st.integers(1, 2))):
                i = draw(st.integers(0, len(seq) - 1))
                seq.insert(draw(st.integers(i + 1, len(seq))), seq[i])
        if draw(st.booleans()):
            seq = draw(st.permutations(seq))
        secondaries[m] = list(seq)
    return {"image": driver, **secondaries}


def _write(tmp_path_factory, streams: dict[str, list[str]], index: bool = False) -> TarSample:
    root = tmp_path_factory.getbasetemp() / "twin" / f"case{next(_counter)}"
    write_twin(root, {SHARD_PATH: streams}, index=index, wdinfo=False)
    return TarSample(path=SHARD_PATH, root=str(root), modalities=tuple(streams), count=None)


def _tar_members(path: Path) -> list[tuple[str, bytes]]:
    with tarfile.open(path) as tf:
        return [(m.name, tf.extractfile(m).read()) for m in tf if m.isfile()]


def _first_positions(seq: list[str]) -> dict[str, int]:
    """Rank of each key's first copy among first copies (same order as stream positions)."""
    out: dict[str, int] = {}
    for k in seq:
        out.setdefault(k, len(out))
    return out


def _unique(seq: list[str]) -> list[str]:
    return list(dict.fromkeys(seq))


def _check_rows_consistent(rows: list[dict], modalities: list[str]) -> None:
    """Every modality of a row carries the first copy of that row's key."""
    for row in rows:
        for m in modalities:
            if row[m] is None:
                continue
            mod, name, occurrence = parse_payload(row[m])
            assert mod == m
            assert name == member_name(m, row[KEY]), (row[KEY], name)
            assert occurrence == 0


# --------------------------------------------------------------------------- strict


def strict_model(streams: dict[str, list[str]]) -> tuple[list[str], dict[str, str] | None, int]:
    """Rows until the first position where the keys differ (or one tar ends early)."""
    mods = list(streams)
    longest = max(len(s) for s in streams.values())
    rows = []
    for pos in range(longest):
        keys = {m: (streams[m][pos] if pos < len(streams[m]) else None) for m in mods}
        if len(set(keys.values())) != 1 or keys[mods[0]] is None:
            return rows, {m: (k if k is not None else "<end of tar>") for m, k in keys.items()}, pos
        rows.append(keys[mods[0]])
    return rows, None, longest


@PROPERTY
@given(case=twin_case())
def test_strict_never_pairs_different_keys(tmp_path_factory, case):
    shard = _write(tmp_path_factory, case)
    want_rows, mismatch, pos = strict_model(case)
    got: list[dict] = []
    if mismatch is None:
        got = list(read_shard(shard, opts=ReadOptions(align="strict")))
    else:
        with pytest.raises(AlignmentError) as err:
            for row in read_shard(shard, opts=ReadOptions(align="strict")):
                got.append(row)
        msg = str(err.value)
        assert f"shard {SHARD_PATH}" in msg
        assert f"position {pos}" in msg
        for m, k in mismatch.items():
            assert f"{m}={k}" in msg
        assert "\n" not in msg
    assert [r[KEY] for r in got] == want_rows
    assert [r[INDEX] for r in got] == list(range(len(want_rows)))
    _check_rows_consistent_strict(got, list(case))


def _check_rows_consistent_strict(rows: list[dict], modalities: list[str]) -> None:
    for row in rows:
        names = {parse_payload(row[m])[1].rsplit(".", 1)[0] for m in modalities}
        assert names == {row[KEY]}


# --------------------------------------------------------------------------- merge


def merge_model(streams: dict[str, list[str]]) -> tuple[list[str], dict[str, dict[str, int]]]:
    """Independent model of merge: driver keys (first copies) present in every secondary, in
    driver order, and the exact skip counters."""
    mods = list(streams)
    driver, secondaries = mods[0], mods[1:]
    dkeys = _unique(streams[driver])
    sets = {m: set(streams[m]) for m in secondaries}
    emitted = [k for k in dkeys if all(k in sets[m] for m in secondaries)]
    counts: dict[str, dict[str, int]] = {m: {} for m in mods}

    def add(m: str, reason: str, n: int) -> None:
        if n:
            counts[m][reason] = counts[m].get(reason, 0) + n

    add(driver, "duplicate", len(streams[driver]) - len(dkeys))
    for m in secondaries:
        uniq = _unique(streams[m])
        add(m, "duplicate", len(streams[m]) - len(uniq))
        add(m, "missing", sum(k not in sets[m] for k in dkeys))
        add(m, "extra", sum(k not in set(dkeys) for k in uniq))
        add(m, "orphan", sum(k in set(dkeys) and k not in set(emitted) for k in uniq))
        pos = _first_positions(streams[m])
        high, behind = -1, 0
        for k in emitted:
            if pos[k] < high:
                behind += 1
            high = max(high, pos[k])
        add(m, "reordered", behind)
    return emitted, {m: c for m, c in counts.items() if c}


def _in_driver_order(streams: dict[str, list[str]], emitted: list[str]) -> bool:
    for m in list(streams)[1:]:
        pos = _first_positions(streams[m])
        order = [pos[k] for k in emitted]
        if order != sorted(order):
            return False
    return True


@PROPERTY
@given(case=twin_case())
def test_merge_matches_model(tmp_path_factory, case):
    shard = _write(tmp_path_factory, case)
    stats = AlignStats()
    rows = list(read_shard(shard, opts=ReadOptions(align="merge"), stats=stats))
    want, counts = merge_model(case)
    assert [r[KEY] for r in rows] == want
    assert stats.emitted == len(want)
    assert stats.to_dict()["counts"] == counts
    reordered = sum(stats.get(m, "reordered") for m in case)
    assert (reordered == 0) == _in_driver_order(case, want)
    _check_rows_consistent(rows, list(case))
    # __index__ is the driver position of the key's first copy
    assert [r[INDEX] for r in rows] == [case["image"].index(k) for k in want]


def test_merge_counts_reorder_only_when_out_of_order(tmp_path_factory):
    same = {"image": ["a", "b", "c", "d"], "caption": ["a", "c", "d"]}  # gap, same order
    stats = AlignStats()
    rows = read_shard(_write(tmp_path_factory, same), opts=ReadOptions(align="merge"),
                      stats=stats)
    assert [r[KEY] for r in rows] == ["a", "c", "d"]
    assert stats.get("caption", "reordered") == 0
    assert stats.get("caption", "missing") == 1
    swapped = {"image": ["a", "b", "c"], "caption": ["c", "a", "b"]}
    stats = AlignStats()
    rows = list(read_shard(_write(tmp_path_factory, swapped), opts=ReadOptions(align="merge"),
                           stats=stats))
    assert [r[KEY] for r in rows] == ["a", "b", "c"]
    assert stats.get("caption", "reordered") == 1


def _member_stream(keys: list[str], consumed: list[str] | None = None, modality: str = "caption"):
    """Members of ``keys`` (payloads inline); appends each key to ``consumed`` as it is read."""
    for pos, k in enumerate(keys):
        if consumed is not None:
            consumed.append(k)
        yield Member(name=f"{k}.json", key=k, ext="json", offset=pos * 1024, size=2,
                     data=f"{modality}:{k}".encode())


def test_merge_read_ahead_is_bounded():
    """Looking for a key, a secondary reads at most ``window`` members ahead; then the key is an
    error naming shard, key and setting (the old look-ahead read to the end of the tar)."""
    consumed: list[str] = []
    streams = {"image": _member_stream(list("abcdefgh"), modality="image"),
               "caption": _member_stream(list("hgfedcba"), consumed)}
    with pytest.raises(AlignmentError) as info:
        list(expand(SHARD_PATH, streams, align="merge", window=3))
    assert str(info.value) == (
        f"shard {SHARD_PATH}: key a not found in caption within 3 members read ahead "
        "(data.max_read_ahead); that tar is too far out of order or lacks too many keys for "
        "merge alignment without a key index")
    assert consumed == ["h", "g", "f"]


def test_merge_beyond_read_ahead_under_skip_marks_the_sample_and_goes_on():
    case = {"image": list("abcdefgh"), "caption": ["a", *"cdefgh"]}  # b missing, same order
    stats = AlignStats()
    rows = list(expand(SHARD_PATH, {m: _member_stream(v, modality=m) for m, v in case.items()},
                       align="merge", window=3, on_error="skip", stats=stats))
    assert [r[KEY] for r in rows] == list("abcdefgh")
    bad = [r for r in rows if ERROR in r]
    assert [(r[KEY], r[INDEX], r["image"], r["caption"]) for r in bad] == [("b", 1, None, None)]
    assert isinstance(bad[0][ERROR], AlignmentError) and "key b not found" in str(bad[0][ERROR])
    good = [r for r in rows if ERROR not in r]
    assert all(r["caption"] == f"caption:{r[KEY]}".encode() for r in good)  # nothing lost after
    assert stats.get("caption", "beyond_read_ahead") == 1 and stats.emitted == 7


def test_merge_with_a_key_index_declares_missing_keys_at_once(tmp_path_factory):
    """The sharder's key index tells an absent key from a far one: no read-ahead, no error."""
    case = {"image": list("abcdefgh"), "caption": ["a", *"cdefgh"]}
    stats = AlignStats()
    rows = list(read_shard(_write(tmp_path_factory, case, index=True),
                           opts=ReadOptions(align="merge", window=1), stats=stats))
    assert [r[KEY] for r in rows] == ["a", *"cdefgh"]
    assert stats.get("caption", "missing") == 1 and stats.get("caption", "beyond_read_ahead") == 0
    # without the index the same window cannot tell: a clear error
    with pytest.raises(AlignmentError, match="key b not found in caption within 1 members"):
        list(read_shard(_write(tmp_path_factory, case), opts=ReadOptions(align="merge", window=1)))


@pytest.mark.parametrize("align", ["strict", "merge"])
def test_member_over_the_size_limit_is_an_error_or_a_marked_row(tmp_path_factory, align):
    shard = _write(tmp_path_factory, {"image": ["a", "b", "c"], "caption": ["a", "b", "c"]})
    big = Path(shard.url("caption"))
    members = [(n, d if n != "b.json" else d + b" " * 5000) for n, d in _tar_members(big)]
    write_tar(big, members)
    opts = ReadOptions(align=align, max_member_bytes=1000)
    with pytest.raises(OversizedMemberError) as info:
        list(read_shard(shard, opts=opts))
    assert re.fullmatch(rf"shard {SHARD_PATH}: key b: caption member b\.json is \d+ bytes, over "
                        r"the member size limit of 1000 \(decode\.max_member_bytes\); not read",
                        str(info.value)), str(info.value)
    stats = AlignStats()
    rows = list(read_shard(shard, opts=opts, on_error="skip", stats=stats))
    assert [(r[KEY], ERROR in r) for r in rows] == [("a", False), ("b", True), ("c", False)]
    assert rows[1]["caption"] is None and isinstance(rows[1][ERROR], OversizedMemberError)
    assert stats.get("caption", "oversized") == 1


# --------------------------------------------------------------------------- index


def index_model(streams: dict[str, list[str]], index: list[str]):
    if not index:
        return [], {}  # an empty index ends at once: nothing is read, nothing counted
    mods = list(streams)
    ikeys = _unique(index)
    sets = {m: set(streams[m]) for m in mods}
    emitted = [k for k in ikeys if all(k in sets[m] for m in mods)]
    counts: dict[str, dict[str, int]] = {m: {} for m in [*mods, "index"]}

    def add(m: str, reason: str, n: int) -> None:
        if n:
            counts[m][reason] = counts[m].get(reason, 0) + n

    add("index", "duplicate", len(index) - len(ikeys))
    for m in mods:
        uniq = _unique(streams[m])
        add(m, "duplicate", len(streams[m]) - len(uniq))
        add(m, "missing", sum(k not in sets[m] for k in ikeys))
        add(m, "extra", sum(k not in set(ikeys) for k in uniq))
        add(m, "orphan", sum(k in set(ikeys) and k not in set(emitted) for k in uniq))
    return emitted, {m: c for m, c in counts.items() if c}


@PROPERTY
@given(case=twin_case(), data=st.data())
def test_index_follows_index(tmp_path_factory, case, data):
    pool = sorted({k for s in case.values() for k in s} | {"k98", "k99"})
    index = data.draw(st.lists(st.sampled_from(pool), max_size=14))
    shard = _write(tmp_path_factory, case)
    stats = AlignStats()
    rows = list(read_shard(shard, opts=ReadOptions(align="index"), stats=stats,
                           index_keys=index))
    want, counts = index_model(case, index)
    assert [r[KEY] for r in rows] == want
    assert [r[INDEX] for r in rows] == [index.index(k) for k in want]
    got_counts = {m: {r: n for r, n in c.items() if r != "reordered"}
                  for m, c in stats.to_dict()["counts"].items()}
    assert {m: c for m, c in got_counts.items() if c} == counts
    _check_rows_consistent(rows, list(case))


def test_index_empty_ends_at_once(tmp_path_factory):
    shard = _write(tmp_path_factory, {"image": ["a", "b"], "caption": ["a", "b"]})
    assert list(read_shard(shard, opts=ReadOptions(align="index"), index_keys=[])) == []


def _members(keys, modality):
    return [Member(member_name(modality, k), k, "x", 0, 1, f"{modality}:{k}".encode())
            for k in keys]


def test_index_pid_examples():
    # reference §12 I: image k0..k4, caption [k0,k2,k3,k3,kx,k4] -> k0,k2,k3,k4
    ks = [f"k{i}" for i in range(5)]
    stats = AlignStats()
    rows = list(expand("s", {"image": _members(ks, "image"),
                             "caption": _members(["k0", "k2", "k3", "k3", "kx", "k4"], "caption")},
                       align="index", index_keys=ks, stats=stats))
    assert [r[KEY] for r in rows] == ["k0", "k2", "k3", "k4"]
    assert stats.to_dict()["counts"] == {
        "caption": {"missing": 1, "duplicate": 1, "extra": 1}, "image": {"orphan": 1}}
    # image [k0,k2,k1,k3]: PiD loses k1; here it is read ahead and kept (counted reordered)
    stats = AlignStats()
    rows = list(expand("s", {"image": _members(["k0", "k2", "k1", "k3"], "image"),
                             "caption": _members(ks[:4], "caption")},
                       align="index", index_keys=ks[:4], stats=stats))
    assert [r[KEY] for r in rows] == ks[:4]
    assert stats.get("image", "reordered") == 1
    # image [k0,k1] vs caption k0..k3
    stats = AlignStats()
    rows = list(expand("s", {"image": _members(ks[:2], "image"),
                             "caption": _members(ks[:4], "caption")},
                       align="index", index_keys=ks[:4], stats=stats))
    assert [r[KEY] for r in rows] == ["k0", "k1"]
    assert stats.get("image", "missing") == 2 and stats.get("caption", "orphan") == 2


def test_index_mode_needs_keys():
    with pytest.raises(ConfigError, match="index_keys"):
        list(expand("s", {"image": []}, align="index"))
    with pytest.raises(ConfigError, match="align"):
        list(expand("s", {"image": []}, align="zip"))


# --------------------------------------------------------------------------- optional modalities


@pytest.mark.parametrize("align", ["strict", "merge"])
def test_optional_modality_absent_for_some_samples(tmp_path_factory, align):
    case = {"image": ["a", "b", "c", "d"], "caption": ["a", "b", "c", "d"], "umt5": ["b", "d"]}
    shard = _write(tmp_path_factory, case)
    rows = list(read_shard(shard, opts=ReadOptions(align=align, optional=("umt5",))))
    assert [r[KEY] for r in rows] == ["a", "b", "c", "d"]
    assert [r["umt5"] is not None for r in rows] == [False, True, False, True]
    assert [r[ext_column("umt5")] for r in rows] == [None, "npy", None, "npy"]
    _check_rows_consistent(rows, list(case))


@pytest.mark.parametrize("align", ["strict", "merge"])
def test_optional_modality_tar_absent(tmp_path_factory, align):
    shard = _write(tmp_path_factory, {"image": ["a", "b"], "caption": ["a", "b"]})
    shard = TarSample(path=shard.path, root=shard.root,
                      modalities=("image", "caption", "umt5"), count=None)
    rows = list(read_shard(shard, opts=ReadOptions(align=align, optional=("umt5",))))
    assert [(r[KEY], r["umt5"]) for r in rows] == [("a", None), ("b", None)]
    with pytest.raises(Exception, match="missing umt5 tar"):
        list(read_shard(shard, opts=ReadOptions(align=align)))


def test_strict_optional_member_without_driver_sample_fails(tmp_path_factory):
    shard = _write(tmp_path_factory, {"image": ["a", "b"], "caption": ["a", "b"],
                                      "umt5": ["b", "z"]})
    with pytest.raises(AlignmentError, match="umt5 has member z"):
        list(read_shard(shard, opts=ReadOptions(align="strict", optional=("umt5",))))


def test_rows_carry_provenance(tmp_path_factory):
    shard = _write(tmp_path_factory, {"image": ["a"], "caption": ["a"]})
    (row,) = read_shard(shard)
    assert row[SHARD] == SHARD_PATH and row[INDEX] == 0 and row[KEY] == "a"
    assert row[ext_column("image")] == "jpg" and row[ext_column("caption")] == "json"


def test_read_task_records_a_key_beyond_read_ahead_as_a_read_skip(tmp_path_factory):
    """Under on_error=skip the read task marks just that sample (``__error__``), like every
    read skip the loader records in the read state; the other samples are read."""
    from ray_ingest.execution.read import (
        ReadItem,
        read_item,
    )

    case = {"image": list("abcdefgh"), "caption": ["a", *"cdefgh"]}
    shard = _write(tmp_path_factory, case)
    opts = ReadOptions(align="merge", window=2)
    [block] = list(read_item(shard, ReadItem(seq=10, sid=3, start=0, count=8), opts, 64,
                             on_error="skip"))
    rows = block.to_pylist()
    assert [r[KEY] for r in rows] == list("abcdefgh")
    errors = {r[KEY]: r["__error__"] for r in rows if r["__error__"]}
    assert list(errors) == ["b"]
    assert errors["b"].startswith(f"read: AlignmentError: shard {SHARD_PATH}: key b not found in "
                                  "caption within 2 members read ahead (data.max_read_ahead)")
    assert [(r["__seq__"], r["__index__"]) for r in rows if r[KEY] == "b"] == [(11, 1)]
    with pytest.raises(AlignmentError, match=r"index 1 \(after key a\): key b not found"):
        list(read_item(shard, ReadItem(seq=10, sid=3, start=0, count=8), opts, 64))
