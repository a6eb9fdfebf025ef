"""Shared memory between the parameter server and the workers of the driver's own host.

A worker on another host reaches the server over its authenticated TCP framing; one that
runs on the driver's host (local mode, a single-node cluster, an executor beside the
driver) still paid for a loopback socket: the payload copied into the kernel and out
again, hashed on both sides, every step, in both directions. On the strategies
benchmark's two local workers the server's round trip took longer than the step itself.

**The segment.** The server creates one anonymous ``memfd`` (never a file in
``/dev/shm``: nothing is left behind however the driver ends) holding a header (a magic
number and a random token) and ``slots`` *areas*, each a push area (a gradient, plain or
compressed) and a weights area (a pull's answer). Pages are touched only as areas are
used, so an idle slot costs address space, not memory. The segment is sealed against
resizing: a process that shrank it would make the server's next write a SIGBUS.

**Who attaches.** The kernel's boot id and mount namespace
(:func:`sparkdl.comm.shared_memory.host_identity`) say first whether to try. A worker
then opens ``/proc/<driver pid>/fd/<fd>``, which the kernel allows only to a process that
may read the driver's memory anyway (its user, or root) and that sees the driver's PID: a
worker in another PID namespace finds no such process, or another one. So it checks that
the path names the server's memfd and that the header's token is the one its endpoint
carries (the endpoint travels inside the task spec, with the secret): a recycled PID or
fd never maps someone else's memory. Anything that fails leaves that worker on its socket.

**Who uses an area.** The server hands one area to each connection that asks for one in
its authenticated HELLO (while any are free) and takes it back when the connection ends;
a freed area is handed out last, not next. Every frame still crosses the authenticated
socket: a PUSH or PULL that names its connection's area says "the payload is there, this
many bytes" instead of carrying it, and the server answers a PULL by writing the weights
into the area and sending only the WEIGHTS header. The worker writes its push area only
before its PUSH and reads its weights area only after the WEIGHTS answer; the server
reads the push area while it handles the PUSH and writes the weights area while it
answers the PULL, and a connection's requests are answered in order. The push and weights
parts are apart, so push_pull's PUSH and the PULL right behind it never share memory. A
frame that names another connection's area closes the connection: that catches mistakes.
It is no wall: every attached worker maps the whole segment, and a process of the
driver's user could write any area (as it could read or write the driver's memory).

Pure memory: no sockets here (:mod:`sparkdl.services.ps.server` and :mod:`sparkdl.services.ps.client` speak).
"""

from __future__ import annotations

import collections
import dataclasses
import fcntl
import hmac
import logging
import mmap
import os
import secrets
import threading

import torch

from sparkdl.comm.shared_memory import host_identity

log = logging.getLogger(__name__)

_MAGIC = b"SDLPSAR1"
_TOKEN_BYTES = 32
_HEADER_BYTES = 64  # the magic, the token, padding to a cache line
_ALIGN = 64
_NAME = "sparkdl-ps-areas"


def shared_memory_supported() -> bool:
    """Whether this platform can make and share the segment (Linux: memfd, seals, /proc)."""
    return hasattr(os, "memfd_create") and hasattr(fcntl, "F_ADD_SEALS") and bool(host_identity())


