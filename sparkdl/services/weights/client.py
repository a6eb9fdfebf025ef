"""The executor's side of the weights channel: a fit's rank 0 uploads the trained weights,
an inference task downloads a model's (see :mod:`sparkdl.services.weights.server`)."""

from __future__ import annotations

import socket
from collections.abc import Mapping

import torch

from sparkdl.errors import ConnectionClosed, ProtocolError, WeightTransferError
from sparkdl.services.weights.endpoint import WeightsEndpoint
from sparkdl.services.weights.protocol import (
    Ack,
    Hello,
    Op,
    WeightsChannel,
    client_hello,
    expect,
    receive_state,
    send_state,
)
from sparkdl.wire.handshake import with_retries
from sparkdl.wire.refusals import close_quietly


def upload(endpoint: WeightsEndpoint, state: Mapping[str, torch.Tensor]) -> int:
    """Send ``state`` to the driver; return the bytes it confirmed receiving.

    Raises:
        WeightTransferError: the driver could not be reached, or did not confirm the upload.
    """
    hello = Hello(Op.UPLOAD, endpoint.slot)

    def open_upload() -> tuple[socket.socket, WeightsChannel]:
        sock = _connect(endpoint)
        try:
            channel = client_hello(
                sock, endpoint.secret, hello.op, hello.slot, endpoint.encrypt, server_key=endpoint.server_key
            )
            expect(channel, Ack, hello)
        except BaseException:
            close_quietly(sock)
            raise
        return sock, channel

    try:  # a handshake the driver closed before answering (a flood at its port) is tried again
        sock, channel = with_retries(open_upload, "rank 0: weights upload")
    except (ProtocolError, OSError) as exc:
        raise WeightTransferError(
            f"the driver's weights server at {endpoint.host}:{endpoint.port} closed every handshake: {exc}"
        ) from exc
    try:
        sent = send_state(channel, hello, state)
        confirmed = expect(channel, Ack, hello)
        assert isinstance(confirmed, Ack)
        if confirmed.total != sent:
            raise WeightTransferError(
                f"the driver confirmed {confirmed.total} bytes of weights, {sent} were sent"
            )
        return sent
    except (ProtocolError, OSError) as exc:
        raise WeightTransferError(
            f"sending the trained weights to the driver's weights server at {endpoint.host}:{endpoint.port} "
            f"failed: {exc}"
        ) from exc
    finally:
        close_quietly(sock)


def download(endpoint: WeightsEndpoint) -> dict[str, torch.Tensor]:
    """Fetch the weights the driver offers at ``endpoint``.

    Raises:
        WeightTransferError: the driver could not be reached, no longer serves these
            weights, or sent a stream that does not verify.
    """
    sock = _connect(endpoint)
    try:
        hello = Hello(Op.DOWNLOAD, endpoint.slot)
        channel = client_hello(
            sock, endpoint.secret, hello.op, hello.slot, endpoint.encrypt, server_key=endpoint.server_key
        )
        try:
            expect(channel, Ack, hello)
        except ConnectionClosed:
            raise WeightTransferError(
                f"the driver no longer serves the weights of this model ({endpoint!r}): the TorchModel "
                "was released and newer models were offered since. Keep a reference to the model while "
                "a DataFrame from its transform is in use"
            ) from None
        return receive_state(channel, hello)[0]
    except (ProtocolError, OSError) as exc:
        raise WeightTransferError(
            f"fetching the model's weights from the driver's weights server at "
            f"{endpoint.host}:{endpoint.port} failed: {exc}"
        ) from exc
    finally:
        close_quietly(sock)


def _connect(endpoint: WeightsEndpoint) -> socket.socket:
    try:
        sock = socket.create_connection((endpoint.host, endpoint.port), timeout=endpoint.timeout_s)
    except OSError as exc:
        raise WeightTransferError(
            f"cannot reach the driver's weights server at {endpoint.host}:{endpoint.port} ({exc}); "
            "executors must reach the driver's address (spark.driver.host) on the ports it opens"
        ) from exc
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    return sock
