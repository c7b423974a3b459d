"""Job-pool controllers for tests (importable by the actor's process)."""

from __future__ import annotations

import asyncio

from ray_ingest.execution.service import DecodeService


class NoTicks(DecodeService):
    """A controller whose control loop never ticks after the first one (the one a join runs):
    whatever it does next happens in answer to its calls and its workers' events alone."""

    async def _run(self) -> None:
        await asyncio.sleep(3600)
