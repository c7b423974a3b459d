"""The reference docs cover the code: every config field (with its default) is in
docs/configuration.md, and every CLI subcommand flag and job flag is in docs/cli.md. Everything
is enumerated from the code, so a new field or flag fails here until it is documented, and a
removed one fails until its row is deleted. A hidden flag (a deprecated old name) is documented
on its command's ``Deprecated aliases:`` line instead of in the table."""

from __future__ import annotations

import importlib
import re
from pathlib import Path

import attrs
import click
import pytest
import yaml

from ray_ingest import config
from ray_ingest.cli.main import SUBCOMMANDS
from ray_ingest.train.job import build_parser

DOCS = Path(__file__).resolve().parents[1] / "docs"
REQUIRED_DOCS = ("architecture.md", "configuration.md", "cli.md", "operations.md",
                 "migration_from_pid.md")


def _sections(text: str) -> dict[str, str]:
    """``## `name` `` heading -> the text up to the next ``## `` heading."""
    out: dict[str, str] = {}
    parts = re.split(r"^## ", text, flags=re.M)
    for part in parts[1:]:
        heading, _, body = part.partition("\n")
        m = re.match(r"`([^`]+)`", heading.strip())
        if m:
            out[m.group(1)] = body
    return out


def _table_rows(body: str) -> dict[str, list[str]]:
    """First-column name (in backticks) -> the row's cells, for every table row in ``body``."""
    rows: dict[str, list[str]] = {}
    for line in body.splitlines():
        if not line.startswith("| `"):
            continue
        cells = [c.strip() for c in re.split(r"(?<!\\)\|", line.strip().strip("|"))]
        names = re.findall(r"`([^`]+)`", cells[0])
        for name in names:
            rows[name] = cells
    return rows


def _yaml(value) -> str:
    if isinstance(value, tuple):
        value = list(value)
    text = yaml.safe_dump(value, default_flow_style=True, width=1000).strip()
    return text.removesuffix("...").strip()


def _commands() -> dict[str, click.Command]:
    out = {}
    for name in SUBCOMMANDS:
        try:
            module = importlib.import_module(f"ray_ingest.cli.{name}")
        except ModuleNotFoundError as exc:
            if exc.name == f"ray_ingest.cli.{name}":
                continue  # listed but not built yet (cli.main skips it the same way)
            raise
        out[name] = module.command
    return out


def test_reference_docs_exist_and_link_each_other():
    for name in REQUIRED_DOCS:
        assert (DOCS / name).is_file(), name
    # relative links between docs resolve
    for md in DOCS.glob("*.md"):
        for target in re.findall(r"\]\(([^)#:]+)(?:#[^)]*)?\)", md.read_text()):
            assert (md.parent / target).exists(), f"{md.name}: broken link {target}"


@pytest.mark.parametrize("section", sorted(config.SECTIONS))
def test_every_config_field_is_documented_with_its_default(section):
    cls = config.SECTIONS[section]
    sections = _sections((DOCS / "configuration.md").read_text())
    assert section in sections, f"docs/configuration.md: no '## `{section}`' section"
    rows = _table_rows(sections[section])
    fields = {f.name: f for f in attrs.fields(cls)}
    missing = sorted(set(fields) - set(rows))
    stale = sorted(set(rows) - set(fields))
    assert not missing, f"{section}: fields not documented: {missing}"
    assert not stale, f"{section}: documented fields that no longer exist: {stale}"
    for name, f in fields.items():
        cells = rows[name]
        assert len(cells) == 4 and cells[3], \
            f"{section}.{name}: expected | name | type | default | meaning |"
        if f.default is attrs.NOTHING:
            assert cells[2] == "required", f"{section}.{name}: default should be 'required'"
            continue
        default = f.default.factory() if isinstance(f.default, attrs.Factory) else f.default
        shown = re.match(r"`([^`]*)`", cells[2])
        assert shown and shown.group(1) == _yaml(default), (
            f"{section}.{name}: docs say default {cells[2]}, code has `{_yaml(default)}`")


def test_config_sections_are_all_documented():
    sections = _sections((DOCS / "configuration.md").read_text())
    assert set(config.SECTIONS) <= set(sections)


def _cli_expected(cmd: click.Command) -> tuple[set[str], set[str], set[str]]:
    """(visible flags, hidden flags, argument names) of ``cmd``."""
    flags, hidden, args = set(), set(), set()
    for p in cmd.params:
        if isinstance(p, click.Argument):
            args.add(p.human_readable_name.upper())
        else:
            opts = {o for o in (*p.opts, *p.secondary_opts) if o.startswith("--")}
            (hidden if getattr(p, "hidden", False) else flags).update(opts)
    return flags, hidden, args


def _deprecated_aliases(body: str) -> dict[str, str]:
    """Old flag -> new flag, from ``Deprecated aliases: `--old` for `--new`, ...`` lines."""
    out: dict[str, str] = {}
    for line in body.splitlines():
        if line.startswith("Deprecated aliases:"):
            out.update(re.findall(r"`(--[\w-]+)` for `(--[\w-]+)`", line))
    return out


def _documented_flags(rows: dict[str, list[str]]) -> set[str]:
    """Flags with a table row (prose may mention other commands' flags)."""
    return {name for name in rows if name.startswith("--")} - {"--help"}


@pytest.mark.parametrize("name", list(SUBCOMMANDS))
def test_every_cli_flag_is_documented(name):
    commands = _commands()
    if name not in commands:
        pytest.skip(f"ray_ingest.cli.{name} is not built yet")
    sections = _sections((DOCS / "cli.md").read_text())
    key = f"ray-ingest {name}"
    assert key in sections, f"docs/cli.md: no '## `{key}`' section"
    body = sections[key]
    flags, hidden, args = _cli_expected(commands[name])
    rows = _table_rows(body)
    for flag in sorted(flags):
        assert flag in rows, f"{key}: flag {flag} has no table row"
    for arg in sorted(args):
        assert any(r.rstrip(".") == arg for r in rows), f"{key}: argument {arg} has no table row"
    stale = sorted(_documented_flags(rows) - flags)
    assert not stale, f"{key}: documented flags that no longer exist: {stale}"
    aliases = _deprecated_aliases(body)
    for flag in sorted(hidden):
        assert flag in aliases, (f"{key}: hidden flag {flag} is not on a "
                                 "'Deprecated aliases: `--old` for `--new`' line")
        assert aliases[flag] in flags, f"{key}: {flag} is an alias of unknown flag {aliases[flag]}"
    stale = sorted(set(aliases) - hidden)
    assert not stale, f"{key}: documented deprecated aliases that are not hidden flags: {stale}"


def test_every_job_flag_is_documented():
    parser = build_parser()
    flags = {o for a in parser._actions for o in a.option_strings if o.startswith("--")}
    flags.discard("--help")
    sections = _sections((DOCS / "cli.md").read_text())
    assert "jobs/train.py" in sections, "docs/cli.md: no '## `jobs/train.py`' section"
    body = sections["jobs/train.py"]
    rows = _table_rows(body)
    missing = sorted(f for f in flags if f not in rows)
    assert not missing, f"jobs/train.py flags not documented: {missing}"
    stale = sorted(_documented_flags(rows) - flags)
    assert not stale, f"jobs/train.py: documented flags that no longer exist: {stale}"


def test_unbuilt_subcommands_are_marked():
    """A subcommand listed in SUBCOMMANDS without a module is documented as not built."""
    sections = _sections((DOCS / "cli.md").read_text())
    for name in SUBCOMMANDS:
        if name not in _commands():
            assert "not built yet" in sections.get(f"ray-ingest {name}", ""), name
