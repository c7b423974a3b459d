"""Tar member streaming straight from a file object: no extraction, no ``tarfile`` overhead.

A small ustar/GNU/pax header walker. It yields regular files only (directories and metadata
entries are passed over; a link, a device or a name that could leave its folder is refused
with :class:`~ray_ingest.errors.UnsafeMemberError`, see :mod:`ray_ingest.twintar.safepath`), checks
every header checksum, and can skip the first N members cheaply: ``seek`` past payloads when
the file is seekable, read-and-discard otherwise, never decode. A per-shard key index
(``<tar>.idx.json``, written by the sharder) lets readers jump straight to member N.

Key rules (PiD's, from webdataset + ``process_sample``), see :func:`split_name`:

* names whose first path component starts and ends with ``__`` (webdataset metadata) are
  skipped;
* a dotless name has no extension and is skipped (PiD drops it later);
* ``id.jpg`` -> key ``id``, ext ``jpg``; with more dots all but the last part are joined with
  ``-`` (``x.y.jpg`` -> key ``x-y``); the extension is lower-cased (``a.JPG`` -> ``jpg``);
  directories stay in the key (``sub/id.jpg`` -> ``sub/id``).

No Ray, no torch.
"""

from __future__ import annotations

import contextlib
import io
import json
from collections.abc import Iterator
from typing import Any, BinaryIO

import attrs

from ray_ingest.errors import TarFormatError
from ray_ingest.twintar.safepath import SPECIAL_TYPES, check_member

BLOCK = 512
INDEX_SUFFIX = ".idx.json"
INDEX_VERSION = 1
_REGULAR = (b"0", b"\0", b"7")
_SKIP_SEEK_MIN = 64 * 1024  # below this, reading is cheaper than a seek on buffered streams
_DISCARD_CHUNK = 1024 * 1024  # read-and-discard (unseekable streams) in chunks of this size


@attrs.frozen(slots=True)
class Member:
    """One regular file of a tar."""

    #: Full member name as stored.
    name: str
    #: Sample key per PiD's rules (None when the name is skipped by the rules).
    key: str | None
    #: Lower-cased extension ("" when none).
    ext: str
    #: Byte offset of the member's (first) header in the tar.
    offset: int
    #: Payload size in bytes.
    size: int
    #: Payload, or None when the caller asked for headers only or the member is over the limit.
    data: bytes | None
    #: The size limit (``max_member_bytes``) this member's header exceeded; its payload was
    #: skipped, never read. None when within the limit (or no limit was given).
    over_limit: int | None = None


def split_name(name: str) -> tuple[str, str] | None:
    """PiD's key rule: ``(key, ext)`` for a member name, or None if the member is skipped."""
    first = name.split("/", 1)[0]
    if len(first) >= 4 and first.startswith("__") and first.endswith("__"):
        return None  # webdataset metadata entries (``__meta__``, ``__dir__/...``)
    parts = name.split(".")
    if len(parts) < 2 or not parts[-1]:
        return None
    key = parts[0] if len(parts) == 2 else "-".join(parts[:-1])
    if not key or key.endswith("/"):
        return None
    return key, parts[-1].lower()


def _octal(field: bytes, what: str, source: str, offset: int) -> int:
    if field and field[0] & 0x80:  # GNU base-256 for large values
        value = int.from_bytes(field[1:], "big")
        return -value if field[0] & 0x40 else value
    text = field.rstrip(b"\0 ").lstrip(b" ")
    if not text:
        return 0
    try:
        return int(text, 8)
    except ValueError:
        raise TarFormatError(
            f"{source}: corrupt tar header at byte {offset}: bad {what} field {field!r}"
        ) from None


def _checksum_ok(header: bytes) -> bool:
    stored = header[148:156].rstrip(b"\0 ").lstrip(b" ")
    try:
        want = int(stored, 8)
    except ValueError:
        return False
    unsigned = sum(header[:148]) + 8 * 32 + sum(header[156:])
    return want == unsigned


def _parse_pax(data: bytes) -> dict[str, str]:
    out: dict[str, str] = {}
    pos = 0
    while pos < len(data):
        sp = data.find(b" ", pos)
        if sp < 0:
            break
        length = int(data[pos:sp])
        record = data[sp + 1 : pos + length - 1]
        k, _, v = record.partition(b"=")
        out[k.decode("utf-8", "replace")] = v.decode("utf-8", "replace")
        pos += length
    return out


