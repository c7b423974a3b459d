"""Browse a twin-tar dataset in a notebook: thumbnails, lookup by key, statistics, plots.

::

    from ray_ingest.tools import explore

    ds = explore.open_dataset("data/demo")      # wdinfo.json files or folders, any fsspec URL
    ds.show(12, bucket="16_9")                   # HTML grid: thumbnails, keys, captions
    ds.sample("s00000003")                       # one sample: image, caption, arrays
    ds.stats()                                   # per-bucket and per-modality table
    ds.plot_aspect_ratios()                      # matplotlib Figures (Agg canvas)

Samples come from :func:`ray_ingest.twintar.reader.read_shard`, the path the Ray read tasks take, so
what a notebook shows is what training reads (same alignment, same keys). Images are opened
header-only for statistics and decoded only for thumbnails; nothing is written. Pickle-like
members are never loaded. No Ray, no torch.
"""

from __future__ import annotations

import html
import json
import statistics
from collections.abc import Iterator, Mapping, Sequence
from typing import Any

import numpy as np

from ray_ingest.catalog.catalog import Catalog
from ray_ingest.catalog.load import load_catalog
from ray_ingest.catalog.shard import Shard
from ray_ingest.errors import IngestError
from ray_ingest.tools.notebook import (
    NO_BUCKET,
    Grid,
    Profile,
    Sample,
    Stats,
    bucket_label,
    norm_bucket,
    summary_stats,
)
from ray_ingest.twintar import remote
from ray_ingest.twintar.reader import (
    ReadOptions,
    read_shard,
)
from ray_ingest.twintar.tario import (
    TarIndex,
    index_url,
    iter_members,
)
from ray_ingest.twintar.twin import (
    INDEX,
    KEY,
    ext_column,
)

__all__ = ["DatasetView", "Grid", "NO_BUCKET", "Sample", "Stats", "open_dataset"]


