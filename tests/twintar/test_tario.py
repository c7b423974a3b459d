"""Tar header walker, key rules, key index; checked against ``tarfile`` on real tars."""

from __future__ import annotations

import io
import json
import tarfile

import pytest

from ray_ingest.errors import TarFormatError
from ray_ingest.twintar.tario import (
    TarIndex,
    build_index,
    index_url,
    iter_members,
    skip_members,
    split_name,
)
from ray_ingest.twintar.writer import ShardWriter
from tests.support.datagen import tar_bytes


@pytest.mark.parametrize(
    ("name", "expected"),
    [
        ("id.jpg", ("id", "jpg")),
        ("a.JPG", ("a", "jpg")),
        ("Image.PNG", ("Image", "png")),
        ("x.y.jpg", ("x-y", "jpg")),  # PiD: all but the last part joined with '-'
        ("a.b.c.json", ("a-b-c", "json")),
        ("sub/id.jpg", ("sub/id", "jpg")),
        ("ds__id_0.npy", ("ds__id_0", "npy")),
        ("noext", None),
        ("trailing.", None),
        ("__meta__", None),
        ("__key__.txt", ("__key__", "txt")),  # webdataset keeps it too
        ("__dir__/a.jpg", None),
        (".jpg", None),
        ("sub/.jpg", None),
    ],
)
def test_split_name(name, expected):
    assert split_name(name) == expected


class NoSeek(io.RawIOBase):
    """A non-seekable stream (like a socket or a pipe)."""

    def __init__(self, data: bytes):
        self._buf = io.BytesIO(data)

    def readable(self) -> bool:
        return True

    def readinto(self, b) -> int:
        chunk = self._buf.read(min(len(b), 700))  # short reads on purpose
        b[: len(chunk)] = chunk
        return len(chunk)


LONG = "p" * 80 + "/" + "x" * 80


def _mixed_tar(fmt: int) -> bytes:
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w", format=fmt) as tf:
        d = tarfile.TarInfo("adir")
        d.type = tarfile.DIRTYPE
        tf.addfile(d)
        for name, data in [
            ("a.jpg", b"A" * 700),
            ("a.json", b"{}"),
            (LONG + ".jpg", b"long"),  # ustar prefix field / GNU long name / pax path
            ("deep/" * 30 + "k.npy", b"N" * 1024),
            ("__meta__", b"meta"),
            ("empty.txt", b""),
        ]:
            info = tarfile.TarInfo(name)
            info.size = len(data)
            tf.addfile(info, io.BytesIO(data))
        # no link: links are refused (tests/test_hostile.py), no longer passed over
    return buf.getvalue()


@pytest.mark.parametrize("fmt", [tarfile.USTAR_FORMAT, tarfile.GNU_FORMAT, tarfile.PAX_FORMAT],
                         ids=["ustar", "gnu", "pax"])
@pytest.mark.parametrize("seekable", [True, False])
@pytest.mark.parametrize("read_data", [True, False])
def test_iter_members_matches_tarfile(fmt, seekable, read_data):
    data = _mixed_tar(fmt)
    with tarfile.open(fileobj=io.BytesIO(data)) as tf:
        want = [(m.name, m.offset, m.size, tf.extractfile(m).read())
                for m in tf.getmembers() if m.isreg()]
    f = io.BytesIO(data) if seekable else io.BufferedReader(NoSeek(data))
    got = list(iter_members(f, "t.tar", read_data=read_data))
    assert [(m.name, m.offset, m.size) for m in got] == [w[:3] for w in want]
    if read_data:
        assert [m.data for m in got] == [w[3] for w in want]
    else:
        assert all(m.data is None for m in got)
    assert [m.key for m in got] == [
        "a", "a", LONG, "deep/" * 30 + "k", None, "empty"]


def test_iter_members_accepts_missing_end_blocks():
    data = tar_bytes([("a.jpg", b"1"), ("b.jpg", b"22")])
    body = data[: 512 * 4]  # two members, no end-of-archive blocks
    assert [m.name for m in iter_members(io.BytesIO(body))] == ["a.jpg", "b.jpg"]


