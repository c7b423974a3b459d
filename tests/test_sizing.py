"""Object-store sizing arithmetic (ray_ingest.decode.sizing): no Ray."""

from __future__ import annotations

import pytest

from ray_ingest.config import config_from_dict
from ray_ingest.decode.sizing import (
    TASKS_IN_FLIGHT_PER_ACTOR,
    block_rows,
    decoded_sample_bytes,
    in_flight_bytes,
)

MIB = 1024**2


def cfg(**sections):
    return config_from_dict({"data": {"paths": ["x"]}, **sections})


@pytest.mark.parametrize(("res", "rows"), [(64, 128), (256, 128), (512, 42), (1024, 10),
                                            (2048, 2), (3840, 1), (8192, 1)])
def test_block_rows_shrink_with_resolution_to_fit_max_block_bytes(res, rows):
    c = cfg(decode={"resolution": res})
    assert block_rows(c) == rows
    # a block never exceeds the cap unless a single row does
    assert rows * res * res * 3 <= c.loader.max_block_bytes or rows == 1


def test_buckets_size_by_their_largest_shape_and_explicit_caps_win():
    square = decoded_sample_bytes(cfg(decode={"resolution": 1024}).decode)
    wide = decoded_sample_bytes(cfg(decode={"resolution": 1024, "buckets": ["21:9", "1:1"]}).decode)
    assert square == 1024 * 1024 * 3 and wide > square  # 21:9 rounds up to multiples of 8
    assert decoded_sample_bytes(cfg(decode={"image_key": None}).decode) == 0
    c = cfg(decode={"resolution": 1024}, loader={"block_rows": 16, "max_block_bytes": 64 * MIB})
    assert block_rows(c) == 16
    assert block_rows(cfg(decode={"image_key": None}, loader={"block_rows": 7})) == 7


def test_in_flight_bytes_formula():
    c = cfg(decode={"resolution": 1024, "pool_max": 3},
            loader={"block_rows": 8, "prefetch_batches": 2})
    f = in_flight_bytes(c)
    block = 8 * 1024 * 1024 * 3
    assert f["block_bytes"] == block
    assert f["decode_side"] == 3 * TASKS_IN_FLIGHT_PER_ACTOR * block
    assert f["consumer_side"] == 3 * block
    assert f["total"] == f["decode_side"] + f["consumer_side"]
    assert in_flight_bytes(c, actors=1)["decode_side"] == TASKS_IN_FLIGHT_PER_ACTOR * block
