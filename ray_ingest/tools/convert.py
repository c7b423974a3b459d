"""Rewrite one modality's tars, turning pickled numpy arrays into ``.npy`` members
(``ray-ingest convert ROOT --modality umt5 --pickle-to-npy``).

PiD stores ``umt5`` text embeddings as pickled numpy arrays (``<key>.pkl`` / ``.pickle``).
ray_ingest refuses to unpickle members while training (a pickle runs code), so existing tars
are converted once, offline:

* every ``.pkl``/``.pickle`` member is loaded with :class:`ArrayUnpickler`, which admits only
  the globals a pickled numpy array needs (numpy 1.x and 2.x names, protocols 0-5) and refuses
  everything else *before* it runs; object arrays are refused too (they can carry any
  object). The array is written back as ``np.save(..., allow_pickle=False)`` bytes, under the
  same name with ``.npy`` as its extension (``a.pkl`` -> ``a.npy``: same key);
* every other member is kept as it is (name, payload), in the same order, so the twin tars stay
  aligned;
* the tar is written under ``<name>.partial`` and renamed when complete, then its key index is
  written (:class:`~ray_ingest.twintar.writer.ShardWriter`); a crash leaves the original or the
  converted tar under the final name, never a mix.

In place (default) the tars are replaced and ``wdinfo.json`` is left as it is (shards, counts
and keys do not change). With ``out`` the converted modality is written to a new dataset
folder, the other modalities' tars and indexes are copied beside it, and a ``wdinfo.json``
is written per leaf (``root: "."``). A re-run skips what is already done: in place, tars
without pickle members; with ``out``, shards already complete there.

Shards are converted as jobs on an executor (:mod:`ray_ingest.tools.tasks`): here, or as Ray
tasks. No Ray, no torch.
"""

from __future__ import annotations

import importlib
import io
import json
import logging
import pickle
import posixpath
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import attrs
import fsspec
import numpy as np

from ray_ingest.catalog.discovery import discover
from ray_ingest.catalog.wdinfo import read_wdinfo
from ray_ingest.errors import CatalogError, ConfigError, IngestError, UnsafeFormatError
from ray_ingest.redact import options_repr, register
from ray_ingest.tools.tasks import (
    Executor,
    LocalExecutor,
)
from ray_ingest.twintar import remote
from ray_ingest.twintar.fsio import (
    join_url,
    partial_url,
    rename_file,
    url_dirname,
    write_file_atomic,
)
from ray_ingest.twintar.layout import WDINFO_NAME
from ray_ingest.twintar.safepath import check_folder_name
from ray_ingest.twintar.tario import (
    TarIndex,
    build_index,
    index_url,
    iter_members,
)
from ray_ingest.twintar.writer import ShardWriter

log = logging.getLogger(__name__)

#: Member extensions holding pickles.
PICKLE_EXTS = frozenset({"pkl", "pickle"})
_COPY_CHUNK = 8 * 2**20


# --------------------------------------------------------------------------- safe unpickling


class RefusedPickle(pickle.UnpicklingError):
    """The pickle asks for something a plain numpy array does not need."""


def _numpy_module(*names: str) -> Any:
    for name in names:
        try:
            return importlib.import_module(name)
        except ImportError:
            continue
    raise ImportError(f"none of {names} is importable")


def _latin1_encode(text: Any, encoding: str = "utf-8", *rest: Any) -> bytes:
    # Protocols 0-2 store bytes as _codecs.encode(str, "latin1"); nothing else is needed.
    if rest or not isinstance(text, str) or encoding not in ("latin1", "latin-1"):
        raise RefusedPickle(f"_codecs.encode is only admitted for latin1 text, got {encoding!r}")
    return text.encode("latin1")


def _plain_bytes(*args: Any) -> bytes:
    # Protocols 0-2 store b"" as bytes(); refuse bytes(n), which would allocate n bytes.
    if not args:
        return b""
    if len(args) == 1 and isinstance(args[0], (bytes, bytearray)):
        return bytes(args[0])
    if len(args) == 2 and isinstance(args[0], str):
        return _latin1_encode(args[0], args[1])
    raise RefusedPickle("builtins.bytes is only admitted for b'' or latin1 text")


