"""A class-data-sharing archive of the JVM classes a Spark driver loads, for the tests' JVMs.

Every Spark JVM the suite starts (about a hundred: the test processes' drivers, local-cluster
and standalone executors, masters, workers, Connect servers) spends most of its start loading
and verifying the same ten thousand classes from Spark's jars. Java's application class-data
sharing (JEP 350) records them once, parsed and verified, in an archive that later JVMs map
read-only: on 2 cores a local session's start falls from 14.2 to 9.5 CPU seconds and a
two-executor local-cluster's from 31 to 21.5.

:class:`Builder` builds the archive once per Java build, PySpark version and jar set (a
driver running :func:`_workload`, a small fit, transform and save, with
``-XX:ArchiveClassesAtExit``), in the background while the first tests run, and keeps it in
pytest's cache directory; the conftest names it in ``JDK_JAVA_OPTIONS`` from the start, and
a JVM started before it is in place (or where none could be built), or whose class path
does not match the archive's (the launcher's own small JVM), starts as before:
``-Xlog:cds*=off`` keeps the warning off stdout. Test speed only: users' JVMs keep Java's
defaults.
"""

from __future__ import annotations

import hashlib
import os
import signal
import subprocess
import sys
import tempfile
import threading
from pathlib import Path

#: What a JVM needs to map the archive, and to stay quiet where it cannot.
USE = "-XX:SharedArchiveFile={path} -Xlog:cds*=off"

#: The most the one-time dump may take (a driver start and a small fit: about 20 s on 2 cores).
DUMP_TIMEOUT_S = 240.0


def _key() -> str:
    """What the archive depends on: the Java build, Spark's jars, and this file."""
    import pyspark

    java = subprocess.run(["java", "-version"], capture_output=True, text=True, timeout=60).stderr
    jars = sorted(p.name for p in (Path(pyspark.__file__).parent / "jars").glob("*.jar"))
    digest = hashlib.sha256()
    for part in (java, pyspark.__version__, *jars, Path(__file__).read_text()):
        digest.update(part.encode())
    return digest.hexdigest()[:16]


class Builder:
    """The archive for this machine's Java and Spark: its path at once, built in the
    background where missing (a JVM started before it is in place runs without it, as
    where none can be built; the archive appears whole, renamed into place)."""

    def __init__(self, cache_dir: Path) -> None:
        self.path: Path | None = None
        self._dump: subprocess.Popen[str] | None = None
        self._thread: threading.Thread | None = None
        try:
            self.path = cache_dir / f"spark-{_key()}.jsa"
        except (OSError, subprocess.SubprocessError) as e:
            _say(f"cannot read the Java version ({e})")
            return
        if self.path.exists():
            return
        cache_dir.mkdir(parents=True, exist_ok=True)
        for stale in cache_dir.glob("spark-*.jsa"):
            stale.unlink(missing_ok=True)
        fd, partial = tempfile.mkstemp(dir=cache_dir, prefix=".dump-", suffix=".jsa")
        os.close(fd)
        os.unlink(partial)  # the JVM writes it at exit
        self._dump = subprocess.Popen(
            [sys.executable, "-m", "tests.jvm_archive", partial],
            cwd=Path(__file__).parent.parent,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.PIPE,
            text=True,
            start_new_session=True,
        )
        self._thread = threading.Thread(target=self._finish, args=(Path(partial),), daemon=True)
        self._thread.start()

    def _finish(self, partial: Path) -> None:
        assert self._dump is not None and self.path is not None
        try:
            _, errors = self._dump.communicate(timeout=DUMP_TIMEOUT_S)
            if self._dump.returncode == 0 and partial.exists():
                os.replace(partial, self.path)
            elif self._dump.returncode > 0:  # not stopped by stop()
                _say(f"the dump run failed (rc {self._dump.returncode}): {errors[-2000:]}")
        except subprocess.TimeoutExpired:
            _say(f"the dump run took over {DUMP_TIMEOUT_S:.0f} s")
            os.killpg(self._dump.pid, signal.SIGKILL)
            self._dump.wait(10)
        finally:
            partial.unlink(missing_ok=True)

    def stop(self) -> None:
        """The session ends: a dump still running (a short run) is stopped, its file removed."""
        if self._dump is not None and self._dump.poll() is None:
            os.killpg(self._dump.pid, signal.SIGTERM)
        if self._thread is not None:
            self._thread.join(30)


def _say(why: str) -> None:
    """Why the suite runs without an archive (slower, not wrong): on the terminal, at startup."""
    print(f"tests: no JVM class archive, the JVMs start without one: {why}", file=sys.stderr)


def _workload(archive: str) -> None:
    """What most test drivers do: a local[2] session, a two-worker fit from a DataFrame,
    transform, and a model saved and loaded through Spark ML's persistence."""
    import torch

    from sparkdl import TorchEstimator, TorchModel
    from sparkdl.config import SparkDLConfig
    from sparkdl.spark.session import build_session

    spark = build_session(
        "local[2]",
        "sparkdl-jvm-archive",
        SparkDLConfig(),
        {
            "spark.ui.enabled": "false",
            "spark.driver.host": "127.0.0.1",
            "spark.driver.extraJavaOptions": f"-XX:ArchiveClassesAtExit={archive}",
        },
    )
    try:
        rows = [([float(i % 7), float(i % 3)], i % 2) for i in range(64)]
        frame = spark.createDataFrame(rows, "features array<float>, label long").repartition(2)
        estimator = TorchEstimator(
            model_fn=_model,
            optimizer_fn=_sgd,
            loss_fn="cross_entropy",
            feature_cols=["features"],
            label_col="label",
            num_workers=2,
            batch_size=8,
            epochs=1,
        )
        model = estimator.fit(frame)
        model.transform(frame).groupBy("prediction").count().collect()
        with tempfile.TemporaryDirectory() as where:
            model.write().overwrite().save(f"{where}/model")
            TorchModel.load(f"{where}/model", model_fn=_model)
            frame.write.parquet(f"{where}/rows")
            spark.read.parquet(f"{where}/rows").count()
        assert isinstance(model.module, torch.nn.Module)
    finally:
        spark.stop()


def _model():  # type: ignore[no-untyped-def]
    import torch

    return torch.nn.Linear(2, 2)


def _sgd(params):  # type: ignore[no-untyped-def]
    import torch

    return torch.optim.SGD(params, lr=0.1)


if __name__ == "__main__":
    os.environ.setdefault("SPARK_LOCAL_IP", "127.0.0.1")
    os.environ.setdefault("PYSPARK_PYTHON", sys.executable)
    _workload(sys.argv[1])
