"""A Spark Connect client: fit and transform, the TorchDistributor and sparkdl.run, through
``SparkSession.builder.remote``.

Run by tests/spark/test_connect.py in its own process against a Connect server it
started: python tests/spark/connect_client.py sc://127.0.0.1:PORT OUT.json
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

import numpy as np  # noqa: E402
import pyarrow as pa  # noqa: E402

from sparkdl import ClusterConfigError, TorchEstimator  # noqa: E402
from tests.reference import make_tiny_net  # noqa: E402


def learnable_table(rows: int, seed: int) -> pa.Table:
    """Six features; the class is the argmax of a fixed projection (learnable by TinyNet)."""
    rng = np.random.default_rng(seed)
    x = rng.normal(size=(rows, 6)).astype(np.float32)
    y = (x @ np.random.default_rng(0).normal(size=(6, 3))).argmax(axis=1).astype(np.int64)
    features = pa.FixedSizeListArray.from_arrays(pa.array(x.reshape(-1)), 6).cast(pa.list_(pa.float32()))
    return pa.table({"features": features, "label": pa.array(y)})


def ddp_sum(scale: float) -> dict:
    """A PySpark-TorchDistributor function: gloo over env://, one all-reduce, a state dict back."""
    import torch
    import torch.distributed as dist

    dist.init_process_group("gloo")
    total = torch.tensor([float(dist.get_rank() + 1)])
    dist.all_reduce(total)
    world = dist.get_world_size()
    dist.destroy_process_group()
    return {"total": total * scale, "world": torch.tensor([world])}


def own_loop(ctx) -> dict:
    """A user's loop with ctx: all-reduce over the DataFrame's partitions."""
    import torch
    import torch.nn.functional as F

    model = make_tiny_net()
    model, optimizer = ctx.prepare(model, torch.optim.SGD(model.parameters(), lr=0.1))
    for epoch in ctx.epochs:
        for batch in ctx.batches(epoch):
            loss = F.cross_entropy(model(batch.inputs["features"]), batch.label)
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
            ctx.report(loss=loss.item())
    return model.module.state_dict()


def own_code(spark, train, results: dict) -> None:
    """sparkdl.TorchDistributor and sparkdl.run over Connect (the ranks meet through allGather,
    results come back in the rows)."""
    import sparkdl
    from sparkdl import TorchDistributor

    value = TorchDistributor(num_processes=2, local_mode=False, use_gpu=False).run(ddp_sum, 2.0)
    results["distributor"] = {k: v.tolist() for k, v in value.items()}
    run = sparkdl.run(own_loop, df=train, num_workers=2, batch_size=64, epochs=2, collective_timeout_s=60.0)
    results["run"] = {
        "keys": sorted(run.value),
        "losses": [h["loss"] for h in run.history],
        "devices": [d["device"] for d in run.worker_devices],
    }


def main(url: str, out: Path) -> None:
    from pyspark.sql import SparkSession

    spark = SparkSession.builder.remote(url).getOrCreate()
    results: dict = {"session": type(spark).__module__}
    train = spark.createDataFrame(learnable_table(2000, 1))
    test = spark.createDataFrame(learnable_table(500, 2))
    for strategy in ("allreduce", "weight_averaging"):
        est = TorchEstimator(
            model_fn=make_tiny_net,
            feature_cols=["features"],
            label_col="label",
            num_workers=2,
            batch_size=32,
            epochs=6,
            lr=0.1,
            strategy=strategy,
            sync_every=4,
            collective_timeout_s=60.0,
        )
        model = est.fit(train)
        predicted = model.transform(test)
        rows = predicted.select("label", "prediction").collect()
        results[strategy] = {
            "losses": [h["loss"] for h in model.history],
            "worker_samples": model.history[-1]["worker_samples"],
            "columns": predicted.columns,
            "rows": len(rows),
            "accuracy": sum(int(r[0] == r[1]) for r in rows) / len(rows),
        }
    own_code(spark, train, results)
    try:
        TorchEstimator(model_fn=make_tiny_net, num_workers=2, strategy="parameter_server").fit(train)
        results["parameter_server"] = "no error"
    except ClusterConfigError as exc:
        results["parameter_server"] = str(exc)
    out.write_text(json.dumps(results))
    spark.stop()


if __name__ == "__main__":
    main(sys.argv[1], Path(sys.argv[2]))
