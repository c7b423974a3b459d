"""Offline tools behind the ``ray-ingest`` commands: ``shard``, ``synth``, ``convert``,
``index``, ``summary`` (info, cat), ``explore`` (notebooks), ``audit``, ``benchmark``, and
``tasks`` (running their jobs here or as Ray tasks)."""
