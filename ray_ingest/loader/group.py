"""Group share: one rank of a parallel group reads and decodes, every rank gets its batches.

All ranks of a tensor/context-parallel group train on identical batches. Instead of G pipelines
reading and decoding the same stream (G x the decode CPU and the storage reads), the group's
leader (its first rank) runs the slot's pipeline and broadcasts every batch inside the group,
as Megatron-LM's ``tensor_parallel.broadcast_data`` does, but for the loader's whole batch:
tensors, provenance and the read-state progress that goes with it. The followers apply the
same progress, so every rank of the group saves the identical read state.

One message per batch, over ``torch.distributed`` on a process group of the group's ranks
(gloo on CPU; NCCL on the device, so the batch crosses NVLink once instead of every rank
decoding it): a 2-int64 frame (kind, header length), a JSON header (no pickle) and then each
tensor. Every wait is bounded by the process group's timeout and fails with one line naming
the group, its leader, the epoch and the batch. Imports torch, not Ray.
"""

from __future__ import annotations

import contextlib
import datetime
import json
from collections.abc import Iterator, Sequence
from typing import Any, Protocol

import attrs
import numpy as np

from ray_ingest.errors import GroupError
from ray_ingest.execution.handoff import Handoff
from ray_ingest.loader.collate import Batch
from ray_ingest.loader.stateful import require
from ray_ingest.plan.topology import Topology

Skip = tuple[int, int, str]

#: Message kinds (the first int of a frame).
BATCH, END, ERROR = 1, 2, 3
KINDS = {BATCH: "batch", END: "end of epoch", ERROR: "error"}


class Channel(Protocol):
    """Moves one message from the group's leader to its other ranks, in order."""

    #: This rank sends (the group's first rank) or receives.
    leader: bool
    #: ``group 3 (ranks 6-7, leader 6)``: for messages.
    name: str

    def send(self, kind: int, header: dict[str, Any], tensors: Sequence[Any]) -> None: ...

    def recv(self) -> tuple[int, dict[str, Any], list[Any]]: ...


@attrs.define
class Message:
    """What a follower received: a batch with its progress, an epoch end, or the leader's error."""

    kind: int
    epoch: int
    batch: Batch | None = None
    #: Stream positions the batch consumed (pads -1; skipped samples included).
    positions: list[int] = attrs.field(factory=list)
    error: str = ""


class GroupShare:
    """The stage: encodes batches on the leader, decodes them on the followers.

    Args:
        channel: the group's transport (:func:`dist_channel` inside Ray Train).
        device: where followers' tensors go (the rank's device).
    """

    def __init__(self, channel: Channel, device: Any = None):
        self.channel, self.device = channel, device
        self.leader = channel.leader
        self.name = channel.name
        #: Epoch and batch of the next message (for error messages).
        self.epoch = self.step = 0

    def get_state(self) -> dict[str, Any]:
        """The epoch and batch of the next message (a batch in flight is not consumed: the
        leader makes it again after a restore)."""
        return {"epoch": self.epoch, "step": self.step}

    def load_state(self, state: dict[str, Any]) -> None:
        """Expect (follower) or send (leader) the message of ``epoch``, ``step`` next."""
        epoch, step = require(state, "GroupShare", "epoch", "step")
        self.epoch, self.step = int(epoch), int(step)

    # --- leader --------------------------------------------------------------------------
    def send_batch(self, batch: Batch, positions: Sequence[int]) -> None:
        header, tensors = encode_batch(batch, positions)
        self._send(BATCH, batch.epoch, batch.step_in_epoch, header, tensors)

    def send_end(self, epoch: int) -> None:
        self._send(END, epoch, self.step, {"epoch": epoch}, [])

    def send_error(self, epoch: int, exc: BaseException) -> None:
        """Tell the followers why no batch comes (best effort: the leader raises anyway)."""
        msg = str(exc).split("\n", 1)[0]
        with contextlib.suppress(GroupError):
            self._send(ERROR, epoch, self.step,
                       {"epoch": epoch, "error": f"{type(exc).__name__}: {msg}"}, [])

    def _send(self, kind: int, epoch: int, step: int, header: dict[str, Any],
              tensors: Sequence[Any]) -> None:
        self.epoch, self.step = epoch, step
        try:
            self.channel.send(kind, header, tensors)
        except GroupError:
            raise
        except Exception as exc:
            raise GroupError(f"{self.name}: sending the {KINDS[kind]} of epoch {epoch} batch "
                             f"{step} failed (a follower is gone?): {_first_line(exc)}") from exc
        if kind == BATCH:
            self.step = step + 1
        elif kind == END:
            self.step = 0

    # --- followers -----------------------------------------------------------------------
    def receive(self, epoch: int) -> Message:
        """The next message for ``epoch``; a leader error or a lost leader raises GroupError."""
        self.epoch = epoch
        try:
            kind, header, tensors = self.channel.recv()
        except GroupError:
            raise
        except Exception as exc:
            raise GroupError(f"{self.name}: no message from the leader for epoch {epoch} batch "
                             f"{self.step} (the leader failed, is gone, or waited longer than "
                             f"loader.group_timeout_s): {_first_line(exc)}") from exc
        got = int(header.get("epoch", -1))
        if kind == ERROR:
            raise GroupError(f"{self.name}: the leader failed at epoch {got} batch {self.step}: "
                             f"{header.get('error', '?')}")
        if got != epoch or kind not in (BATCH, END):
            raise GroupError(f"{self.name}: expected a message of epoch {epoch} batch "
                             f"{self.step}, got a {KINDS.get(kind, kind)} of epoch {got}: the "
                             f"group's ranks are out of step")
        if kind == END:
            self.step = 0
            return Message(END, epoch)
        batch, positions = decode_batch(header, tensors, self.device)
        self.step = batch.step_in_epoch + 1
        return Message(BATCH, epoch, batch, positions)