class DatasetView:
    """A read-only notebook view of the datasets under ``paths`` (see :func:`open_dataset`)."""

    def __init__(self, catalog: Catalog, opts: ReadOptions, image_modality: str | None,
                 caption_modality: str | None):
        self.catalog = catalog
        self.opts = opts
        self.image_modality = image_modality
        self.caption_modality = caption_modality
        self._shard_keys: dict[int, list[str]] = {}
        self._where: dict[str, tuple[int, int]] = {}
        self._profile: Profile | None = None

    # --- structure -----------------------------------------------------------------------
    @property
    def modalities(self) -> tuple[str, ...]:
        return self.catalog.modalities

    @property
    def buckets(self) -> dict[str, int]:
        """Samples per aspect-ratio bucket (from the wdinfo counts; :data:`NO_BUCKET` if none)."""
        out: dict[str, int] = {}
        for s in self.catalog.shards:
            label = bucket_label(s.bucket)
            out[label] = out.get(label, 0) + (s.count or 0)
        return dict(sorted(out.items()))

    def __len__(self) -> int:
        return sum(s.count or 0 for s in self.catalog.shards)

    def __repr__(self) -> str:
        return (f"DatasetView({len(self.catalog.shards)} shards, {len(self)} samples, "
                f"modalities {list(self.modalities)}, buckets {list(self.buckets)})")

    def _repr_html_(self) -> str:
        rows = "".join(f"<tr><td>{html.escape(b)}</td><td>{n}</td></tr>"
                       for b, n in self.buckets.items())
        return (f"<div><b>{len(self.catalog.shards)}</b> shards, <b>{len(self)}</b> samples, "
                f"modalities <code>{html.escape(', '.join(self.modalities))}</code>, "
                f"fingerprint <code>{self.catalog.fingerprint}</code>"
                f"<table><tr><th>bucket</th><th>samples</th></tr>{rows}</table></div>")

    # --- reading -------------------------------------------------------------------------
    def _shards(self, bucket: str | None) -> list[int]:
        want = norm_bucket(bucket)
        sids = [i for i, s in enumerate(self.catalog.shards)
                if want is None or bucket_label(s.bucket) == want]
        if want is not None and not sids:
            raise IngestError(f"bucket: expected one of {', '.join(self.buckets)}, got {bucket!r}")
        return sids

    def _sample(self, sid: int, row: Mapping[str, Any]) -> Sample:
        shard = self.catalog.shards[sid]
        members = {}
        for m in shard.modalities:
            data = row.get(m)
            members[m] = None if data is None else (row.get(ext_column(m)) or "", data)
        sample = Sample(key=row[KEY], shard=shard.path, index=int(row[INDEX]),
                        bucket=bucket_label(shard.bucket), members=members,
                        image_modality=self.image_modality, caption_modality=self.caption_modality)
        self._where.setdefault(sample.key, (sid, sample.index))
        return sample

    def iter_samples(self, bucket: str | None = None, limit: int | None = None,
                     seed: int | None = None) -> Iterator[Sample]:
        """Samples in catalog order (``seed``: shards visited in a seeded random order)."""
        sids = self._shards(bucket)
        if seed is not None:
            sids = [sids[i] for i in np.random.default_rng(seed).permutation(len(sids))]
        n = 0
        for sid in sids:
            if limit is not None and n >= limit:
                return
            count = None if limit is None else limit - n
            for row in read_shard(self.catalog.shards[sid], count=count, opts=self.opts):
                yield self._sample(sid, row)
                n += 1

    def show(self, n: int = 12, bucket: str | None = None, keys: Sequence[str] | None = None,
             *, seed: int | None = None, thumb: int = 160, columns: int = 6) -> Grid:
        """An HTML grid (thumbnails, keys, bucket, size, caption) of samples.

        Args:
            n: how many samples (ignored when ``keys`` is given).
            bucket: only this aspect-ratio bucket (``"16_9"`` or ``"16:9"``).
            keys: exactly these samples, in this order (looked up with :meth:`sample`).
            seed: visit shards in a seeded random order instead of catalog order.
            thumb: thumbnail box side in pixels.
            columns: grid columns.
        """
        if keys is not None:
            if isinstance(keys, str):
                keys = [keys]
            samples = [self.sample(k) for k in keys]
        else:
            samples = list(self.iter_samples(bucket=bucket, limit=max(0, n), seed=seed))
        return Grid(samples, thumb=thumb, columns=max(1, min(columns, len(samples) or 1)))

    def _keys_of(self, sid: int) -> list[str]:
        """Sample keys of a shard's driver tar, from its key index or a header-only scan."""
        if sid in self._shard_keys:
            return self._shard_keys[sid]
        shard: Shard = self.catalog.shards[sid]
        url = shard.url(shard.modalities[0])
        keys: list[str] | None = None
        try:
            raw = remote.read_bytes(index_url(url), self.opts.storage_options)
            keys = [k for k in TarIndex.from_dict(json.loads(raw), index_url(url)).keys
                    if k is not None]
        except (FileNotFoundError, OSError, ValueError, IngestError):
            keys = None
        if keys is None:
            with remote.open_url(url, self.opts.storage_options) as f:
                keys = [m.key for m in iter_members(f, url, read_data=False) if m.key is not None]
        self._shard_keys[sid] = keys
        return keys

    def sample(self, key: str) -> Sample:
        """The sample named ``key`` (raises ``KeyError`` when no shard holds it).

        Shards are searched through their key indexes (``<tar>.idx.json``) or a header-only
        scan of the driving modality's tar; only the matching sample's payloads are read.
        """
        candidates: list[tuple[int, int]] = []
        if key in self._where:
            candidates.append(self._where[key])
        else:
            for sid in range(len(self.catalog.shards)):
                keys = self._keys_of(sid)
                if key in keys:
                    candidates.append((sid, keys.index(key)))
                    break
        for sid, pos in candidates:
            shard = self.catalog.shards[sid]
            # Member position == sample position when alignment drops nothing; otherwise
            # read from the member position on and take the row with that key.
            for row in read_shard(shard, start=pos if self.opts.align == "strict" else 0,
                                  opts=self.opts):
                if row[KEY] == key:
                    return self._sample(sid, row)
                if self.opts.align == "strict":
                    break
        raise KeyError(f"{key!r}: no such sample in the {len(self.catalog.shards)} shards "
                       f"of this dataset")

    # --- statistics ----------------------------------------------------------------------
    def profile(self, limit: int | None = None) -> Profile:
        """Scan samples once (header-only image reads) and cache the measurements."""
        if self._profile is not None and (self._profile.limit is None
                                          or self._profile.limit == limit):
            return self._profile
        p = Profile(limit=limit)
        for m in self.modalities:
            p.nbytes[m] = []
            p.exts[m] = []
        sids = range(len(self.catalog.shards))
        for sid in sids:
            if limit is not None and len(p) >= limit:
                break
            count = None if limit is None else limit - len(p)
            shard = self.catalog.shards[sid]
            for row in read_shard(shard, count=count, opts=self.opts):
                s = self._sample(sid, row)
                p.keys.append(s.key)
                p.sids.append(sid)
                p.indices.append(s.index)
                p.buckets.append(s.bucket)
                size = s.image_size
                p.widths.append(size[0] if size else None)
                p.heights.append(size[1] if size else None)
                cap = s.caption()
                p.caption_chars.append(None if cap is None else len(cap))
                p.caption_words.append(None if cap is None else len(cap.split()))
                for m in self.modalities:
                    member = s.members.get(m)
                    p.nbytes[m].append(None if member is None else len(member[1]))
                    p.exts[m].append(None if member is None else member[0])
        self._profile = p
        return p

    def stats(self, limit: int | None = None) -> Stats:
        """Per-bucket and per-modality statistics (reads every sample unless ``limit``).

        Returns a :class:`Stats` dict: ``samples``/``shards`` (from the catalog), ``scanned``,
        ``buckets`` -> {``samples``, ``shards``, ``bytes`` per modality, ``image_width``,
        ``image_height``, ``aspect_ratio`` (w/h), ``caption_chars``, ``caption_words``: each
        ``{min, median, mean, max}`` or None}, ``total`` (the same over all buckets) and
        ``modalities`` -> {``present``, ``absent``, ``bytes``, ``mean_bytes``, ``exts``}.
        """
        p = self.profile(limit)

        def group(rows: list[int], shards: int) -> dict[str, Any]:
            w = [p.widths[i] for i in rows if p.widths[i] is not None]
            h = [p.heights[i] for i in rows if p.heights[i] is not None]
            ar = [round(p.widths[i] / p.heights[i], 4) for i in rows
                  if p.widths[i] is not None and p.heights[i]]
            cc = [p.caption_chars[i] for i in rows if p.caption_chars[i] is not None]
            cw = [p.caption_words[i] for i in rows if p.caption_words[i] is not None]
            return {
                "samples": len(rows),
                "shards": shards,
                "bytes": {m: sum(p.nbytes[m][i] or 0 for i in rows) for m in self.modalities},
                "image_width": summary_stats(w),
                "image_height": summary_stats(h),
                "aspect_ratio": summary_stats(ar),
                "caption_chars": summary_stats(cc),
                "caption_words": summary_stats(cw),
            }

        by_bucket: dict[str, list[int]] = {}
        for i, b in enumerate(p.buckets):
            by_bucket.setdefault(b, []).append(i)
        shards_of: dict[str, set[int]] = {}
        for i, b in enumerate(p.buckets):
            shards_of.setdefault(b, set()).add(p.sids[i])
        modalities = {}
        for m in self.modalities:
            sizes = [v for v in p.nbytes[m] if v is not None]
            exts: dict[str, int] = {}
            for e in p.exts[m]:
                if e is not None:
                    exts[e] = exts.get(e, 0) + 1
            modalities[m] = {"present": len(sizes), "absent": len(p) - len(sizes),
                             "bytes": sum(sizes),
                             "mean_bytes": round(sum(sizes) / len(sizes), 1) if sizes else 0.0,
                             "exts": dict(sorted(exts.items()))}
        return Stats(
            samples=len(self),
            shards=len(self.catalog.shards),
            scanned=len(p),
            buckets={b: group(rows, len(shards_of[b])) for b, rows in sorted(by_bucket.items())},
            total=group(list(range(len(p))), len(set(p.sids))),
            modalities=modalities,
        )

    # --- plots ---------------------------------------------------------------------------
    @staticmethod
    def _by_bucket(p: Profile, values: Sequence[float | None]) -> dict[str, list[float]]:
        out: dict[str, list[float]] = {}
        for b, v in zip(p.buckets, values, strict=True):
            if v is not None:
                out.setdefault(b, []).append(v)
        return dict(sorted(out.items()))

    def plot_aspect_ratios(self, bins: int = 40, limit: int | None = None):
        """Histogram of image aspect ratios (w/h, log scale) per bucket, with the bucket ratios
        marked. Returns a ``matplotlib.figure.Figure``."""
        p = self.profile(limit)
        ratios = [None if w is None or not h else w / h
                  for w, h in zip(p.widths, p.heights, strict=True)]
        groups = self._by_bucket(p, ratios)
        fig, ax = _figure()
        if groups:
            lo = min(min(v) for v in groups.values())
            hi = max(max(v) for v in groups.values())
            lo, hi = (lo / 1.1, hi * 1.1)
            edges = np.geomspace(lo, hi, bins + 1)
            ax.hist(list(groups.values()), bins=edges, stacked=True, label=list(groups))
            ax.set_xscale("log")
            for b in groups:
                if b != NO_BUCKET and "_" in b:
                    w, h = (int(x) for x in b.split("_", 1))
                    ax.axvline(w / h, color="k", lw=0.6, ls=":")
            if len(groups) > 1 or NO_BUCKET not in groups:
                ax.legend(title="bucket", fontsize=8)
        ax.set_xlabel("aspect ratio (width / height)")
        ax.set_ylabel("samples")
        ax.set_title(f"Aspect ratios ({len(p)} samples)")
        return fig

    def plot_image_sizes(self, limit: int | None = None):
        """Scatter of image width vs height, coloured by bucket. Returns a Figure."""
        p = self.profile(limit)
        fig, ax = _figure()
        pts: dict[str, tuple[list[int], list[int]]] = {}
        for b, w, h in zip(p.buckets, p.widths, p.heights, strict=True):
            if w is not None and h is not None:
                xs, ys = pts.setdefault(b, ([], []))
                xs.append(w)
                ys.append(h)
        for b, (xs, ys) in sorted(pts.items()):
            ax.scatter(xs, ys, s=10, alpha=0.7, label=b)
        if pts and (len(pts) > 1 or NO_BUCKET not in pts):
            ax.legend(title="bucket", fontsize=8)
        ax.set_xlabel("width (px)")
        ax.set_ylabel("height (px)")
        ax.set_title(f"Image sizes ({sum(len(v[0]) for v in pts.values())} images)")
        return fig

    def plot_caption_lengths(self, bins: int = 30, unit: str = "chars",
                             limit: int | None = None):
        """Histogram of caption lengths in ``chars`` or ``words``. Returns a Figure."""
        if unit not in ("chars", "words"):
            raise IngestError(f"unit: expected chars or words, got {unit!r}")
        p = self.profile(limit)
        values = [v for v in (p.caption_chars if unit == "chars" else p.caption_words)
                  if v is not None]
        fig, ax = _figure()
        if values:
            ax.hist(values, bins=max(1, min(bins, len(set(values)))))
            ax.axvline(statistics.median(values), color="k", lw=0.8, ls="--",
                       label=f"median {statistics.median(values):g}")
            ax.legend(fontsize=8)
        ax.set_xlabel(f"caption length ({unit})")
        ax.set_ylabel("samples")
        ax.set_title(f"Caption lengths ({len(values)} captions)")
        return fig


