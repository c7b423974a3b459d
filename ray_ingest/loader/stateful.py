"""The state contract every stateful stage of the loader keeps.

``get_state()`` returns the stage's position in its rank's stream as a small JSON-able dict;
``load_state(state)`` puts a freshly built stage (same configuration) at that position, so it
continues exactly as the saved one would. Rows a stage holds but has not handed on (a batcher's
partial batch, a window's rows of a later epoch, a leader's batch in flight) are never state:
nothing counts them as consumed, so a restored run reads them again (the plan re-reads every
unconsumed stream position). The loader's own state is the :class:`~ray_ingest.plan.state.
ReadState` (:class:`~ray_ingest.loader.progress.Progress`); the others are what each stage
keeps of its own. ``tests/support/roundtrip.py`` runs every stage through save and restore at
every position. No Ray, no torch.
"""

from __future__ import annotations

from typing import Any, Protocol, runtime_checkable

from ray_ingest.errors import StateError


@runtime_checkable
class Stateful(Protocol):
    """A stage with a position that a checkpoint keeps (see module docstring)."""

    def get_state(self) -> dict[str, Any]: ...

    def load_state(self, state: dict[str, Any]) -> None: ...


def require(state: dict[str, Any], where: str, *fields: str) -> list[Any]:
    """The ``fields`` of ``state``, strictly (a missing one is an error naming it)."""
    missing = [f for f in fields if f not in state]
    if missing:
        raise StateError(f"{where}.load_state: state lacks {', '.join(missing)} "
                         f"(got {sorted(state)}): not a state this stage saved")
    return [state[f] for f in fields]
