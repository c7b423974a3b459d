"""Exception types. Every message is one line naming the file, shard, key or field at fault."""

from __future__ import annotations

from ray_ingest.redact import scrub


class IngestError(Exception):
    """Base class: bad input the user can fix. The CLI prints it as one line and exits 2.

    Its text never shows a credential: registered storage-option secrets and the passwords of
    ``user:password@`` URLs are replaced (:func:`ray_ingest.redact.scrub`)."""

    def __str__(self) -> str:
        # one line whatever a hostile name spliced into the message holds
        return scrub(super().__str__()).replace("\r", "\\r").replace("\n", "\\n")

    def __repr__(self) -> str:
        return f"{type(self).__name__}({str(self)!r})"


class CatalogError(IngestError):
    """A wdinfo.json (or dataset discovery) is missing, malformed or inconsistent."""


class TarFormatError(IngestError):
    """A tar stream is truncated, corrupt or holds an unreadable member."""


class AlignmentError(IngestError):
    """Twin tars disagree (strict mode): names the shard, the position and every modality's key."""


class ConfigError(IngestError):
    """A configuration field is invalid: names the field, the expected and the actual value."""


class StateError(IngestError):
    """A saved ReadState does not match the run it is restored into: names the field."""


class UnsafeFormatError(IngestError):
    """A member uses a format that executes code on load (pickle, torch) and the user did not
    opt in."""


class SkipBudgetExceeded(IngestError):
    """on_error=skip ran past its per-shard or per-epoch budget."""


class OversizedMemberError(IngestError):
    """A tar member's header declares more bytes than the size limit; its payload was not read."""


class StallError(IngestError):
    """The read/decode pipeline made no progress for loader.stall_timeout_s (e.g. a decode node
    was lost and its actors have nowhere to restart)."""


class GroupError(RuntimeError):
    """A parallel group's shared stream broke: its leader failed or is gone, or a wait for it
    ran past loader.group_timeout_s. Names the group, its leader, the epoch and the batch."""


class UnsafeMemberError(TarFormatError):
    """A tar entry could leave its folder or hide part of its name (``..``, an absolute path, a
    NUL byte), or is a link or a device: refused, never followed
    (:mod:`ray_ingest.twintar.safepath`)."""


class UnsafePathError(IngestError):
    """A relative path (a ``data_list`` entry, an output shard path or folder) would leave the
    folder it is joined to: refused (:mod:`ray_ingest.twintar.safepath`)."""