def _allowed_globals() -> dict[tuple[str, str], Any]:
    """What a pickled ndarray refers to, under its numpy 1.x and 2.x module names."""
    multiarray = _numpy_module("numpy._core.multiarray", "numpy.core.multiarray")
    numeric = _numpy_module("numpy._core.numeric", "numpy.core.numeric")
    out: dict[tuple[str, str], Any] = {
        ("numpy", "ndarray"): np.ndarray,
        ("numpy", "dtype"): np.dtype,
        ("_codecs", "encode"): _latin1_encode,
        ("__builtin__", "bytes"): _plain_bytes,
        ("builtins", "bytes"): _plain_bytes,
    }
    for prefix in ("numpy._core", "numpy.core"):
        out[(f"{prefix}.multiarray", "_reconstruct")] = multiarray._reconstruct
        out[(f"{prefix}.multiarray", "scalar")] = multiarray.scalar
        out[(f"{prefix}.numeric", "_frombuffer")] = numeric._frombuffer
    return out


class ArrayUnpickler(pickle.Unpickler):
    """An unpickler that can build numpy arrays and nothing else.

    ``find_class`` is the only way a pickle reaches code (GLOBAL, STACK_GLOBAL, INST, OBJ and
    extension-registry opcodes all go through it); it admits the numpy reconstructors listed
    by :func:`_allowed_globals` and raises :class:`RefusedPickle` for any other name, so a
    ``__reduce__`` payload fails before anything runs. Persistent ids are refused by the base
    class.
    """

    _ALLOWED: dict[tuple[str, str], Any] | None = None

    def find_class(self, module: str, name: str) -> Any:
        if ArrayUnpickler._ALLOWED is None:
            ArrayUnpickler._ALLOWED = _allowed_globals()
        target = ArrayUnpickler._ALLOWED.get((module, name))
        if target is None:
            raise RefusedPickle(f"global {module}.{name} is not allowed "
                                "(a pickled numpy array needs only numpy's reconstructors)")
        return target


def load_pickled_array(data: bytes) -> np.ndarray:
    """Unpickle a numpy array (or numpy scalar) without running any other code.

    Raises:
        RefusedPickle: the pickle names a global outside the allowlist, or holds something
            other than a plain, non-object numpy array.
        pickle.UnpicklingError, ValueError, EOFError, TypeError: a malformed pickle.
    """
    obj = ArrayUnpickler(io.BytesIO(data)).load()
    if isinstance(obj, np.generic):
        obj = np.asarray(obj)
    if type(obj) is not np.ndarray:
        raise RefusedPickle(f"expected a numpy array, got {type(obj).__name__}")
    if obj.dtype.hasobject:
        raise RefusedPickle(f"object arrays are refused (dtype {obj.dtype}): they can hold "
                            "arbitrary Python objects")
    return obj


def npy_bytes(arr: np.ndarray) -> bytes:
    buf = io.BytesIO()
    np.save(buf, arr, allow_pickle=False)
    return buf.getvalue()


# --------------------------------------------------------------------------- one shard


@attrs.frozen
class ShardResult:
    """What converting one shard did."""

    #: Leaf folder URL of the output shard.
    leaf: str
    #: Relative tar path (``data_list`` entry).
    path: str
    #: ``converted`` (rewritten), ``unchanged`` (no pickle member; left or copied as is) or
    #: ``done`` (already complete in the output; a re-run).
    status: str
    #: Named members of the modality's tar.
    members: int = 0
    #: Pickle members turned into ``.npy``.
    pickles: int = 0
    #: Members without a sample key (no extension, ``__meta__``): readers skip them, so the
    #: rewrite leaves them out; counted and logged.
    unnamed: int = 0
    #: Other modalities' tars that were not found (``out`` only).
    missing: tuple[str, ...] = ()


