"""The driver's servers for one barrier stage: where its ranks meet, and where rank 0
sends what it brings back without the JVM.

Every barrier stage sparkdl launches (fit, :func:`sparkdl.run`, the TorchDistributor)
opens the same three for its length: a meeting point (a signed store on the driver: the
ranks meet in milliseconds instead of through ``allGather``'s one-second polls), the
publisher of each task's stage attempt to it, and an upload slot on the weights server.
Over Spark Connect there is no driver process of ours: none of them opens, the ranks meet
through ``allGather`` and results come back in the result rows.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Iterator
from dataclasses import dataclass

from sparkdl.services.meeting.endpoint import MeetingPoint
from sparkdl.services.meeting.server import MeetingPointServer
from sparkdl.services.weights.endpoint import WeightsEndpoint
from sparkdl.services.weights.server import Upload, weight_server
from sparkdl.spark.attempts import AttemptPublisher
from sparkdl.spark.cluster import driver_host, executor_addresses, is_connect

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class StageServers:
    """The open servers of one stage (None over Spark Connect).

    Attributes:
        upload: rank 0's upload slot for weights.
        meeting: the meeting point's endpoint, for the tasks.
    """

    upload: Upload | None
    meeting: MeetingPoint | None

    @property
    def weights(self) -> WeightsEndpoint | None:
        return self.upload.endpoint if self.upload is not None else None


@contextlib.contextmanager
def stage_servers(spark: object, group: str, timeout_s: float, encrypt: bool) -> Iterator[StageServers]:
    """Open the servers of one stage run in job group ``group``; close them after.

    Args:
        spark: the session (over Connect nothing opens).
        group: the stage's job group (names its attempts).
        timeout_s: how long the meeting point waits on a rank.
        encrypt: encrypt the weights upload (``runtime.encrypt``).
    """
    if is_connect(spark):
        yield StageServers(None, None)
        return
    host = driver_host(spark)
    if encrypt:
        warn_if_tasks_travel_in_the_clear(spark)
    with contextlib.ExitStack() as stack:
        known = executor_addresses(spark)
        upload = weight_server(host, encrypt, known).expect_upload()
        stack.callback(upload.close)
        meeting = stack.enter_context(MeetingPointServer(host, timeout_s, encrypt, known=known))
        attempts = AttemptPublisher(spark.sparkContext, group, meeting.publish)  # type: ignore[attr-defined]
        stack.callback(attempts.close)
        yield StageServers(upload, meeting.endpoint)


def warn_if_tasks_travel_in_the_clear(spark: object) -> None:
    """``runtime.encrypt`` seals the driver's connections, but the fit's secret reaches the
    executors inside the task, which Spark sends in the clear unless its own RPC encryption
    is on. Forward secrecy keeps a passive listener who reads it out of every session (the
    session keys also hang on ephemeral keys it never sees); an active one could still
    present it as a worker. Warn, once per stage run, naming the two settings."""
    conf = spark.sparkContext.getConf()  # type: ignore[attr-defined]
    if conf.get("spark.network.crypto.enabled", "false").lower() == "true":
        return
    log.warning(
        "runtime.encrypt is on, but Spark sends tasks, and with them this fit's secret, in the clear: "
        "set spark.authenticate=true and spark.network.crypto.enabled=true so that no one on the "
        "network can read the secret and act as a worker (recorded sessions stay sealed either way)"
    )
