"""Hostile archives and paths, at every entry point.

A twin dataset (image + caption, two shards of four samples) is damaged with one hostile tar
entry written by the stdlib ``tarfile``, in place of the image member of sample 2 of the first
shard: a name that climbs with ``..``, an absolute name, a NUL byte in the name (ustar field,
pax path, GNU long name), a symbolic or hard link, a character or block device, a FIFO.
``wdinfo.json`` files whose ``data_list`` entries (or ``data_keys``) climb out of the root are
the other kind of hostile input.

Every case at every entry point — the tar walker, the read stage (loader, Ray read tasks),
``IngestLoader`` under ``on_error: skip``, ``ray-ingest cat`` / ``index``, ``convert``,
``read_twin_tars`` + ``write_twin_tars``, ``shard`` — either fails with one line naming the tar
(shard) and the member, or is a counted skip; and nothing is created outside the output folder
(the tree around ``tmp_path`` is compared before and after).
"""

from __future__ import annotations

import io
import json
import os
import re
import shutil
import tarfile
from pathlib import Path
from typing import Any

import pytest

from ray_ingest.catalog.load import load_catalog
from ray_ingest.catalog.wdinfo import read_wdinfo
from ray_ingest.cli.main import main
from ray_ingest.errors import ConfigError, IngestError, UnsafeMemberError, UnsafePathError
from ray_ingest.execution.read import (
    ReadItem,
    read_item,
)
from ray_ingest.tools.convert import convert_pickles
from ray_ingest.tools.shard import (
    BAD_KEY,
    SPECIAL,
    shard_folders,
)
from ray_ingest.tools.synth import synth_dataset
from ray_ingest.twintar.reader import (
    read_options,
    read_shard,
)
from ray_ingest.twintar.tario import (
    index_url,
    iter_members,
)
from tests.decode.test_corrupt import cfg_for, run
from tests.support.datagen import write_raw_folders

SHARD = "part_000000/000000.tar"
OTHER = "part_000000/000001.tar"
POS = 2  # the hostile entry takes the place of this sample's image member


def key(i: int) -> str:
    return f"s{i:08d}"


# --- the hostile entries ------------------------------------------------------------------------
# case -> (tarfile format, entry name, type flag, link name, what the refusal says)

def member_cases(elsewhere: Path) -> dict[str, tuple[int, str, bytes, str, str]]:
    k = f"{key(POS)}.jpg"
    return {
        "dotdot": (tarfile.PAX_FORMAT, "../../escaped_dotdot.jpg", tarfile.REGTYPE, "",
                   "a '..' part that climbs out of the folder"),
        "dotdot_inner": (tarfile.PAX_FORMAT, "sub/../../../escaped_inner.jpg", tarfile.REGTYPE,
                         "", "a '..' part that climbs out of the folder"),
        "absolute": (tarfile.PAX_FORMAT, str(elsewhere / "escaped_abs.jpg"), tarfile.REGTYPE,
                     "", "an absolute path"),
        "nul_ustar": (tarfile.USTAR_FORMAT, f"{key(POS)}\0x.jpg", tarfile.REGTYPE, "",
                      "a NUL byte in the name"),
        "nul_pax": (tarfile.PAX_FORMAT, "é" * 60 + "\0.jpg", tarfile.REGTYPE, "",
                    "a NUL byte in the name"),
        "nul_gnu_long": (tarfile.GNU_FORMAT, "n" * 120 + "\0.jpg", tarfile.REGTYPE, "",
                         "a NUL byte in the name"),
        "symlink": (tarfile.PAX_FORMAT, k, tarfile.SYMTYPE, "/etc/passwd", "a symbolic link"),
        "hardlink": (tarfile.PAX_FORMAT, k, tarfile.LNKTYPE, "../../escaped_hard",
                     "a hard link"),
        "chardev": (tarfile.PAX_FORMAT, k, tarfile.CHRTYPE, "", "a character device"),
        "blockdev": (tarfile.PAX_FORMAT, k, tarfile.BLKTYPE, "", "a block device"),
        "fifo": (tarfile.PAX_FORMAT, k, tarfile.FIFOTYPE, "", "a FIFO"),
    }


