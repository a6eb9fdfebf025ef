"""The driver's weights server: trained weights arrive from a fit's rank 0, and inference
tasks fetch a model's weights, over the driver's own socket instead of through the JVM.

Why not Spark. A fit's result row and a ``transform`` closure both cross the JVM: a
400 MB model ran a default driver (1 GB heap) out of memory, and a closure is sent to
the Python worker again with every task. Here the bytes go socket to tensor: the
receiver allocates each tensor once from the manifest and copies every chunk into
place, so the driver holds one copy of the model; a Python worker fetches a model
once and keeps it for every later task (:mod:`sparkdl.spark.inference`).

Slots. Every transfer names a slot: an upload slot opened by one fit (:meth:`expect_upload`)
or a model offered for download (:meth:`offer`). Each slot has its own random secret,
shipped only in the tasks that use it; a HELLO must verify under its slot's secret
(the listener's handshake with a lookup), so a task of one fit can neither read another
model nor upload into another fit.

How long an offer lives. ``transform`` is lazy: its DataFrame may run long after the call,
even after the model object is gone (``TorchModel.load(p).transform(df).show()``). An
offer is kept while the model that made it lives, and the newest
:data:`KEEP_RELEASED` offers of released models are kept as well; a task asking for an
offer dropped since gets an error that says to keep the model referenced.
"""

from __future__ import annotations

import contextlib
import functools
import itertools
import logging
import os
import secrets
import threading
import weakref
from collections.abc import Container, Hashable, Iterator, Mapping
from dataclasses import dataclass, field

import torch

from sparkdl import process
from sparkdl.errors import ConnectionClosed, ProtocolError
from sparkdl.services.weights.codec import manifest_of
from sparkdl.services.weights.endpoint import WeightsEndpoint
from sparkdl.services.weights.protocol import (
    WEIGHTS_WIRE,
    Ack,
    Hello,
    Op,
    WeightsChannel,
    receive_state,
    send_state,
)
from sparkdl.wire.framing import Fields
from sparkdl.wire.listener import ConnectionListener

log = logging.getLogger(__name__)

#: Offers of released models still served (for lazy DataFrames that outlive them): the
#: newest offer always, and up to this many more released ones while they hold at most
#: :data:`RELEASED_BYTES` together (a released 2 GB model is not kept beside the next one).
KEEP_RELEASED = 2
RELEASED_BYTES = 512 * 1024 * 1024

#: Uploads into one slot at once: a re-run stage's rank 0 may upload while the dying one's
#: upload is still under way; a third is refused before its ACK (each holds a connection
#: and a thread, and the listener takes 256 sessions).
MAX_UPLOADS_PER_SLOT = 2


@dataclass
class _Offer:
    """A model's weights, served for download."""

    secret: bytes
    state: Mapping[str, torch.Tensor]
    nbytes: int
    owner: int  # id() of the object that offered it
    fingerprint: Hashable  # (owner, what the owner said identifies the tensors' content)
    released: bool = False


@dataclass
class _Inbox:
    """A fit's upload slot: the newest complete upload (a re-run stage uploads again), and
    its budget: the bytes the uploads under way may hold at once."""

    secret: bytes
    budget: int
    state: dict[str, torch.Tensor] | None = None
    total: int = 0
    in_flight: int = 0
    uploads: int = 0  # connections uploading now (at most MAX_UPLOADS_PER_SLOT)
    arrived: threading.Event = field(default_factory=threading.Event)
    refused: str = ""  # why the newest refused upload was (the worker only sees its socket close)


def default_upload_budget(meminfo: str = "/proc/meminfo") -> int:
    """Half the memory this host has available now: what one fit's uploads may hold at once,
    whatever the manifests they announce (a model larger than that could not be held
    beside the driver's own anyway).

    Available, not free: Linux keeps what files were read in its page cache until memory is
    wanted, so after a long run (a CI machine's installs and tests) free memory can be a few
    hundred MB of a host whose available memory is 20 GB, and a budget of half of it can
    refuse a model the driver has room for (the trained weights lost; the likely cause of a
    CI run's failed upload of an 805 MB model, the worker told only "Broken pipe")."""
    try:
        with open(meminfo, encoding="ascii") as lines:
            for line in lines:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024 // 2  # kB
    except (OSError, ValueError, IndexError):
        pass
    try:  # no MemAvailable (not Linux, or a kernel before 3.14): free memory
        return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE") // 2
    except (OSError, ValueError):  # not on this platform: a fixed bound
        return 64 << 30