def test_start_offset_keeps_offsets_absolute():
    data = tar_bytes([("a.jpg", b"1"), ("b.jpg", b"2" * 600), ("c.jpg", b"3")])
    f = io.BytesIO(data)
    f.seek(1024)
    got = list(iter_members(f, start_offset=1024))
    assert [(m.name, m.offset) for m in got] == [("b.jpg", 1024), ("c.jpg", 2560)]


def test_truncated_payload_names_member_and_offset():
    data = tar_bytes([("a.jpg", b"1" * 100), ("b.jpg", b"2" * 3000)])
    with pytest.raises(TarFormatError,
                       match=r"t\.tar: truncated tar: member 'b\.jpg' at byte 1536"):
        list(iter_members(io.BytesIO(data[:2000]), "t.tar"))


def test_truncated_header():
    data = tar_bytes([("a.jpg", b"1" * 100), ("b.jpg", b"2")])
    with pytest.raises(TarFormatError, match="truncated tar: header at byte 1024"):
        list(iter_members(io.BytesIO(data[:1024 + 100]), "t.tar"))


def test_corrupt_checksum():
    data = bytearray(tar_bytes([("a.jpg", b"1"), ("b.jpg", b"2")]))
    data[1024 + 10] ^= 0xFF  # inside b.jpg's header name field
    with pytest.raises(TarFormatError, match=r"t\.tar: corrupt tar header at byte 1024 \(checksum"):
        list(iter_members(io.BytesIO(bytes(data)), "t.tar"))


def test_bad_size_field():
    data = bytearray(tar_bytes([("a.jpg", b"1")]))
    header = bytearray(data[:512])
    header[124:136] = b"0000000zz00\0"
    header[148:156] = b" " * 8
    header[148:156] = f"{sum(header):06o}\0 ".encode()
    data[:512] = header
    with pytest.raises(TarFormatError, match="bad size field"):
        list(iter_members(io.BytesIO(bytes(data)), "t.tar"))


def test_not_a_tar():
    with pytest.raises(TarFormatError, match="checksum"):
        list(iter_members(io.BytesIO(b"{\"json\": 1}" + b" " * 600), "x.tar"))


def test_build_index_and_skip_members():
    members = [("a.jpg", b"1" * 10), ("__meta__", b"m"), ("b.jpg", b"2" * 5000),
               ("noext", b"n"), ("c.jpg", b"3")]
    data = tar_bytes(members)
    idx = build_index(io.BytesIO(data), "t.tar", tar_size=len(data))
    assert idx.names == ("a.jpg", "__meta__", "b.jpg", "noext", "c.jpg")
    assert idx.keys == ("a", None, "b", None, "c")
    with tarfile.open(fileobj=io.BytesIO(data)) as tf:
        assert list(idx.offsets) == [m.offset for m in tf.getmembers()]
        assert list(idx.sizes) == [m.size for m in tf.getmembers()]
    assert TarIndex.from_dict(idx.to_dict()) == idx
    # skip_members counts named members only and returns the next header's offset
    for n, want in [(0, 0), (1, idx.offsets[1]), (2, idx.offsets[3]), (3, len(data))]:
        f = io.BytesIO(data)
        pos = skip_members(f, n, "t.tar")
        if n < 3:
            assert pos == want and f.tell() == want
        rest = [m.name for m in iter_members(f, start_offset=pos)]
        assert [k for k in ("a.jpg", "b.jpg", "c.jpg") if k in rest] == ["a.jpg", "b.jpg",
                                                                        "c.jpg"][n:]


@pytest.mark.parametrize("doc", [{"version": 2}, {"version": 1, "names": []},
                                 {"version": 1, "names": ["a"], "offsets": [], "sizes": []}, []])
def test_index_from_dict_rejects(doc):
    with pytest.raises(TarFormatError):
        TarIndex.from_dict(doc, "x.idx.json")


