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
from collections.abc import Iterator
from dataclasses import dataclass

from sparkdl.comm.meeting_point import MeetingPoint, MeetingPointServer
from sparkdl.services.weights.endpoint import WeightsEndpoint
from sparkdl.services.weights.server import Upload, weight_server
from sparkdl.spark.attempts import AttemptPublisher
from sparkdl.spark.cluster import driver_host, is_connect


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
    with contextlib.ExitStack() as stack:
        upload = weight_server(host, encrypt).expect_upload()
        stack.callback(upload.close)
        meeting = stack.enter_context(MeetingPointServer(host, timeout_s))
        attempts = AttemptPublisher(spark.sparkContext, group, meeting.publish)  # type: ignore[attr-defined]
        stack.callback(attempts.close)
        yield StageServers(upload, meeting.endpoint)
