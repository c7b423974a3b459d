"""What a notebook shows of a twin-tar dataset: one sample, a grid of thumbnails, statistics.

The views :mod:`ray_ingest.tools.explore` returns, rendered as HTML in Jupyter
(``_repr_html_``). Images are opened header-only for sizes and decoded only for thumbnails;
pickle-like members are never loaded. No Ray, no torch.
"""

from __future__ import annotations

import base64
import html
import io
import statistics
from collections.abc import Iterator, Mapping, Sequence
from typing import Any

import attrs
import numpy as np

from ray_ingest.decode.decoder import IMAGE_EXTS, SampleError, caption_text, load_array
from ray_ingest.errors import IngestError

#: Bucket label of shards that are not under an ``aspect_ratio_W_H/`` folder.
NO_BUCKET = "-"
#: Caption characters shown under a thumbnail (the full text is in the tooltip).
CAPTION_CHARS = 160
TEXT_EXTS = frozenset({"json", "txt", "text"})
ARRAY_EXTS = frozenset({"npy"})


def bucket_label(bucket: str | None) -> str:
    return bucket if bucket else NO_BUCKET


def norm_bucket(bucket: str | None) -> str | None:
    """``"16:9"``, ``"16_9"`` and ``"aspect_ratio_16_9"`` all name bucket ``16_9``."""
    if bucket is None:
        return None
    return bucket.removeprefix("aspect_ratio_").replace(":", "_")


def _image_size(data: bytes) -> tuple[int, int] | None:
    """(width, height) from the image header only; None when it is not a readable image."""
    from PIL import Image, UnidentifiedImageError

    try:
        with Image.open(io.BytesIO(data)) as img:
            return img.size
    except (UnidentifiedImageError, OSError, ValueError):
        return None


def _thumbnail(data: bytes, size: int) -> tuple[str, str] | None:
    """``(mime, base64)`` of an inline thumbnail (JPEG, or PNG when the image has alpha)."""
    from PIL import Image, UnidentifiedImageError

    try:
        with Image.open(io.BytesIO(data)) as img:
            if img.format == "JPEG":
                img.draft("RGB", (size, size))  # DCT-scaled decode: cheap for big images
            alpha = img.mode in ("RGBA", "LA", "PA") or "transparency" in img.info
            img = img.convert("RGBA" if alpha else "RGB")
            img.thumbnail((size, size))
            buf = io.BytesIO()
            if alpha:
                img.save(buf, format="PNG")
                mime = "image/png"
            else:
                img.save(buf, format="JPEG", quality=85)
                mime = "image/jpeg"
    except (UnidentifiedImageError, OSError, ValueError):
        return None
    return mime, base64.b64encode(buf.getvalue()).decode("ascii")


def summary_stats(values: Sequence[float]) -> dict[str, float] | None:
    if not values:
        return None
    return {"min": min(values), "median": statistics.median(values),
            "mean": round(statistics.fmean(values), 2), "max": max(values)}


