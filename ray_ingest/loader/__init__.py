"""The per-rank loader: :class:`~ray_ingest.loader.ingest.IngestLoader` and its stages.

Rows flow ``window`` (an execution's rows epoch by epoch) -> ``account`` (instrumentation
columns) -> ``skips`` (failed rows out, budgets) -> ``batcher`` (batches, padding) ->
``progress`` (what was consumed, into the read state) -> ``collate`` (torch) -> ``group``
(one rank of a parallel group decodes for all). ``checkpoint`` writes the read state per rank,
``clock`` times the stages. Only ``collate``, ``group`` and ``ingest`` import torch; none
imports Ray.
"""
