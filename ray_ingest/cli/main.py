"""Entry point of the `ray-ingest` CLI.

Every subcommand lives in its own module (``ray_ingest/cli/<name>.py``) exposing a click command
named ``command``. Bad input raises :class:`ray_ingest.errors.IngestError`; it is printed here as
one line on stderr with exit status 2, never as a traceback.
"""

from __future__ import annotations

import importlib
import sys

import click

from ray_ingest.errors import IngestError

#: Subcommand modules, in help order. A module that fails to import is a bug, not bad input.
SUBCOMMANDS = ("synth", "shard", "index", "convert", "info", "cat", "plan", "bench", "audit",
               "demo")


class _Group(click.Group):
    def list_commands(self, ctx: click.Context) -> list[str]:
        return list(SUBCOMMANDS)

    def get_command(self, ctx: click.Context, name: str) -> click.Command | None:
        if name not in SUBCOMMANDS:
            return None
        try:
            module = importlib.import_module(f"ray_ingest.cli.{name}")
        except ModuleNotFoundError as exc:
            if exc.name == f"ray_ingest.cli.{name}":
                return None  # subcommand not built yet
            raise
        return module.command


@click.group(cls=_Group, context_settings={"help_option_names": ["-h", "--help"]})
def cli() -> None:
    """Twin-tar WebDataset ingest on Ray."""


def main(argv: list[str] | None = None) -> int:
    try:
        cli.main(args=argv, prog_name="ray-ingest", standalone_mode=False)
    except IngestError as exc:
        click.echo(f"ray-ingest: error: {exc}", err=True)
        return 2
    except click.exceptions.Abort:
        click.echo("ray-ingest: aborted", err=True)
        return 1
    except click.ClickException as exc:
        exc.show()
        return 2
    except click.exceptions.Exit as exc:
        return exc.exit_code
    return 0


if __name__ == "__main__":
    sys.exit(main())
