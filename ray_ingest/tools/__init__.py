"""Offline tools behind the ``ray-ingest`` commands: ``shard``, ``synth``, ``convert``,
``index``, ``summary`` (info, cat), ``explore`` (notebooks), ``audit``, ``benchmark`` (with
``cpu_roles``: CPU by process role, and ``train_bench``: train-step time), and ``tasks``
(running their jobs here or as Ray tasks)."""