def _fs(url: str, so: Mapping[str, Any]) -> tuple[fsspec.AbstractFileSystem, str]:
    return fsspec.core.url_to_fs(url, **so)


def _exists(url: str, so: Mapping[str, Any]) -> bool:
    fs, path = _fs(url, so)
    return fs.exists(path)


def _read_index(url: str, so: Mapping[str, Any]) -> TarIndex | None:
    try:
        raw = remote.read_bytes(index_url(url), dict(so))
        return TarIndex.from_dict(json.loads(raw), index_url(url))
    except (FileNotFoundError, IngestError, OSError, ValueError):
        return None


def _complete(url: str, so: Mapping[str, Any]) -> bool:
    """A tar whose key index records its current size (written after the tar's rename)."""
    idx = _read_index(url, so)
    if idx is None:
        return False
    fs, path = _fs(url, so)
    try:
        return fs.size(path) == idx.tar_size
    except FileNotFoundError:
        return False


def _ensure_index(url: str, so: Mapping[str, Any]) -> None:
    if _complete(url, so):
        return
    fs, path = _fs(url, so)
    size = fs.size(path)
    with remote.open_url(url, dict(so)) as f:
        idx = build_index(f, url, tar_size=size)
    write_file_atomic(index_url(url), idx.dumps().encode(), so)


def _copy(src: str, dst: str, so: Mapping[str, Any]) -> None:
    """Byte copy ``src`` -> ``dst.partial`` -> ``dst``, then the key index. The source's
    headers are walked first: a tar holding an unsafe member is refused, never copied."""
    with remote.open_url(src, dict(so)) as f:
        build_index(f, src)
    dst_fs, dst_path = _fs(partial_url(dst), so)
    parent = posixpath.dirname(dst_path)
    if parent:
        dst_fs.makedirs(parent, exist_ok=True)
    with remote.open_url(src, dict(so)) as fin, dst_fs.open(dst_path, "wb") as fout:
        while chunk := fin.read(_COPY_CHUNK):
            fout.write(chunk)
    rename_file(partial_url(dst), dst, so)
    _ensure_index(dst, so)


def _has_pickles(url: str, so: Mapping[str, Any]) -> bool:
    with remote.open_url(url, dict(so)) as f:
        return any(m.ext in PICKLE_EXTS for m in iter_members(f, url, read_data=False))


def convert_tar(src_url: str, out_leaf: str, path: str, modality: str, shard: str,
                storage_options: Mapping[str, Any]) -> ShardResult:
    """Rewrite one tar, pickled arrays -> ``.npy``; the output is ``<out_leaf>/<modality>/<path>``.

    Raises:
        UnsafeFormatError: a pickle was refused (names the shard, the key and the global).
        IngestError: a malformed pickle or tar, naming the shard and key.
    """
    so = dict(storage_options)
    members = pickles = unnamed = 0
    with remote.open_url(src_url, so) as f, ShardWriter(
            out_leaf, path, [modality], storage_options=so, atomic=True) as w:
        for m in iter_members(f, src_url):
            if m.key is None:
                unnamed += 1
                log.warning("shard %s: member %r has no sample key; left out of the rewrite",
                            shard, m.name)
                continue
            members += 1
            name, ext, data = m.name, m.ext, m.data
            if ext in PICKLE_EXTS:
                try:
                    arr = load_pickled_array(data)
                except RefusedPickle as exc:
                    raise UnsafeFormatError(
                        f"shard {shard} key {m.key}: refusing to unpickle {name!r}: {exc}"
                    ) from None
                except (pickle.UnpicklingError, ValueError, EOFError, TypeError,
                        AttributeError, IndexError, MemoryError) as exc:
                    raise IngestError(f"shard {shard} key {m.key}: cannot unpickle {name!r}: "
                                      f"{type(exc).__name__}: {exc}") from None
                name, ext, data = name.rsplit(".", 1)[0] + ".npy", "npy", npy_bytes(arr)
                pickles += 1
            w.add(m.key, {modality: (ext, data)}, member_names={modality: name})
    return ShardResult(leaf=out_leaf, path=path, status="converted", members=members,
                       pickles=pickles, unnamed=unnamed)


