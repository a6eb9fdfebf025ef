"""Process-wide state is in one table: what each piece holds, how long, and its release."""

import re
from pathlib import Path

import numpy as np
import pytest

from sparkdl import process

ROOT = Path(__file__).resolve().parents[2]


def _import_every_holder():
    import sparkdl.data.pool
    import sparkdl.services.weights.server
    import sparkdl.spark.cluster
    import sparkdl.spark.environment
    import sparkdl.spark.inference  # noqa: F401


def test_every_piece_of_process_wide_state_is_registered_and_documented():
    _import_every_holder()
    registered = {(k.name, k.side) for k in process.kept()}
    text = (ROOT / "docs/architecture.md").read_text()
    documented = set(re.findall(r"^\| `([a-z_.]+)` \| (driver|executor) \|", text, re.M))
    assert registered == documented, (
        "docs/architecture.md's 'What survives a fit' must list every registration"
    )
    assert registered == {
        ("data.pool", "executor"),
        ("services.weights", "driver"),
        ("spark.environment", "driver"),
        ("spark.executor_addresses", "driver"),
        ("spark.inference", "executor"),
    }


def test_releasing_the_pool_drops_the_pages_it_kept_for_the_next_fit():
    from sparkdl.data.pool import shared_pool

    pool = shared_pool()
    saved = (pool.keep_s, pool.limit_bytes)
    pool.configure(keep_s=60.0, limit_bytes=1 << 22)
    try:
        pool.give([np.empty(1 << 20, dtype=np.uint8)])
        assert pool.free_bytes == 1 << 20
        process.release("data.pool")
        assert pool.free_bytes == 0
    finally:
        pool.configure(*saved)


def test_releasing_the_weights_server_stops_it_and_the_next_fit_starts_a_new_one():
    from sparkdl.services.weights.server import weight_server

    first = weight_server("127.0.0.1")
    assert weight_server("127.0.0.1") is first  # kept from one call to the next
    process.release("services.weights")
    second = weight_server("127.0.0.1")
    try:
        assert second is not first and second.port != 0
    finally:
        process.release("services.weights")


def test_releasing_an_unknown_name_lists_the_registered_ones():
    _import_every_holder()
    with pytest.raises(KeyError, match=r"no process-wide state named 'cache'; registered: \['data.pool'"):
        process.release("cache")


def test_releasing_the_executors_addresses_forgets_them_until_the_next_reading():
    from sparkdl.spark import cluster

    class Context:
        def getConf(self):
            return {"spark.driver.host": "10.3.4.5"}

    view = cluster.ExecutorAddresses(lambda: Context())
    view.refresh()
    assert "10.3.4.5" in view
    view.forget()
    assert "10.3.4.5" not in view._addresses
