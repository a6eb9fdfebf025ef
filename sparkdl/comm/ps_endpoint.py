"""Where workers reach the parameter server: a plain value, shipped inside the task spec.

Kept apart from the server and the wire so that code which only passes the endpoint
along (the strategy context, the training loop) imports no sockets or cryptography.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from sparkdl.comm.ps_areas import AreasInfo


@dataclass(frozen=True)
class PsEndpoint:
    """What workers need to reach the server; shipped inside the task spec, never in SparkConf."""

    host: str
    port: int
    secret: bytes
    server_key: (
        bytes  # the server's static public key: the handshake proves the server holds its private half
    )
    shard_params: tuple[tuple[int, ...], ...]  # parameter indices of each shard
    timeout_s: float
    max_payload: int
    encrypt: bool = False
    areas: AreasInfo | None = None  # the server's shared memory, for workers on its host
    shard_sizes: tuple[int, ...] = ()  # values in each shard (what a shared area's weights hold)
    # independent tasks (ps_barrier = false): the partition this task pushes as (-1: the
    # worker's rank, barrier workers) and its Spark task id (taskAttemptId), which fences older ones
    partition: int = -1
    task_attempt: int = 0

    def __repr__(self) -> str:  # never print the secret
        return f"PsEndpoint({self.host}:{self.port}, {len(self.shard_params)} shards)"