def _aligned(nbytes: int) -> int:
    return max(_ALIGN, -(-nbytes // _ALIGN) * _ALIGN)


def slot_bytes(push_bytes: int, weights_bytes: int) -> int:
    """The memory one area takes: its push and weights parts, each cache-line aligned."""
    return _aligned(push_bytes) + _aligned(weights_bytes)


@dataclasses.dataclass(frozen=True)
class AreasInfo:
    """Where a worker finds the server's segment; shipped inside the endpoint."""

    host: str  # host_identity() of the driver
    pid: int
    fd: int
    token: bytes
    slots: int
    push_bytes: int
    weights_bytes: int

    @property
    def size(self) -> int:
        return _HEADER_BYTES + self.slots * (self.push_bytes + self.weights_bytes)

    def __repr__(self) -> str:  # never print the token
        return (
            f"AreasInfo(pid {self.pid}, {self.slots} slots of {self.push_bytes}+{self.weights_bytes} bytes)"
        )


class _Segment:
    """A mapped segment's areas: typed views of one slot's push and weights memory."""

    def __init__(self, mapping: mmap.mmap, info: AreasInfo) -> None:
        self.info = info  # the tensors below keep ``mapping`` alive
        self._bytes = torch.frombuffer(
            mapping, dtype=torch.uint8, offset=_HEADER_BYTES, count=info.size - _HEADER_BYTES
        )
        self._slots = self._bytes.view(info.slots, info.push_bytes + info.weights_bytes)

    def push_area(self, slot: int, nbytes: int) -> torch.Tensor:
        """The first ``nbytes`` of ``slot``'s push area, as bytes."""
        if nbytes > self.info.push_bytes:
            raise ValueError(f"{nbytes} bytes do not fit a push area of {self.info.push_bytes}")
        return self._slots[slot, :nbytes]

    def weights_area(self, slot: int, numel: int, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """``numel`` values of ``dtype`` at the start of ``slot``'s weights area."""
        nbytes = numel * dtype.itemsize
        if nbytes > self.info.weights_bytes:
            raise ValueError(f"{nbytes} bytes do not fit a weights area of {self.info.weights_bytes}")
        start = self.info.push_bytes
        return self._slots[slot, start : start + nbytes].view(dtype)

    def close(self) -> None:
        """Drop this object's hold on the mapping. It is unmapped once no tensor views it
        either: an explicit ``munmap`` would leave pulled weights that still view an area
        pointing at nothing (torch keeps the mapping object alive, not its memory)."""
        self._slots = self._bytes = torch.empty(0, dtype=torch.uint8)


class ServerAreas(_Segment):
    """The server's segment and which areas are free; thread-safe hand-out.

    Args:
        slots: areas to create (connections that can use shared memory at once).
        push_bytes: the largest push payload a slot takes (the server's frame cap).
        weights_bytes: the largest weights payload (4 bytes per value of the largest shard).

    Raises:
        OSError: the memfd could not be created, sized or sealed (no memory, an old kernel).
    """

    def __init__(self, slots: int, push_bytes: int, weights_bytes: int) -> None:
        fd = os.memfd_create(_NAME, os.MFD_CLOEXEC | os.MFD_ALLOW_SEALING)
        try:
            info = AreasInfo(
                host=host_identity(),
                pid=os.getpid(),
                fd=fd,
                token=secrets.token_bytes(_TOKEN_BYTES),
                slots=slots,
                push_bytes=_aligned(push_bytes),
                weights_bytes=_aligned(weights_bytes),
            )
            os.ftruncate(fd, info.size)
            fcntl.fcntl(fd, fcntl.F_ADD_SEALS, fcntl.F_SEAL_SHRINK | fcntl.F_SEAL_GROW | fcntl.F_SEAL_SEAL)
            mapping = mmap.mmap(fd, info.size)
        except BaseException:
            os.close(fd)
            raise
        mapping[: len(_MAGIC) + _TOKEN_BYTES] = _MAGIC + info.token
        self._fd = fd  # held open for the workers to open through /proc
        super().__init__(mapping, info)
        self._free = collections.deque(range(slots))  # the longest free first
        self._lock = threading.Lock()

    def acquire(self) -> int | None:
        """A free slot, or None when every slot is in use."""
        with self._lock:
            return self._free.popleft() if self._free else None

    def release(self, slot: int) -> None:
        """Give ``slot`` back; it is handed out after every slot already free (a worker whose
        connection the server just ended has the longest time to notice before a new owner
        writes there)."""
        with self._lock:
            if slot not in self._free:
                self._free.append(slot)

    def close(self) -> None:
        super().close()
        if self._fd >= 0:
            os.close(self._fd)
            self._fd = -1


class WorkerAreas(_Segment):
    """A worker's mapping of the server's segment (see :func:`attach`)."""


def attach(info: AreasInfo | None) -> WorkerAreas | None:
    """Map the server's segment when this process runs on the driver's host and may open
    it; None otherwise (the worker then sends its payloads over the socket)."""
    if info is None or not info.host or host_identity() != info.host:
        return None
    path = f"/proc/{info.pid}/fd/{info.fd}"
    try:
        if not os.readlink(path).startswith(f"/memfd:{_NAME}"):  # before opening: it may be a tty or FIFO now
            log.info("parameter server: not using its shared memory: %s is not its segment", path)
            return None
        fd = os.open(path, os.O_RDWR | os.O_NOCTTY | os.O_NONBLOCK)
    except OSError as exc:
        log.info("parameter server: not using its shared memory: cannot open %s (%s)", path, exc)
        return None
    try:
        if os.fstat(fd).st_size != info.size:
            log.info("parameter server: not using its shared memory: %s is not its segment", path)
            return None
        mapping = mmap.mmap(fd, info.size)
    except OSError as exc:
        log.info("parameter server: not using its shared memory: cannot map %s (%s)", path, exc)
        return None
    finally:
        os.close(fd)
    header = mapping[: len(_MAGIC) + _TOKEN_BYTES]
    if not hmac.compare_digest(header, _MAGIC + info.token):
        mapping.close()
        log.info("parameter server: not using its shared memory: %s holds another segment", path)
        return None
    return WorkerAreas(mapping, info)
