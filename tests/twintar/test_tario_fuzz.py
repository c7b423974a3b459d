"""Differential fuzzing of the tar header walker (:mod:`ray_ingest.twintar.tario`) against the
standard library's ``tarfile``.

Tars are written by ``tarfile`` in the ustar, GNU and pax formats (long and unicode names,
directories, links, devices, GNU and pax sparse members, pax records that rename or resize a
member, global pax headers) and then mutated: header fields set to edge values (octal with
spaces, signs, underscores, base-256, negative, huge), checksums recomputed (unsigned or
signed) or not, bytes flipped, inserted or deleted, the file truncated. For every input the
walker must

* yield exactly the regular files ``tarfile`` yields (names and bytes), or
* raise a one-line :class:`~ray_ingest.errors.IngestError` (``TarFormatError``,
  ``UnsafeMemberError``) after yielding a prefix of them;

never another exception, never a hang, never a member ``tarfile`` does not see. Seekable and
unseekable streams, and the header-only walk (``read_data=False``, which resume and the key
index use), must agree. The budget is ``tests/support/fuzz.py``'s.
"""

from __future__ import annotations

import io
import re
import tarfile
from typing import Any

import pytest
from hypothesis import given
from hypothesis import strategies as st

from ray_ingest.errors import IngestError
from ray_ingest.twintar.tario import iter_members
from tests.support.fuzz import fuzz_settings, tally, within
from tests.twintar.test_tario import NoSeek

pytestmark = pytest.mark.fuzz

SOURCE = "mem://fuzz/x.tar"
FORMATS = {"ustar": tarfile.USTAR_FORMAT, "gnu": tarfile.GNU_FORMAT, "pax": tarfile.PAX_FORMAT}
#: (offset, length) of the ustar header fields mutations aim at
FIELDS = {"name": (0, 100), "mode": (100, 8), "uid": (108, 8), "gid": (116, 8),
          "size": (124, 12), "mtime": (136, 12), "chksum": (148, 8), "type": (156, 1),
          "linkname": (157, 100), "magic": (257, 6), "version": (263, 2),
          "devmajor": (329, 8), "devminor": (337, 8), "prefix": (345, 155),
          "sparse": (386, 110)}

# --- tars written by tarfile ------------------------------------------------------------------

_PLAIN = ["a.jpg", "s00000001.json", "sub/k.npy", "__meta__", "noext", "x.y.JPG", "é/ü.png",
          "deep/" * 25 + "long.jpg", "n" * 99 + ".j", "dir/", "a.jpg/", "./a.txt", "..a.jpg"]
names = st.one_of(
    st.sampled_from(_PLAIN),
    st.text(st.characters(codec="utf-8", blacklist_characters="\0"), min_size=1, max_size=40),
    st.text(st.sampled_from("ab/._é"), min_size=90, max_size=260),
)
payloads = st.one_of(st.binary(max_size=1100),
                     st.integers(0, 3000).map(lambda n: bytes(i % 251 for i in range(n))))
member = st.tuples(
    st.sampled_from(["file"] * 6 + ["dir", "symlink", "hardlink", "fifo", "chardev",
                                     "gnu_sparse", "pax_sparse", "pax_size", "pax_path",
                                     "contiguous", "unknown"]),
    names, payloads)


def _info(kind: str, name: str, data: bytes, fmt: int) -> tuple[tarfile.TarInfo, bytes | None]:
    info = tarfile.TarInfo(name)
    info.size = len(data)
    body: bytes | None = data
    if kind in ("dir", "symlink", "hardlink", "fifo", "chardev"):
        info.type = {"dir": tarfile.DIRTYPE, "symlink": tarfile.SYMTYPE,
                     "hardlink": tarfile.LNKTYPE, "fifo": tarfile.FIFOTYPE,
                     "chardev": tarfile.CHRTYPE}[kind]
        info.linkname = "target.jpg" if "link" in kind else ""
        info.size, body = 0, None
    elif kind == "gnu_sparse":
        info.type = tarfile.GNUTYPE_SPARSE
    elif kind == "contiguous":
        info.type = tarfile.CONTTYPE
    elif kind == "unknown":
        info.type = b"V"
    elif kind == "pax_sparse" and fmt == tarfile.PAX_FORMAT:
        info.pax_headers = {"GNU.sparse.major": "1", "GNU.sparse.minor": "0",
                            "GNU.sparse.name": name, "GNU.sparse.realsize": str(len(data))}
    elif kind == "pax_size" and fmt == tarfile.PAX_FORMAT:
        info.pax_headers = {"size": str(len(data))}
    elif kind == "pax_path" and fmt == tarfile.PAX_FORMAT:
        info.pax_headers = {"path": name + "/", "comment": "x" * 30}
    return info, body


