"""The catalog: which shards a job reads, as sorted, columnar, fingerprinted arrays.

``shard`` (one shard, a dataset's options), ``arrays`` (the Arrow/numpy columns), ``wdinfo``
(one ``wdinfo.json`` parsed; ``scan``, its vectorized reader), ``discovery`` (finding wdinfo
files, checking roots, counts from key indexes), ``catalog`` (:class:`Catalog`), ``load``
(:func:`load_catalog` and its cache). No Ray, no torch.
"""

from __future__ import annotations