@attrs.frozen
class Sample:
    """One aligned sample: provenance plus each modality's ``(ext, bytes)`` (None: absent)."""

    key: str
    #: Relative tar path of the shard (``data_list`` entry).
    shard: str
    #: Position of the sample in its shard.
    index: int
    #: Aspect-ratio bucket of the shard (``16_9``), :data:`NO_BUCKET` when unbucketed.
    bucket: str
    members: Mapping[str, tuple[str, bytes] | None]
    image_modality: str | None = None
    caption_modality: str | None = None

    # --- modalities ----------------------------------------------------------------------
    def data(self, modality: str) -> bytes | None:
        """Raw member bytes of ``modality`` (None when the sample lacks it)."""
        member = self.members[modality]
        return None if member is None else member[1]

    def ext(self, modality: str) -> str | None:
        member = self.members[modality]
        return None if member is None else member[0]

    def image(self, modality: str | None = None):
        """The decoded image as an RGB ``PIL.Image`` (None when absent)."""
        from PIL import Image

        modality = modality or self.image_modality
        if modality is None or self.members.get(modality) is None:
            return None
        img = Image.open(io.BytesIO(self.data(modality)))
        return img.convert("RGB")

    @property
    def image_size(self) -> tuple[int, int] | None:
        """(width, height) read from the image header, without decoding."""
        if self.image_modality is None or self.members.get(self.image_modality) is None:
            return None
        return _image_size(self.data(self.image_modality))

    def caption(self, modality: str | None = None) -> str | None:
        """Caption text (JSON ``prompt``, then ``prompt_medium``/``prompt_short``; or .txt)."""
        modality = modality or self.caption_modality
        if modality is None or self.members.get(modality) is None:
            return None
        ext, data = self.members[modality]
        try:
            return caption_text(data, ext)
        except (SampleError, ValueError, UnicodeDecodeError):
            return None

    def array(self, modality: str) -> np.ndarray | None:
        """A ``.npy`` member as an array (pickle is never loaded)."""
        if self.members.get(modality) is None:
            return None
        ext, data = self.members[modality]
        return load_array(data, ext, allow_pickle=False)

    def describe(self, modality: str) -> str:
        """One-line description of a member: ``jpg 12.3 KiB 320x180`` / ``npy (37, 64) float16``."""
        member = self.members.get(modality)
        if member is None:
            return "absent"
        ext, data = member
        text = f"{ext} {_human(len(data))}"
        if ext in IMAGE_EXTS:
            size = _image_size(data)
            if size:
                text += f" {size[0]}x{size[1]}"
        elif ext in ARRAY_EXTS:
            try:
                arr = load_array(data, ext, allow_pickle=False)
                text = f"{ext} {tuple(arr.shape)} {arr.dtype}"
            except (ValueError, OSError, IngestError):
                text += " (unreadable)"
        return text

    def decoded(self, decode: Any = None, seed: int = 0) -> Decoded:
        """The sample as the loader decodes it (every modality, one geometry, the hook):
        ``decode`` is a :class:`~ray_ingest.config.DecodeConfig` (default: its defaults)."""
        from ray_ingest.columns import BUCKET, INDEX, KEY, SHARD, SID, ext_column
        from ray_ingest.config import DecodeConfig
        from ray_ingest.decode.decoder import Decoder

        cfg = decode or DecodeConfig(image_modality=self.image_modality,
                                     caption_modality=self.caption_modality)
        cols: dict[str, list[Any]] = {KEY: [self.key], SHARD: [self.shard], INDEX: [self.index],
                                      SID: [0], BUCKET: [self.bucket.replace(NO_BUCKET, "")]}
        for m, member in self.members.items():
            cols[m] = [None if member is None else member[1]]
            cols[ext_column(m)] = [None if member is None else member[0]]
        block = Decoder(cfg, seed=seed)(cols)
        fields = {k: v[0] for k, v in block.items() if not k.startswith("__")}
        return Decoded(self.key, fields, cfg.image_modality)

    def to_dict(self) -> dict[str, Any]:
        """JSON-able summary (no payloads)."""
        return {"key": self.key, "shard": self.shard, "index": self.index,
                "bucket": self.bucket, "caption": self.caption(),
                "image_size": self.image_size,
                "members": {m: self.describe(m) for m in self.members}}

    # --- rendering -----------------------------------------------------------------------
    def _cell_html(self, thumb: int, caption_chars: int = CAPTION_CHARS,
                   details: bool = False) -> str:
        key = html.escape(self.key)
        img_html = '<div style="color:#999;font-size:11px">no image</div>'
        if self.image_modality is not None and self.members.get(self.image_modality) is not None:
            t = _thumbnail(self.data(self.image_modality), thumb)
            if t is not None:
                img_html = (f'<img src="data:{t[0]};base64,{t[1]}" alt="{key}" '
                            f'style="max-width:{thumb}px;max-height:{thumb}px;display:block"/>')
            else:
                img_html = '<div style="color:#c00;font-size:11px">unreadable image</div>'
        size = self.image_size
        meta = " &middot; ".join(
            x for x in (html.escape(self.bucket) if self.bucket != NO_BUCKET else "",
                        f"{size[0]}&times;{size[1]}" if size else "") if x)
        cap = self.caption()
        cap_html = ""
        if cap is not None:
            short = cap if len(cap) <= caption_chars else cap[: caption_chars - 1] + "\u2026"
            cap_html = (f'<div class="ri-caption" title="{html.escape(cap, quote=True)}">'
                        f"{html.escape(short)}</div>")
        extra = ""
        if details:
            rows = "".join(
                f"<tr><td>{html.escape(m)}</td><td>{html.escape(self.describe(m))}</td></tr>"
                for m in self.members)
            extra = (f'<table style="font-size:11px">{rows}<tr><td>shard</td>'
                     f"<td>{html.escape(self.shard)} #{self.index}</td></tr></table>")
        return (f'<figure class="ri-cell" data-key="{key}" style="margin:0;width:{thumb}px">'
                f"{img_html}<figcaption style=\"font-size:11px;line-height:1.3\">"
                f'<code class="ri-key">{key}</code>'
                f"{'<br/>' + meta if meta else ''}{cap_html}{extra}</figcaption></figure>")

    def _repr_html_(self) -> str:
        return self._cell_html(thumb=256, caption_chars=10_000, details=True)


