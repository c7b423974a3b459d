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
import re
from collections.abc import Iterator
from typing import Any, BinaryIO

import attrs

from ray_ingest.errors import TarFormatError
from ray_ingest.twintar.safepath import SPECIAL_TYPES, check_member

BLOCK = 512
INDEX_SUFFIX = ".idx.json"
INDEX_VERSION = 1
_REGULAR = (b"0", b"\0", b"7")
_GNU_TYPES = (b"L", b"K", b"S")
#: Headers that describe the member after them: GNU long name and link, pax (``X``: Solaris).
_EXTENDED = (b"L", b"K", b"x", b"X", b"g")
#: Number fields every header must hold (besides size and checksum), as ``tarfile`` checks.
_NUMBER_FIELDS = (("mode", 100, 108), ("uid", 108, 116), ("gid", 116, 124),
                  ("mtime", 136, 148), ("devmajor", 329, 337), ("devminor", 337, 345))
_PAX_RECORD = re.compile(rb"(\d+) ([^=]+)=")
#: Extended headers (long names, pax records) longer than this are refused.
MAX_EXTENDED_BYTES = 1 << 20
_READ_CHUNK = 64 * 1024 * 1024  # a payload is read in pieces of at most this
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


def _number(field: bytes, what: str, source: str, offset: int) -> int:
    """A header number field, read as ``tarfile`` reads it: GNU base-256 when the first byte is
    0x80 (or 0xFF: negative), else octal text up to the first NUL, blanks around it ignored."""
    if field[:1] in (b"\x80", b"\xff"):
        value = int.from_bytes(field[1:], "big")
        return value - 256 ** (len(field) - 1) if field[0] == 0xFF else value
    try:
        return int(field.split(b"\0", 1)[0].decode("ascii").strip() or "0", 8)
    except (UnicodeDecodeError, ValueError):
        raise TarFormatError(
            f"{source}: corrupt tar header at byte {offset}: bad {what} field {field!r}"
        ) from None


def _checksum_ok(header: bytes, source: str, offset: int) -> bool:
    """The stored checksum matches the header's unsigned or (old Sun and NeXT tars) signed
    byte sum, the checksum field counted as spaces."""
    want = _number(header[148:156], "checksum", source, offset)
    unsigned = sum(header[:148]) + 8 * 32 + sum(header[156:])
    if want == unsigned:
        return True
    high = sum(1 for b in header[:148] + header[156:] if b > 127)
    return want == unsigned - 256 * high


def _pax_records(data: bytes, source: str, offset: int) -> dict[str, str]:
    """The ``"<length> <key>=<value>\\n"`` records of a pax header (its padded blocks, as
    ``tarfile`` reads them: parsing stops at the first text that is not a record)."""
    out: dict[str, str] = {}
    pos = 0
    while True:
        m = _PAX_RECORD.match(data, pos)
        if m is None:
            return out
        length = int(m.group(1))
        if length == 0:
            raise TarFormatError(
                f"{source}: corrupt tar header at byte {offset}: pax record of length 0")
        value = data[m.end(2) + 1:m.start(1) + length - 1]
        out[m.group(2).decode("utf-8", "surrogateescape")] = value.decode(
            "utf-8", "surrogateescape")
        pos += length


def _read_exact(f: BinaryIO, n: int, source: str, what: str, offset: int) -> bytes:
    data = f.read(min(n, _READ_CHUNK))
    if len(data) != n:
        # Short reads (buffered remote readers) and huge declared sizes: a chunk at a time, so
        # a header that declares more bytes than the tar holds allocates no more than it has.
        parts = [data]
        got = len(data)
        while got < n:
            more = f.read(min(n - got, _READ_CHUNK))
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
        f.seek(n, io.SEEK_CUR)  # past the end of a truncated tar: found at the next header
        return
    while n > 0:  # never hold more than one chunk of a skipped payload in memory
        step = min(n, _DISCARD_CHUNK)
        _read_exact(f, step, source, what, offset)
        n -= step
        offset += step


