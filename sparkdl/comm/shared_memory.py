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

**Who shares memory.** Workers whose kernel boot id and mount namespace are equal see
the same ``/dev/shm``. The leader creates the segment and the socket in a directory of
its own there (mode 0700) once every worker has arrived, members attach and connect,
proving it with the token they read from the segment, and the directory is removed as
soon as they all have: from then on the segment lives only in the workers' mappings and
nothing is left behind however a worker ends (only a leader killed within those few
setup messages would leave its directory).
Setup is collective over a gloo group; if it fails anywhere (no ``/dev/shm``, too little
room in it), every worker keeps gloo and the log says why.
"""

from __future__ import annotations

import hmac
import logging
import mmap
import os
import secrets
import shutil
import socket
import struct
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path

import torch
import torch.distributed as dist

from sparkdl.errors import CollectiveError, CollectiveTimeout

log = logging.getLogger(__name__)

SHM_DIR = "/dev/shm"
_MAGIC = b"SDLSHM01"
_TOKEN_BYTES = 32
_HEADER_BYTES = 64  # the magic, the token, padding to a cache line
_HELLO = struct.Struct(f"<{_TOKEN_BYTES}sI")  # a member's token and local rank
#: The largest area: a tensor beyond it goes through in parts (two parities x (workers + 1) areas).
MAX_AREA_BYTES = 4 << 20
#: Below this many bytes read per worker, every worker sums every area itself (one barrier).
_DIRECT_BYTES = 1 << 20


def host_identity() -> str:
    """What is equal on two workers exactly when they see the same ``/dev/shm``: the kernel's
    boot id and the mount namespace; "" where that cannot be told (not Linux)."""
    try:
        boot = Path("/proc/sys/kernel/random/boot_id").read_text().strip()
        mounts = os.readlink("/proc/self/ns/mnt")
    except OSError:
        return ""
    return f"{boot} {mounts}"


def area_bytes_for(payload_bytes: int) -> int:
    """An area for a payload: the payload rounded up to a cache line, at most MAX_AREA_BYTES."""
    return max(64, min(MAX_AREA_BYTES, -(-payload_bytes // 64) * 64))


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
        data = torch.frombuffer(segment, dtype=torch.uint8, offset=_HEADER_BYTES, count=count)
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
        total = _HEADER_BYTES + 2 * (size + 1) * area
        setup = _Setup(local_rank, size, total, timeout_s)
        agreed = False
        try:
            # every worker is here before the segment exists: the window in which a killed
            # leader would leave its directory behind is the few gloo calls below, not the
            # time the others take to arrive
            _all_agree(True, group)
            path = setup.create(directory) if local_rank == 0 else ""
            shared = [path]
            dist.broadcast_object_list(shared, src=ranks[0], group=group)
            if local_rank != 0 and shared[0]:
                setup.attach(shared[0])
            attached = _all_agree(setup.ok, group)
            setup.remove_directory()  # every member has mapped the segment and connected (or failed)
            if attached and local_rank == 0:
                setup.accept_members()
            agreed = attached and _all_agree(setup.ok, group)
        finally:
            setup.remove_directory()
            setup.close_listener()
            if not agreed:
                setup.abandon()
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


def _all_agree(ok: bool, group: dist.ProcessGroup | None) -> bool:
    flag = torch.tensor([1 if ok else 0], dtype=torch.int32)
    dist.all_reduce(flag, op=dist.ReduceOp.MIN, group=group)
    return bool(flag.item())


class _Setup:
    """One worker's side of :meth:`SharedMemoryGroup.form`; records the first failure in ``reason``."""

    def __init__(self, local_rank: int, size: int, total: int, timeout_s: float) -> None:
        self.local_rank, self.size, self.total, self.timeout_s = local_rank, size, total, timeout_s
        self.segment: mmap.mmap | None = None
        self.token = b""
        self.peers: list[socket.socket] = []
        self.directory = ""
        self.listener: socket.socket | None = None
        self.reason = ""

    @property
    def ok(self) -> bool:
        return not self.reason

    def create(self, parent: str) -> str:
        """The leader: the segment and the listening socket in a private directory; its path."""
        try:
            self.directory = tempfile.mkdtemp(prefix="sparkdl-", dir=parent)  # mode 0700
            fd = os.open(os.path.join(self.directory, "segment"), os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
            try:
                os.posix_fallocate(fd, 0, self.total)  # fails now if the tmpfs is too small, not later
                self.segment = mmap.mmap(fd, self.total)
            finally:
                os.close(fd)
            self.token = secrets.token_bytes(_TOKEN_BYTES)
            self.segment[: len(_MAGIC) + _TOKEN_BYTES] = _MAGIC + self.token
            self.listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            self.listener.bind(os.path.join(self.directory, "socket"))
            self.listener.listen(self.size)
        except OSError as exc:
            self.reason = f"cannot create {self.total / 1e6:.1f} MB of shared memory in {parent}: {exc}"
            return ""
        return self.directory

    def attach(self, directory: str) -> None:
        """A member: map the leader's segment, connect, and prove it with the segment's token."""
        try:
            fd = os.open(os.path.join(directory, "segment"), os.O_RDWR)
            try:
                if os.fstat(fd).st_size != self.total:
                    raise OSError(f"the segment holds {os.fstat(fd).st_size} bytes, not {self.total}")
                self.segment = mmap.mmap(fd, self.total)
            finally:
                os.close(fd)
            if self.segment[: len(_MAGIC)] != _MAGIC:
                raise OSError("the segment does not start with sparkdl's magic number")
            token = bytes(self.segment[len(_MAGIC) : len(_MAGIC) + _TOKEN_BYTES])
            peer = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            self.peers = [peer]
            peer.settimeout(self.timeout_s)
            peer.connect(os.path.join(directory, "socket"))
            peer.sendall(_HELLO.pack(token, self.local_rank))
        except OSError as exc:
            self.reason = f"cannot attach to the shared memory in {directory}: {exc}"

    def accept_members(self) -> None:
        """The leader: one authenticated connection from each member, in local-rank order."""
        assert self.listener is not None
        self.listener.settimeout(self.timeout_s)
        members: dict[int, socket.socket] = {}
        try:
            for _ in range(self.size - 1):
                conn, _ = self.listener.accept()
                try:
                    conn.settimeout(self.timeout_s)
                    token, local_rank = _HELLO.unpack(_receive_exactly(conn, _HELLO.size))
                    if not hmac.compare_digest(token, self.token) or not 0 < local_rank < self.size:
                        raise OSError("a connection did not present the segment's token")
                    if local_rank in members:
                        raise OSError(f"local rank {local_rank} connected twice")
                except OSError:
                    conn.close()
                    raise
                members[local_rank] = conn
        except OSError as exc:
            self.reason = f"the host's workers did not all connect: {exc}"
        self.peers = [members[r] for r in sorted(members)]

    def remove_directory(self) -> None:
        """Unlink the segment and the socket's path (the listener still accepts what is queued)."""
        if self.directory:
            shutil.rmtree(self.directory, ignore_errors=True)
            self.directory = ""

    def close_listener(self) -> None:
        if self.listener is not None:
            self.listener.close()
            self.listener = None

    def abandon(self) -> None:
        for peer in self.peers:
            peer.close()
        self.peers = []
        if self.segment is not None:
            self.segment.close()
            self.segment = None


def _receive_exactly(conn: socket.socket, size: int) -> bytes:
    data = b""
    while len(data) < size:
        more = conn.recv(size - len(data))
        if not more:
            raise OSError(f"the connection closed after {len(data)} of {size} bytes")
        data += more
    return data


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
