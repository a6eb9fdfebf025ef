"""Errors are data: every error class crosses from a worker to the driver with its fields."""

from __future__ import annotations

import pickle

import pytest

from sparkdl import errors
from sparkdl.errors import (
    BadDataError,
    ErrorRecord,
    PeerStopped,
    SparkDLError,
    TrainingFailedError,
    WorkerFailed,
    agreed,
)


def every_error_class() -> list[type[SparkDLError]]:
    found: list[type[SparkDLError]] = []
    pending: list[type[SparkDLError]] = [SparkDLError]
    while pending:
        cls = pending.pop()
        found.append(cls)
        pending.extend(cls.__subclasses__())
    return found


def sample(cls: type[SparkDLError]) -> SparkDLError:
    values = {
        "column": "age",
        "bad_rows": 7,
        "causes": {1: "RuntimeError: boom", 3: "x"},
        "setting": "runtime.collective_timeout_s",
        "limit_s": 60.0,
        "python_type": "KeyError",
        "exit_code": 3,
        "output_tail": "Traceback ...\nKeyError: 'label_map'",
        "available": 1,
        "required": 2,
    }
    return cls(f"{cls.__name__} happened", *(values[name] for name in cls.fields))


def test_every_error_class_lives_in_sparkdl_errors_and_is_found_by_name():
    import sparkdl.services.ps.client
    import sparkdl.spark.driver  # noqa: F401

    for cls in every_error_class():
        assert cls.__module__ == "sparkdl.errors", f"{cls.__qualname__} is defined in {cls.__module__}"
        assert errors.error_class(cls.__name__) is cls


@pytest.mark.parametrize("cls", every_error_class(), ids=lambda c: c.__name__)
def test_each_error_class_survives_the_record_and_pickle_with_its_fields(cls):
    error = sample(cls)
    record = ErrorRecord.of(error, rank=2, partition=2, attempt=1)
    back = ErrorRecord.from_json(record.to_json()).to_error()
    assert type(back) is cls
    assert back.message == error.message
    assert back.field_values() == error.field_values()
    assert (back.rank, back.partition, back.attempt, back.agreed_by_all_ranks) == (2, 2, 1, False)
    unpickled = pickle.loads(pickle.dumps(back))
    assert type(unpickled) is cls and unpickled.field_values() == error.field_values()
    assert unpickled.rank == 2


def test_bad_data_fields_and_the_agreed_mark_cross_intact():
    error = agreed(BadDataError("3 nulls in 'age'", column="age", bad_rows=3))
    back = ErrorRecord.of(error, rank=1).to_error()
    assert isinstance(back, BadDataError)
    assert (back.column, back.bad_rows, back.agreed_by_all_ranks, back.rank) == ("age", 3, True, 1)


def test_a_foreign_exception_becomes_training_failed_with_its_type_and_rank():
    record = ErrorRecord.of(ZeroDivisionError("division by zero"), rank=3, partition=3, attempt=0)
    back = record.to_error()
    assert type(back) is TrainingFailedError
    assert back.causes == {3: "ZeroDivisionError: division by zero"}
    assert record.python_type == "ZeroDivisionError"
    assert "rank 3 failed: ZeroDivisionError: division by zero" == back.message


def test_a_record_embedded_in_a_long_spark_failure_text_is_found_again():
    record = ErrorRecord.of(BadDataError("ragged 'tags'", column="tags", bad_rows=5), rank=0)
    failure = WorkerFailed(record)
    spark_text = (
        "org.apache.spark.SparkException: Job aborted due to stage failure: Task 0 in stage 3.0 "
        "failed 4 times ...\nTraceback (most recent call last):\n  ...\n"
        f"sparkdl.errors.WorkerFailed: {failure}\n"
        "\tat org.apache.spark.api.python.BasePythonRunner...\n"
    )
    (found,) = ErrorRecord.find_embedded(spark_text)
    assert found == record
    assert pickle.loads(pickle.dumps(failure)).record == record


def test_a_truncated_record_is_ignored_not_misread():
    text = WorkerFailed(ErrorRecord.of(PeerStopped("stopped"), rank=1)).args[0]
    cut = text[: text.index("sparkdl-error-record:") + 40] + "]"
    assert ErrorRecord.find_embedded(cut) == []


def test_a_record_of_an_unknown_class_keeps_its_message():
    record = ErrorRecord("NoSuchError", "what happened", {}, rank=0)
    back = record.to_error()
    assert type(back) is TrainingFailedError and back.message == "what happened"


@pytest.mark.parametrize(
    ("failure", "setting"),
    [
        ("java.lang.OutOfMemoryError: Java heap space\n\tat java.base/...", "spark.driver.memory"),
        (
            "io.netty.util.internal.OutOfDirectMemoryError: failed to allocate 1200010488 byte(s)",
            "memoryOverhead",
        ),
        ("RuntimeError: CUDA out of memory. Tried to allocate 2.00 GiB", "fsdp"),
        (
            "RuntimeError: [enforce fail at alloc_cpu.cpp:117] DefaultCPUAllocator: can't allocate memory",
            "pyspark.memory",
        ),
        ("org.apache.spark.SparkException: Python worker exited unexpectedly (crashed)", "pyspark.memory"),
    ],
)
def test_a_stage_that_ran_out_of_memory_fails_naming_the_memory_and_the_setting(failure, setting):
    from sparkdl.spark.stage import translate_failure

    error = translate_failure(Exception(f"Job aborted due to stage failure: {failure}"))
    assert setting in error.message and "memory" in error.message
    assert "Java heap" not in translate_failure(Exception("Job aborted: something else")).message


def test_every_timeout_shares_one_base_that_names_the_setting_to_raise():
    timeouts = {cls.__name__ for cls in every_error_class() if issubclass(cls, errors.WaitTimeout)}
    assert timeouts == {
        "WaitTimeout",
        "RendezvousTimeout",
        "CollectiveTimeout",
        "PsTimeoutError",
        "StageStalledError",
        "RunTimeout",
        "WorkersLostError",
    }
    # each is also of its kind: a handler of RendezvousError or CollectiveError catches its timeout
    assert issubclass(errors.RendezvousTimeout, errors.RendezvousError)
    assert issubclass(errors.CollectiveTimeout, errors.CollectiveError)
    assert issubclass(errors.PsTimeoutError, errors.ParameterServerError)
    back = ErrorRecord.from_json(ErrorRecord.of(sample(errors.PsTimeoutError)).to_json()).to_error()
    assert (back.setting, back.limit_s) == ("runtime.collective_timeout_s", 60.0)


def test_a_wrapped_error_records_its_root_cause_and_the_memory_hint_reads_it():
    """torch's pipeline schedule raises "Failed to run stage backward" from the allocator's
    error: the record names the allocator, so the driver's memory hint applies."""
    from sparkdl.errors import ErrorRecord
    from sparkdl.spark.environment import memory_hint

    try:
        try:
            raise RuntimeError("DefaultCPUAllocator: can't allocate memory: you tried to allocate 64 MiB")
        except RuntimeError as exc:
            raise RuntimeError("\n        Failed to run stage backward:\n        Stage output: ...") from exc
    except RuntimeError as wrapped:
        record = ErrorRecord.of(wrapped, rank=3)
    assert "Failed to run stage backward" in record.message
    assert "(caused by RuntimeError: DefaultCPUAllocator: can't allocate memory" in record.message
    assert "spark.executor.pyspark.memory" in memory_hint(record.message)
    plain = ErrorRecord.of(ValueError("bad"), rank=0)
    assert plain.message == "rank 0 failed: ValueError: bad"  # no cause, nothing added
