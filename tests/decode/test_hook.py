"""The user hook: resolved from an import path, called with the sample's own RNG, the global
RNGs seeded around it and restored, its fields kept, its None a counted filter, its errors one
line naming the sample and the hook."""

from __future__ import annotations

import random
import warnings

import numpy as np
import pytest
import torch

from ray_ingest.config import DecodeConfig
from ray_ingest.decode import hook as hooks
from ray_ingest.decode.decoder import Decoder
from ray_ingest.errors import IngestError
from ray_ingest.loader.skips import SkipFilter, skip_kind
from tests.decode.test_modalities import block
from tests.support import hooks as user


def _draws(out, i):
    return (out["rng_draw"][i].tolist(), float(out["py_draw"][i]), float(out["np_draw"][i]),
            out["torch_draw"][i].tolist())


def test_an_import_path_hook_adds_fields_with_per_sample_draws():
    cfg = DecodeConfig(resolution=32, crop="random", transform="tests.support.hooks:draws")
    a = Decoder(cfg, seed=3)(block(range(6)))
    b = Decoder(cfg, seed=3)(block(range(5, -1, -1)))  # another decoder, another order
    assert a["rng_draw"].shape == (6, 3) and a["torch_draw"].shape == (6, 2)
    assert a["key_seen"].tolist() == [f"k{i:05d}" for i in range(6)]
    for i in range(6):
        assert _draws(a, i) == _draws(b, 5 - i)  # same sample, same draws
    assert len({tuple(a["rng_draw"][i]) for i in range(6)}) == 6  # samples differ
    c = Decoder(cfg, seed=4)(block(range(6)))
    assert _draws(a, 0) != _draws(c, 0)  # another run seed, other draws
    other_epoch = block(range(6), __epoch__=[1] * 6)
    assert _draws(a, 0) != _draws(Decoder(cfg, seed=3)(other_epoch), 0)


def test_the_hooks_rng_is_seeded_from_seed_epoch_key_and_repeat():
    ctx = hooks.SampleContext("k00002", "s.tar", 2, 0, 0, 3)
    sample = {"label": 2}
    got = hooks.call(user.draws, sample, ctx)
    want = np.random.default_rng(np.random.SeedSequence(
        [3, 0, hooks.key_digest("k00002"), 0])).random(3)
    np.testing.assert_array_equal(got["rng_draw"], want)
    dup = hooks.call(user.draws, {"label": 2}, hooks.SampleContext("k00002", "s.tar", 2, 0, 1, 3))
    assert dup["rng_draw"].tolist() != got["rng_draw"].tolist()  # a planned duplicate differs
    # the digest is stable across processes and Python versions (sha256, not hash())
    assert hooks.key_digest("k00002") == int.from_bytes(
        __import__("hashlib").sha256(b"k00002").digest()[:8], "big")


def test_global_rngs_are_restored_after_the_call():
    random.seed(1)
    np.random.seed(1)
    torch.manual_seed(1)
    expect = (random.random(), np.random.random(), torch.rand(1).item())
    random.seed(1)
    np.random.seed(1)
    torch.manual_seed(1)
    Decoder(DecodeConfig(resolution=32, transform=user.draws))(block(range(3)))
    assert (random.random(), np.random.random(), torch.rand(1).item()) == expect


def test_a_class_hook_is_built_once_with_its_kwargs():
    user.Scale.built = 0
    cfg = DecodeConfig(resolution=32, crop="random", transform="tests.support.hooks:Scale",
                       transform_kwargs={"factor": 2.5})
    dec = Decoder(cfg)
    out = dec(block(range(4)))
    dec(block(range(4, 8)))
    assert user.Scale.built == 1
    assert out["scaled_label"].tolist() == [0.0, 2.5, 5.0, 7.5]
    assert out["crop_box"].shape == (4, 4)  # the placement reaches the hook


def test_none_is_a_counted_filter_outside_the_error_budgets():
    cfg = DecodeConfig(resolution=32, transform="tests.support.hooks:drop_odd")
    out = Decoder(cfg, on_error="raise")(block(range(6)))  # filtering is not an error
    reasons = out["__error__"].tolist()
    assert [bool(r) for r in reasons] == [False, True] * 3
    assert all(r == "filtered: transform tests.support.hooks:drop_odd returned None"
               for r in reasons[1::2])
    assert skip_kind(reasons[1]) == "filtered"
    skips = SkipFilter(0, 0, lambda sid: "s.tar")  # budgets of zero: any error would trip
    out["__seq__"] = np.arange(6)
    kept = skips(out)
    assert kept["label"].tolist() == [0, 2, 4] and skips.by_kind == {"filtered": 3}


@pytest.mark.parametrize("name, message", [
    ("boom", "transform tests.support.hooks:boom failed: ValueError: no good k00001"),
    ("not_a_dict", "transform tests.support.hooks:not_a_dict returned a list, expected a dict"),
    ("without_label", "transform tests.support.hooks:without_label dropped label: return "
                      "every decoded modality"),
])
def test_hook_errors_name_the_sample_and_the_hook(name, message):
    cfg = DecodeConfig(resolution=32, transform=f"tests.support.hooks:{name}")
    with pytest.raises(IngestError) as info:
        Decoder(cfg)(block([1]))
    assert "shard s.tar key k00001 index 1: cannot decode: HookError: " in str(info.value)
    assert message in str(info.value) and "\n" not in str(info.value)
    out = Decoder(cfg, on_error="skip", log_skips=False)(block([1, 2]))
    assert message in out["__error__"][0]


def test_an_unknown_hook_fails_when_the_decoder_is_built():
    with pytest.raises(ImportError, match="decode.transform tests.support.hooks:nope"):
        Decoder(DecodeConfig(transform="tests.support.hooks:nope"))
    with pytest.raises(ImportError, match="cannot import no_such_module"):
        Decoder(DecodeConfig(transform="no_such_module:f"))


@pytest.mark.parametrize("flip", [False, True])
def test_the_hook_may_write_into_every_array_it_gets(flip):
    """Pillow-decoded images map read-only bytes: the hook gets arrays of its own, whichever
    path decoded them, and torch.from_numpy on them does not warn."""
    plain = DecodeConfig(resolution=32, crop="random", flip=flip)
    hooked = DecodeConfig(resolution=32, crop="random", flip=flip,
                          transform="tests.support.hooks:minus_one_in_place")
    ref = Decoder(plain, seed=3)(block(range(6)))
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        out = Decoder(hooked, seed=3)(block(range(6)))
    for name in ("image", "mask"):
        np.testing.assert_array_equal(out[name], ref[name] - np.uint8(1))
    np.testing.assert_array_equal(out["depth"], ref["depth"])
