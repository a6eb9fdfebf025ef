"""The driver's side of every barrier stage sparkdl runs: one kit for fit, ``sparkdl.run``
and the TorchDistributor.

Before the first stage (:func:`stage_site`): the cluster is checked for the stage's slots
(and GPUs), the stage's resource profile chosen, its job group named and the gate that
tells the driver's servers which stage attempt is running set up. Around each stage
(:func:`barrier_stage`): the stage's servers (the meeting point, the weights upload:
:mod:`sparkdl.spark.stage_servers`) and the progress channel open, and close after. The
stage itself (:meth:`Stage.run`): ``mapInArrow(task, barrier=True)`` followed by a shuffle
(so that Spark re-runs the stage as a whole after a failed task, instead of aborting the
job as it does for a failed barrier ResultStage), collected under the silence bound and,
for fit, the watch on lost slots; a worker's error comes back as its own class
(:func:`translate_failure`). The task side is :mod:`sparkdl.spark.barrier_task`.
"""

from __future__ import annotations

import contextlib
import logging
import secrets
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

from sparkdl.config import SparkDLConfig, UseGpu
from sparkdl.errors import ErrorRecord, SparkDLError, StageStalledError, TrainingFailedError, WorkersLostError
from sparkdl.services.meeting.endpoint import MeetingPoint
from sparkdl.services.progress.board import ProgressBoard
from sparkdl.services.progress.channel import ProgressEndpoint, ProgressServer
from sparkdl.services.weights.endpoint import WeightsEndpoint
from sparkdl.spark.attempts import attempt_gate
from sparkdl.spark.cluster import (
    check_cluster,
    described,
    driver_host,
    executor_addresses,
    is_connect,
    own_local_properties,
)
from sparkdl.spark.environment import failure_excerpt, memory_hint
from sparkdl.spark.resources import training_profile
from sparkdl.spark.stage_servers import StageServers, stage_servers
from sparkdl.spark.watch import MARGIN_S, SlotWatch, collect_watched, fit_job_group

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Site:
    """Where a run's barrier stages go: the session, the stages' resource profile, their job
    group and the attempt gate (the last two: none over Spark Connect).

    Attributes:
        spark: the session.
        profile: the stages' resource profile (None: the default one; Connect).
        group: the job group the stages run in, which the watch cancels ("" over Connect).
        attempt_started: whether a stage attempt of the group is running (None over Connect).
    """

    spark: Any
    profile: Any
    group: str
    attempt_started: Callable[[int], bool] | None

    @property
    def connect(self) -> bool:
        return not self.group


def stage_site(spark: Any, workers: int, *, use_gpu: UseGpu, wait_s: float, collective_s: float) -> Site:
    """Check the cluster for ``workers`` slots (waiting up to ``wait_s`` for executors) and
    set up the stages' site.

    Raises:
        ClusterConfigError: fewer slots or GPUs than workers, with the setting to change.
    """
    connect = is_connect(spark)
    profile = None if connect else training_profile(spark, use_gpu)
    check_cluster(spark, workers, wait_s, collective_s, profile)
    group = "" if connect else fit_job_group(spark)  # Connect: Spark's own timeouts only
    return Site(spark, profile, group, attempt_gate(spark.sparkContext, group) if group else None)


@dataclass(frozen=True)
class Stage:
    """One barrier stage's open servers, on its site.

    Attributes:
        site: where it runs.
        servers: the meeting point and the weights upload (none over Connect).
        progress: the progress channel (None where the driver cannot listen: Connect).
        bound_s: a rank silent for longer stalls the stage.
    """

    site: Site
    servers: StageServers
    progress: ProgressServer | None
    bound_s: float

    @property
    def weights(self) -> WeightsEndpoint | None:
        return self.servers.weights

    @property
    def meeting(self) -> MeetingPoint | None:
        return self.servers.meeting

    @property
    def progress_endpoint(self) -> ProgressEndpoint | None:
        return self.progress.endpoint() if self.progress is not None else None

    def uploaded(self) -> Any:
        """What rank 0 uploaded to the weights server (None: nothing, or no server)."""
        return self.servers.upload.take() if self.servers.upload is not None else None

    def upload_refusal(self) -> str:
        """Why the weights server refused rank 0's upload ("" when it did not)."""
        return self.servers.upload.refusal() if self.servers.upload is not None else ""

    def run(
        self,
        data: Any,
        task: Callable[..., Any],
        schema: str,
        description: str,
        slots: SlotWatch | None = None,
    ) -> list[Any]:
        """The rows of ``task`` run as a barrier stage over ``data``'s partitions, one task
        each, described as ``description`` in the Spark UI (see :func:`run_barrier_stage`)."""
        site = self.site
        silence = self.progress.silence if self.progress is not None else None
        board = self.progress.board if self.progress is not None else None
        if board is not None:
            board.stage_submitted(
                f"starting {board.num_workers} workers: each executor starts Python and imports torch first"
            )
        with own_local_properties(site.spark), described(site.spark, description):
            rows = run_barrier_stage(
                data, task, schema, site.profile, silence, self.bound_s, site.group, slots
            )
        if board is not None:
            board.finish()
        return rows