CASES = list(member_cases(Path("/x")))


def _members(path: Path) -> list[tuple[str, bytes]]:
    with tarfile.open(path) as tf:
        return [(m.name, tf.extractfile(m).read()) for m in tf if m.isfile()]


def plant(root: Path, case: str, elsewhere: Path) -> tuple[Path, str, str]:
    """Rewrite ``root``'s image tar of SHARD with the hostile entry at POS (its key index is
    dropped: hostile tars come without ours); returns (tar path, entry name, reason)."""
    fmt, name, typ, linkname, why = member_cases(elsewhere)[case]
    tar = root / "image" / SHARD
    members = _members(tar)
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w", format=fmt) as tf:
        for i, (n, data) in enumerate(members):
            if i != POS:
                info = tarfile.TarInfo(n)
                info.size = len(data)
                tf.addfile(info, io.BytesIO(data))
                continue
            info = tarfile.TarInfo(name)
            info.type = typ
            info.linkname = linkname
            if typ == tarfile.REGTYPE:
                info.size = len(data)
                tf.addfile(info, io.BytesIO(data))
            else:
                tf.addfile(info)
    tar.write_bytes(buf.getvalue())
    Path(index_url(str(tar))).unlink()
    return tar, name, why


def tree(root: Path, skip: Path | None = None) -> set[str]:
    """Every path under ``root`` (files and folders), except under ``skip``."""
    out = set()
    for dirpath, dirnames, filenames in os.walk(root):
        here = Path(dirpath)
        if skip is not None and (here == skip or skip in here.parents):
            dirnames[:] = []
            continue
        out.update(str(here / n) for n in dirnames + filenames if here / n != skip)
    return out


