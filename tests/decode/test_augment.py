"""resize_crop resamples only the kept pixels, and must give the textbook transform's bytes."""

from __future__ import annotations

import concurrent.futures
import random
import threading
import time

import attrs
import numpy as np
import pytest
from PIL import Image

from ray_ingest.decode import augment
from ray_ingest.decode.augment import (
    Geometry,
    resize_crop,
    resize_then_crop,
)


def _noise(w: int, h: int, seed: int, mode: str = "RGB") -> Image.Image:
    arr = np.random.default_rng(seed).integers(0, 256, (h, w, 3), dtype=np.uint8)
    return Image.fromarray(arr).convert(mode)


def _cases(n: int, seed: int = 0):
    """Random sizes (tall, wide, tiny, upscaled), target shapes and crop modes."""
    rnd = random.Random(seed)
    for i in range(n):
        w, h = rnd.randint(1, 400), rnd.randint(1, 400)
        if rnd.random() < 0.3:
            h *= rnd.randint(2, 4)
        elif rnd.random() < 0.3:
            w *= rnd.randint(2, 4)
        side = rnd.choice([1, 7, 33, 64, 224])
        geom = Geometry(rnd.choice([side, side, 3, 160]), side, rnd.choice(["center", "random"]))
        yield i, w, h, geom, rnd.getrandbits(64)


def test_kept_pixels_equal_the_textbook_resize_then_crop_bit_for_bit():
    orders = {True: 0, False: 0}
    one_axis = 0
    for i, w, h, geom, seed in _cases(600):
        img = _noise(w, h, i)
        want = resize_then_crop(img, geom, seed)
        got = resize_crop(img, geom, seed)
        assert got.shape == want.shape == (geom.height, geom.width, 3)
        assert np.array_equal(got, want), (w, h, geom)
        _, (nw, nh), _ = augment._cover(img, geom, seed)
        one_axis += nw == w or nh == h
        if nw != w and nh != h:
            orders[augment.pass_order()(w, h, nw, nh)] += 1
    # the cases reach both pass orders and the one-pass shortcuts
    assert min(orders.values()) > 20 and one_axis > 0, (orders, one_axis)


def test_flipped_kept_pixels_equal_the_textbook_flip_bit_for_bit():
    """The render flips with Pillow; the textbook reverses the numpy array."""
    flipped = kept = 0
    for i, w, h, geom, seed in _cases(300, seed=1):
        geom = Geometry(geom.height, geom.width, geom.crop, flip=True)
        img = _noise(w, h, i, "L" if i % 4 == 0 else "RGB")
        want = resize_then_crop(img, geom, seed)
        got = resize_crop(img, geom, seed)
        assert got.shape == want.shape and np.array_equal(got, want), (w, h, geom)
        assert got.flags.c_contiguous
        if np.array_equal(got, resize_then_crop(img, attrs.evolve(geom, flip=False), seed)):
            kept += 1
        else:
            flipped += 1
    assert flipped > 100 and kept > 100, (flipped, kept)


@pytest.mark.parametrize("dtype", [np.uint8, np.uint16, np.float32, bool])
def test_mirrored_is_numpys_reversal_for_any_layout(dtype):
    rng = np.random.default_rng(7)
    values = rng.random((9, 13, 4)) * 200
    base = values > 100 if dtype is bool else values.astype(dtype)
    views = [base, base[..., 0], base[..., :3], base[..., 1:2], base[2:7, 3:11], base[:, :1],
             base[::2, ::3, :3], base[:0], np.asfortranarray(base[..., :3])]
    for arr in views:
        got = augment.mirrored(arr)
        assert got.flags.c_contiguous and got.dtype == arr.dtype
        assert got.shape == arr.shape and np.array_equal(got, arr[:, ::-1]), arr.shape
        assert not np.shares_memory(got, base)


def test_grey_and_alpha_images_match_too():
    for mode in ("L", "RGBA", "P"):
        img = _noise(300, 170, 1, mode)
        geom = Geometry(64, 64)
        assert np.array_equal(resize_crop(img, geom), resize_then_crop(img, geom))


