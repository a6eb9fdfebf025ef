"""Setting up the shared memory of one host's workers: the segment, its sockets, and who joins.

**Who shares memory.** Workers whose kernel boot id and mount namespace are equal see
the same ``/dev/shm`` (:func:`host_identity`). The leader creates the segment and the
socket in a directory of its own there (mode 0700) once every worker has arrived, members
attach and connect, proving it with the token they read from the segment, and the
directory is removed as soon as they all have: from then on the segment lives only in the
workers' mappings and nothing is left behind however a worker ends (only a leader killed
within those few setup messages would leave its directory).
Setup is collective over a gloo group; if it fails anywhere (no ``/dev/shm``, too little
room in it), every worker keeps gloo and the log says why.

**The segment.** A header of ``HEADER_BYTES`` (the magic number and the random token,
padded to a cache line), then the areas that :class:`~sparkdl.comm.shared_memory.SharedMemoryGroup`
reduces through. Kept apart from the collectives: setup runs once, over gloo and the file
system, and fails softly (a reason, not an error); the collectives run every step and
fail loudly.
"""

from __future__ import annotations

import hmac
import mmap
import os
import secrets
import shutil
import socket
import struct
import tempfile
from collections.abc import Sequence
from pathlib import Path

import torch
import torch.distributed as dist

SHM_DIR = "/dev/shm"
MAGIC = b"SDLSHM01"
TOKEN_BYTES = 32
HEADER_BYTES = 64  # the magic, the token, padding to a cache line
HELLO = struct.Struct(f"<{TOKEN_BYTES}sI")  # a member's token and local rank
#: The largest area: a tensor beyond it goes through in parts (two parities x (workers + 1) areas).
MAX_AREA_BYTES = 4 << 20


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


def all_agree(ok: bool, group: dist.ProcessGroup | None) -> bool:
    """Whether ``ok`` holds on every worker of ``group`` (collective)."""
    flag = torch.tensor([1 if ok else 0], dtype=torch.int32)
    dist.all_reduce(flag, op=dist.ReduceOp.MIN, group=group)
    return bool(flag.item())


class SegmentSetup:
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

    def run(self, ranks: Sequence[int], group: dist.ProcessGroup | None, directory: str) -> bool:
        """The collective setup, called by every worker of ``ranks`` in step: whether every
        one of them holds the segment and its sockets. Where not, this worker has let go of
        what it held (and ``reason`` says why, where it failed here)."""
        agreed = False
        try:
            # every worker is here before the segment exists: the window in which a killed
            # leader would leave its directory behind is the few gloo calls below, not the
            # time the others take to arrive
            all_agree(True, group)
            path = self.create(directory) if self.local_rank == 0 else ""
            shared = [path]
            dist.broadcast_object_list(shared, src=ranks[0], group=group)
            if self.local_rank != 0 and shared[0]:
                self.attach(shared[0])
            attached = all_agree(self.ok, group)
            self.remove_directory()  # every member has mapped the segment and connected (or failed)
            if attached and self.local_rank == 0:
                self.accept_members()
            agreed = attached and all_agree(self.ok, group)
        finally:
            self.remove_directory()
            self.close_listener()
            if not agreed:
                self.abandon()
        return agreed

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
            self.token = secrets.token_bytes(TOKEN_BYTES)
            self.segment[: len(MAGIC) + TOKEN_BYTES] = MAGIC + self.token
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
            if self.segment[: len(MAGIC)] != MAGIC:
                raise OSError("the segment does not start with sparkdl's magic number")
            token = bytes(self.segment[len(MAGIC) : len(MAGIC) + TOKEN_BYTES])
            peer = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            self.peers = [peer]
            peer.settimeout(self.timeout_s)
            peer.connect(os.path.join(directory, "socket"))
            peer.sendall(HELLO.pack(token, self.local_rank))
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
                    token, local_rank = HELLO.unpack(_receive_exactly(conn, HELLO.size))
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
