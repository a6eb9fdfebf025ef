"""All-reduce among the workers of one host through shared memory.

On a CPU, gloo all-reduces over TCP even between two processes of one host. For the
benchmarks' 85k-parameter model (340 KB of gradients) a step on two cores took 3.6 ms
with DDP over gloo against 1.1 ms without any exchange: gloo's chunked ring and the
wake-ups of its threads cost 1.4 ms of system time a step. Here the workers of a host
copy their gradients into one shared-memory segment and only wake each other over Unix
sockets, one byte each way per round: the same step took 1.5 ms, with bit-identical
results (``benchmarks/bench_shared_memory.py``).

**The segment.** A header (a magic number and a random token), then two *parities*,
each holding one area per worker and one result area, ``area_bytes`` each. A tensor
larger than an area goes through in area-sized parts, one *round* per part; round k
uses parity k % 2.

**A round.** Every worker copies its part into its own area and meets the others at a
barrier. With two workers, or a small part, every worker then sums all the areas in
rank order into its own tensor (one barrier; every worker adds the same numbers in the
same order, so every worker's result is the same, bit for bit). Otherwise each worker
sums its slice of the part into the result area, a second barrier, and every worker
copies the result (each worker reads about twice the part, not once per worker).

**Why two parities and no barrier at the end of a round.** A worker reads the memory of
round k only before it arrives at round k+1's first barrier, and it writes the memory
of round k+2 (the same parity) only after it has left round k+1's barriers, which no
worker leaves before every worker has arrived. So no write of round k+2 can meet a read
of round k.

**The barrier.** A star of Unix stream sockets: each member sends a byte to the host's
leader (its smallest rank) and waits for one back; the leader waits for every member's
byte, then answers each. Data never travels on them; a write before a ``send`` is seen
by the reader after its ``recv`` returns (both are system calls). Every wait has the
collective timeout. A worker that fails closes its sockets (at once when a barrier
fails, else in its teardown), so the others stop with an error naming it instead of
waiting out the timeout; a group whose barrier failed raises on every later call.

**Setup.** Only workers that see the same ``/dev/shm`` form a group, collectively over
gloo, and where that fails anywhere every worker keeps gloo and the log says why:
:mod:`sparkdl.comm.shared_memory_setup` (the segment, its sockets, who joins) does it,
:meth:`SharedMemoryGroup.form` and :func:`form_host_group` ask for it.
"""

from __future__ import annotations

import logging
import mmap
import socket
import time
from collections.abc import Sequence

import torch
import torch.distributed as dist

from sparkdl.comm.shared_memory_setup import (
    HEADER_BYTES,
    MAX_AREA_BYTES,
    SHM_DIR,
    SegmentSetup,
    area_bytes_for,
    host_identity,
)
from sparkdl.errors import CollectiveError, CollectiveTimeout

__all__ = [
    "MAX_AREA_BYTES",
    "SHM_DIR",
    "SharedMemoryGroup",
    "area_bytes_for",
    "form_host_group",
    "host_identity",
    "shared_memory_hook",
]

log = logging.getLogger(__name__)

#: Below this many bytes read per worker, every worker sums every area itself (one barrier).
_DIRECT_BYTES = 1 << 20


