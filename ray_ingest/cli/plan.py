"""``ray-ingest plan``: print which shards each (rank, worker) reads in one epoch.

A thin wrapper of :func:`ray_ingest.plan.assign_slot`; needs only the wdinfo.json files. The
planning flags default to training's (``loader.*``, :data:`ray_ingest.plan.DEFAULT_SETTINGS`),
so without flags it prints what a training run with the default config reads. Imports neither
Ray nor torch: a million-shard wdinfo plans in about a second.
"""

from __future__ import annotations

import json

import click

from ray_ingest.catalog.load import load_catalog
from ray_ingest.catalog.shard import ROOT_MODES
from ray_ingest.cli._options import modalities_arg, modalities_option
from ray_ingest.errors import ConfigError
from ray_ingest.plan import (
    DEFAULT_SETTINGS,
    SEED_MODES,
    PlanParams,
    Topology,
    assign_slot,
    base_order,
)

_D = DEFAULT_SETTINGS


@click.command("plan")
@click.argument("paths", nargs=-1, required=True)
@click.option("--world-size", type=int, required=True, help="Number of training ranks.")
@click.option("--num-workers", type=int, required=True, help="Loader workers per rank.")
@click.option("--group-size", type=int, default=1, show_default=True,
              help="Ranks per data-parallel group (TP*CP*PP); they read identical lists.")
@click.option("--rank", type=int, default=None, help="Only this rank.")
@click.option("--worker", type=int, default=None, help="Only this worker of each rank.")
@click.option("--epoch", type=int, default=0, show_default=True)
@click.option("--seed", type=int, default=_D.seed, show_default=True,
              help="Run seed (loader.seed; epoch mode).")
@click.option("--seed-mode", type=click.Choice(SEED_MODES), default=_D.seed_mode,
              show_default=True,
              help="epoch: hash-seeded per epoch; pid: PiD's url lists bit for bit.")
@click.option("--shuffle/--no-shuffle", default=_D.shuffle, show_default=True,
              help="Shuffle worker lists (loader.shuffle).")
@click.option("--repeat/--no-repeat", default=_D.repeat, show_default=True,
              help="Extend cyclically to slots*workers, as PiD does (loader.repeat).")
@click.option("--start-index", type=int, default=0, show_default=True,
              help="PiD WDS_START_INDEX: skip start_index // chunk_size // workers shards.")
@modalities_option("Comma-separated modalities (default: the wdinfo's).")
@click.option("--root", "root_mode", type=click.Choice(ROOT_MODES), default="wdinfo",
              show_default=True, help="Tars under the wdinfo's root, or the folder holding it.")
@click.option("--json", "as_json", is_flag=True,
              help='One line {"rank","worker","group","shards"} per (rank, worker).')
def command(
    paths: tuple[str, ...],
    world_size: int,
    num_workers: int,
    group_size: int,
    rank: int | None,
    worker: int | None,
    epoch: int,
    seed: int,
    seed_mode: str,
    shuffle: bool,
    repeat: bool,
    start_index: int,
    modalities: str | None,
    old_keys: str | None,
    root_mode: str,
    as_json: bool,
) -> None:
    """Shard lists per rank and worker for PATH... (wdinfo.json files or folders).

    With --rank and --worker: that worker's shards, one data_list path per line. With
    --json: one JSON line per selected (rank, worker); all of them when none is selected.
    """
    mods = modalities_arg(modalities, old_keys)
    if not as_json and (rank is None or worker is None):
        raise ConfigError("--rank/--worker: expected both (or --json), got "
                          f"rank={rank} worker={worker}")
    # Validate the whole selection up front; errors name the Topology field.
    topo = Topology(world_size=world_size, rank=rank or 0, num_workers=num_workers,
                    worker_id=worker or 0, group_size=group_size)
    params = PlanParams(seed=seed, seed_mode=seed_mode, shuffle=shuffle, repeat=repeat,
                        equal_work=_D.equal_work, start_index=start_index)
    catalog = load_catalog(list(paths), modalities=mods, root=root_mode)
    n = len(catalog.paths)
    order = base_order(n, params, epoch)
    ranks = range(world_size) if rank is None else [rank]
    workers = range(num_workers) if worker is None else [worker]
    slot, lists = -1, ()
    for r in ranks:
        if r // topo.group_size != slot:  # ranks of one group share their lists
            slot = r // topo.group_size
            lists = assign_slot(n, catalog.chunk_size, slot, topo.slots, num_workers, params,
                                epoch, order)
        for w in workers:
            names = catalog.paths_at(lists[w].shards)
            if as_json:
                click.echo(json.dumps({"rank": r, "worker": w, "group": slot, "shards": names}))
            elif names:
                click.echo("\n".join(names))
