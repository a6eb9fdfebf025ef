"""The sections of the run's machinery: ``[runtime]``, ``[reliability]`` and ``[tracking]``.

They hold what every strategy shares and none of them decides: the devices, the process group,
compression and the timeouts of every wait (``[runtime]``); checkpoints, resume, bad input and
fault drills (``[reliability]``); and MLflow logging of the fit (``[tracking]``). Each is one
frozen dataclass whose fields carry their meaning and valid values (``metadata=about(...)``);
rules within a section live in its ``__post_init__``, rules across sections in
:class:`sparkdl.config.SparkDLConfig`.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from sparkdl.config.choices import (
    DRILL_FORM,
    Backend,
    Compression,
    FaultDrillSpec,
    Hierarchy,
    OnError,
    SufficientFactors,
    UseGpu,
)
from sparkdl.config.loading import about, check_bounds, check_storage_path
from sparkdl.errors import ConfigError


@dataclass(frozen=True)
class RuntimeConfig:
    """``[runtime]``: devices, process group and the timeouts of every wait."""

    backend: Backend = field(
        default=Backend.AUTO,
        metadata=about("torch.distributed backend of the workers; auto is nccl on GPU and gloo on CPU."),
    )
    use_gpu: UseGpu = field(
        default=UseGpu.AUTO,
        metadata=about(
            "Train on GPU: true fails fast without one, false stays on CPU, "
            "auto uses the GPU Spark gave the task."
        ),
    )
    collective_timeout_s: float = field(
        default=300.0,
        metadata=about(
            "Longest a worker waits in the rendezvous or a collective before failing.", bound="> 0"
        ),
    )
    executor_wait_timeout_s: float = field(
        default=30.0,
        metadata=about(
            "How long fit waits for enough free task slots (executors still starting), and how long "
            "slots lost while it trains may stay away before it goes on with fewer (min_workers) or fails.",
            bound=">= 0",
        ),
    )
    torch_threads: int = field(
        default=0, metadata=about("torch intra-op threads per worker; 0 = spark.task.cpus.", bound=">= 0")
    )
    network_interface: str = field(
        default="",
        metadata=about(
            "Network interface of the process group (GLOO_SOCKET_IFNAME, NCCL_SOCKET_IFNAME); "
            '"" takes the one holding the address Spark gives the executor (unless the '
            "environment names one), not the host name's, which often resolves to loopback.",
            valid='an interface name such as "eth0", or ""',
        ),
    )
    compression: Compression = field(
        default=Compression.NONE,
        metadata=about(
            "What the strategies compress before it travels: allreduce its gradients (a DDP hook), "
            "weight_averaging the change since the last average, parameter_server its pushes. fp16 and "
            "bf16 halve the bytes; 1bit sends signs and two means per 1,024 values (1/30 of float32); topk "
            "the topk_ratio largest values; 1bit and topk carry what they lose into the next round (error "
            "feedback). powersgd is PyTorch's low-rank hook (allreduce only)."
        ),
    )
    topk_ratio: float = field(
        default=0.01,
        metadata=about("The share of values compression = 'topk' sends, at most 1.", bound="> 0"),
    )
    error_feedback: bool = field(
        default=True,
        metadata=about(
            "Carry what 1bit and topk compression lost into the next round; turn off only to see what "
            "it is worth (1bit then loses accuracy)."
        ),
    )
    sufficient_factors: SufficientFactors = field(
        default=SufficientFactors.OFF,
        metadata=about(
            "Send a fully connected layer's gradient as its sufficient factors, each row's input and "
            "output gradient (rows x (inputs + outputs) numbers), instead of the inputs x outputs matrix; "
            "every worker rebuilds the exact sum (Poseidon). on: every nn.Linear; auto: per layer and "
            "step, whichever sends fewer bytes (factors win for wide layers and small batches). "
            "allreduce and parameter_server (whose server rebuilds the gradient; a push carries a "
            "layer's factors only where they are smaller, in both modes); not with a hierarchy; the "
            "factors are never compressed."
        ),
    )
    powersgd_rank: int = field(
        default=2, metadata=about("Rank of PowerSGD's low-rank approximation.", bound="> 0")
    )
    hierarchy: Hierarchy = field(
        default=Hierarchy.NONE,
        metadata=about(
            "Aggregate within a host first: its workers reduce into one leader, the leaders exchange "
            "across hosts, and each hands the result back (parameter_server: only the leaders push and "
            "pull). host groups the tasks by address, executor by executor; none = flat."
        ),
    )
    shared_memory: bool = field(
        default=True,
        metadata=about(
            "On CPUs, when every worker runs on one host (local mode, one machine's executors), allreduce "
            "and weight_averaging exchange through a shared-memory segment instead of gloo's loopback TCP "
            "(the same sums, the same on every worker; not with compression); with a hierarchy, each "
            "host's level does, every strategy. Falls back to gloo, with a warning, where /dev/shm "
            "cannot hold it."
        ),
    )
    bucket_cap_mb: float = field(
        default=25.0,
        metadata=about(
            "Size of the buckets gradients (allreduce) or weights (weight_averaging) travel in.", bound="> 0"
        ),
    )
    teardown_timeout_s: float = field(
        default=60.0,
        metadata=about(
            "How long a worker may take to release its process groups, sockets and threads after the "
            "last step before it is ended with a clear error.",
            bound="> 0",
        ),
    )
    preflight: bool = field(
        default=True,
        metadata=about(
            "Before the training stage, check on the driver that a few rows go through model_fn, the "
            "loss and one backward (fails in seconds, once, in the terms of the columns), and that the "
            "executors' Python can import torch and sparkdl; turn off for a model too big for the driver."
        ),
    )
    progress: bool = field(
        default=True,
        metadata=about("Live progress bars on the driver (worker warnings are forwarded either way)."),
    )
    progress_interval_s: float = field(
        default=0.5, metadata=about("Shortest time between two progress reports of a worker.", bound="> 0")
    )
    encrypt: bool = field(
        default=False,
        metadata=about(
            "Encrypt the driver's sockets (parameter server, progress, weights) with AES-256-GCM under "
            "per-connection keys; frames are authenticated either way. Traffic between workers (gloo, "
            "NCCL) is not covered: see docs/guide/security.md."
        ),
    )

    def __post_init__(self) -> None:
        check_bounds(self, "runtime")
        if self.topk_ratio > 1:
            raise ConfigError(
                f"runtime.topk_ratio = {self.topk_ratio} must be at most 1 (the share of values sent)"
            )
        if self.backend is Backend.NCCL and self.use_gpu is UseGpu.NO:
            raise ConfigError(
                "runtime.backend = 'nccl' needs GPUs but runtime.use_gpu = false; "
                "set backend = 'gloo' or 'auto', or use_gpu = 'auto'"
            )


@dataclass(frozen=True)
class ReliabilityConfig:
    """``[reliability]``: checkpoints, resume, and what to do about bad input."""

    checkpoint_dir: str = field(
        default="",
        metadata=about(
            'Directory of the checkpoints a rerun of fit resumes from; "" = no checkpoints.',
            valid="a directory every executor and the driver can reach (a shared path, or a URL: s3://, "
            'gs://, abfss://, hdfs://, dbfs:/), or ""',
        ),
    )
    storage_options: dict[str, str] = field(
        default_factory=dict,
        repr=False,  # credentials: never in a repr, a log line or saved metadata
        metadata=about(
            "Options of the object store checkpoint_dir and saved models are on, given to its fsspec "
            "filesystem (s3fs: key, secret, token, endpoint_url, region_name); over the driver's "
            "spark.hadoop.fs.s3a.* conf and the environment. Never logged nor saved with a model.",
            valid="a table of strings",
        ),
    )
    checkpoint_upload_timeout_s: float = field(
        default=600.0,
        metadata=about(
            "Longest a checkpoint's background upload to object storage may take before the next "
            "checkpoint or the end of the fit fails naming it.",
            bound="> 0",
        ),
    )
    checkpoint_every: int = field(
        default=0,
        metadata=about(
            "Optimizer steps between checkpoints; 0 = at epoch ends only (with checkpoint_dir).", bound=">= 0"
        ),
    )
    on_bad_rows: OnError = field(
        default=OnError.ERROR,
        metadata=about(
            "Rows with nulls, NaN, wrong lengths or bad labels: stop the fit, or skip and count them."
        ),
    )
    on_nan_loss: OnError = field(
        default=OnError.ERROR,
        metadata=about("A non-finite loss: stop the fit, or skip that step and count it (on every rank)."),
    )
    max_nan_skips: int = field(
        default=10,
        metadata=about("With on_nan_loss = skip: stop after this many skipped steps in a row.", bound=">= 0"),
    )
    min_workers: int = field(
        default=0,
        metadata=about(
            "Fewest workers to go on with after executors are lost for good: the fit resumes from its "
            "last checkpoint on the slots left; 0 = num_workers (never shrink).",
            bound=">= 0",
        ),
    )
    fault_injection: str = field(
        default="",
        metadata=about(
            'A fault drill, fired once on one rank at one step; "" = none.', valid=f'"" or {DRILL_FORM}'
        ),
    )

    def __post_init__(self) -> None:
        check_bounds(self, "reliability")
        check_storage_path(self.checkpoint_dir, "reliability.checkpoint_dir")
        if self.checkpoint_every and not self.checkpoint_dir:
            raise ConfigError(
                f"reliability.checkpoint_every = {self.checkpoint_every} but no checkpoint_dir is set; "
                "set checkpoint_dir to a directory every executor and the driver can reach"
            )
        if self.fault_injection:
            FaultDrillSpec.parse(self.fault_injection)

    @property
    def drill(self) -> FaultDrillSpec | None:
        """The fault drill named by ``fault_injection``, or None when there is none."""
        return FaultDrillSpec.parse(self.fault_injection) if self.fault_injection else None


@dataclass(frozen=True)
class TrackingConfig:
    """``[tracking]``: MLflow logging (needs the ``mlflow`` extra and a tracking URI)."""

    mlflow: bool = field(
        default=True,
        metadata=about("Log the fit to MLflow when mlflow is installed and a tracking URI is set."),
    )
    mlflow_experiment: str = field(
        default="", metadata=about('MLflow experiment to log to; "" = the active or default one.')
    )
    mlflow_run_name: str = field(default="", metadata=about('Name of the MLflow run; "" lets MLflow choose.'))
    mlflow_log_model: bool = field(
        default=True, metadata=about("Log the trained model to the run (mlflow.pytorch).")
    )
    mlflow_pickle_model: bool = field(
        default=False,
        metadata=about(
            "Log a model that does not export as pt2 pickled (loading a pickle runs its code); "
            "off: only its weights are logged, as a weights_only torch file."
        ),
    )
