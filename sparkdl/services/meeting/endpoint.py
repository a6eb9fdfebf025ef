"""Where a task reaches its stage's meeting point: a plain value, shipped inside the task
(no sockets or cryptography imported with it)."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class MeetingPoint:
    """The driver's meeting point for one stage, as the workers reach it.

    Attributes:
        host, port: the server's address (the driver's, as executors reach it).
        secret: the stage's own key: a HELLO must verify under it.
        server_key: the server's static public key (the handshake proves the driver).
        encrypt: the server encrypts every connection (``runtime.encrypt``).
    """

    host: str
    port: int
    secret: bytes
    server_key: bytes
    encrypt: bool = False

    def __repr__(self) -> str:  # never print the secret
        return f"MeetingPoint({self.host}:{self.port})"
