"""Where a task reaches one slot of the driver's weights channel: a plain value, shipped
inside the task spec (no sockets or cryptography imported with it)."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class WeightsEndpoint:
    """One slot of the driver's weights server: a fit's upload, or a model's download.

    Attributes:
        host, port: the driver's weights server.
        slot: what is moved; its HELLO must verify under ``secret``, which is this slot's alone.
        server_key: the server's static public key (the handshake proves the server holds
            its private half).
        server_id: the serving process's random id: with ``slot``, a key no other model shares.
        timeout_s: how long a connect or a read may wait.
        encrypt: the server encrypts every transfer (``runtime.encrypt``).
    """

    host: str
    port: int
    slot: int
    secret: bytes
    server_key: bytes
    server_id: str
    timeout_s: float = 120.0
    encrypt: bool = False

    @property
    def key(self) -> str:
        return f"{self.server_id}/{self.slot}"

    def __repr__(self) -> str:  # never print the secret
        return f"WeightsEndpoint({self.host}:{self.port}, slot {self.slot})"