def _read_exact(f: BinaryIO, n: int, source: str, what: str, offset: int) -> bytes:
    data = f.read(n)
    if len(data) != n:
        # Buffered remote readers may return short reads; keep reading until EOF.
        parts = [data]
        got = len(data)
        while got < n:
            more = f.read(n - got)
            if not more:
                raise TarFormatError(
                    f"{source}: truncated tar: {what} at byte {offset} needs {n} bytes, "
                    f"only {got} left"
                )
            parts.append(more)
            got += len(more)
        data = b"".join(parts)
    return data


def _skip(f: BinaryIO, n: int, seekable: bool, source: str, what: str, offset: int) -> None:
    if n <= 0:
        return
    if seekable and n >= _SKIP_SEEK_MIN:
        f.seek(n, io.SEEK_CUR)
        return
    while n > 0:  # never hold more than one chunk of a skipped payload in memory
        step = min(n, _DISCARD_CHUNK)
        _read_exact(f, step, source, what, offset)
        n -= step
        offset += step


def _header_name(header: bytes) -> str:
    """A ustar/v7 header's own name (prefix joined), when no long-name or pax record gave one.
    Bytes after the NUL that ends the name stay in it (and get it refused)."""
    name = header[0:100].rstrip(b"\0").decode("utf-8", "surrogateescape")
    if header[257:262] == b"ustar":
        prefix = header[345:500].split(b"\0", 1)[0]
        if prefix:
            name = prefix.decode("utf-8", "surrogateescape") + "/" + name
    return name


def _payload(f: BinaryIO, size: int, padded: int, read: bool, probe_end: bool, seekable: bool,
             source: str, name: str, pos: int) -> bytes | None:
    """A member's payload (``read``), or None with the payload skipped. ``probe_end`` (an
    over-limit member of a seekable tar): seek to the payload's last byte and read it, so a
    truncated tar fails here, as it would have when reading the payload, instead of looking like
    a clean end."""
    if read:
        data = _read_exact(f, size, source, f"member {name!r}", pos)
        _skip(f, padded - size, False, source, f"member {name!r} padding", pos + size)
        return data
    if probe_end and padded >= _SKIP_SEEK_MIN:
        f.seek(padded - 1, io.SEEK_CUR)
        if not f.read(1):
            raise TarFormatError(
                f"{source}: truncated tar: member {name!r} at byte {pos} needs {size} "
                f"bytes, the file ends before")
        return None
    _skip(f, padded, seekable, source, f"member {name!r}", pos)
    return None


def iter_members(
    f: BinaryIO,
    source: str = "<tar>",
    *,
    read_data: bool = True,
    start_offset: int = 0,
    max_member_bytes: int | None = None,
) -> Iterator[Member]:
    """Yield the regular-file members of a tar stream, in order.

    Args:
        f: binary file object positioned at ``start_offset`` (a member header boundary).
        source: name used in error messages (the tar's URL).
        read_data: when False, payloads are skipped (seek if possible) and ``data`` is None.
        start_offset: byte offset ``f`` is positioned at, so offsets stay absolute.
        max_member_bytes: a member whose header declares more bytes is yielded with
            ``data=None`` and ``over_limit`` set; its payload is skipped, never read, so one
            huge member cannot exhaust memory. The caller decides whether that is an error.

    Raises:
        TarFormatError: truncated stream, bad checksum or malformed header, naming ``source``.
        UnsafeMemberError: an entry is a link or a device, or its name holds a NUL byte, is
            absolute or climbs with ``..`` (names ``source`` and the member).
    """
    try:
        seekable = bool(f.seekable())
    except (AttributeError, ValueError):
        seekable = False
    pos = start_offset
    long_name: str | None = None
    pax: dict[str, str] = {}
    header_start: int | None = None
    while True:
        header = f.read(BLOCK)
        if len(header) < BLOCK:
            if not header:
                return  # EOF without end blocks: accepted (many writers omit them)
            header = header + _read_exact(f, BLOCK - len(header), source, "header", pos)
        if header.count(0) == BLOCK:
            return  # end-of-archive marker
        if not _checksum_ok(header):
            raise TarFormatError(f"{source}: corrupt tar header at byte {pos} (checksum mismatch)")
        if header_start is None:
            header_start = pos
        size = _octal(header[124:136], "size", source, pos)
        typeflag = header[156:157]
        pos += BLOCK
        padded = (size + BLOCK - 1) // BLOCK * BLOCK
        if typeflag in (b"L", b"x", b"g", b"K"):
            data = _read_exact(f, padded, source, "extended header", pos)[:size]
            pos += padded
            if typeflag == b"L":
                long_name = data.rstrip(b"\0").decode("utf-8", "surrogateescape")
            elif typeflag == b"x":
                pax = _parse_pax(data)
            continue  # global headers and long link names do not name a file
        if long_name is not None:
            name = long_name
        else:
            name = pax["path"] if "path" in pax else _header_name(header)
        if "size" in pax:
            size = int(pax["size"])
            padded = (size + BLOCK - 1) // BLOCK * BLOCK
        member_offset = header_start
        long_name, pax, header_start = None, {}, None
        if typeflag in SPECIAL_TYPES or "\0" in name or name[:1] == "/" or ".." in name:
            check_member(source, name, typeflag, member_offset)  # refused unless ".." is benign
        if typeflag not in _REGULAR:
            _skip(f, padded, seekable, source, f"member {name!r}", pos)
            pos += padded
            continue
        parsed = split_name(name)
        key, ext = parsed if parsed else (None, "")
        over = (max_member_bytes if max_member_bytes is not None and size > max_member_bytes
                else None)
        data = _payload(f, size, padded, read_data and over is None, over is not None and seekable,
                        seekable, source, name, pos)
        pos += padded
        yield Member(name=name, key=key, ext=ext, offset=member_offset, size=size, data=data,
                     over_limit=over if read_data else None)