def test_the_installed_pillow_has_a_known_pass_order():
    # Without one, every image would be resized whole (correct, but the speed-up is gone).
    assert augment.pass_order() is not None


def test_threads_rendering_their_first_images_at_once_probe_the_pass_order_once(monkeypatch):
    """Decode threads (or ranks sharing a process) that render at once wait for one probe."""
    calls = []
    real = augment._probe_pass_order

    def slow_probe():
        calls.append(threading.current_thread().name)
        time.sleep(0.2)  # the others arrive while it runs
        return real()

    monkeypatch.setattr(augment, "_probe_pass_order", slow_probe)
    augment.pass_order.cache_clear()
    try:
        with concurrent.futures.ThreadPoolExecutor(8) as pool:
            orders = list(pool.map(lambda _: augment.pass_order(), range(8)))
        assert len(calls) == 1 and orders == [orders[0]] * 8 and orders[0] is not None
        assert augment.pass_order() is orders[0] and len(calls) == 1
    finally:
        augment.pass_order.cache_clear()


def test_a_wrong_pass_order_is_caught_by_the_probes():
    rule = augment.pass_order()

    def wrong(w, h, nw, nh):
        return not rule(w, h, nw, nh)

    mismatched = 0
    for (w, h), geom in augment._PROBES:
        img = _noise(w, h, 3)
        args = augment._cover(img, geom, 7)
        if args[1][0] != w and args[1][1] != h:
            kept = np.asarray(augment._resize_kept(*args, wrong))
            mismatched += not np.array_equal(kept, resize_then_crop(img, geom, 7))
    assert mismatched > 0


def test_unknown_pass_order_falls_back_to_the_whole_resize(monkeypatch):
    calls = []
    monkeypatch.setattr(augment, "pass_order", lambda: None)
    monkeypatch.setattr(augment, "_resize_kept", lambda *a: calls.append(a))
    img = _noise(500, 300, 2)
    assert np.array_equal(resize_crop(img, Geometry(224, 224)),
                          resize_then_crop(img, Geometry(224, 224)))
    assert calls == []


@pytest.mark.parametrize("size", [(1000, 600), (600, 1000)])
def test_kept_resize_does_less_work_than_the_whole(size):
    """Pixels resampled by each path, counted from the pass sizes (not timed: CI is noisy)."""
    seen: list[tuple[tuple[int, int], tuple[int, int]]] = []
    real = Image.Image.resize

    def counting(self, sz, *a, **k):
        seen.append((self.size, tuple(sz)))
        return real(self, sz, *a, **k)

    img = _noise(*size, 4)
    geom = Geometry(224, 224)
    augment.pass_order()  # its probes resize too: run them first
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(Image.Image, "resize", counting)
        resize_crop(img, geom)
        kept = list(seen)
        seen.clear()
        resize_then_crop(img, geom)
        whole = list(seen)

    # pixels each pass writes: the kept path's calls are single passes; the whole resize is
    # one call of two passes, the first writing the intermediate image
    kept_work = sum(nw * nh for _, (nw, nh) in kept)
    (w, h), (nw, nh) = whole[0]
    first = nw * h if augment.pass_order()(w, h, nw, nh) else w * nh
    assert len(kept) == 2 and kept_work < 0.9 * (first + nw * nh), (kept, whole)


def test_a_pillow_that_refuses_the_kept_path_gets_the_whole_resize(monkeypatch):
    def refuses(*a):
        raise ValueError("box can't exceed original image size")

    augment.pass_order.cache_clear()
    monkeypatch.setattr(augment, "_resize_kept", refuses)
    try:
        assert augment.pass_order() is None
        img = _noise(400, 260, 5)
        assert np.array_equal(resize_crop(img, Geometry(96, 96)),
                              resize_then_crop(img, Geometry(96, 96)))
    finally:
        augment.pass_order.cache_clear()  # the next caller probes the real path again