#: Colours of mask classes 1.. in overlays (class 0 stays clear).
_PALETTE = np.array([(230, 25, 75), (60, 180, 75), (255, 225, 25), (0, 130, 200),
                     (245, 130, 48), (145, 30, 180), (70, 240, 240), (240, 50, 230)], np.uint8)
#: An integer map with at most this many distinct values is drawn as a mask over the image.
MASK_CLASSES = 32


def _png_uri(arr: np.ndarray) -> str:
    from PIL import Image

    buf = io.BytesIO()
    Image.fromarray(np.ascontiguousarray(arr)).save(buf, format="PNG")
    return "data:image/png;base64," + base64.b64encode(buf.getvalue()).decode("ascii")


@attrs.frozen
class Decoded:
    """A decoded sample: every field, the image-like ones drawn beside the image (a mask over
    it in colour, a depth map or any other 2-D array in grey, scaled to its range)."""

    key: str
    fields: Mapping[str, Any]
    image_modality: str | None = None

    def __getitem__(self, name: str) -> Any:
        return self.fields[name]

    def panels(self) -> list[tuple[str, np.ndarray]]:
        """(title, uint8 RGB or grey picture) per image-like field, the image first."""
        image = self.fields.get(self.image_modality) if self.image_modality else None
        out: list[tuple[str, np.ndarray]] = []
        if isinstance(image, np.ndarray) and image.ndim == 3:
            out.append((self.image_modality, image))
        for name, value in self.fields.items():
            if name == self.image_modality or not isinstance(value, np.ndarray):
                continue
            if value.ndim == 3 and value.shape[2] == 3 and value.dtype == np.uint8:
                out.append((name, value))
            elif value.ndim == 2 and value.dtype.kind in "biuf" and value.size:
                classes = np.unique(value)
                if (value.dtype.kind in "bui" and len(classes) <= MASK_CLASSES and len(out)
                        and out[0][1].shape[:2] == value.shape):
                    out.append((f"{name} over {out[0][0]}", _overlay(out[0][1], value)))
                else:
                    v = value.astype(np.float64)
                    lo, hi = float(v.min()), float(v.max())
                    grey = np.zeros(v.shape, np.uint8) if hi <= lo else np.round(
                        (v - lo) / (hi - lo) * 255).astype(np.uint8)
                    out.append((f"{name} ({value.dtype}, {lo:g}..{hi:g})", grey))
        return out

    def _repr_html_(self) -> str:
        from ray_ingest.tools.summary import describe

        figs = "".join(
            f'<figure style="margin:0"><img src="{_png_uri(pic)}" alt="{html.escape(t)}" '
            f'style="max-width:256px;display:block"/><figcaption style="font-size:11px">'
            f"{html.escape(t)}</figcaption></figure>" for t, pic in self.panels())
        rows = "".join(f"<tr><td>{html.escape(k)}</td><td>{html.escape(str(describe(v)))}"
                       f"</td></tr>" for k, v in self.fields.items())
        return (f'<div class="ri-decoded" data-key="{html.escape(self.key)}">'
                f'<div style="display:flex;gap:10px">{figs}</div>'
                f'<table style="font-size:11px">{rows}</table></div>')


def _overlay(image: np.ndarray, mask: np.ndarray) -> np.ndarray:
    """Mask classes 1.. blended over the image (half opacity); class 0 leaves it as it is."""
    colours = _PALETTE[(mask.astype(np.int64) - 1) % len(_PALETTE)]
    out = image.astype(np.float32)
    on = mask != 0
    out[on] = 0.5 * out[on] + 0.5 * colours[on]
    return out.astype(np.uint8)


def _human(n: int) -> str:
    value = float(n)
    for unit in ("B", "KiB", "MiB", "GiB"):
        if value < 1024 or unit == "GiB":
            return f"{value:.0f} {unit}" if unit == "B" else f"{value:.1f} {unit}"
        value /= 1024
    return f"{n} B"  # pragma: no cover


