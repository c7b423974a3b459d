"""Twin tars on storage: reading and writing the tars themselves.

``tario`` (tar header walker, key index format), ``twin`` (lockstep expansion of a shard's
modality tars: strict, merge, index), ``remote`` (fsspec reads that retry and resume at the
byte offset), ``reader`` (one shard slice -> aligned rows), ``layout`` (names and folders of a
dataset), ``fsio`` (URLs, atomic writes), ``writer`` (one twin shard written), ``dataset``
(whole datasets written: shard jobs, wdinfo, the output folder). No Ray, no torch.
"""
