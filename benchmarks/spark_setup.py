"""Driver-side helpers shared by the Spark benchmarks: the session and the data frames."""

from __future__ import annotations

import os
import sys
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))
os.environ.setdefault("SPARK_LOCAL_IP", "127.0.0.1")
os.environ.setdefault("PYSPARK_PYTHON", sys.executable)
os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")

from common import make_table  # noqa: E402

from sparkdl.config import SparkDLConfig  # noqa: E402
from sparkdl.spark.session import build_session  # noqa: E402


def bench_session(app_name: str) -> Any:
    """local[2], quiet, with benchmarks/common.py shipped to the executors (model_fn lives there)."""
    spark = build_session(
        "local[2]", app_name, SparkDLConfig(), {"spark.ui.enabled": "false", "spark.driver.memory": "6g"}
    )
    spark.sparkContext.setLogLevel("ERROR")
    spark.sparkContext.addPyFile(str(HERE / "common.py"))
    return spark


def dataframe(spark: Any, rows: int, partitions: int, seed: int = 0) -> Any:
    """The synthetic data set as a cached DataFrame (features: array<float>, label: long)."""
    table = make_table(rows, seed)
    df = spark.createDataFrame(table).repartition(partitions).cache()
    df.count()
    return df