def _check_end(f: BinaryIO, pos: int, seekable: bool, source: str) -> None:
    """At the end of the stream: a payload skipped with a seek must not have gone past it."""
    if not seekable:
        return
    try:
        end = f.seek(0, io.SEEK_END)
    except (OSError, ValueError):  # size unknown
        return
    if end < pos:
        raise TarFormatError(f"{source}: truncated tar: a member ends at byte {pos}, "
                             f"the file at byte {end}")
    f.seek(pos)


def _header_name(header: bytes, typeflag: bytes) -> str:
    """A header's own name with its ustar prefix (``tarfile``'s rule: a prefix field up to its
    first NUL, whatever the magic, except on GNU long-name and sparse headers). Bytes after
    the NUL that ends the name stay in it (and get it refused)."""
    name = header[0:100].rstrip(b"\0").decode("utf-8", "surrogateescape")
    prefix = header[345:500].split(b"\0", 1)[0]
    if prefix and typeflag not in _GNU_TYPES:
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


@attrs.define
class _Chain:
    """What the extended headers before a member say about it (the first one to set a name
    or a size wins: ``tarfile`` applies them from the last to the first)."""

    start: int | None = None
    name: str | None = None
    size: int | None = None

    def read(self, f: BinaryIO, typeflag: bytes, size: int, source: str, pos: int) -> None:
        """Read the data of the extended header whose payload starts at ``pos``."""
        if size > MAX_EXTENDED_BYTES:
            raise TarFormatError(f"{source}: corrupt tar header at byte {pos - BLOCK}: an "
                                 f"extended header of {size} bytes (limit {MAX_EXTENDED_BYTES})")
        padded = (size + BLOCK - 1) // BLOCK * BLOCK
        self.extend(typeflag, _read_exact(f, padded, source, "extended header", pos), source,
                    pos - BLOCK)

    def extend(self, typeflag: bytes, data: bytes, source: str, pos: int) -> None:
        """Take one GNU long-name (``L``), long-link (``K``) or pax (``x``, ``X``, ``g``)
        header's data (its padded blocks)."""
        if typeflag == b"L":
            if self.name is None:  # tarfile: up to the first NUL; bytes after it get it refused
                self.name = data.rstrip(b"\0").decode("utf-8", "surrogateescape")
            return
        if typeflag == b"K":
            return  # a link's target: links are refused
        records = _pax_records(data, source, pos)
        sparse = next((k for k in records if k.startswith("GNU.sparse.")), None)
        if sparse is not None:
            raise TarFormatError(f"{source}: unsupported tar member at byte {pos}: a GNU sparse "
                                 f"file (pax record {sparse!r}); refused")
        if typeflag == b"g":
            bad = next((k for k in ("path", "size", "linkpath") if k in records), None)
            if bad is not None:  # tarfile would apply it to every member after it
                raise TarFormatError(f"{source}: unsupported tar header at byte {pos}: a global "
                                     f"pax header that sets {bad!r}; refused")
            return
        if self.name is None and "path" in records:
            self.name = records["path"].rstrip("/")
        if self.size is None and "size" in records:
            try:
                self.size = int(records["size"])
            except ValueError:
                self.size = -1
            if self.size < 0:
                raise TarFormatError(f"{source}: corrupt tar header at byte {pos}: bad pax size "
                                     f"{records['size']!r}")


def _is_directory(header: bytes, typeflag: bytes, name: str, source: str, offset: int) -> bool:
    """Whether the entry is a directory (also a pre-POSIX regular entry whose own name ends in
    ``/``, as ``tarfile`` has it); refuses links, devices, unsafe names and sparse files."""
    if typeflag in SPECIAL_TYPES or "\0" in name or name[:1] == "/" or ".." in name:
        check_member(source, name, typeflag, offset)  # refused unless ".." is benign
    if typeflag == b"S":
        raise TarFormatError(f"{source}: unsupported tar member {name!r} at byte {offset}: a "
                             f"GNU sparse file; refused")
    return typeflag == b"5" or (typeflag == b"\0" and header[0:100].split(b"\0", 1)[0]
                                .endswith(b"/"))


