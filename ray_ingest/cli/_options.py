"""Options shared by several subcommands (not a subcommand itself)."""

from __future__ import annotations

from collections.abc import Callable
from typing import TypeVar

import click

from ray_ingest.errors import IngestError

F = TypeVar("F", bound=Callable)


def modalities_option(help: str) -> Callable[[F], F]:
    """``--modalities CSV`` plus ``--keys``, its old name (hidden, deprecated).

    The command receives both as ``modalities`` and ``old_keys``; :func:`modalities_arg` turns
    them into one list.
    """

    def decorate(f: F) -> F:
        f = click.option("--keys", "old_keys", default=None, hidden=True, metavar="CSV",
                         help="Deprecated name of --modalities.")(f)
        return click.option("--modalities", default=None, metavar="CSV", help=help)(f)

    return decorate


def modalities_arg(modalities: str | None, old_keys: str | None) -> list[str] | None:
    """The comma-separated ``--modalities`` (or ``--keys``, with a one-line warning) as a list.

    None when neither was given (the wdinfo's ``data_keys`` apply).
    """
    if old_keys is not None:
        if modalities is not None:
            raise IngestError("--keys: old name of --modalities; got both, give only "
                              "--modalities")
        click.echo("ray-ingest: warning: --keys is deprecated; use --modalities", err=True)
        modalities = old_keys
    names = [m.strip() for m in modalities.split(",") if m.strip()] if modalities else []
    return names or None
