"""Options shared by several subcommands (not a subcommand itself)."""

from __future__ import annotations

from collections.abc import Callable
from typing import TypeVar

import click

F = TypeVar("F", bound=Callable)


def modalities_option(help: str) -> Callable[[F], F]:
    """``--modalities CSV``, received by the command as ``modalities``."""
    return click.option("--modalities", default=None, metavar="CSV", help=help)


def modalities_arg(modalities: str | None) -> list[str] | None:
    """The comma-separated ``--modalities`` as a list; None when not given (the wdinfo's
    ``data_keys`` apply)."""
    names = [m.strip() for m in modalities.split(",") if m.strip()] if modalities else []
    return names or None