class SharedMemoryGroup:
    """Sum (and broadcast) CPU tensors among the workers of one host, in place.

    Every worker of the group calls the same operations on tensors of the same size and
    dtype, in the same order, as with any collective. Build it with :meth:`form`.
    """

    def __init__(
        self,
        segment: mmap.mmap,
        local_rank: int,
        area_bytes: int,
        peers: list[socket.socket],
        ranks: Sequence[int],
        timeout_s: float,
    ) -> None:
        self.local_rank = local_rank
        self.ranks = list(ranks)
        self.size = size = len(self.ranks)
        self._segment: mmap.mmap | None = segment
        self._peers = peers  # the leader: one socket per member, in local-rank order; a member: the leader's
        self._timeout_s = timeout_s
        count = 2 * (size + 1) * area_bytes
        data = torch.frombuffer(segment, dtype=torch.uint8, offset=HEADER_BYTES, count=count)
        self._areas: torch.Tensor | None = data.view(2, size + 1, area_bytes)
        self._typed: dict[torch.dtype, torch.Tensor] = {}
        self._round = 0
        self._broken: str | None = None  # why a barrier failed (or "closed"): every later call raises

    # -- collectives ------------------------------------------------------------------

    def all_reduce_(self, tensor: torch.Tensor) -> torch.Tensor:
        """Replace ``tensor`` by its sum over the group's workers; return it."""
        flat = _flat(tensor)
        areas = self._areas_of(flat.dtype)
        part = areas.shape[-1]
        for start in range(0, flat.numel(), part):
            self._sum_round(flat[start : start + part], areas[self._next_parity()])
        return tensor

    def broadcast_(self, tensor: torch.Tensor) -> torch.Tensor:
        """Replace ``tensor`` by the leader's (local rank 0) on every worker; return it."""
        flat = _flat(tensor)
        areas = self._areas_of(flat.dtype)
        part = areas.shape[-1]
        for start in range(0, flat.numel(), part):
            piece = flat[start : start + part]
            result = areas[self._next_parity(), self.size, : piece.numel()]
            if self.local_rank == 0:
                result.copy_(piece)
            self._barrier()
            if self.local_rank != 0:
                piece.copy_(result)
        return tensor

    def _sum_round(self, piece: torch.Tensor, areas: torch.Tensor) -> None:
        n, me, k = self.size, self.local_rank, piece.numel()
        areas[me, :k].copy_(piece)
        self._barrier()
        if n == 2 or n * k * piece.element_size() <= _DIRECT_BYTES:
            torch.add(areas[0, :k], areas[1, :k], out=piece)
            for other in range(2, n):
                piece.add_(areas[other, :k])
            return
        lo, hi = k * me // n, k * (me + 1) // n
        mine = areas[n, lo:hi]
        torch.add(areas[0, lo:hi], areas[1, lo:hi], out=mine)
        for other in range(2, n):
            mine.add_(areas[other, lo:hi])
        self._barrier()
        piece.copy_(areas[n, :k])

    def _areas_of(self, dtype: torch.dtype) -> torch.Tensor:
        if self._areas is None:
            raise CollectiveError(f"the shared-memory group cannot be used: {self._broken}")
        typed = self._typed.get(dtype)
        if typed is None:
            typed = self._typed[dtype] = self._areas.view(dtype)
        return typed

    def _next_parity(self) -> int:
        parity = self._round & 1
        self._round += 1
        return parity

    def _barrier(self) -> None:
        """Meet every worker of the group, within one collective timeout. A barrier that fails
        breaks the group for good: its sockets close at once (so the others stop too, rather
        than pair this round's bytes with the next one's) and every later call raises."""
        if self._broken is not None:
            raise CollectiveError(f"the shared-memory group failed earlier: {self._broken}")
        deadline = time.monotonic() + self._timeout_s
        try:
            if self.local_rank == 0:
                for member, peer in enumerate(self._peers, start=1):
                    self._expect_byte(peer, member, deadline)
                for member, peer in enumerate(self._peers, start=1):
                    self._send_byte(peer, member)
            else:
                self._send_byte(self._peers[0], 0)
                self._expect_byte(self._peers[0], 0, deadline)
        except CollectiveError as exc:
            self._broken = str(exc)
            self._close_sockets()
            raise

    def _send_byte(self, peer: socket.socket, local_rank: int) -> None:
        try:
            peer.sendall(b"\0")
        except OSError as exc:
            raise self._left(local_rank, exc) from None

    def _expect_byte(self, peer: socket.socket, local_rank: int, deadline: float) -> None:
        try:
            peer.settimeout(max(deadline - time.monotonic(), 1e-3))
            got = peer.recv(1)
        except TimeoutError:
            raise CollectiveTimeout(
                f"shared-memory all-reduce: rank {self.ranks[self.local_rank]} waited "
                f"{self._timeout_s:g}s for rank {self.ranks[local_rank]} of the same host, which "
                "neither arrived nor failed; raise runtime.collective_timeout_s if one step can take "
                "that long",
                setting="runtime.collective_timeout_s",
                limit_s=self._timeout_s,
            ) from None
        except OSError as exc:
            raise self._left(local_rank, exc) from None
        if not got:
            raise self._left(local_rank, None)

    def _left(self, local_rank: int, cause: OSError | None) -> CollectiveError:
        how = f" ({cause})" if cause is not None else ""
        return CollectiveError(
            f"shared-memory all-reduce: rank {self.ranks[local_rank]} of the same host closed its "
            f"connection in the middle of a step{how}; it failed or stopped, and its own error says why"
        )

    # -- lifetime ---------------------------------------------------------------------

    def _close_sockets(self) -> None:
        for peer in self._peers:
            peer.close()
        self._peers = []

    def close(self) -> None:
        """Close the sockets (the others then see this worker leave) and let go of the segment.

        It is not unmapped here: a thread may still be copying into it (a hierarchy's hook
        thread that outlived its join). The segment is unmapped when the last tensor over
        it is freed, so no access can ever meet an unmapped page."""
        self._close_sockets()
        self._broken = self._broken or "closed"
        self._typed.clear()
        self._areas = None
        self._segment = None

    @classmethod
    def form(
        cls,
        ranks: Sequence[int],
        rank: int,
        group: dist.ProcessGroup | None,
        payload_bytes: int,
        timeout_s: float,
        directory: str = SHM_DIR,
    ) -> SharedMemoryGroup | None:
        """Set up the group of ``ranks`` (global ranks, ascending; ``group`` holds exactly them),
        called by each of them in step; None on every one of them where it cannot be set up.

        Args:
            payload_bytes: the largest tensor expected (the areas are sized for it, up to
                MAX_AREA_BYTES; larger tensors go through in parts).
        """
        local_rank, size = list(ranks).index(rank), len(ranks)
        if size < 2:
            raise ValueError(f"a shared-memory group needs 2 workers or more, got ranks {list(ranks)}")
        area = area_bytes_for(payload_bytes)
        setup = SegmentSetup(local_rank, size, HEADER_BYTES + 2 * (size + 1) * area, timeout_s)
        agreed = setup.run(ranks, group, directory)
        if not agreed:
            if local_rank == 0 or setup.reason:
                log.warning(
                    "rank %d: workers of one host exchange through gloo, not shared memory: %s "
                    "(set runtime.shared_memory = false to skip trying)",
                    rank,
                    setup.reason or "another worker of this host could not attach",
                )
            return None
        assert setup.segment is not None
        log.info("rank %d: shared memory with ranks %s (%d KB areas)", rank, list(ranks), area // 1024)
        return cls(setup.segment, local_rank, area, setup.peers, ranks, timeout_s)


def _flat(tensor: torch.Tensor) -> torch.Tensor:
    if tensor.device.type != "cpu" or not tensor.is_contiguous():
        raise CollectiveError(
            f"shared-memory all-reduce needs a contiguous CPU tensor, got one on {tensor.device} "
            f"(contiguous: {tensor.is_contiguous()}); this is a sparkdl bug, please report it"
        )
    return tensor.view(-1)


def form_host_group(
    rank: int, world_size: int, group: dist.ProcessGroup | None, payload_bytes: int, timeout_s: float
) -> SharedMemoryGroup | None:
    """The shared-memory group of this worker's host, where every worker of the world shares
    one (the single-host case: local mode, one machine's executors); None otherwise.

    Collective over ``group`` (the gloo control group): every rank calls it in step."""
    identities: list[str] = [""] * world_size
    dist.all_gather_object(identities, host_identity(), group=group)
    if not identities[0] or len(set(identities)) != 1:
        return None
    return SharedMemoryGroup.form(list(range(world_size)), rank, group, payload_bytes, timeout_s)


def shared_memory_hook(
    state: SharedMemoryGroup, bucket: dist.GradBucket
) -> torch.futures.Future[torch.Tensor]:
    """A DDP communication hook: each bucket's gradients averaged through shared memory."""
    buffer = bucket.buffer()
    buffer.div_(state.size)
    state.all_reduce_(buffer)
    future: torch.futures.Future[torch.Tensor] = torch.futures.Future()
    future.set_result(buffer)
    return future


# DDP checks a hook's annotations against the classes themselves, not their names
shared_memory_hook.__annotations__ = {
    "state": SharedMemoryGroup,
    "bucket": dist.GradBucket,
    "return": torch.futures.Future[torch.Tensor],
}