def _header(f: BinaryIO, pos: int, source: str) -> bytes | None:
    """The next 512-byte header, or None at the end of the archive (end of file, or a block
    of zeros)."""
    header = f.read(BLOCK)
    if len(header) < BLOCK:
        if not header:
            return None  # EOF without end blocks: accepted (many writers omit them)
        header = header + _read_exact(f, BLOCK - len(header), source, "header", pos)
    if header.count(0) == BLOCK:
        return None  # end-of-archive marker
    if not _checksum_ok(header, source, pos):
        raise TarFormatError(f"{source}: corrupt tar header at byte {pos} (checksum mismatch)")
    for what, a, b in _NUMBER_FIELDS:  # tarfile refuses a header whose numbers do not parse
        _number(header[a:b], what, source, pos)
    return header


def iter_members(
    f: BinaryIO,
    source: str = "<tar>",
    *,
    read_data: bool = True,
    start_offset: int = 0,
    max_member_bytes: int | None = None,
) -> Iterator[Member]:
    """Yield the regular-file members of a tar stream, in order.

    Headers are read as Python's ``tarfile`` reads them (number fields, checksums, ustar
    prefixes, GNU long names, pax records), so every member yielded is one ``tarfile`` sees,
    with the same name and bytes (``tests/twintar/test_tario_fuzz.py`` checks it).

    Args:
        f: binary file object positioned at ``start_offset`` (a member header boundary).
        source: name used in error messages (the tar's URL).
        read_data: when False, payloads are skipped (seek if possible) and ``data`` is None.
        start_offset: byte offset ``f`` is positioned at, so offsets stay absolute.
        max_member_bytes: a member whose header declares more bytes is yielded with
            ``data=None`` and ``over_limit`` set; its payload is skipped, never read, so one
            huge member cannot exhaust memory. The caller decides whether that is an error.

    Raises:
        TarFormatError: truncated stream, bad checksum or malformed header, an extended header
            without its member, a sparse member or a global pax header that renames or resizes
            members (unsupported), naming ``source``.
        UnsafeMemberError: an entry is a link or a device, or its name holds a NUL byte, is
            absolute or climbs with ``..`` (names ``source`` and the member).
    """
    try:
        seekable = bool(f.seekable())
    except (AttributeError, ValueError):
        seekable = False
    pos = start_offset
    chain = _Chain()
    while True:
        header = _header(f, pos, source)
        if header is None:
            if chain.start is not None:
                raise TarFormatError(f"{source}: corrupt tar: the extended header at byte "
                                     f"{chain.start} is not followed by a member")
            _check_end(f, pos, seekable, source)
            return
        if chain.start is None:
            chain.start = pos
        size = _number(header[124:136], "size", source, pos)
        typeflag = header[156:157]
        if size < 0:
            raise TarFormatError(f"{source}: corrupt tar header at byte {pos}: negative size")
        pos += BLOCK
        padded = (size + BLOCK - 1) // BLOCK * BLOCK
        if typeflag in _EXTENDED:
            chain.read(f, typeflag, size, source, pos)
            pos += padded
            continue
        name = chain.name if chain.name is not None else _header_name(header, typeflag)
        if chain.size is not None:
            size = chain.size
            padded = (size + BLOCK - 1) // BLOCK * BLOCK
        member_offset, chain = chain.start, _Chain()
        if _is_directory(header, typeflag, name, source, member_offset):
            continue  # tarfile reads no payload after a directory, whatever its size
        if typeflag not in _REGULAR:
            _skip(f, padded, seekable, source, f"member {name!r}", pos)  # an unknown type
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
