"""save_pipeline / load_pipeline's rule for JVM stages, without Spark (the round trip on a real
S3 server: tests/spark/test_object_storage.py)."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from sparkdl.errors import ConfigError
from sparkdl.ml.pipelines import _refuse_jvm_stages_off_this_machine


def test_jvm_stages_are_staged_on_a_local_masters_disk_only():
    class VectorAssembler:  # what the rule names: the stage's type
        pass

    def on(master):
        return SimpleNamespace(sparkContext=SimpleNamespace(master=master))

    for master in ("local[2]", "local-cluster[2,1,1024]"):  # the executors share the driver's disk
        _refuse_jvm_stages_off_this_machine(on(master), [VectorAssembler()])
    _refuse_jvm_stages_off_this_machine(on("yarn"), [])  # sparkdl's own stages go anywhere
    with pytest.raises(
        ConfigError, match=r"JVM stages \(VectorAssembler\) save and load through their executors"
    ):
        _refuse_jvm_stages_off_this_machine(on("spark://master:7077"), [VectorAssembler()])
    with pytest.raises(ConfigError, match=r"on yarn do not share the driver's disk"):
        _refuse_jvm_stages_off_this_machine(on("yarn"), [VectorAssembler])  # a class, as loading names it
