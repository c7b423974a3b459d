"""Row columns passed between the stream's stages, named once.

A row is one sample: provenance (where it comes from, where it sits in the rank's stream),
one binary column plus one extension column per modality (``image``, ``image__ext``, …), and
the bookkeeping columns the read and decode stages add. No Ray, no torch.
"""

from __future__ import annotations

#: Sample key (the member name without extension), shared by every modality of a sample.
KEY = "__key__"
#: The shard's ``data_list`` path.
SHARD = "__shard__"
#: Position of the sample in its shard.
INDEX = "__index__"
#: Shard number in the catalog.
SID = "__sid__"
#: Position in the rank's stream of its epoch: what the read state records as consumed.
SEQ = "__seq__"
#: Epoch the row was planned for (one execution reads several epochs in order).
EPOCH = "__epoch__"
#: Planned duplicate (cyclic-repeat extra, equal-work or batch padding): delivered, flagged.
PAD = "__pad__"
#: Aspect bucket of the shard ("" without bucketing).
BUCKET = "__bucket__"
#: Non-empty for a sample skipped under ``on_error=skip``: the reason.
ERROR = "__error__"
#: Seconds the read task spent per sample (read + align), for the stage breakdown.
T_READ = "__t_read__"
#: Payload bytes the read task read for the sample (all modalities): per-rank bytes read.
BYTES = "__bytes__"
#: CPU seconds the decode actor's thread spent per sample.
T_DECODE = "__t_decode__"
#: Id of the decode actor that produced the row (observed pool size).
ACTOR = "__actor__"
#: Ray node id of the decode actor that produced the row (reported by the actor itself).
NODE = "__node__"
#: Ray node id of the task that read the row.
READ_NODE = "__read_node__"

#: ``decode.device: cuda``: the primary image's placement (geometry.Placement.to_list), next
#: to its JPEG bytes, for the trainer's GPU decoder.
PLACEMENT = "__placement__"

#: Provenance carried unchanged from the read stage through decode to the batcher.
PROVENANCE = (KEY, SHARD, INDEX, SID, SEQ, EPOCH, PAD, BUCKET)
#: Bookkeeping dropped before a batch is assembled.
BOOKKEEPING = (ERROR, T_READ, BYTES, T_DECODE, ACTOR, NODE, READ_NODE)


def ext_column(modality: str) -> str:
    """Name of the column holding a modality's member extension (``image__ext``)."""
    return f"{modality}__ext"