def lead(share: GroupShare, made: Iterator[tuple[Batch, list[int]]], epoch: int) -> Handoff:
    """The leader's ``(batch, positions)`` of ``epoch``, each sent to the group as it is made.

    Made one ahead in a helper thread: batch k+1 is made and broadcast while batch k trains.
    One message is in flight at a time, as on the followers (:func:`follow`), so a train loop
    that stops after batch k leaves no broadcast half done: the k+1 in flight completes on every
    rank of the group and is dropped unrecorded everywhere. Close the hand-off when done.
    """

    def sent() -> Iterator[tuple[Batch, list[int]]]:
        for batch, positions in made:
            share.send_batch(batch, positions)
            yield batch, positions
        share.send_end(epoch)

    return Handoff(sent(), None, ahead=True)


def follow(share: GroupShare, epoch: int) -> Handoff:
    """A follower's messages of ``epoch`` from the leader, up to and including its end; the
    next one is received in a helper thread while this one trains. Close the hand-off when
    done."""

    def received() -> Iterator[Message]:
        while True:
            msg = share.receive(epoch)
            yield msg
            if msg.batch is None:
                return

    return Handoff(received(), None, ahead=True)


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip().split("\n", 1)[0]
    return f"{type(exc).__name__}: {text}" if text else type(exc).__name__


# --- the wire format -------------------------------------------------------------------------
def encode_batch(batch: Batch, positions: Sequence[int]) -> tuple[dict[str, Any], list[Any]]:
    """A batch as a JSON-able header and the tensors that follow it (no pickle).

    Tensors travel as they are (on the device under NCCL). A list field travels element by
    element: numpy arrays (variable-shape embeddings, masks) and bytes as one uint8 tensor
    each, with their dtype and shape in the header; text, numbers, JSON documents and None
    inline in the header.
    """
    import torch

    tensors: list[Any] = []
    fields: list[list[Any]] = []
    for name, value in batch.data.items():
        if isinstance(value, torch.Tensor):
            fields.append([name, "tensor", str(value.dtype).removeprefix("torch."),
                           list(value.shape)])
            tensors.append(value.contiguous())
            continue
        entries: list[list[Any]] = []
        for i, v in enumerate(value):
            if isinstance(v, np.ndarray) and v.dtype != object:
                a = np.ascontiguousarray(v)
                entries.append(["a", a.dtype.str, list(a.shape)])
                tensors.append(torch.from_numpy(a.reshape(-1).view(np.uint8).copy()))
            elif isinstance(v, (bytes, bytearray, memoryview)):
                entries.append(["b", len(v)])
                tensors.append(torch.frombuffer(bytearray(v), dtype=torch.uint8)
                               if len(v) else torch.empty(0, dtype=torch.uint8))
            else:
                _check_json(v, name, i)
                entries.append(["j", v])
        fields.append([name, "list", entries])
    header = {
        "epoch": batch.epoch, "step": batch.step_in_epoch, "bucket": batch.bucket,
        "sample_keys": batch.sample_keys, "captions": batch.captions, "sids": batch.sids,
        "indices": batch.indices, "pads": batch.pads,
        "skipped": [list(s) for s in batch.skipped], "present": batch.present,
        "positions": [int(p) for p in positions], "fields": fields,
    }
    return header, tensors


def _check_json(value: Any, name: str, row: int) -> None:
    try:
        json.dumps(value)
    except (TypeError, ValueError):
        raise GroupError(f"group share: batch field {name!r} row {row} is a "
                         f"{type(value).__name__}, which travels to the group only as an array, "
                         f"bytes, text, a number or a JSON document") from None