class Upload:
    """One fit's upload slot on the server; :meth:`take` the weights once the stage is done."""

    def __init__(self, server: WeightServer, endpoint: WeightsEndpoint) -> None:
        self._server = server
        self.endpoint = endpoint

    def wait(self, timeout_s: float) -> bool:
        """Whether a complete upload arrived within ``timeout_s``."""
        with self._server._lock:
            inbox = self._server._slots.get(self.endpoint.slot)
        return isinstance(inbox, _Inbox) and inbox.arrived.wait(timeout_s)

    def take(self) -> dict[str, torch.Tensor] | None:
        """The newest complete upload, or None if none arrived; the slot then closes."""
        inbox = self._server._close(self.endpoint.slot)
        return inbox.state if isinstance(inbox, _Inbox) else None

    def close(self) -> None:
        self._server._close(self.endpoint.slot)

    def refusal(self) -> str:
        """Why this slot's server refused an upload, if it did ("" if none was refused)."""
        with self._server._lock:
            inbox = self._server._slots.get(self.endpoint.slot)
        return inbox.refused if isinstance(inbox, _Inbox) else ""


class WeightServer:
    """Listens on the driver's address for uploads and downloads of weights.

    Args:
        host: the address to bind (the driver's, which executors reach).
        timeout_s: how long a connection may wait on its peer between two frames.
        encrypt: encrypt every transfer (a server encrypts all its connections or none).
        known: the executors' addresses (places are reserved for them; None: none known).
    """

    def __init__(
        self, host: str, timeout_s: float = 120.0, encrypt: bool = False, known: Container[str] | None = None
    ) -> None:
        self.server_id = secrets.token_hex(8)
        self._timeout_s = timeout_s
        self._lock = threading.Lock()
        self._slots: dict[int, _Offer | _Inbox] = {}
        self._numbers = itertools.count(1)
        # Not "sparkdl-" named: it serves for the life of the driver process, not of one fit.
        self._encrypt = encrypt
        self._listener = ConnectionListener(
            host, WEIGHTS_WIRE, self._secret_of, self._serve, "weights", log, encrypt=encrypt, known=known
        )
        self.host, self.port = self._listener.host, self._listener.port
        self.public_key = self._listener.public_key  # the endpoints' server_key

    def offer(
        self, state: Mapping[str, torch.Tensor], owner: object, fingerprint: Hashable
    ) -> WeightsEndpoint:
        """Serve ``state`` (held by reference, not copied) while ``owner`` lives.

        An owner offering the same ``fingerprint`` again gets its earlier slot back, so
        executors keep the model they loaded; a new fingerprint releases its older offers.
        """
        identity = (id(owner), fingerprint)
        with self._lock:
            for slot, held in self._slots.items():
                if isinstance(held, _Offer) and not held.released and held.fingerprint == identity:
                    return self._endpoint(slot, held.secret)
            for held in self._slots.values():
                if isinstance(held, _Offer) and held.owner == id(owner):
                    held.released = True
            slot, secret = next(self._numbers), secrets.token_bytes(32)
            nbytes = sum(t.numel() * t.element_size() for t in manifest_of(state)[1])  # tied once
            self._slots[slot] = _Offer(secret, state, nbytes, id(owner), identity)
            self._prune()
        weakref.finalize(owner, self._release, slot)
        return self._endpoint(slot, secret)

    def expect_upload(self, budget: int | None = None) -> Upload:
        """Open a slot for one fit's trained weights. ``budget``: the bytes its uploads may
        hold at once (an upload whose manifest would pass it is refused before anything is
        allocated); None: :func:`default_upload_budget`."""
        with self._lock:
            slot, secret = next(self._numbers), secrets.token_bytes(32)
            self._slots[slot] = _Inbox(secret, default_upload_budget() if budget is None else budget)
            self._prune()
        return Upload(self, self._endpoint(slot, secret))

    def serves(self, slot: int) -> bool:
        with self._lock:
            return slot in self._slots

    def stop(self) -> None:
        self._listener.stop()

    # --------------------------------------------------------------- bookkeeping

    def _endpoint(self, slot: int, secret: bytes) -> WeightsEndpoint:
        return WeightsEndpoint(
            self.host,
            self.port,
            slot,
            secret,
            self.public_key,
            self.server_id,
            self._timeout_s,
            self._encrypt,
        )

    def _release(self, slot: int) -> None:
        """The owner of offer ``slot`` was collected. Runs inside the garbage collector, which
        may fire in any allocation, also one made while this thread holds ``_lock``: so it
        takes no lock (a dict lookup and an attribute store are atomic) and prunes nothing;
        the next offer or upload prunes."""
        held = self._slots.get(slot)
        if isinstance(held, _Offer):
            held.released = True

    def _prune(self) -> None:
        """Drop released offers but the newest offer and, beyond it, up to
        :data:`KEEP_RELEASED` of the newest within :data:`RELEASED_BYTES` (lock held)."""
        offers = sorted((s for s, h in list(self._slots.items()) if isinstance(h, _Offer)), reverse=True)
        kept, held = 0, 0
        for slot in offers[1:]:  # the newest offer stays, released or not
            offer = self._slots[slot]
            assert isinstance(offer, _Offer)
            if not offer.released:
                continue
            if kept < KEEP_RELEASED and held + offer.nbytes <= RELEASED_BYTES:
                kept, held = kept + 1, held + offer.nbytes
            else:
                del self._slots[slot]

    def _close(self, slot: int) -> _Offer | _Inbox | None:
        with self._lock:
            return self._slots.pop(slot, None)

    def _secret_of(self, fields: Fields) -> bytes | None:
        op, slot = fields[0], fields[1]
        with self._lock:
            held = self._slots.get(slot)
        wanted = _Inbox if op == Op.UPLOAD else _Offer
        return held.secret if isinstance(held, wanted) else None

    # --------------------------------------------------------------- connections

    @contextlib.contextmanager
    def _reserve(self, inbox: _Inbox, nbytes: int, what: str) -> Iterator[None]:
        """Hold ``nbytes`` of ``inbox``'s budget for one step of an upload (``what``: what
        they are for, said when refused).

        Raises:
            ProtocolError: the uploads under way would hold more than the budget.
        """
        with self._lock:
            if inbox.in_flight + nbytes > inbox.budget:
                raise ProtocolError(
                    f"{what}, with {inbox.in_flight} bytes under way, is over the slot's budget of "
                    f"{inbox.budget} bytes (a fit's is half the memory the driver had available when "
                    "the fit began: give the driver more memory)"
                )
            inbox.in_flight += nbytes
        try:
            yield
        finally:
            with self._lock:
                inbox.in_flight -= nbytes

    @contextlib.contextmanager
    def _upload_session(self, inbox: _Inbox, slot: int) -> Iterator[None]:
        """One of the at most :data:`MAX_UPLOADS_PER_SLOT` uploads into ``inbox`` at once.

        Raises:
            ProtocolError: as many uploads into the slot are under way already.
        """
        with self._lock:
            if inbox.uploads >= MAX_UPLOADS_PER_SLOT:
                raise ProtocolError(
                    f"an upload into slot {slot} while {inbox.uploads} are under way; a slot takes "
                    f"{MAX_UPLOADS_PER_SLOT} at once (a fit's rank 0, and a re-run stage's beside it)"
                )
            inbox.uploads += 1
        try:
            yield
        finally:
            with self._lock:
                inbox.uploads -= 1

    def _serve(self, hello: Hello, channel: WeightsChannel, peer: tuple[str, int]) -> None:
        held: _Offer | _Inbox | None = None
        try:
            channel.sock.settimeout(self._timeout_s)
            with self._lock:
                held = self._slots.get(hello.slot)
            if isinstance(held, _Offer):
                channel.send(Ack(hello.op, hello.slot))
                sent = send_state(channel, hello, held.state)
                log.debug("sent %d bytes of weights (slot %d) to %s", sent, hello.slot, peer)
            elif isinstance(held, _Inbox):
                with self._upload_session(held, hello.slot):
                    channel.send(Ack(hello.op, hello.slot))
                    self._receive(held, hello, channel, peer)
            # None: the slot closed since its secret was looked up
        except ConnectionClosed:
            pass
        except ProtocolError as exc:
            if isinstance(held, _Inbox):  # a peer that proved it holds the slot's secret
                held.refused = str(exc)
            if not self._listener.stopping:
                self._listener.refusals.add("transfer refused", peer, str(exc))
        except OSError as exc:
            if not self._listener.stopping:
                log.warning("weights transfer with %s failed: %s", peer, exc)
        except Exception as exc:  # e.g. a manifest whose tensors cannot be allocated
            log.warning("weights transfer with %s failed: %s: %s", peer, type(exc).__name__, exc)

    def _receive(self, inbox: _Inbox, hello: Hello, channel: WeightsChannel, peer: tuple[str, int]) -> None:
        """Receive one upload into ``inbox`` within its budget; confirm it with an ACK."""
        state, total = receive_state(channel, hello, functools.partial(self._reserve, inbox))
        with self._lock:
            inbox.state, inbox.total = state, total
        inbox.arrived.set()
        channel.send(Ack(hello.op, hello.slot, total))
        log.debug("received %d bytes of trained weights (slot %d) from %s", total, hello.slot, peer)


_SERVERS: dict[tuple[str, bool], WeightServer] = {}
_SERVERS_LOCK = threading.Lock()


def _stop_servers() -> None:
    with _SERVERS_LOCK:
        servers = list(_SERVERS.values())
        _SERVERS.clear()
    for server in servers:
        server.stop()


process.keep(
    "services.weights",
    "driver",
    "the weights server on the driver's address (one listening socket, for every fit and transform)",
    "the driver process",
    _stop_servers,
)


def weight_server(host: str, encrypt: bool = False, known: Container[str] | None = None) -> WeightServer:
    """This process's weights server on ``host`` (an encrypting one with ``encrypt``),
    started on first use (with ``known``, the executors' addresses)."""
    with _SERVERS_LOCK:
        if (host, encrypt) not in _SERVERS:
            _SERVERS[(host, encrypt)] = WeightServer(host, encrypt=encrypt, known=known)
        return _SERVERS[(host, encrypt)]
