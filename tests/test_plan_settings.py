"""seed, seed_mode, shuffle, repeat and equal_work are declared once (PlanSettings) and shared by
the config, the planner and ``ray-ingest plan``: same defaults, same checks, same lists."""

from __future__ import annotations

import json
import re

import attrs
import pytest

from ray_ingest.cli.main import main
from ray_ingest.config import LoaderConfig, config_from_dict
from ray_ingest.errors import ConfigError
from ray_ingest.plan import (
    DEFAULT_PARAMS,
    DEFAULT_SETTINGS,
    SETTING_NAMES,
    PlanParams,
    PlanSettings,
    assign_slot,
)
from ray_ingest.twintar.dataset import write_wdinfo


def test_one_definition_one_set_of_defaults():
    assert SETTING_NAMES == ("seed", "seed_mode", "shuffle", "repeat", "equal_work")
    base = {f.name: f for f in attrs.fields(PlanSettings)}
    for cls in (LoaderConfig, PlanParams):
        fields = {f.name: f for f in attrs.fields(cls)}
        for name, f in base.items():
            assert fields[name].default == f.default and fields[name].validator is f.validator
    assert LoaderConfig().plan_params() == DEFAULT_PARAMS == PlanParams()
    assert DEFAULT_SETTINGS.repeat is False and DEFAULT_PARAMS.repeat is False
    cfg = config_from_dict({"data": {"paths": ["x"]},
                            "loader": {"seed": 7, "seed_mode": "pid", "repeat": True,
                                       "shuffle": False, "equal_work": False}})
    assert cfg.loader.plan_params(40) == PlanParams(seed=7, seed_mode="pid", repeat=True,
                                                    shuffle=False, equal_work=False,
                                                    start_index=40)


@pytest.mark.parametrize(("field", "value", "message"), [
    ("repeat", "yes", "expected a bool, got 'yes' (str)"),
    ("shuffle", 1, "expected a bool, got 1 (int)"),
    ("seed", -1, "expected >= 0, got -1"),
    ("seed", 1.5, "expected an int, got 1.5"),
    ("seed_mode", "wall", "expected one of epoch, pid, got 'wall'"),
])
def test_errors_name_the_field_where_it_was_given(field, value, message):
    with pytest.raises(ConfigError, match=re.escape(f"loader.{field}: {message}")):
        config_from_dict({"data": {"paths": ["x"]}, "loader": {field: value}})
    with pytest.raises(ConfigError, match=re.escape(f"PlanParams.{field}: {message}")):
        PlanParams(**{field: value})


def test_plan_cli_defaults_are_trainings(tmp_path, capsys):
    write_wdinfo(str(tmp_path), [f"{i:02d}.tar" for i in range(11)], [4] * 11, ["image"])
    base = ["plan", str(tmp_path), "--world-size", "3", "--num-workers", "2", "--json"]

    def lists(*extra):
        assert main([*base, *extra]) == 0
        return [json.loads(x)["shards"] for x in capsys.readouterr().out.splitlines()]

    def expected(params):
        return [[f"{i:02d}.tar" for i in w.shards] for s in range(3)
                for w in assign_slot(11, 4, s, 3, 2, params)]

    assert lists() == expected(LoaderConfig().plan_params())
    assert lists("--repeat") == expected(PlanParams(repeat=True)) != lists()
    assert lists("--no-shuffle", "--no-repeat") == expected(PlanParams(shuffle=False))


def test_stream_plan_params_is_the_config_method():
    from ray_ingest.loader.ingest import plan_params

    cfg = config_from_dict({"data": {"paths": ["x"]}, "loader": {"seed": 3, "repeat": True}})
    assert plan_params(cfg, 9) == cfg.loader.plan_params(9)
