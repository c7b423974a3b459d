"""Executions: what reads and decodes a rank's planned read items, in stream order.

``read`` (one read item -> raw row blocks), ``local`` (read + decode in this process),
``threads`` (``decode.compute: threads``), ``pool`` (``actors``, ``tasks``, ``process``: Ray
workers of the rank's own), ``headstart`` (an execution's first items decoded here while its
pool starts), ``handoff`` (the execution protocol, bounded waits), ``raydata`` (the Ray Data
edge, with ``loader.fused_read: false`` and for ``read_twin_tars``), ``opener`` (which of
them, ``decode.compute`` resolved once). Only ``pool`` and ``raydata`` import Ray.
"""