@attrs.frozen
class ConvertJob:
    """One shard: where its tars are, where the output goes."""

    #: Relative tar path (``data_list`` entry).
    path: str
    #: Root of the source shard (its modality folders live here).
    src_root: str
    #: Output leaf folder (== ``src_root`` in place).
    out_leaf: str
    #: Modalities copied beside the converted one (``out`` only).
    copy: tuple[str, ...] = ()


@attrs.frozen
class _ConvertGroup:
    """Converts a list of shards (picklable: an executor may run it as a Ray task)."""

    modality: str
    storage_options: dict[str, Any] = attrs.field(repr=options_repr)

    def __call__(self, jobs: Sequence[ConvertJob]) -> list[ShardResult]:
        register(self.storage_options)  # maybe a Ray task's process: errors never show them
        return [self.one(job) for job in jobs]

    def one(self, job: ConvertJob) -> ShardResult:
        so = self.storage_options
        src = join_url(job.src_root, self.modality, job.path)
        dst = join_url(job.out_leaf, self.modality, job.path)
        in_place = src == dst
        missing = []
        for m in job.copy:  # other modalities first: the converted tar completes the shard
            other_src = join_url(job.src_root, m, job.path)
            other_dst = join_url(job.out_leaf, m, job.path)
            if _complete(other_dst, so):
                continue
            if not _exists(other_src, so):
                log.warning("shard %s: no %s tar at %s; not copied", job.path, m, other_src)
                missing.append(m)
                continue
            _copy(other_src, other_dst, so)
        if not in_place and _complete(dst, so):
            return ShardResult(job.out_leaf, job.path, "done", missing=tuple(missing))
        if not _exists(src, so):
            raise IngestError(f"shard {job.path}: missing {self.modality} tar {src}")
        if not _has_pickles(src, so):
            if in_place:
                _ensure_index(src, so)
            else:
                _copy(src, dst, so)
            return ShardResult(job.out_leaf, job.path, "unchanged", missing=tuple(missing))
        result = convert_tar(src, job.out_leaf, job.path, self.modality, job.path, so)
        return attrs.evolve(result, missing=tuple(missing))


# --------------------------------------------------------------------------- a dataset


@attrs.define
class ConvertReport:
    """What ``convert_pickles`` did."""

    modality: str = ""
    #: Shards looked at.
    shards: int = 0
    #: Tars rewritten with ``.npy`` members.
    converted: int = 0
    #: Tars without pickle members (left in place, or copied to ``out``).
    unchanged: int = 0
    #: Shards already complete in ``out`` (a re-run).
    done: int = 0
    #: Pickle members converted.
    pickles: int = 0
    #: Members without a sample key left out of rewritten tars.
    unnamed: int = 0
    #: Other modalities' tars not found (``out`` only), per modality.
    missing: dict[str, int] = attrs.field(factory=dict)
    #: wdinfo.json URLs written (``out`` only).
    wdinfos: list[str] = attrs.field(factory=list)

    def add(self, r: ShardResult) -> None:
        self.shards += 1
        if r.status == "converted":
            self.converted += 1
        elif r.status == "unchanged":
            self.unchanged += 1
        else:
            self.done += 1
        self.pickles += r.pickles
        self.unnamed += r.unnamed
        for m in r.missing:
            self.missing[m] = self.missing.get(m, 0) + 1

    def to_dict(self) -> dict[str, Any]:
        return attrs.asdict(self)


def _rel_leaf(root: str, wdinfo_url: str, storage_options: Mapping[str, Any]) -> str:
    """Folder of ``wdinfo_url`` relative to ``root`` ("" when ``root`` is the file itself)."""
    if root.endswith(".json"):
        return ""
    base = _fs(root, storage_options)[1].rstrip("/")
    leaf = _fs(url_dirname(wdinfo_url), storage_options)[1].rstrip("/")
    rel = posixpath.relpath(leaf, base)
    return "" if rel == "." else rel


