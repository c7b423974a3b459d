"""The package's layout is the architecture: packages in data-flow order, each importing only
the ones below it; the layers that must stay pure import neither Ray nor torch; modules and
functions stay small enough to read (issue 31's rules, checked on every run)."""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parents[1] / "ray_ingest"

#: Every top-level package/module in data-flow order: a module may import its own package and
#: those of a lower or equal rank, never one above it (a type-only import excepted).
RANK = {"errors": 0, "columns": 0, "redact": 0, "metrics": 1, "twintar": 1, "catalog": 2, "plan": 3,
        "config": 4, "decode": 5, "execution": 6, "loader": 7, "datasets": 8, "train": 9,
        "tools": 10, "cli": 11, "__init__": 12}
#: Modules importable with neither Ray nor torch loaded (the loader's torch edges, collate,
#: group and ingest, and the Ray edge are not among them).
PURE = ("ray_ingest.twintar.*", "ray_ingest.catalog.*", "ray_ingest.plan.*",
        "ray_ingest.decode.*", "ray_ingest.config", "ray_ingest.columns", "ray_ingest.errors",
        "ray_ingest.metrics", "ray_ingest.execution.read", "ray_ingest.execution.local",
        "ray_ingest.execution.threads", "ray_ingest.execution.headstart",
        "ray_ingest.execution.handoff", "ray_ingest.execution.opener",
        "ray_ingest.execution.fairshare",
        "ray_ingest.loader.window", "ray_ingest.loader.account", "ray_ingest.loader.skips",
        "ray_ingest.loader.batcher", "ray_ingest.loader.progress",
        "ray_ingest.loader.checkpoint", "ray_ingest.loader.clock", "ray_ingest.loader.stateful",
        "ray_ingest.train.detect", "ray_ingest.train.ledger", "ray_ingest.tools.audit",
        "ray_ingest.tools.summary", "ray_ingest.tools.synth", "ray_ingest.tools.shard",
        "ray_ingest.tools.index", "ray_ingest.tools.convert")
MAX_TOP_LEVEL_MODULES = 10
MAX_MODULE_LINES = 700
MAX_FUNCTION_LINES = 80


def _modules() -> list[Path]:
    return sorted(PACKAGE.rglob("*.py"))


def _name(path: Path) -> str:
    parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _expand(patterns) -> list[str]:
    names = [_name(p) for p in _modules()]
    out = []
    for pat in patterns:
        out += [n for n in names if n.startswith(pat[:-1])] if pat.endswith("*") else [pat]
    return sorted(set(out))


def _type_only(tree: ast.Module) -> set[int]:
    """Line numbers of imports under ``if TYPE_CHECKING:``."""
    lines: set[int] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
            lines.update(n.lineno for stmt in node.body for n in ast.walk(stmt))
    return lines


def test_every_top_level_part_has_a_rank():
    tops = {p.stem if p.parent == PACKAGE else p.relative_to(PACKAGE).parts[0]
            for p in _modules()}
    assert tops == set(RANK), f"unranked: {tops - set(RANK)}, gone: {set(RANK) - tops}"


def test_imports_go_down_the_data_flow():
    upward = []
    for path in _modules():
        rel = path.relative_to(PACKAGE).parts
        top = rel[0].removesuffix(".py")
        tree = ast.parse(path.read_text())
        skip = _type_only(tree)
        for node in ast.walk(tree):
            if not (isinstance(node, ast.ImportFrom) and node.module
                    and node.module.split(".")[0] == "ray_ingest") or node.lineno in skip:
                continue
            parts = node.module.split(".")
            targets = [parts[1]] if len(parts) > 1 else [a.name for a in node.names]
            upward += [f"{path.relative_to(PACKAGE)}:{node.lineno}: {top} imports {t}"
                       for t in targets if t in RANK and RANK[t] > RANK[top]]
    assert not upward, "imports against the data flow:\n" + "\n".join(upward)


def test_pure_layers_import_neither_ray_nor_torch():
    names = _expand(PURE)
    assert len(names) > 40, names  # the patterns matched the packages
    code = ("import importlib, sys\n"
            f"for name in {names!r}:\n"
            "    importlib.import_module(name)\n"
            "    bad = [m for m in ('ray', 'torch') if m in sys.modules]\n"
            "    if bad:\n"
            "        sys.exit(f'{name} imports {bad}')\n")
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert res.returncode == 0, res.stderr or res.stdout


def test_top_level_holds_few_modules():
    top = sorted(p.name for p in PACKAGE.glob("*.py"))
    assert len(top) <= MAX_TOP_LEVEL_MODULES, top


@pytest.mark.parametrize("limit", [MAX_MODULE_LINES])
def test_no_module_is_too_long(limit):
    long = {str(p.relative_to(PACKAGE)): n for p in _modules()
            if (n := len(p.read_text().splitlines())) > limit}
    assert not long, f"modules over {limit} lines: {long}"


def test_no_function_is_too_long():
    long = []
    for path in _modules():
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                n = node.end_lineno - node.lineno + 1
                if n > MAX_FUNCTION_LINES:
                    long.append(f"{path.relative_to(PACKAGE)}:{node.lineno} {node.name} ({n})")
    assert not long, f"functions over {MAX_FUNCTION_LINES} lines:\n" + "\n".join(long)


def test_public_entry_points():
    code = ("import sys, ray_ingest\n"
            "assert 'ray' not in sys.modules  # cheap to import\n"
            "from ray_ingest import IngestLoader, read_twin_tars, write_twin_tars\n"
            "from ray_ingest.loader.ingest import IngestLoader as L\n"
            "assert IngestLoader is L and callable(read_twin_tars) and callable(write_twin_tars)\n"
            "assert sorted(ray_ingest.__all__) == ray_ingest.__all__\n")
    subprocess.run([sys.executable, "-c", code], check=True)