def decode_batch(header: dict[str, Any], tensors: list[Any], device: Any = None
                 ) -> tuple[Batch, list[int]]:
    """Inverse of :func:`encode_batch` (tensors moved to ``device``)."""
    data: dict[str, Any] = {}
    it = iter(tensors)
    for field in header["fields"]:
        name, form = field[0], field[1]
        if form == "tensor":
            t = next(it)
            data[name] = t if device is None or t.device == _device(device) else t.to(device)
            continue
        values: list[Any] = []
        for entry in field[2]:
            if entry[0] == "a":
                values.append(np.frombuffer(next(it).cpu().numpy().tobytes(),
                                            dtype=np.dtype(entry[1])).reshape(entry[2]))
            elif entry[0] == "b":
                values.append(next(it).cpu().numpy().tobytes())
            else:
                values.append(entry[1])
        data[name] = values
    batch = Batch(data=data, sample_keys=list(header["sample_keys"]), captions=header["captions"],
                  sids=list(header["sids"]), indices=list(header["indices"]),
                  pads=list(header["pads"]), bucket=header["bucket"], epoch=header["epoch"],
                  step_in_epoch=header["step"],
                  skipped=[(int(a), int(b), str(c)) for a, b, c in header["skipped"]],
                  present={k: list(v) for k, v in header.get("present", {}).items()})
    return batch, list(header["positions"])


def _device(device: Any) -> Any:
    import torch

    return torch.device(device)


def tensor_specs(header: dict[str, Any]) -> list[tuple[str, list[int]]]:
    """(torch dtype name, shape) of every tensor a header announces, in wire order."""
    specs: list[tuple[str, list[int]]] = []
    for field in header["fields"]:
        if field[1] == "tensor":
            specs.append((field[2], field[3]))
            continue
        for entry in field[2]:
            if entry[0] == "a":
                specs.append(("uint8", [int(np.prod(entry[2], dtype=np.int64))
                                        * np.dtype(entry[1]).itemsize]))
            elif entry[0] == "b":
                specs.append(("uint8", [int(entry[1])]))
    return specs


# --- torch.distributed transport ---------------------------------------------------------------
class DistChannel:
    """Broadcasts inside the group's own process group (see module docstring).

    Args:
        group: the process group of the group's ranks.
        ranks: their global ranks; ``ranks[0]`` is the leader.
        rank: this rank.
        device: tensors travel on it under NCCL; on the CPU under gloo.
    """

    def __init__(self, group: Any, ranks: Sequence[int], rank: int, device: Any = None):
        import torch
        import torch.distributed as dist

        self.group, self.ranks, self.src = group, list(ranks), ranks[0]
        self.leader = rank == self.src
        self.name = f"group {rank // len(ranks)} (ranks {ranks[0]}-{ranks[-1]}, leader {self.src})"
        nccl = dist.get_backend(group) == "nccl"
        self.wire = torch.device(device) if nccl and device is not None else torch.device("cpu")
        self._dist, self._torch = dist, torch

    def _bcast(self, t: Any) -> Any:
        self._dist.broadcast(t, src=self.src, group=self.group)
        return t

    def send(self, kind: int, header: dict[str, Any], tensors: Sequence[Any]) -> None:
        torch = self._torch
        raw = json.dumps(header, separators=(",", ":")).encode()
        self._bcast(torch.tensor([kind, len(raw)], dtype=torch.int64, device=self.wire))
        self._bcast(torch.frombuffer(bytearray(raw), dtype=torch.uint8).to(self.wire))
        for t in tensors:
            self._bcast(t if t.device == self.wire else t.to(self.wire))

    def recv(self) -> tuple[int, dict[str, Any], list[Any]]:
        torch = self._torch
        frame = self._bcast(torch.empty(2, dtype=torch.int64, device=self.wire)).tolist()
        raw = self._bcast(torch.empty(frame[1], dtype=torch.uint8, device=self.wire))
        header = json.loads(raw.cpu().numpy().tobytes())
        tensors = [self._bcast(torch.empty(shape, dtype=getattr(torch, dt), device=self.wire))
                   for dt, shape in (tensor_specs(header) if frame[0] == BATCH else ())]
        return int(frame[0]), header, tensors


def dist_channel(topology: Topology, device: Any = None, timeout_s: float | None = None
                 ) -> DistChannel:
    """This rank's channel to its group, inside an initialised ``torch.distributed`` world.

    Collective: every rank of the world calls it (``new_group`` creates every group's process
    group, in the same order, on every rank). The group's collectives time out after
    ``timeout_s`` (None: the default process group's timeout).
    """
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized()):
        raise GroupError("group share needs torch.distributed (Ray Train's TorchTrainer sets it "
                         "up); set loader.group_share: off to decode on every rank")
    g, world = topology.group_size, topology.world_size
    if dist.get_world_size() != world:
        raise GroupError(f"group share: torch.distributed world size {dist.get_world_size()} "
                         f"!= topology world_size {world}")
    kw: dict[str, Any] = {"backend": dist.get_backend()}
    if timeout_s is not None:
        kw["timeout"] = datetime.timedelta(seconds=timeout_s)
    groups = [dist.new_group(list(range(s * g, (s + 1) * g)), **kw) for s in range(world // g)]
    ranks = list(range(topology.slot * g, (topology.slot + 1) * g))
    return DistChannel(groups[topology.slot], ranks, topology.rank, device)
