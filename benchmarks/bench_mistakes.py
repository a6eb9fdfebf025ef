"""Common mistakes, as a new user makes them: the error each one gets and how long it takes.

    .venv/bin/python benchmarks/bench_mistakes.py

Every mistake runs against one local[2] session (the one with a wrong PYSPARK_PYTHON in a
child process of its own); the figures go to benchmarks/results/mistakes.json and a
table is printed. A mistake that fails on every attempt must fail once, in seconds, in
the user's terms.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
os.environ.setdefault("PYSPARK_PYTHON", sys.executable)
os.environ.setdefault("SPARK_LOCAL_IP", "127.0.0.1")

from benchmarks.common import save_report  # noqa: E402


def mlp(inputs: int, outputs: int) -> Callable[[], torch.nn.Module]:
    return lambda: torch.nn.Sequential(
        torch.nn.Linear(inputs, 16), torch.nn.ReLU(), torch.nn.Linear(16, outputs)
    )


def frame(spark: Any, width: int = 6, rows: int = 256, label: str = "long", nulls: bool = False) -> Any:
    rng = np.random.default_rng(0)
    data = [
        (None if nulls and i % 7 == 0 else rng.normal(size=width).astype(float).tolist(), int(i % 3))
        for i in range(rows)
    ]
    return spark.createDataFrame(data, f"features array<double>, y {label}").repartition(2)


def mistakes(spark: Any) -> dict[str, Callable[[], Any]]:
    from sparkdl import TorchEstimator

    def est(**kwargs: Any) -> Any:
        settings = {"model_fn": mlp(6, 3), "label_col": "y", "num_workers": 2, "epochs": 1, "progress": False}
        return TorchEstimator(**{**settings, **kwargs})

    df = frame(spark)
    return {
        "first layer does not match the features (6 values, Linear(8, ...))": lambda: est(
            model_fn=mlp(8, 3)
        ).fit(df),
        "integer label with mse and a 2-output model": lambda: est(model_fn=mlp(6, 2), loss_fn="mse").fit(df),
        "loss_fn='cross_entropy' with loss='mse'": lambda: est(loss_fn="cross_entropy", loss="mse").fit(df),
        "misspelt setting (batch_sise)": lambda: est(batch_sise=32).fit(df),
        "label column that does not exist": lambda: est(label_col="target").fit(df),
        "a string feature column": lambda: est(feature_cols=["name"]).fit(
            spark.createDataFrame([("a", 1)] * 8, "name string, y long")
        ),
        "nulls in a feature column": lambda: est().fit(frame(spark, nulls=True)),
        "a class label beyond the model's outputs (labels 0..2, 2 outputs)": lambda: est(
            model_fn=mlp(6, 2)
        ).fit(df),
        "more workers than task slots": lambda: est(num_workers=3, executor_wait_timeout_s=2.0).fit(df),
    }


def attempt(run: Callable[[], Any]) -> dict[str, Any]:
    started = time.monotonic()
    try:
        run()
    except Exception as exc:
        return {
            "error": type(exc).__name__,
            "message": str(exc)[:400],
            "seconds": round(time.monotonic() - started, 2),
        }
    return {"error": "", "message": "no error", "seconds": round(time.monotonic() - started, 2)}


def wrong_interpreter() -> dict[str, Any]:
    """The main job's fit with PYSPARK_PYTHON pointing at a Python without torch or sparkdl."""
    python = shutil.which("python3", path="/usr/bin:/usr/local/bin") or ""
    if not python or python == sys.executable:
        return {"error": "", "message": "skipped: no second interpreter on this machine", "seconds": 0.0}
    code = (
        "import json, sys, time; sys.path.insert(0, sys.argv[1]); import sparkdl; "
        "from benchmarks.bench_mistakes import frame, mlp, attempt; "
        "spark = sparkdl.session('local[2]', 'mistake', **{'spark.ui.enabled': 'false'}); "
        "est = sparkdl.TorchEstimator(model_fn=mlp(6, 3), label_col='y', num_workers=2, epochs=1, "
        "progress=False); "
        "df = frame(spark); print(json.dumps(attempt(lambda: est.fit(df)))); spark.stop()"
    )
    env = {**os.environ, "PYSPARK_PYTHON": python}
    done = subprocess.run(
        [sys.executable, "-c", code, str(ROOT)], env=env, capture_output=True, text=True, timeout=600
    )
    lines = [line for line in done.stdout.splitlines() if line.startswith("{")]
    return json.loads(lines[-1]) if lines else {"error": "?", "message": done.stderr[-400:], "seconds": 0.0}


def main() -> None:
    import sparkdl

    spark = sparkdl.session("local[2]", "sparkdl-mistakes", **{"spark.ui.enabled": "false"})
    spark.sparkContext.setLogLevel("ERROR")
    warm = frame(spark)
    attempt(
        lambda: sparkdl.TorchEstimator(model_fn=mlp(6, 3), label_col="y", epochs=1, progress=False).fit(warm)
    )
    results = {name: attempt(run) for name, run in mistakes(spark).items()}
    spark.stop()
    results["PYSPARK_PYTHON names a Python without torch or sparkdl"] = wrong_interpreter()
    print("| mistake | error | seconds to fail | message |\n|---|---|---|---|")
    for name, result in results.items():
        message = result["message"].replace("|", "/").replace("\n", " ")
        print(f"| {name} | {result['error']} | {result['seconds']} | {message} |")
    save_report(str(ROOT / "benchmarks/results/mistakes.json"), results=results)


if __name__ == "__main__":
    main()
