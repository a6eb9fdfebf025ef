"""The wire under the driver's servers (torch-free, Spark-free): authenticated, optionally
encrypted framing that each protocol fills with its own messages
(:mod:`sparkdl.wire.framing`), and the listening socket that authenticates a peer before it
spends a thread on it (:mod:`sparkdl.wire.listener`)."""

from sparkdl.wire.framing import Channel, WireProtocol, accept_hello, client_hello, server_hello
from sparkdl.wire.listener import ConnectionListener
from sparkdl.wire.refusals import Refusals, close_quietly

__all__ = [
    "Channel",
    "ConnectionListener",
    "Refusals",
    "WireProtocol",
    "accept_hello",
    "client_hello",
    "close_quietly",
    "server_hello",
]
