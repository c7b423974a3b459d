"""Executions: what reads and decodes a rank's planned read items, in stream order.

``read`` (one read item -> raw row blocks), ``local`` (read + decode in this process),
``threads`` (``decode.compute: threads``), ``headstart`` (an execution's first items decoded
here while its pool starts), ``handoff`` (the execution protocol, bounded waits), ``raydata``
(the Ray Data edge: decode actors or tasks), ``opener`` (which of them, ``decode.compute``
resolved once). Only ``raydata`` and ``datasource`` import Ray.
"""
