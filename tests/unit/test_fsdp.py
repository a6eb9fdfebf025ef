"""Strategy "fsdp" (FSDP2) on real gloo process groups over loopback, without Spark.

Spawned processes run ``run_worker`` as barrier tasks do (the helpers of
test_worker_gloo). The trained weights are rank 0's result (the shards gathered by
``full_state_dict``), checked against the run's last checkpoint: the shards each rank
writes at every epoch end, assembled whole.
"""

from __future__ import annotations

import ctypes
import io
import time
from pathlib import Path

import numpy as np
import pyarrow as pa
import pytest
import torch
from torch import nn
from torch.distributed.checkpoint.metadata import MetadataIndex

from sparkdl.config import SparkDLConfig
from sparkdl.data.columns import LabelKind
from sparkdl.data.decoding import decode_block
from sparkdl.data.inputs import plan_data
from sparkdl.data.tensors import to_batch
from sparkdl.errors import ConfigError
from sparkdl.storage import sharded
from sparkdl.storage.checkpoint_store import CheckpointStore
from sparkdl.strategies import check_settings
from sparkdl.strategies.fsdp import shard_units
from sparkdl.training.checkpointing import whole_checkpoint
from sparkdl.worker.assembly import Placement, TrainSpec, run_worker
from tests import object_store
from tests.reference import (
    TinyNet,
    make_shards,
    make_tiny_net,
    max_abs_diff,
    reference_sgd,
    shard_plan,
    shard_to_batch,
)
from tests.unit.test_worker_gloo import LR, MOMENTUM, _sgd, file_all_gather, run_workers
from tests.workers import worker_context

s3_server = object_store.s3_server  # the fixture

pytestmark = pytest.mark.slow

_BASELINE: list[int] = []  # VmRSS in KiB just before the model is built (in the worker process)


def _adam(params):
    return torch.optim.Adam(params, lr=0.01)