def test_writer_output_is_a_standard_tar_with_a_matching_index(tmp_path):
    keys = ["k0", "k1", "a" * 150, "sub_dir_key"]
    payloads = [b"", b"x" * 511, b"y" * 513, b"z" * 5000]
    with ShardWriter(str(tmp_path), "000000.tar", ["image", "caption"]) as w:
        for k, p in zip(keys, payloads, strict=True):
            w.add(k, {"image": ("JPG", p), "caption": ("json", p[:3])})
    info = w.info
    assert info.count == 4
    for m, ext in (("image", "JPG"), ("caption", "json")):
        path = tmp_path / m / "000000.tar"
        data = path.read_bytes()
        assert len(data) == info.bytes[m] and len(data) % tarfile.RECORDSIZE == 0
        with tarfile.open(path) as tf:
            regs = tf.getmembers()
            assert [r.name for r in regs] == [f"{k}.{ext}" for k in keys]
            assert all(r.mtime == 0 and r.uid == 0 and r.mode == 0o644 for r in regs)
        idx = TarIndex.from_dict(json.loads((tmp_path / m / "000000.tar.idx.json").read_text()))
        assert idx == build_index(io.BytesIO(data), tar_size=len(data))
        assert idx.keys == tuple(keys)
    assert index_url("x/y.tar") == "x/y.tar.idx.json"


# --- size limit from the header: the payload of an oversized member is never read -----------


class Counting(io.RawIOBase):
    """A file that counts the payload bytes handed out and remembers the largest read."""

    def __init__(self, data: bytes, seekable: bool):
        self._buf = io.BytesIO(data)
        self._seekable = seekable
        self.bytes_read = 0
        self.largest_read = 0

    def readable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return self._seekable

    def seek(self, pos: int, whence: int = io.SEEK_SET) -> int:
        if not self._seekable:
            raise io.UnsupportedOperation("not seekable")
        return self._buf.seek(pos, whence)

    def tell(self) -> int:
        return self._buf.tell()

    def readinto(self, b) -> int:
        chunk = self._buf.read(len(b))
        b[: len(chunk)] = chunk
        self.bytes_read += len(chunk)
        self.largest_read = max(self.largest_read, len(chunk))
        return len(chunk)


HUGE = 8 * 2**20  # an 8 MiB member, limit 64 KiB


def _huge_tar() -> bytes:
    return tar_bytes([("a.jpg", b"A" * 100), ("b.jpg", b"\x00" * HUGE), ("c.jpg", b"C" * 200)])


@pytest.mark.parametrize("seekable", [True, False], ids=["seekable", "stream"])
def test_oversized_member_is_skipped_from_its_header(seekable):
    f = Counting(_huge_tar(), seekable)
    ms = list(iter_members(f, "x.tar", max_member_bytes=64 * 1024))
    assert [(m.key, m.size, m.over_limit) for m in ms] == [
        ("a", 100, None), ("b", HUGE, 64 * 1024), ("c", 200, None)]
    assert ms[1].data is None and ms[0].data == b"A" * 100 and ms[2].data == b"C" * 200
    if seekable:  # the payload was seeked over: only headers, the small payloads, one byte
        assert f.bytes_read < 16 * 1024, f.bytes_read
    else:  # read and discarded, never held whole: chunks of at most 1 MiB
        assert f.bytes_read > HUGE and f.largest_read <= 2**20, f.largest_read


def test_no_limit_reads_every_member_and_headers_only_ignore_the_limit():
    ms = list(iter_members(io.BytesIO(_huge_tar()), "x.tar"))
    assert ms[1].data == b"\x00" * HUGE and ms[1].over_limit is None
    ms = list(iter_members(io.BytesIO(_huge_tar()), "x.tar", read_data=False, max_member_bytes=1))
    assert all(m.data is None and m.over_limit is None for m in ms)


def test_oversized_member_of_a_truncated_tar_is_a_truncation_error():
    data = _huge_tar()
    offset = 3 * 512 + 1024  # header a + payload a (1 block) + header b, inside b's payload
    with pytest.raises(TarFormatError, match=r"x\.tar: truncated tar: member 'b\.jpg'"):
        list(iter_members(io.BytesIO(data[: offset + HUGE // 2]), "x.tar",
                          max_member_bytes=64 * 1024))
