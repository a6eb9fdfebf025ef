"""The wire under the driver's two servers (torch-free, Spark-free): authenticated
framing that each protocol fills with its own messages (:mod:`sparkdl.net.framing`),
and the listening socket with a thread per connection (:mod:`sparkdl.net.listener`)."""

from sparkdl.net.framing import Channel, WireProtocol, client_hello, read_raw, server_hello
from sparkdl.net.listener import ConnectionListener, close_quietly

__all__ = [
    "Channel",
    "ConnectionListener",
    "WireProtocol",
    "client_hello",
    "close_quietly",
    "read_raw",
    "server_hello",
]