@contextlib.contextmanager
def barrier_stage(
    site: Site,
    *,
    collective_s: float,
    bound_s: float,
    encrypt: bool,
    board: ProgressBoard | None,
    interval_s: float,
) -> Iterator[Stage]:
    """Open one stage's servers and progress channel on ``site``; close them after.

    Args:
        site: where the stage runs.
        collective_s: how long the meeting point waits on a rank.
        bound_s: a rank silent for longer stalls the stage.
        encrypt: encrypt the driver's connections (``runtime.encrypt``).
        board: what the progress channel shows (None: no channel).
        interval_s: how often a worker reports.
    """
    with contextlib.ExitStack() as stack:
        servers = stack.enter_context(stage_servers(site.spark, site.group, collective_s, encrypt))
        progress = None
        if board is not None and site.connect:
            log.info("Spark Connect session: no live progress; the result's history holds every figure")
        elif board is not None:
            host = driver_host(site.spark)
            progress = ProgressServer(
                board,
                host,
                secrets.token_bytes(32),
                interval_s,
                encrypt=encrypt,
                attempt_started=site.attempt_started,
                known=executor_addresses(site.spark),
            )
            stack.callback(progress.stop)
        yield Stage(site, servers, progress, bound_s)


def training_site(spark: Any, config: SparkDLConfig) -> Site:
    """The site of a training run's stages (fit's, ``sparkdl.run``'s): ``num_workers`` slots
    of the ``runtime`` settings' kind."""
    runtime = config.runtime
    return stage_site(
        spark,
        config.training.num_workers,
        use_gpu=runtime.use_gpu,
        wait_s=runtime.executor_wait_timeout_s,
        collective_s=runtime.collective_timeout_s,
    )


def training_stage(site: Site, config: SparkDLConfig) -> contextlib.AbstractContextManager[Stage]:
    """One stage of a training run (fit's, ``sparkdl.run``'s): its servers under the
    ``runtime`` settings, a progress channel showing each worker's epochs (an L-BFGS
    iteration reports as an epoch), and a rank silent for longer than a collective's wait,
    the teardown's and a margin stalls it."""
    runtime = config.runtime
    full_batch = config.optimizer.optimizer.value == "lbfgs"
    epochs = config.lbfgs.max_iterations if full_batch else config.training.epochs
    return barrier_stage(
        site,
        collective_s=runtime.collective_timeout_s,
        bound_s=runtime.collective_timeout_s + runtime.teardown_timeout_s + MARGIN_S,
        encrypt=runtime.encrypt,
        board=ProgressBoard(config.training.num_workers, epochs, show=runtime.progress),
        interval_s=runtime.progress_interval_s,
    )


def run_barrier_stage(
    data: Any,
    task: Callable[..., Any],
    schema: str,
    profile: Any,
    silence: Callable[[], dict[int, float]] | None,
    bound_s: float,
    group: str,
    slots: SlotWatch | None = None,
) -> list[Any]:
    """The rows of ``data.mapInArrow(task, schema, barrier=True)``, collected after a shuffle
    (so that Spark re-runs the stage after a failed task instead of aborting the job), in job
    group ``group``, watched for silent ranks (and, with ``slots``, for lost slots).

    Raises:
        StageStalledError: a rank went silent for longer than ``bound_s``.
        WorkersLostError: the cluster lost the stage's slots for good (with ``slots``).
        SparkDLError: the error a worker raised, rebuilt from its record (:func:`translate_failure`).
    """
    stage = data.mapInArrow(task, schema, barrier=True, profile=profile)
    try:
        return collect_watched(data.sparkSession, stage.repartition(1), silence, bound_s, group, slots)
    except (StageStalledError, WorkersLostError):
        raise
    except Exception as exc:
        raise translate_failure(exc) from exc


def stage_input(df: Any, columns: list[str], n: int) -> Any:
    """``df``'s ``columns`` in ``n`` partitions, one per barrier task (repartitioned only
    where needed: :func:`needs_repartition`)."""
    data = df.select(*columns)
    return data.repartition(n) if needs_repartition(data, n, df.sparkSession) else data


def needs_repartition(data: Any, n: int, spark: Any) -> bool:
    """Whether ``data`` must be shuffled into ``n`` partitions before the barrier stage: when
    it has another count, and when a coalesce made its count (Spark refuses a barrier stage
    over a coalesce, SPARK-24820). A Connect client cannot see the plan: always."""
    if is_connect(spark) or data.rdd.getNumPartitions() != n:
        return True
    return "Coalesce" in data._jdf.queryExecution().executedPlan().toString()


def raise_agreed_error(rows: list[Any]) -> None:
    """Raise the error that made every rank stop together (the rejecting rank's, not its peers')."""
    records = [ErrorRecord.from_json(row["error"]) for row in rows if row["error"]]
    if records:
        records.sort(key=lambda r: r.error_type == "PeerStopped")
        raise located(records[0].to_error())


def translate_failure(exc: Exception) -> SparkDLError:
    """The error a worker raised, rebuilt from the record its failed task carried; the
    Spark failure itself (first line) when no worker's record is in it."""
    text = str(exc)
    records = ErrorRecord.find_embedded(text)
    if records:
        error = located(records[-1].to_error())
    else:
        detail = failure_excerpt(text) or type(exc).__name__
        error = TrainingFailedError(f"the training stage failed: {detail}")
    hint = memory_hint(text)
    if hint and hint not in error.message:
        error.message = f"{error.message}; {hint}"
        error.args = (error.message,)
    return error


def located(error: SparkDLError) -> SparkDLError:
    """The same error, its message prefixed with the rank it happened on (when known)."""
    if error.rank is not None and not error.message.startswith(f"rank {error.rank}"):
        error.message = f"rank {error.rank}: {error.message}"
        error.args = (error.message,)
    return error