def build_tar(fmt_name: str, members: list, global_pax: dict[str, str] | None,
              end_blocks: bool) -> bytes:
    fmt = FORMATS[fmt_name]
    buf = io.BytesIO()
    kw: dict[str, Any] = {"format": fmt}
    if global_pax and fmt == tarfile.PAX_FORMAT:
        kw["pax_headers"] = global_pax
    with tarfile.open(fileobj=buf, mode="w", **kw) as tf:
        for kind, name, data in members:
            info, body = _info(kind, name, data, fmt)
            try:
                tf.addfile(info, None if body is None else io.BytesIO(body))
            except (ValueError, UnicodeError):
                continue  # a name or size this format cannot hold: left out
    raw = buf.getvalue()
    if not end_blocks:
        raw = raw.rstrip(b"\0")
        raw = raw + b"\0" * (-len(raw) % 512)
    return raw


# --- mutations ------------------------------------------------------------------------------

_NUMBERS = [b"0", b"7", b"00000000144", b" 144 ", b"144\0   ", b"+144", b"-1", b"1_4",
            b"0o17", b"89", b"\t12\n", b"", b"77777777777", b"\x80" + b"\0" * 10 + b"\x05",
            b"\x80" + b"\xff" * 11, b"\xff" * 12, b"\xff" + b"\xff" * 10 + b"\xfb",
            b"\x81\0\0\0\0\0\0\0\0\0\0\x01", b"1" * 12, b"\x00" * 12, b"\xc0" * 12,
            b"000000001000", b"00000001001", b"00000000777"]
field_values = st.one_of(st.sampled_from(_NUMBERS), st.binary(max_size=12),
                         st.sampled_from([b"0", b"\0", b"1", b"2", b"5", b"7", b"L", b"K",
                                          b"x", b"g", b"X", b"S", b"V", b"D", b"ustar\0",
                                          b"ustar ", b"../x.jpg", b"/abs.jpg", b"a\0b.jpg",
                                          b"pre/fix", b"a.jpg/"]))
mutation = st.one_of(
    st.tuples(st.just("field"), st.integers(0, 40), st.sampled_from(sorted(FIELDS)),
              field_values, st.sampled_from(["unsigned", "signed", "stale"])),
    st.tuples(st.just("byte"), st.integers(0, 30_000), st.integers(0, 255)),
    st.tuples(st.just("truncate"), st.integers(0, 30_000)),
    st.tuples(st.just("insert"), st.integers(0, 30_000), st.binary(min_size=1, max_size=600)),
    st.tuples(st.just("delete"), st.integers(0, 30_000), st.integers(1, 700)),
    st.tuples(st.just("pax"), st.integers(0, 40), st.sampled_from(
        [b"0 path=x\n", b"9 path=\n", b"abc", b"12 size=-5\n", b"11 size=zz\n",
         b"13 path=a\0b\n", b"99999999999 path=x\n", b"18 path=\xff\xfe.jpg\n",
         b"21 hdrcharset=BINARY\n", b"12 path=a.jp\n", b"30 GNU.sparse.name=s.jpg\n",
         b"14 size=99999\n", b"5 a=b\n"])),
)


def _checksum(block: bytearray, kind: str) -> None:
    fmt = "148B8x356B" if kind == "unsigned" else "148b8x356b"
    import struct

    total = 256 + sum(struct.unpack_from(fmt, bytes(block)))
    block[148:156] = b"%06o\0 " % (total & 0o777777) if total >= 0 else b"-%05o\0 " % -total