class PoisonNet(TinyNet):
    """TinyNet whose output is NaN for a row whose first feature is above 100 (a NaN loss
    that the feed's input checks cannot see)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        poison = torch.where(
            x[:, :1] > 100, torch.full_like(x[:, :1], float("nan")), torch.zeros_like(x[:, :1])
        )
        return super().forward(x) + poison


def make_poison_net() -> nn.Module:
    return PoisonNet()


def make_wide_net() -> nn.Module:
    """Eight equal layers of 1024 x 1024 (32 MiB of float32 weights)."""
    _return_freed_memory()
    _reset_peak()
    _BASELINE[:] = [_status_kib("VmRSS")]
    return nn.Sequential(*[nn.Linear(1024, 1024) for _ in range(8)])


# ------------------------------------------------------------------ spawning


def _worker(rank, world, record_batches, spec, store_path, out, runs=1, gpus=False):
    import os

    os.environ["GLOO_SOCKET_IFNAME"] = "lo"
    try:
        placement = Placement(rank, world, "127.0.0.1", gpu_addresses=(str(rank),) if gpus else ())
        for run in range(runs):  # the last run is the one measured
            gather = file_all_gather(f"{store_path}-{run}", rank, world)
            result = run_worker(spec, iter(record_batches), placement, gather)
        peak = _status_kib("VmHWM") - _BASELINE[0] if _BASELINE else 0
        out.put((rank, result.history, None, peak, result.state))
    except Exception as exc:  # reported to the test process
        out.put((rank, [], exc, 0, b""))


def spawn(
    parts,
    spec,
    tmp_path: Path,
    runs: int = 1,
    weights: dict | None = None,
    gpus: bool = False,
    fresh: bool = False,
):
    """Run ``spec`` ``runs`` times in a row on one process per entry of ``parts`` (each a
    list of record batches); return {rank: (history, error, peak KiB)} of the last run, and
    put rank 0's trained weights into ``weights``. ``fresh``: workers from a new interpreter
    (their memory measured from zero, their environment read at start-up)."""
    tmp_path.mkdir(parents=True, exist_ok=True)
    ctx = worker_context(fresh)
    out = ctx.Queue()
    world = len(parts)
    procs = [
        ctx.Process(target=_worker, args=(r, world, parts[r], spec, str(tmp_path / "store"), out, runs, gpus))
        for r in range(world)
    ]
    for p in procs:
        p.start()
    results = {}
    for _ in procs:
        rank, history, error, peak, state = out.get(timeout=120)
        results[rank] = (history, error, peak)
        if state and weights is not None:
            weights.update(torch.load(io.BytesIO(state), weights_only=True))
    for p in procs:
        p.join(30)
    return results


def train(
    shards, tmp_path: Path, optimizer_fn=_sgd, model_fn=make_tiny_net, parts=None, gpus=False, **settings
):
    """Train with strategy fsdp; return the final (gathered) weights and the results."""
    config = SparkDLConfig().replace(
        num_workers=len(shards),
        collective_timeout_s=30.0,
        prefetch_batches=2,
        strategy="fsdp",
        checkpoint_dir=str(tmp_path / "ckpt"),
        **settings,
    )
    plan, template = shard_plan(shards)
    spec = TrainSpec(config, model_fn, optimizer_fn, "cross_entropy", plan, template)
    if parts is None:
        parts = [[shard_to_batch(x, y)] if len(y) else [] for x, y in shards]
    state: dict = {}
    results = spawn(parts, spec, tmp_path, weights=state, gpus=gpus)
    errors = {r: e for r, (_, e, _) in results.items() if e is not None}
    assert not errors, errors
    saved = last_checkpoint(tmp_path / "ckpt")["model"]
    assert state.keys() == saved.keys()
    assert all(torch.equal(state[k], saved[k]) for k in saved)  # full, not rank 0's shard
    return state, results


def last_checkpoint(directory: Path | str, options=None):
    """The newest checkpoint, its model whole (assembled from the ranks' shards)."""
    store = CheckpointStore(str(directory), options=options)
    try:
        return whole_checkpoint(store, store.latest())
    finally:
        store.close()


# ------------------------------------------------------------------ the tests


@pytest.mark.parametrize(
    ("sizes", "shuffle"),
    [
        ([50, 21], False),  # uneven: the short worker steps on zero-weight fillers
        ([40, 0, 17], True),  # one worker with no rows at all
    ],
)
def test_fsdp_equals_all_reduce_and_single_process_sgd_with_momentum(tmp_path, sizes, shuffle):
    shards = make_shards(sizes)
    settings = {"batch_size": 8, "epochs": 2, "shuffle": shuffle}
    state, results = train(shards, tmp_path / "fsdp", **settings)
    expected = reference_sgd(shards, 8, 2, 0, LR, MOMENTUM, shuffle)
    allreduce, _ = run_workers(shards, tmp_path / "allreduce", **settings)
    assert max_abs_diff(state, expected) < 1e-5
    assert max_abs_diff(state, allreduce) < 1e-5
    history = results[0][0]
    assert [h["samples"] for h in history] == [sum(sizes)] * 2
    assert all(h["steps"] == max((s + 7) // 8 for s in sizes) for h in history)


class ScaledNet(TinyNet):
    """TinyNet with a buffer outside its state dict: fsdp cannot build it on the meta device
    (nothing would fill that buffer), so every rank builds it whole, then shards it."""

    def __init__(self) -> None:
        super().__init__()
        self.register_buffer("scale", torch.tensor(0.5), persistent=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return super().forward(x) * self.scale


def make_scaled_net() -> nn.Module:
    return ScaledNet()


def all_reduce_weights(shards, tmp_path: Path, model_fn, optimizer_fn, **settings) -> dict:
    """Rank 0's final weights of the same fit under all-reduce (the default strategy)."""
    plan, template = shard_plan(shards)
    config = SparkDLConfig().replace(num_workers=len(shards), collective_timeout_s=30.0, **settings)
    spec = TrainSpec(config, model_fn, optimizer_fn, "cross_entropy", plan, template)
    weights: dict = {}
    spawn([[shard_to_batch(x, y)] for x, y in shards], spec, tmp_path, weights=weights)
    return weights


def test_a_model_with_a_non_persistent_buffer_is_built_whole_and_trains_as_all_reduce(tmp_path):
    shards = make_shards([50, 21])
    settings = {"batch_size": 8, "epochs": 2, "shuffle": False}
    state, _ = train(shards, tmp_path / "fsdp", model_fn=make_scaled_net, **settings)
    weights = all_reduce_weights(shards, tmp_path / "allreduce", make_scaled_net, _sgd, **settings)
    assert max_abs_diff(state, weights) < 1e-5
    assert max_abs_diff(state, make_tiny_net().state_dict()) > 1e-2  # it did train


def make_flat_net() -> nn.Module:
    """24 small layers of 3.5-4% of the parameters each: fsdp shards them in runs of two."""
    hidden = [m for _ in range(24) for m in (nn.Linear(8, 8), nn.Tanh())]
    return nn.Sequential(nn.Linear(6, 8), nn.Tanh(), *hidden, nn.Linear(8, 3))


def test_a_flat_stack_sharded_in_runs_trains_as_all_reduce(tmp_path):
    units = shard_units(make_flat_net())
    assert len(units) >= 10 and all(isinstance(unit, list) for unit in units), units
    shards = make_shards([50, 21])
    settings = {"batch_size": 8, "epochs": 2, "shuffle": False}
    state, _ = train(shards, tmp_path / "fsdp", _adam, model_fn=make_flat_net, **settings)
    weights = all_reduce_weights(shards, tmp_path / "allreduce", make_flat_net, _adam, **settings)
    assert max_abs_diff(state, weights) < 1e-5
    torch.manual_seed(0)
    assert max_abs_diff(state, make_flat_net().state_dict()) > 1e-3  # it did train


def test_fsdp_with_adam_and_clipping_equals_all_reduce(tmp_path):
    shards = make_shards([50, 21])
    settings = {"batch_size": 8, "epochs": 2, "shuffle": True, "grad_clip_norm": 0.5}
    state, _ = train(shards, tmp_path / "fsdp", _adam, **settings)
    allreduce, _ = run_workers(shards, tmp_path / "allreduce", _adam, **settings)
    assert max_abs_diff(state, allreduce) < 1e-5
    assert max_abs_diff(state, make_tiny_net().state_dict()) > 1e-2  # it did train


def test_fsdp_accumulating_two_batches_of_4_equals_steps_on_batches_of_8(tmp_path):
    shards = make_shards([37, 20])  # uneven, with a short last step: fillers make up the micro-batches
    state, results = train(shards, tmp_path, batch_size=4, accumulate_steps=2, epochs=2, shuffle=False)
    assert max_abs_diff(state, reference_sgd(shards, 8, 2, 0, LR, MOMENTUM, False)) < 1e-5
    assert [h["steps"] for h in results[0][0]] == [5, 5]


def _poisoned(sizes, rank, row):
    shards = make_shards(sizes)
    shards[rank][0][row, 0] = 1000.0  # its forward gives NaN
    return shards


def test_a_nan_loss_on_one_rank_is_skipped_by_every_rank_alike(tmp_path):
    shards = _poisoned([32, 32], rank=1, row=17)  # step 2 of rank 1
    state, results = train(
        shards, tmp_path, model_fn=make_poison_net, batch_size=8, epochs=1, shuffle=False, on_nan_loss="skip"
    )
    assert [results[r][0][0]["nan_skips"] for r in (0, 1)] == [1, 1]
    clean = make_shards([32, 32])
    keep = [np.r_[0:16, 24:32], np.r_[0:16, 24:32]]  # the reference without step 2
    expected = reference_sgd(
        [(x[k], y[k]) for (x, y), k in zip(clean, keep, strict=True)], 8, 1, 0, LR, MOMENTUM, False
    )
    assert max_abs_diff(state, expected) < 1e-5


def test_a_nan_loss_on_one_rank_stops_every_rank_at_once(tmp_path):
    shards = _poisoned([32, 32], rank=1, row=17)
    started = time.monotonic()
    config = SparkDLConfig().replace(
        num_workers=2, collective_timeout_s=30.0, strategy="fsdp", batch_size=8, epochs=1, shuffle=False
    )
    plan, template = shard_plan(shards)
    spec = TrainSpec(config, make_poison_net, _sgd, "cross_entropy", plan, template)
    results = spawn([[shard_to_batch(x, y)] for x, y in shards], spec, tmp_path)
    assert time.monotonic() - started < 25  # no rank waited for a collective timeout
    errors = {r: results[r][1] for r in (0, 1)}
    assert "non-finite loss or gradient at rank 1, epoch 1, step 2" in str(errors[1])
    assert "non-finite averaged gradient at epoch 1, step 2" in str(errors[0])
    assert all(e.agreed_by_all_ranks for e in errors.values())


def _resumed_after_a_fault(tmp_path: Path, checkpoint_dir: str, options=None):
    """fsdp on two ranks with Adam, rank 1 failing at step 11 (after the checkpoint of step
    10), run again from ``checkpoint_dir``; the settings and shards."""
    shards = make_shards([50, 21])
    settings = {"batch_size": 8, "epochs": 2, "shuffle": True}
    marker = tmp_path / "drill"
    config = SparkDLConfig().replace(
        num_workers=2,
        collective_timeout_s=10.0,
        strategy="fsdp",
        checkpoint_dir=checkpoint_dir,
        checkpoint_every=2,
        storage_options=options or {},
        fault_injection=f"raise:1:11:{marker}",  # epoch 2, after the checkpoint of step 10
        **settings,
    )
    plan, template = shard_plan(shards)
    spec = TrainSpec(config, make_tiny_net, _adam, "cross_entropy", plan, template)
    parts = [[shard_to_batch(x, y)] for x, y in shards]
    failed = spawn(parts, spec, tmp_path)
    assert "fault drill: rank 1 raised at step 11" in str(failed[1][1])
    assert CheckpointStore(checkpoint_dir, options=options).latest() == 10
    written = CheckpointStore(checkpoint_dir, options=options).load(10)
    resumed = spawn(parts, spec, tmp_path / "again")
    assert all(e is None for _, e, _ in resumed.values()), resumed
    assert resumed[0][0][-1]["resumed_from_step"] == 10
    return shards, settings, written


def test_fsdp_ranks_write_their_own_shards_and_resume_from_them_to_the_same_weights(tmp_path):
    shards, settings, written = _resumed_after_a_fault(tmp_path, str(tmp_path / "ckpt"))
    # rank 0's file holds where training stood, no tensor of the model: each rank wrote its own
    assert written["model"] == {} and written["optimizer"] == {} and written["shards"]
    last = CheckpointStore(str(tmp_path / "ckpt")).latest()
    folder = tmp_path / "ckpt" / f"checkpoint-{last:09d}.shards"
    assert {"__0_0.distcp", "__1_0.distcp", ".metadata"} <= {p.name for p in folder.iterdir()}
    # every weight and Adam moment is in two halves, one in each rank's file
    metadata = sharded._reader(folder, {}).read_metadata()
    for name, param in make_tiny_net().named_parameters():
        for key in (f"model.{name}", f"optimizer.state.{name}.exp_avg", f"optimizer.state.{name}.exp_avg_sq"):
            chunks = metadata.state_dict_metadata[key].chunks
            files = {metadata.storage_data[MetadataIndex(key, c.offsets)].relative_path for c in chunks}
            assert [c.sizes[0] for c in chunks] == [(param.shape[0] + 1) // 2, param.shape[0] // 2], key
            assert files == {"__0_0.distcp", "__1_0.distcp"}, (key, files)
    state = last_checkpoint(tmp_path / "ckpt")["model"]
    uninterrupted, _ = run_workers(shards, tmp_path / "allreduce", _adam, **settings)
    assert max_abs_diff(state, uninterrupted) < 1e-5
    # the only two checkpoints kept have their shards; older ones went with their folders
    kept = sorted(p.name for p in (tmp_path / "ckpt").iterdir() if p.name.startswith("checkpoint-"))
    steps = sorted({name.split(".")[0] for name in kept})
    assert len(steps) == 2 and kept == sorted(f"{s}.{kind}" for s in steps for kind in ("pt", "shards"))


def test_fsdp_shards_on_s3_resume_to_the_same_weights_and_assemble_whole(tmp_path, s3_server):
    url = s3_server.url("fsdp")
    shards, settings, _ = _resumed_after_a_fault(tmp_path, url, s3_server.options)
    last = CheckpointStore(url, options=s3_server.options).latest()
    listed = s3_server.fs().ls(f"{url.removeprefix('s3://')}/checkpoint-{last:09d}.shards", refresh=True)
    assert {p.rsplit("/", 1)[-1] for p in listed} >= {"__0_0.distcp", "__1_0.distcp", ".metadata"}
    state = last_checkpoint(url, s3_server.options)["model"]
    uninterrupted, _ = run_workers(shards, tmp_path / "allreduce", _adam, **settings)
    assert max_abs_diff(state, uninterrupted) < 1e-5


def _with_held_out(x, y, held: int) -> pa.RecordBatch:
    batch = shard_to_batch(x, y)
    val = pa.array([i < held for i in range(len(y))])
    return pa.RecordBatch.from_arrays([*batch.columns, val], [*batch.schema.names, "val"])


def test_validation_with_unequal_held_out_rows_gives_all_reduces_figures(tmp_path):
    shards = make_shards([40, 24])
    parts = [[_with_held_out(*shards[0], held=20)], [_with_held_out(*shards[1], held=3)]]
    plan = plan_data(
        parts[0][0].schema,
        feature_cols=("features",),
        label_col="label",
        label_kind=LabelKind.CLASS_INDEX,
        validation_col="val",
    )
    template = to_batch(decode_block(parts[0][0].slice(0, 2), plan), plan)
    figures = {}
    for strategy in ("fsdp", "allreduce"):
        config = SparkDLConfig().replace(
            num_workers=2,
            collective_timeout_s=30.0,
            strategy=strategy,
            batch_size=8,
            epochs=3,
            inference_batch_size=4,  # 5 held-out batches on rank 0, 1 on rank 1
            early_stopping_patience=1,
            optimizer="adam",
            lr=0.5,  # high enough that some epoch gets worse
        )
        spec = TrainSpec(config, make_tiny_net, None, "cross_entropy", plan, template)
        results = spawn(parts, spec, tmp_path / strategy)
        assert all(e is None for _, e, _ in results.values()), results
        figures[strategy] = [
            (h["val_loss"], h["val_samples"], h.get("restored_epoch")) for h in results[0][0]
        ]
    assert [f[1] for f in figures["fsdp"]] == [23] * len(figures["fsdp"])
    assert len(figures["fsdp"]) == len(figures["allreduce"])
    for (fsdp_loss, _, fsdp_restored), (ar_loss, _, ar_restored) in zip(
        figures["fsdp"], figures["allreduce"], strict=True
    ):
        assert fsdp_loss == pytest.approx(ar_loss, abs=1e-5)
        assert fsdp_restored == ar_restored


def test_fsdp_refuses_fp16_and_compression_naming_the_fix():
    with pytest.raises(ConfigError, match="precision = 'bf16'"):
        check_settings(SparkDLConfig().replace(strategy="fsdp", precision="fp16"))
    with pytest.raises(ConfigError, match="compression = 'none'"):
        check_settings(SparkDLConfig().replace(strategy="fsdp", compression="fp16"))


def test_each_large_enough_submodule_is_its_own_unit_innermost_first():
    model = nn.Sequential(
        nn.Linear(100, 100), nn.Sequential(nn.Linear(100, 100), nn.Linear(100, 2)), nn.ReLU()
    )
    units = shard_units(model)
    assert units == [model[0], model[1][0]]  # model[1][1] (202 params) is under 5%: the root keeps it
    tiny = TinyNet()
    assert shard_units(tiny) == [tiny.body[0], tiny.body[2]]  # 56 and 27 of 83 parameters


def test_a_flat_stack_of_small_layers_is_sharded_in_runs_not_gathered_whole():
    """61 layers of 1.6% each: no layer reaches 5%, so runs of 4 consecutive ones (6.6%)
    are the units, and the root keeps the last, shorter run (the ReLUs hold nothing)."""
    layers = [m for _ in range(61) for m in (nn.Linear(16, 16), nn.ReLU())]
    model = nn.Sequential(*layers)
    units = shard_units(model)
    linears = [m for m in model if isinstance(m, nn.Linear)]
    assert units == [linears[i : i + 4] for i in range(0, 60, 4)]
    root_keeps = sum(p.numel() for p in linears[60].parameters())
    assert root_keeps / sum(p.numel() for p in model.parameters()) < 0.05


# ------------------------------------------------------------------ memory


def _status_kib(field: str) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1])
    raise AssertionError(f"no {field} in /proc/self/status")


M_MMAP_THRESHOLD = -3  # glibc's mallopt parameter


def _return_freed_memory() -> None:
    """Fix glibc's mmap threshold at 128 KiB, so that a freed tensor goes back to the OS and
    RSS follows the live tensors (by default the threshold grows up to 32 MiB and freed
    blocks stay in the heap: RSS would measure the allocator's history)."""
    assert ctypes.CDLL("libc.so.6").mallopt(M_MMAP_THRESHOLD, 128 * 1024) == 1


def _reset_peak() -> None:
    """Reset VmHWM to the current RSS (Linux: writing 5 to clear_refs)."""
    Path("/proc/self/clear_refs").write_text("5")


_PEAKS: dict[str, float] = {}  # rank 1's peak MiB by strategy: all-reduce's is measured once for both


@pytest.mark.parametrize("strategy", ["fsdp", "pipeline"])
def test_a_split_model_with_adam_needs_at_most_0_6_of_all_reduces_memory_per_worker(tmp_path, strategy):
    """Peak memory of a worker training 8 x Linear(1024, 1024) with Adam on 2 workers.

    Measured in worker processes each fitting twice in a row; the second fit is measured,
    so one-time costs (lazy imports, DTensor's operator tables, about 30 MiB at the first
    ``fully_shard``) stay out of the figure. model_fn fixes glibc's mmap threshold
    (:func:`_return_freed_memory`), resets the process's peak RSS (VmHWM, via
    /proc/self/clear_refs) and records its RSS just before it builds the model; after
    training, the peak minus that baseline is what the model, its gradients, the optimizer
    state, the communication buffers and the activations took. Rank 1's figure is
    compared: rank 0 also gathers the final weights for the driver.
    All-reduce holds weights, gradients (DDP's buckets) and two Adam moments whole,
    about 4 x 32 MiB; fsdp holds half of each, plus one gathered unit at a time; a
    pipeline's stage half of each (rank 1 allocates only its stage, sent by rank 0).
    """
    rng = np.random.default_rng(0)
    shards = []
    for _ in range(2):
        shards.append(
            (rng.normal(size=(32, 1024)).astype(np.float32), rng.integers(0, 10, 32).astype(np.int64))
        )
    plan, template = shard_plan(shards)
    parts = [[shard_to_batch(x, y)] for x, y in shards]
    peaks = _PEAKS
    for run in ("allreduce", strategy):
        if run in peaks:  # the all-reduce baseline of the other parametrization (same workload)
            continue
        config = SparkDLConfig().replace(
            num_workers=2, collective_timeout_s=30.0, strategy=run, batch_size=8, epochs=1, shuffle=False
        )
        spec = TrainSpec(config, make_wide_net, _adam, "cross_entropy", plan, template)
        results = spawn(parts, spec, tmp_path / run, runs=2)
        assert all(e is None for _, e, _ in results.values()), results
        peaks[run] = results[1][2] / 1024
    ratio = peaks[strategy] / peaks["allreduce"]
    figures = f"allreduce {peaks['allreduce']:.1f}, {strategy} {peaks[strategy]:.1f}, ratio {ratio:.2f}"
    print(f"peak MiB per worker (rank 1): {figures}")
    assert ratio <= 0.6, figures


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_fsdp_on_gpus_with_nccl_matches_the_cpu_run(tmp_path):
    """One worker per GPU (up to 2), each on the GPU its Spark resources would name, NCCL."""
    world = min(torch.cuda.device_count(), 2)
    shards = make_shards([48, 29][:world])
    settings = {"batch_size": 8, "epochs": 2, "shuffle": False}
    on_gpus, results = train(shards, tmp_path / "gpu", _adam, gpus=True, use_gpu="true", **settings)
    on_cpu, _ = train(shards, tmp_path / "cpu", _adam, use_gpu="false", **settings)
    assert max_abs_diff(on_gpus, on_cpu) < 1e-4
    assert results[0][0][-1]["peak_gpu_mb"] > 0  # it did run on the GPU
