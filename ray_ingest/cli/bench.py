"""`ray-ingest bench`: decoded samples/s vs webdataset+DataLoader, read_webdataset, raw ceiling."""

from __future__ import annotations

import click


@click.command("bench", context_settings={"ignore_unknown_options": True,
                                          "help_option_names": []})
@click.argument("args", nargs=-1, type=click.UNPROCESSED)
def command(args: tuple[str, ...]) -> None:
    """Run the throughput benchmark; ARGS are its flags (`ray-ingest bench --help`):
    --data --samples --shard-size --min-side --max-side --res --batch --runs --cores --only
    --json-out."""
    from ray_ingest.benchmark import main

    rc = main(list(args))
    if rc:
        raise click.exceptions.Exit(rc)