@pytest.fixture(scope="module")
def pristine(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("hostile") / "pristine"
    synth_dataset(str(root), samples=8, shard_size=4, seed=3, min_side=16, max_side=32)
    return root


@pytest.fixture
def hostile(pristine, tmp_path, request) -> dict[str, Any]:
    """A copy of the dataset with the case's hostile entry; the tree around tmp_path before."""
    case = request.param
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    root = tmp_path / "ds"
    shutil.copytree(pristine, root)
    tar, name, why = plant(root, case, elsewhere)
    return {"case": case, "root": root, "tar": tar, "name": name, "why": why,
            "elsewhere": elsewhere, "around": tmp_path.parent,
            "before": tree(tmp_path.parent)}


def refusal(h: dict[str, Any]) -> str:
    """The walker's words: ``<tar>: unsafe member '<name>' at byte N: <why>; refused``."""
    return (rf"{re.escape(str(h['tar']))}: unsafe member {re.escape(repr(h['name']))} at byte "
            rf"\d+: {re.escape(h['why'])}; refused")


def assert_nothing_outside(h: dict[str, Any], out: Path | None = None) -> None:
    after = tree(h["around"], skip=out)
    before = {p for p in h["before"] if out is None or not p.startswith(str(out))}
    assert after == before, sorted(after ^ before)
    assert not list(h["elsewhere"].iterdir())


def assert_one_line(rc: int, err: str, *needles: str) -> None:
    assert rc == 2, err
    assert err.count("\n") == 1 and err.startswith("ray-ingest: error: "), err
    for needle in needles:
        assert needle in err, (needle, err)


# --- tar members ----------------------------------------------------------------------------


@pytest.mark.parametrize("hostile", CASES, indirect=True)
def test_walker_refuses_the_entry(hostile):
    with open(hostile["tar"], "rb") as f, pytest.raises(UnsafeMemberError) as info:
        list(iter_members(f, str(hostile["tar"])))
    assert re.fullmatch(refusal(hostile), str(info.value)), str(info.value)
    # a header-only walk (resume, key index) too
    with open(hostile["tar"], "rb") as f, pytest.raises(UnsafeMemberError):
        list(iter_members(f, str(hostile["tar"]), read_data=False))
    assert_nothing_outside(hostile)


@pytest.mark.parametrize("hostile", CASES, indirect=True)
def test_read_stage_raises_one_line_naming_shard_and_member(hostile):
    cfg = cfg_for(hostile["root"])
    catalog = load_catalog([str(hostile["root"])])
    sid = next(i for i, s in enumerate(catalog.shards) if s.path == SHARD)
    with pytest.raises(UnsafeMemberError) as info:
        list(read_item(catalog.shards[sid], ReadItem(0, sid, 0, 4), read_options(cfg), 4))
    text = str(info.value)
    assert "\n" not in text
    assert re.fullmatch(rf"shard {re.escape(SHARD)} index {POS} \(after key {key(POS - 1)}\): "
                        + refusal(hostile), text), text
    with pytest.raises(UnsafeMemberError):  # the reader behind cat, the benchmarks, Ray tasks
        list(read_shard(catalog.shards[sid]))
    assert_nothing_outside(hostile)


@pytest.mark.parametrize("hostile", CASES, indirect=True)
def test_loader_skip_is_counted_in_the_read_state(hostile):
    cfg = cfg_for(hostile["root"], on_error="skip", max_skips_per_shard=None,
                  max_skips_per_epoch=None)
    delivered, skipped, loader = run(cfg, local=True)
    catalog = load_catalog([str(hostile["root"])])
    sid = next(i for i, s in enumerate(catalog.shards) if s.path == SHARD)
    other = next(i for i, s in enumerate(catalog.shards) if s.path == OTHER)
    # the tar is not trusted past the hostile entry: the rest of its slice is skipped
    assert sorted((s, i) for s, i, _ in skipped) == [(sid, POS), (sid, POS + 1)]
    for _, _, reason in skipped:
        assert re.fullmatch(r"read: UnsafeMemberError: .*" + refusal(hostile), reason), reason
    assert sorted(delivered) == sorted([(sid, 0), (sid, 1)] + [(other, i) for i in range(4)])
    assert loader.metrics()["skips_by_kind"] == {"read/UnsafeMemberError": 2}
    # recorded in the read state with the batch that follows them (a checkpoint keeps them)
    _, _, stopped = run(cfg, stop_after=1, local=True)
    state = stopped.state.to_dict()
    assert state["epoch"] == 0
    assert sorted((s, i) for s, i, _ in state["skips"]) == [(sid, POS), (sid, POS + 1)]
    assert_nothing_outside(hostile)


@pytest.mark.parametrize("hostile", CASES, indirect=True)
def test_cat_and_index_fail_in_one_line(hostile, capsys):
    rc = main(["cat", str(hostile["root"])])
    out, err = capsys.readouterr()
    assert_one_line(rc, err, SHARD, str(hostile["tar"]), repr(hostile["name"]),
                    hostile["why"])
    assert len(out.splitlines()) == POS  # the samples before it were printed
    rc = main(["index", str(hostile["root"]), "--force"])
    _, err = capsys.readouterr()
    assert_one_line(rc, err, str(hostile["tar"]), repr(hostile["name"]), hostile["why"])
    assert not Path(index_url(str(hostile["tar"]))).exists()
    assert_nothing_outside(hostile)


@pytest.mark.parametrize("hostile", CASES, indirect=True)
def test_convert_refuses_and_writes_only_into_out(hostile, capsys):
    out = hostile["around"] / f"{hostile['root'].parent.name}_out"
    # the hostile tar is a copied modality: refused before a byte of it is copied
    with pytest.raises(UnsafeMemberError) as info:
        convert_pickles(str(hostile["root"]), "caption", out=str(out))
    assert re.fullmatch(refusal(hostile), str(info.value)), str(info.value)
    assert not (out / "image" / SHARD).exists()
    # in place, on the hostile modality itself: the header walk refuses it
    rc = main(["convert", str(hostile["root"]), "--modality", "image", "--pickle-to-npy"])
    _, err = capsys.readouterr()
    assert_one_line(rc, err, str(hostile["tar"]), repr(hostile["name"]), hostile["why"])
    assert_nothing_outside(hostile, out=out)
    shutil.rmtree(out, ignore_errors=True)


@pytest.mark.ray
@pytest.mark.parametrize("hostile", CASES, indirect=True)
def test_read_and_write_twin_tars_refuse(ray_local, hostile):
    from ray_ingest.datasets.read import read_twin_tars
    from ray_ingest.datasets.write import write_twin_tars

    out = hostile["around"] / f"{hostile['root'].parent.name}_twin_out"
    with pytest.raises(IngestError) as info:
        write_twin_tars(read_twin_tars(str(hostile["root"])), str(out),
                        modalities=["image", "caption"], num_cpus=0.25)
    text = str(info.value)
    assert "\n" not in text and isinstance(info.value, UnsafeMemberError), text
    assert re.search(refusal(hostile), text), text
    assert not (out / "image" / SHARD).exists()
    assert_nothing_outside(hostile, out=out)
    shutil.rmtree(out, ignore_errors=True)


# --- what write_twin_tars is asked to write -------------------------------------------------


ROW_CASES = {
    # case: (column overrides of the first row, error type, words of the error)
    "shard_dotdot": ({"__shard__": "../../escaped.tar"}, UnsafePathError,
                     "unsafe path '../../escaped.tar': a '..' part"),
    "shard_inner": ({"__shard__": "p/../../../escaped.tar"}, UnsafePathError,
                    "unsafe path 'p/../../../escaped.tar': a '..' part"),
    "shard_absolute": ({"__shard__": "/tmp/ray_ingest_escaped.tar"}, ConfigError,
                       "expected a relative '*.tar' path, got '/tmp/ray_ingest_escaped.tar'"),
    "key_absolute": ({"__key__": "/tmp/escaped"}, UnsafeMemberError,
                     "sample key: unsafe member name '/tmp/escaped': an absolute path"),
    "key_nul": ({"__key__": "k\0x"}, UnsafeMemberError,
                "sample key: unsafe member name 'k\\x00x': a NUL byte in the name"),
    "leaf_dotdot": ({"__leaf__": "../.."}, ConfigError, "expected a relative folder, got '../..'"),
}


@pytest.mark.ray
@pytest.mark.parametrize("case", list(ROW_CASES))
def test_write_twin_tars_refuses_hostile_rows(ray_local, tmp_path, case):
    import ray

    from ray_ingest.datasets.write import write_twin_tars

    override, error, words = ROW_CASES[case]
    rows = [{"__key__": f"k{i}", "__shard__": "part_000000/000000.tar", "__index__": i,
             "__leaf__": "", "image": b"img", "image__ext": "jpg"} for i in range(3)]
    rows[0].update(override)
    out = tmp_path / "out"
    before = tree(tmp_path.parent, skip=out)
    with pytest.raises(error) as info:
        write_twin_tars(ray.data.from_items(rows), str(out), modalities=["image"],
                        num_cpus=0.25)
    text = str(info.value)
    assert "\n" not in text and words in text, text
    # refused before the shuffle: no shard of the good rows either, now or later
    assert not [p for p in out.rglob("*") if p.is_file()]
    assert tree(tmp_path.parent, skip=out) == before
    assert not Path("/tmp/ray_ingest_escaped.tar").exists()


@pytest.mark.ray
@pytest.mark.parametrize("key", ["/tmp/escaped", "k\0x", "a.b"])
def test_reshard_refuses_a_hostile_key_before_writing(ray_local, tmp_path, key):
    import ray

    from ray_ingest.datasets.write import write_twin_tars

    # the good keys sort first: their shards come before the hostile one's
    rows = [{"__key__": k, "image": b"img", "image__ext": "jpg"} for k in ("-0", "-1", key)]
    out = tmp_path / "out"
    with pytest.raises((UnsafeMemberError, ConfigError)) as info:
        write_twin_tars(ray.data.from_items(rows), str(out), modalities=["image"],
                        shard_size=1, part_size=0, num_cpus=0.25)
    text = str(info.value)
    assert "\n" not in text and repr(key) in text, text
    assert not [p for p in out.rglob("*") if p.is_file()]


# --- wdinfo data_list (and data_keys) ---------------------------------------------------------


def _escape_target(tmp_path: Path) -> Path:
    """A real twin shard outside the dataset root, where the hostile entries point."""
    target = tmp_path / "elsewhere"
    synth_dataset(str(target), samples=2, shard_size=2, seed=1, min_side=16, max_side=24)
    return target


LIST_CASES = {
    "dotdot": lambda t: "../../elsewhere/part_000000/000000.tar",
    "inner": lambda t: "part_000000/../../../elsewhere/part_000000/000000.tar",
    "absolute": lambda t: str(t / "image" / "part_000000" / "000000.tar"),
    # a URL: fsspec read it as a protocol ("Protocol not known: .../caption/file", a traceback)
    "file_url": lambda t: (t / "image" / "part_000000" / "000000.tar").as_uri(),
}


def _wdinfo(root: Path, entry: str, n: int = 1, data_keys=("image", "caption")) -> Path:
    data_list = [f"part_000000/{i:06d}.tar" for i in range(n)]
    data_list[min(7, n - 1)] = entry
    doc = {"data_list": data_list, "data_list_key_count": [2] * n, "total_key_count": 2 * n,
           "data_keys": list(data_keys), "root": "."}
    root.mkdir(parents=True, exist_ok=True)
    (root / "wdinfo.json").write_text(json.dumps(doc))
    return root / "wdinfo.json"


@pytest.mark.parametrize("case", list(LIST_CASES))
def test_data_list_climbing_out_of_the_root_is_refused(tmp_path, case, capsys):
    target = _escape_target(tmp_path)
    entry = LIST_CASES[case](target)
    url = _wdinfo(tmp_path / "ds", entry)
    words = rf"{re.escape(str(url))}: field 'data_list\[0\]': unsafe path {re.escape(repr(entry))}"
    before = tree(tmp_path.parent)
    with pytest.raises(UnsafePathError, match=words):
        load_catalog([str(tmp_path / "ds")])
    from ray_ingest.datasets.read import read_twin_tars

    with pytest.raises(UnsafePathError, match=words):
        read_twin_tars(str(tmp_path / "ds"))
    out = tmp_path / "out"
    with pytest.raises(UnsafePathError, match=words):
        convert_pickles(str(tmp_path / "ds"), "caption", out=str(out))
    for cmd in (["cat"], ["info"], ["index"]):
        rc = main([*cmd, str(tmp_path / "ds")])
        assert_one_line(rc, capsys.readouterr()[1], "'data_list[0]'", repr(entry))
    assert tree(tmp_path.parent) == before


@pytest.mark.parametrize("parser", ["json", "pyarrow", "scan"])
@pytest.mark.parametrize("case", list(LIST_CASES))
def test_every_wdinfo_parser_refuses(tmp_path, parser, case):
    """Big documents (1 MiB and more) take the vectorised parsers; each refuses the same way."""
    n = 1 if parser == "json" else 60_000
    entry = LIST_CASES[case](tmp_path)
    url = _wdinfo(tmp_path, entry, n=n)
    if parser == "pyarrow":  # a backslash escape: the scanner declines, pyarrow parses it
        doc = json.loads(url.read_text())
        doc["note"] = "a/b"
        url.write_text(json.dumps(doc).replace('"a/b"', '"a\\/b"'))
    bad = min(7, n - 1)
    with pytest.raises(UnsafePathError,
                       match=rf"field 'data_list\[{bad}\]': unsafe path {re.escape(repr(entry))}"):
        read_wdinfo(str(url))


@pytest.mark.parametrize("parser", ["json", "pyarrow", "scan"])
def test_dots_inside_a_name_are_fine(tmp_path, parser):
    n = 1 if parser == "json" else 60_000
    url = _wdinfo(tmp_path, "part..1/a..b.tar", n=n)
    if parser == "pyarrow":
        doc = json.loads(url.read_text())
        doc["note"] = "a/b"
        url.write_text(json.dumps(doc).replace('"a/b"', '"a\\/b"'))
    w = read_wdinfo(str(url))
    assert w.paths[min(7, n - 1)].as_py() == "part..1/a..b.tar"


def test_data_keys_climbing_out_are_refused(tmp_path, capsys):
    url = _wdinfo(tmp_path / "ds", "part_000000/000000.tar", data_keys=("image", "../.."))
    with pytest.raises(UnsafePathError, match=r"field 'data_keys': expected a plain folder name, "
                                              r"got '\.\./\.\.'"):
        read_wdinfo(str(url))
    rc = main(["cat", str(tmp_path / "ds")])
    assert_one_line(rc, capsys.readouterr()[1], "data_keys", "'../..'")


def test_a_hand_made_shard_path_is_refused_by_the_reader(pristine):
    from ray_ingest.catalog.shard import Shard

    shard = Shard("../../part_000000/000000.tar", str(pristine / "image"), ("image",))
    with pytest.raises(UnsafePathError, match=r"shard \.\./\.\./part_000000/000000\.tar: unsafe "
                                              r"path"):
        list(read_shard(shard))


# --- shard: links and special files in raw folders -----------------------------------------------


def test_shard_never_follows_links_or_reads_special_files(tmp_path):
    raw = write_raw_folders(tmp_path / "in", extra_anomalies=False)
    secret = tmp_path / "outside.txt"
    secret.write_bytes(b"SECRET BYTES OUTSIDE THE INPUT")
    (raw / "image" / "s04.jpg").unlink()
    os.symlink(secret, raw / "image" / "s04.jpg")       # a link to a file outside
    (raw / "caption" / "s05.json").unlink()
    os.mkfifo(raw / "caption" / "s05.json")             # reading it would block forever
    out = tmp_path / "out"
    report = shard_folders(str(raw), str(out), shard_size=4)
    assert report.samples == 8
    assert report.dropped["image"][SPECIAL] == 1 and report.dropped["caption"][SPECIAL] == 1
    for tar in out.rglob("*.tar"):
        assert b"SECRET BYTES" not in tar.read_bytes()
    assert {p.name for p in tmp_path.iterdir()} == {"in", "out", "outside.txt"}


def test_shard_refuses_a_linked_modality_folder(tmp_path, capsys):
    raw = write_raw_folders(tmp_path / "in", extra_anomalies=False)
    elsewhere = tmp_path / "elsewhere"
    shutil.move(raw / "umt5", elsewhere)
    os.symlink(elsewhere, raw / "umt5")
    rc = main(["shard", str(raw), str(tmp_path / "out"), "--shard-size", "4"])
    assert_one_line(rc, capsys.readouterr()[1], "umt5 is a link to a folder")
    assert not (tmp_path / "out").exists()


def test_shard_drops_names_with_a_nul_byte(tmp_path):
    import fsspec

    fs = fsspec.filesystem("memory")
    base = f"hostile_{tmp_path.name}"
    for m, ext in (("image", "jpg"), ("caption", "json")):
        for stem in ("a", "b\0c"):
            fs.pipe(f"/{base}/in/{m}/{stem}.{ext}", b"x" if m == "caption" else b"\xff\xd8x")
    try:
        report = shard_folders(f"memory://{base}/in", f"memory://{base}/out", shard_size=4)
        assert report.samples == 1
        assert report.dropped == {"image": {BAD_KEY: 1}, "caption": {BAD_KEY: 1}}
    finally:
        fs.rm(f"/{base}", recursive=True)
