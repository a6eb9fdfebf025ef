"""Authenticated (optionally encrypted) framing shared by the driver's sockets. The
parameter server (:mod:`sparkdl.services.ps.protocol`), the progress channel
(:mod:`sparkdl.services.progress.protocol`) and the weights server (:mod:`sparkdl.services.weights.protocol`)
each speak their own messages over it.

The framing knows nothing of what a frame means: a :class:`WireProtocol` names its kinds
and header fields and maps its messages onto them. No pickle, no JSON: a payload is raw
bytes that the protocol decodes itself.

This module is the framing's one door: the names a protocol, a server or a client uses,
gathered from the modules that hold them, each of which says why it is built as it is:

- :mod:`sparkdl.wire.layout`: the bytes of a header, a challenge and a frame, the
  :class:`WireProtocol` base, and the checks a frame fails by its layout alone;
- :mod:`sparkdl.wire.keys`: key derivation from the per-fit secret, and the nonces that
  bind every tag to its connection, direction, frame and piece;
- :mod:`sparkdl.wire.handshake`: the CHALLENGE and HELLO that open a connection;
- :mod:`sparkdl.wire.channel`: the record layer, sending and receiving tagged (or
  encrypted) frames, the header authenticated before its length is trusted;
- :mod:`sparkdl.wire.socket_io`: the scatter/gather socket calls and reused buffers.
"""

from sparkdl.wire.channel import MAX_POLL_MS, Channel
from sparkdl.wire.handshake import (
    Challenge,
    ServerKey,
    accept_hello,
    client_hello,
    server_challenge,
    server_hello,
)
from sparkdl.wire.layout import (
    CHALLENGE,
    ENCRYPTED,
    HELLO_PAYLOAD_BYTES,
    HELLO_TAG_BYTES,
    MAGIC,
    MAX_FRAME_PAYLOAD,
    NONCE_BYTES,
    PREFIX,
    STREAM_CHUNK,
    TAG_BYTES,
    VERSION,
    Fields,
    Payload,
    PayloadPlacement,
    SecretLookup,
    WireProtocol,
    check_prefix,
    frame_bytes,
    member,
)
from sparkdl.wire.socket_io import ReusedBuffer

__all__ = [
    "CHALLENGE",
    "ENCRYPTED",
    "HELLO_PAYLOAD_BYTES",
    "HELLO_TAG_BYTES",
    "MAGIC",
    "MAX_FRAME_PAYLOAD",
    "MAX_POLL_MS",
    "NONCE_BYTES",
    "PREFIX",
    "STREAM_CHUNK",
    "TAG_BYTES",
    "VERSION",
    "Challenge",
    "Channel",
    "Fields",
    "Payload",
    "PayloadPlacement",
    "ReusedBuffer",
    "SecretLookup",
    "ServerKey",
    "WireProtocol",
    "accept_hello",
    "check_prefix",
    "client_hello",
    "frame_bytes",
    "member",
    "server_challenge",
    "server_hello",
]
