"""User hooks for the tests, named by import path (``tests.support.hooks:draws``) as a user's
``decode.transform`` would be: resolved in every decode worker."""

from __future__ import annotations

import random

import numpy as np
import torch  # imported at module level, as docs/hooks.md asks: its RNG is seeded per sample


def draws(sample, rng, ctx):
    """Adds the sample's draws from every source a hook may use, and the image's mean."""
    sample["rng_draw"] = rng.random(3)
    sample["py_draw"] = random.random()
    sample["np_draw"] = float(np.random.random())
    sample["torch_draw"] = torch.rand(2)
    sample["key_seen"] = ctx.key
    if "image" in sample and isinstance(sample["image"], np.ndarray):
        sample["image_mean"] = float(sample["image"].mean())
    return sample


def drop_odd(sample, rng, ctx):
    """Skips every sample with an odd label (a filter)."""
    return None if int(sample["label"]) % 2 else sample


def boom(sample, rng, ctx):
    raise ValueError(f"no good {ctx.key}")


def not_a_dict(sample, rng, ctx):
    return [1, 2]


def without_label(sample, rng, ctx):
    """Builds a new dict without the label it was given."""
    return {k: v for k, v in sample.items() if k != "label"}


class Scale:
    """A class hook: built once per worker with ``decode.transform_kwargs``."""

    built = 0

    def __init__(self, factor: float = 1.0):
        Scale.built += 1
        self.factor = factor

    def __call__(self, sample, rng, ctx):
        sample["scaled_label"] = int(sample["label"]) * self.factor
        sample["crop_box"] = np.asarray(ctx.placement.box if ctx.placement else (0, 0, 0, 0))
        return sample


def minus_one_in_place(sample, rng, ctx):
    """Writes into every array it is given (as users do: ``out=``, ``torch.from_numpy``)."""
    for value in sample.values():
        if isinstance(value, np.ndarray) and value.dtype == np.uint8:
            torch.from_numpy(value).neg_()  # uint8: 256 - v, in place, through torch
            np.subtract(255, value, out=value, casting="unsafe")  # 255 - (256 - v) = v - 1
    return sample