def index_url(tar_url: str) -> str:
    """Where the per-shard key index of ``tar_url`` lives (beside the tar)."""
    return tar_url + INDEX_SUFFIX


@attrs.frozen
class TarIndex:
    """Keys and header byte offsets of a tar's members, so readers can seek without scanning."""

    names: tuple[str, ...] = attrs.field(converter=tuple)
    offsets: tuple[int, ...] = attrs.field(converter=tuple)
    sizes: tuple[int, ...] = attrs.field(converter=tuple)
    #: Byte size of the whole tar, to detect a stale index.
    tar_size: int = -1

    @property
    def keys(self) -> tuple[str | None, ...]:
        return tuple((split_name(n) or (None, ""))[0] for n in self.names)

    def to_dict(self) -> dict[str, Any]:
        return {
            "version": INDEX_VERSION,
            "names": list(self.names),
            "offsets": list(self.offsets),
            "sizes": list(self.sizes),
            "tar_size": self.tar_size,
        }

    @classmethod
    def from_dict(cls, doc: dict[str, Any], source: str = "<index>") -> TarIndex:
        if not isinstance(doc, dict) or doc.get("version") != INDEX_VERSION:
            raise TarFormatError(
                f"{source}: unsupported key index (expected version {INDEX_VERSION})")
        try:
            idx = cls(doc["names"], doc["offsets"], doc["sizes"], doc.get("tar_size", -1))
        except KeyError as exc:
            raise TarFormatError(f"{source}: key index lacks field {exc.args[0]!r}") from None
        if not (len(idx.names) == len(idx.offsets) == len(idx.sizes)):
            raise TarFormatError(f"{source}: key index fields have different lengths")
        return idx

    def dumps(self) -> str:
        return json.dumps(self.to_dict(), separators=(",", ":"))


def build_index(f: BinaryIO, source: str = "<tar>", tar_size: int = -1) -> TarIndex:
    """Scan headers only (payloads skipped) and return the member index."""
    names, offsets, sizes = [], [], []
    for m in iter_members(f, source, read_data=False):
        names.append(m.name)
        offsets.append(m.offset)
        sizes.append(m.size)
    return TarIndex(names, offsets, sizes, tar_size)


def skip_members(f: BinaryIO, n: int, source: str = "<tar>", start_offset: int = 0) -> int:
    """Advance ``f`` past the first ``n`` *named* members; return the new absolute offset.

    Payloads are never read when ``f`` is seekable. Stops at end of archive.
    """
    pos = start_offset
    if n <= 0:
        return pos
    named = 0
    for m in iter_members(f, source, read_data=False, start_offset=start_offset):
        pos = m.offset + BLOCK + (m.size + BLOCK - 1) // BLOCK * BLOCK
        if m.key is not None:
            named += 1
            if named == n:
                break
    with contextlib.suppress(AttributeError, OSError, ValueError):
        pos = f.tell()  # exact even after pax / long-name headers
    return pos