def _check_out(out: str, storage_options: Mapping[str, Any]) -> None:
    """``out`` may be absent, empty or a previous (partial) convert output; nothing else."""
    fs, path = _fs(out, storage_options)
    if not fs.exists(path):
        return
    if not fs.isdir(path):
        raise ConfigError(f"--out {out}: expected a folder, got a file")
    ours = (".tar", ".idx.json", WDINFO_NAME, ".partial")
    foreign = [p for p in fs.find(path) if not p.endswith(ours)]
    if foreign:
        raise ConfigError(f"--out {out}: refusing to write into a folder holding other files "
                          f"(e.g. {foreign[0]})")


def convert_pickles(
    root: str,
    modality: str,
    *,
    out: str | None = None,
    executor: Executor | None = None,
    shards_per_task: int = 1,
    storage_options: Mapping[str, Any] | None = None,
    progress: Callable[[ShardResult], None] | None = None,
) -> ConvertReport:
    """Convert the pickled arrays of ``modality`` in every shard under ``root`` to ``.npy``.

    Args:
        root: a wdinfo.json, or a folder searched recursively for them (local, ``gs://``).
        modality: the modality folder to rewrite (``umt5``).
        out: write a converted copy of the dataset here (same relative layout) instead of
            rewriting ``root`` in place.
        executor: runs groups of ``shards_per_task`` shards (:class:`~ray_ingest.tools.tasks.
            RayExecutor` for Ray tasks); None: in this process.
        shards_per_task: shards per executor job.
        storage_options: fsspec options.
        progress: called with each shard's result, in shard order, once all are done.

    Raises:
        UnsafeFormatError: a pickle would need more than numpy (named: shard, key, global);
            nothing of it ran. Shards converted before it stay converted; a re-run resumes.
        CatalogError, ConfigError, IngestError: bad input, named.
    """
    so = dict(storage_options or {})
    register(so)
    if not modality or "/" in modality:
        raise ConfigError(f"modality: expected a folder name, got {modality!r}")
    check_folder_name("modality", modality)
    if shards_per_task < 1:
        raise ConfigError(f"shards_per_task: expected >= 1, got {shards_per_task}")
    urls = discover(root, so)
    if out is not None:
        _check_out(out, so)
    jobs: list[ConvertJob] = []
    leaves: list[tuple[str, str, dict[str, Any]]] = []
    for url in urls:
        try:
            doc = json.loads(remote.read_bytes(url, so))
        except (OSError, IngestError, ValueError) as exc:
            raise CatalogError(f"{url}: cannot read wdinfo.json ({exc})") from None
        info = read_wdinfo(url, storage_options=so)
        if info.listed_modalities and modality not in info.listed_modalities:
            raise ConfigError(f"{url}: modality {modality!r} is not in data_keys "
                              f"{list(info.listed_modalities)}")
        others = tuple(k for k in info.listed_modalities if k != modality)
        out_leaf = None if out is None else join_url(out, _rel_leaf(root, url, so))
        for shard in info.tar_files:
            jobs.append(ConvertJob(path=shard.path, src_root=shard.root,
                                   out_leaf=out_leaf or shard.root,
                                   copy=others if out_leaf is not None else ()))
        if out_leaf is not None:
            leaves.append((url, out_leaf, doc))
    group = _ConvertGroup(modality, so)
    chunks = [jobs[i : i + shards_per_task] for i in range(0, len(jobs), shards_per_task)]
    results = [r for chunk in (executor or LocalExecutor()).map(group, chunks) for r in chunk]
    report = ConvertReport(modality=modality)
    for r in results:
        report.add(r)
        if progress is not None:
            progress(r)
    for url, out_leaf, doc in leaves:
        new = dict(doc)
        new["root"] = "."
        target = join_url(out_leaf, WDINFO_NAME)
        write_file_atomic(target, (json.dumps(new, indent=2) + "\n").encode(), so)
        report.wdinfos.append(target)
        log.info("wrote %s (from %s)", target, url)
    return report