def mutate(raw: bytes, mutations: list) -> bytes:
    out = bytearray(raw)
    for m in mutations:
        kind = m[0]
        if kind in ("field", "pax"):
            blocks = max(1, len(out) // 512)
            start = (m[1] % blocks) * 512
            block = bytearray(out[start:start + 512].ljust(512, b"\0"))
            if kind == "field":
                off, length = FIELDS[m[2]]
                value = m[3][:length].ljust(length, b"\0") if m[2] != "type" else m[3][:1]
                block[off:off + len(value)] = value
                if m[4] != "stale":
                    _checksum(block, m[4])
            else:  # a pax record over the start of the block (a pax header's data block)
                block[:len(m[2])] = m[2]
            out[start:start + 512] = block
        elif kind == "byte" and out:
            out[m[1] % len(out)] = m[2]
        elif kind == "truncate":
            del out[m[1] % (len(out) + 1):]
        elif kind == "insert":
            at = m[1] % (len(out) + 1)
            out[at:at] = m[2]
        elif kind == "delete" and out:
            at = m[1] % len(out)
            del out[at:at + m[2]]
    return bytes(out)


# --- the two readers --------------------------------------------------------------------------


def reference(raw: bytes) -> tuple[list[tuple[str, bytes]], bool]:
    """tarfile's regular files (name, bytes) in order, and whether it raised (then the list is
    what it gave before)."""
    out: list[tuple[str, bytes]] = []
    try:
        with tarfile.open(fileobj=io.BytesIO(raw), mode="r:") as tf:
            for m in tf:
                if m.isfile():
                    f = tf.extractfile(m)
                    out.append((m.name, f.read()))
    except Exception:  # tarfile raises ValueError and others besides TarError on bad input
        return out, True
    return out, False


def walk(stream: Any, read_data: bool = True) -> tuple[list[tuple[str, bytes | None]],
                                                       IngestError | None]:
    got: list[tuple[str, bytes | None]] = []
    try:
        for m in iter_members(stream, SOURCE, read_data=read_data):
            got.append((m.name, m.data))
    except IngestError as exc:
        return got, exc
    return got, None


def check(raw: bytes) -> str:
    """The walker against tarfile on ``raw``; returns the outcome, fails on a divergence."""
    want, ref_failed = reference(raw)
    with within(10, "iter_members"):
        got, err = walk(io.BytesIO(raw))
        unseekable = walk(NoSeek(raw))
        headers = walk(io.BytesIO(raw), read_data=False)
    # never a member tarfile does not see, with other bytes or in another order
    assert got == want[:len(got)], (got[:3], want[:3])
    if err is None:
        # (an empty file: no member either way; tarfile calls it an error, the walker an empty
        # tar, as GNU tar does)
        assert got == want and (not ref_failed or raw == b""), ("taken where tarfile fails",
                                                                 got[:3])
    else:
        text = str(err)
        assert "\n" not in text and text.startswith(SOURCE + ": "), text
    assert (unseekable[0], type(unseekable[1])) == (got, type(err)), (unseekable, got, err)
    names = [n for n, _ in headers[0]]
    assert names == [n for n, _ in got] or (err is not None and
                                            names[:len(got)] == [n for n, _ in got]), names
    assert headers[1] is None or err is not None, headers[1]
    return "same" if err is None else f"refused: {_why(str(err))}"


def _why(text: str) -> str:
    """The kind of a refusal, for the counts (the words after the byte offset)."""
    for words in ("checksum mismatch", "negative size", "pax record of length 0", "bad pax size",
                  "not followed by a member", "GNU sparse", "global pax header", "truncated",
                  "extended header of", "unsafe member"):
        if words in text:
            return words
    field = re.search(r"bad (\w+) field", text)
    return f"bad {field.group(1)} field" if field else text[len(SOURCE) + 2:][:40]


@fuzz_settings(ci_examples=1000)
@given(fmt=st.sampled_from(sorted(FORMATS)), members=st.lists(member, max_size=6),
       global_pax=st.none() | st.dictionaries(st.sampled_from(["comment", "path", "size",
                                                                "mtime", "GNU.sparse.size"]),
                                              st.sampled_from(["x", "5", "a.jpg", "-1"]),
                                              max_size=2),
       end_blocks=st.booleans(), mutations=st.lists(mutation, max_size=4))
def test_the_walker_reads_what_tarfile_reads_or_refuses(fmt, members, global_pax, end_blocks,
                                                        mutations):
    raw = mutate(build_tar(fmt, members, global_pax, end_blocks), mutations)
    tally("tar walker (tario) vs tarfile", check(raw))


# --- divergences found, one regression example each ---------------------------------------------


def _tar(*members: tuple[str, bytes], fmt: int = tarfile.PAX_FORMAT, **pax: Any) -> bytes:
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w", format=fmt, pax_headers=pax or None) as tf:
        for name, data in members:
            info = tarfile.TarInfo(name)
            info.size = len(data)
            tf.addfile(info, io.BytesIO(data))
    return buf.getvalue()


def _set(raw: bytes, block: int, field: str, value: bytes, checksum: str = "unsigned") -> bytes:
    return mutate(raw, [("field", block, field, value, checksum)])


def _typed(kind: str, name: str = "s.jpg", data: bytes = b"abc", fmt: int = tarfile.GNU_FORMAT,
           **pax: str) -> bytes:
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w", format=fmt) as tf:
        info, body = _info(kind, name, data, fmt)
        info.pax_headers.update(pax)
        tf.addfile(info, None if body is None else io.BytesIO(body))
        ok = tarfile.TarInfo("ok.jpg")
        ok.size = 2
        tf.addfile(ok, io.BytesIO(b"ok"))
    return buf.getvalue()


def _pax_member(records: bytes, name: str = "a.jpg", data: bytes = b"xyz",
                typeflag: bytes = b"x") -> bytes:
    """A pax header carrying ``records`` (as written, lengths unchecked), then the member."""
    head = tarfile.TarInfo("././@PaxHeader")
    head.type, head.size = typeflag, len(records)
    raw = head.tobuf(tarfile.USTAR_FORMAT) + records + b"\0" * (-len(records) % 512)
    return raw + _tar((name, data), fmt=tarfile.USTAR_FORMAT)


def _long_name_chain(first: bytes, second: bytes) -> bytes:
    """Two extended headers before one member: ``L`` (GNU long name) and/or ``x`` (pax)."""
    out = b""
    for kind in (first, second):
        if kind == b"L":
            name = b"from_long_name.jpg\0"
            head = tarfile.TarInfo("././@LongLink")
            head.type, head.size = tarfile.GNUTYPE_LONGNAME, len(name)
            out += head.tobuf(tarfile.GNU_FORMAT) + name.ljust(512, b"\0")
        else:
            rec = b"27 path=from_pax_path.jpg\n"
            head = tarfile.TarInfo("././@PaxHeader")
            head.type, head.size = tarfile.XHDTYPE, len(rec)
            out += head.tobuf(tarfile.USTAR_FORMAT) + rec.ljust(512, b"\0")
    return out + _tar(("own.jpg", b"data"), fmt=tarfile.USTAR_FORMAT)


def _dir_with_size() -> bytes:
    raw = bytearray(_tar(("d/", b""), ("a.jpg", b"A" * 10), fmt=tarfile.USTAR_FORMAT))
    raw[:512] = mutate(bytes(raw[:512]), [("field", 0, "type", b"5", "unsigned"),
                                          ("field", 0, "size", b"00000001000", "unsigned")])
    return bytes(raw)


REGRESSIONS = {
    # tarfile strips a pax path's trailing "/": the walker kept it ("x.jpg/", another key)
    "pax_path_trailing_slash": (lambda: _typed("pax_path", "x.jpg", fmt=tarfile.PAX_FORMAT),
                                "same"),
    # a number field tarfile cannot read ends its archive: the walker read on
    "bad_devmajor": (lambda: _set(_tar(("a.jpg", b"A"), ("b.jpg", b"B")), 2, "devmajor",
                                  b"\x01"), "refused: bad devmajor field"),
    "bad_mtime": (lambda: _set(_tar(("a.jpg", b"A")), 0, "mtime", b"9" * 11),
                  "refused: bad mtime field"),
    # only 0x80 and 0xFF start a base-256 number: 0x81 was read as one
    "base256_marker": (lambda: _set(_tar(("a.jpg", b"A")), 0, "size",
                                    b"\x81" + b"\0" * 10 + b"\x01"), "refused: bad size field"),
    # a negative size read the whole rest of the file as the member
    "negative_size": (lambda: _set(_tar(("a.jpg", b"A"), ("b.jpg", b"B")), 0, "size",
                                   b"\xff" * 12), "refused: negative size"),
    # octal as tarfile (int(text, 8)) reads it: blanks, a sign, 0o, underscores
    "octal_spellings": (lambda: _set(_tar(("a.jpg", b"A" * 12)), 0, "size", b" +0o1_4 \0"),
                        "same"),
    # a pax record of length 0 looped forever
    "pax_length_zero": (lambda: _pax_member(b"0 path=x\n"), "refused: pax record of length 0"),
    # a record that is not "<digits> key=" ended with ValueError; tarfile stops parsing there
    "pax_not_a_record": (lambda: _pax_member(b"abc"), "same"),
    # a pax size that is not a number: ValueError
    "pax_size_not_a_number": (lambda: _pax_member(b"11 size=zz\n"), "refused: bad pax size"),
    # GNU sparse members were skipped without a word (tarfile sees a file)
    "gnu_sparse": (lambda: _typed("gnu_sparse"), "refused: GNU sparse"),
    # pax (1.0) sparse members were read with their sparse map as data
    "pax_sparse": (lambda: _typed("pax_sparse", fmt=tarfile.PAX_FORMAT),
                   "refused: GNU sparse"),
    # a global pax path renames every member after it in tarfile; it was ignored
    "global_pax_path": (lambda: _tar(("a.jpg", b"A"), path="g.jpg"),
                        "refused: global pax header"),
    "global_pax_harmless": (lambda: _tar(("a.jpg", b"A"), comment="built by x"), "same"),
    # a directory's payload is not skipped by tarfile whatever its size: it was
    "dir_with_size": (_dir_with_size, "same"),
    # a pre-POSIX regular entry named "x/" is a directory: it was yielded as a member
    "v7_dir": (lambda: _set(_tar(("d/", b""), ("a.jpg", b"A"), fmt=tarfile.USTAR_FORMAT),
                            0, "type", b"\0"), "same"),
    # tarfile joins the prefix field whatever the magic: it was joined only under "ustar"
    "prefix_without_magic": (lambda: _set(_set(_tar(("a.jpg", b"A"), fmt=tarfile.USTAR_FORMAT),
                                               0, "magic", b"\0" * 6), 0, "prefix", b"pre"),
                             "same"),
    # old Sun and NeXT tars sum signed bytes into the checksum: refused before
    "signed_checksum": (lambda: _set(_tar(("é.jpg", b"A"), fmt=tarfile.USTAR_FORMAT), 0,
                                     "mode", b"0000644", "signed"), "same"),
    # a Solaris extended header ("X") is a pax header to tarfile: it was ignored
    "solaris_pax": (lambda: _pax_member(b"20 path=solaris.jpg\n", typeflag=b"X"), "same"),
    # two extended headers: the first one's name wins in tarfile; the long name always won
    "pax_then_long_name": (lambda: _long_name_chain(b"x", b"L"), "same"),
    "long_name_then_pax": (lambda: _long_name_chain(b"L", b"x"), "same"),
    # tarfile reads pax records from the header's whole blocks, past its size field
    "pax_records_past_size": (lambda: _set(_pax_member(b"18 path=past.jpg\n"), 0, "size",
                                           b"00000000001"), "same"),
    # an extended header with no member after it: tarfile fails, the walker ended quietly
    "dangling_long_name": (lambda: _long_name_chain(b"L", b"x")[:1024], "refused: not "
                                                                          "followed by a member"),
    # a truncated payload skipped with a seek (>= 64 KiB): the walker ended quietly
    "truncated_big_unknown_type": (lambda: _set(_tar(("big.jpg", b"B" * 200_000)), 0, "type",
                                                b"V")[:100_000], "refused: truncated"),
}


@pytest.mark.parametrize("case", list(REGRESSIONS))
def test_regressions(case):
    build, outcome = REGRESSIONS[case]
    raw = build()
    assert check(raw) == outcome
    if outcome == "same":
        assert reference(raw)[0], "the example holds a member"