@attrs.frozen
class Grid:
    """Samples rendered as an HTML grid of thumbnails (what :meth:`DatasetView.show` returns)."""

    samples: tuple[Sample, ...] = attrs.field(converter=tuple)
    #: Thumbnail box side in pixels.
    thumb: int = 160
    columns: int = 6

    @property
    def keys(self) -> list[str]:
        return [s.key for s in self.samples]

    def __len__(self) -> int:
        return len(self.samples)

    def __iter__(self) -> Iterator[Sample]:
        return iter(self.samples)

    def __getitem__(self, i: int) -> Sample:
        return self.samples[i]

    def _repr_html_(self) -> str:
        if not self.samples:
            return '<div class="ri-grid">no samples</div>'
        cells = "".join(s._cell_html(self.thumb) for s in self.samples)
        return (f'<div class="ri-grid" style="display:grid;gap:10px;'
                f"grid-template-columns:repeat({self.columns},{self.thumb}px)\">{cells}</div>")

    def __repr__(self) -> str:
        more = ", ..." if len(self) > 8 else ""
        return f"Grid({len(self.samples)} samples: {', '.join(self.keys[:8])}{more})"


class Stats(dict):
    """:meth:`DatasetView.stats` result: a plain JSON-able dict that renders as tables."""

    def _repr_html_(self) -> str:
        def fmt(s: dict[str, float] | None) -> str:
            if not s:
                return ""
            return f"{s['min']:g} / {s['median']:g} / {s['max']:g}"

        mods = list(self["modalities"])
        head = ("<tr><th>bucket</th><th>shards</th><th>samples</th>"
                + "".join(f"<th>{html.escape(m)} bytes</th>" for m in mods)
                + "<th>width min/med/max</th><th>height min/med/max</th>"
                  "<th>aspect min/med/max</th><th>caption chars min/med/max</th></tr>")
        rows = []
        for name, b in [*self["buckets"].items(), ("all", self["total"])]:
            cells = [html.escape(name), str(b["shards"]), str(b["samples"])]
            cells += [_human(b["bytes"].get(m, 0)) for m in mods]
            cells += [fmt(b["image_width"]), fmt(b["image_height"]), fmt(b["aspect_ratio"]),
                      fmt(b["caption_chars"])]
            style = ' style="font-weight:bold"' if name == "all" else ""
            rows.append(f"<tr{style}>" + "".join(f"<td>{c}</td>" for c in cells) + "</tr>")
        mhead = ("<tr><th>modality</th><th>present</th><th>absent</th><th>bytes</th>"
                 "<th>mean bytes</th><th>extensions</th></tr>")
        mrows = []
        for m, s in self["modalities"].items():
            exts = ", ".join(f"{e}: {n}" for e, n in s["exts"].items())
            mrows.append(f"<tr><td>{html.escape(m)}</td><td>{s['present']}</td>"
                         f"<td>{s['absent']}</td><td>{_human(s['bytes'])}</td>"
                         f"<td>{_human(int(s['mean_bytes']))}</td>"
                         f"<td>{html.escape(exts)}</td></tr>")
        note = ""
        if self["scanned"] < self["samples"]:
            note = (f"<p>scanned {self['scanned']} of {self['samples']} samples "
                    "(limit)</p>")
        return (f'<div class="ri-stats">{note}<table>{head}{"".join(rows)}</table>'
                f"<table>{mhead}{''.join(mrows)}</table></div>")


@attrs.define
class Profile:
    """Per-sample measurements collected by one scan (columns of equal length)."""

    keys: list[str] = attrs.field(factory=list)
    sids: list[int] = attrs.field(factory=list)
    indices: list[int] = attrs.field(factory=list)
    buckets: list[str] = attrs.field(factory=list)
    widths: list[int | None] = attrs.field(factory=list)
    heights: list[int | None] = attrs.field(factory=list)
    caption_chars: list[int | None] = attrs.field(factory=list)
    caption_words: list[int | None] = attrs.field(factory=list)
    #: modality -> bytes per sample (None: absent)
    nbytes: dict[str, list[int | None]] = attrs.field(factory=dict)
    #: modality -> extension per sample (None: absent)
    exts: dict[str, list[str | None]] = attrs.field(factory=dict)
    limit: int | None = None

    def __len__(self) -> int:
        return len(self.keys)
