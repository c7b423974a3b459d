"""The planning settings, declared once: seed, seed_mode, shuffle, repeat, equal_work.

:class:`PlanSettings` is the one definition (defaults, types, validation). The YAML
``loader`` section (:class:`ray_ingest.config.LoaderConfig`), the planner's
:class:`ray_ingest.plan.assign.PlanParams` and ``ray-ingest plan`` all build on it, so their
defaults cannot drift apart: what ``ray-ingest plan`` prints without flags is what training
reads. Errors name the field under the class's ``SECTION`` (``loader.repeat``,
``PlanParams.repeat``).

No Ray, no torch.
"""

from __future__ import annotations

from typing import Any

import attrs

from ray_ingest.errors import ConfigError
from ray_ingest.plan.topology import check_int

#: Valid ``seed_mode`` values: ``epoch`` (default, reshuffles per epoch) and ``pid`` (bit-exact).
SEED_MODES = ("epoch", "pid")


def _where(inst: Any, attribute: attrs.Attribute) -> str:
    return f"{getattr(type(inst), 'SECTION', type(inst).__name__)}.{attribute.name}"


def check_seed_mode(field: str, value: object) -> str:
    """Validate a seed mode name, listing the valid ones in the error."""
    if value not in SEED_MODES:
        raise ConfigError(f"{field}: expected one of {', '.join(SEED_MODES)}, got {value!r}")
    return str(value)


def check_bool(field: str, value: object) -> bool:
    """Validate a bool (``0``/``1`` and strings rejected), naming ``field``."""
    if not isinstance(value, bool):
        raise ConfigError(f"{field}: expected a bool, got {value!r} ({type(value).__name__})")
    return value


def _seed(inst: Any, attribute: attrs.Attribute, value: Any) -> None:
    check_int(_where(inst, attribute), value, 0)


def _seed_mode(inst: Any, attribute: attrs.Attribute, value: Any) -> None:
    check_seed_mode(_where(inst, attribute), value)


def _bool(inst: Any, attribute: attrs.Attribute, value: Any) -> None:
    check_bool(_where(inst, attribute), value)


def _opt_bool(inst: Any, attribute: attrs.Attribute, value: Any) -> None:
    if value is not None:
        check_bool(_where(inst, attribute), value)


@attrs.frozen
class PlanSettings:
    """What a run chooses about its shard order (everything but topology, epoch and data)."""

    SECTION = "PlanSettings"
    #: Root seed; every random choice derives from it (only ``epoch`` mode uses it to plan).
    seed: int = attrs.field(default=0, validator=_seed)
    #: ``epoch`` (hash-seeded per epoch) or ``pid`` (PiD's ``ShardlistBasic`` lists bit for bit).
    seed_mode: str = attrs.field(default="epoch", validator=_seed_mode)
    #: Shuffle each worker list (PiD ``shuffle``).
    shuffle: bool = attrs.field(default=True, validator=_bool)
    #: Extend cyclically to a multiple of ``slots * workers`` (PiD ``repeat_url``); the
    #: extras are planned duplicates. Unset: on in ``pid`` mode (so ``seed_mode: pid`` alone
    #: gives PiD's lists), off in ``epoch`` mode (every shard once per epoch).
    repeat: bool = attrs.field(default=None, validator=_opt_bool)
    #: Pad every data-parallel slot to the same number of samples per epoch.
    equal_work: bool = attrs.field(default=True, validator=_bool)

    def __attrs_post_init__(self) -> None:
        if self.repeat is None:
            object.__setattr__(self, "repeat", self.seed_mode == "pid")

    def settings(self) -> dict[str, Any]:
        """The five settings as a plain dict (for :class:`PlanParams` and read states)."""
        return {name: getattr(self, name) for name in SETTING_NAMES}


#: Field names of :class:`PlanSettings`, in declaration order.
SETTING_NAMES = tuple(a.name for a in attrs.fields(PlanSettings))
#: The defaults every consumer shares (training, the planner, ``ray-ingest plan``).
DEFAULT_SETTINGS = PlanSettings()