def _figure(width: float = 6.0, height: float = 3.6):
    """A Figure on an Agg canvas, outside pyplot's global state (no window, no leak)."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    fig = Figure(figsize=(width, height), layout="constrained")
    FigureCanvasAgg(fig)
    return fig, fig.add_subplot()


def open_dataset(
    paths: str | Sequence[str],
    modalities: Sequence[str] | None = None,
    *,
    align: str = "strict",
    optional: Sequence[str] = (),
    index_path: str | None = None,
    storage_options: Mapping[str, Any] | None = None,
    image_modality: str | None = None,
    caption_modality: str | None = None,
) -> DatasetView:
    """Open datasets for browsing (only wdinfo files are read here).

    Args:
        paths: wdinfo.json files or folders searched for them (local, ``gs://``, ``memory://``).
        modalities: modalities to read (default: the wdinfo's ``data_keys``); the first drives
            alignment.
        align: ``strict`` | ``merge`` | ``index``, as in training.
        optional: modalities that may lack a sample.
        index_path: parquet key list for ``align="index"``.
        storage_options: fsspec options.
        image_modality: modality shown as thumbnails (default: ``image`` if present).
        caption_modality: modality shown as captions (default: ``caption`` if present).
    """
    so = dict(storage_options or {})
    catalog = load_catalog(paths if isinstance(paths, str) else list(paths),
                           modalities=modalities, storage_options=so)
    opts = ReadOptions(align=align, optional=tuple(optional), index_path=index_path,
                       storage_options=so)
    mods = catalog.modalities
    if image_modality is None:
        image_modality = "image" if "image" in mods else None
    if caption_modality is None:
        caption_modality = "caption" if "caption" in mods else None
    for name, value in (("image_modality", image_modality), ("caption_modality", caption_modality)):
        if value is not None and value not in mods:
            raise IngestError(f"{name}: expected one of {', '.join(mods)}, got {value!r}")
    return DatasetView(catalog, opts, image_modality, caption_modality)
