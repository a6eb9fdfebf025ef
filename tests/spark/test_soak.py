"""Soak: hundreds of consecutive small fits of each strategy, none hanging, each bounded.

Not in the default run (marker ``soak``): ``pytest -m soak tests/spark/test_soak.py``;
``SPARKDL_SOAK_FITS`` sets the fits per strategy (default 300). The teardown race this
guards against hung about one fit in 150 before the worker released the GIL ahead of
destroying its gloo groups.
"""

from __future__ import annotations

import os
import time

import pytest
import torch

from sparkdl import TorchEstimator
from tests.reference import make_shards, make_tiny_net
from tests.spark.test_fit import shards_dataframe

pytestmark = [pytest.mark.spark, pytest.mark.slow, pytest.mark.soak]

FITS = int(os.environ.get("SPARKDL_SOAK_FITS", "300"))
BOUND_S = 60.0  # one small fit takes a few seconds; a hang would take the watchdog's bound


@pytest.mark.timeout(FITS * 3 * int(BOUND_S))
@pytest.mark.parametrize(
    "settings",
    [
        {"strategy": "allreduce"},
        {"strategy": "weight_averaging", "sync_every": 2},
        {"strategy": "parameter_server", "ps_mode": "sync"},
    ],
    ids=lambda s: s["strategy"],
)
def test_consecutive_fits_never_hang(spark, settings):
    df = shards_dataframe(spark, make_shards([40, 25])).cache()
    df.count()
    estimator = TorchEstimator(
        model_fn=make_tiny_net,
        optimizer_fn=lambda params: torch.optim.SGD(params, lr=0.1),
        num_workers=2,
        batch_size=16,
        epochs=2,
        progress=False,
        collective_timeout_s=30.0,
        teardown_timeout_s=20.0,
        **settings,
    )
    durations = []
    for _ in range(FITS):
        started = time.monotonic()
        model = estimator.fit(df)
        durations.append(time.monotonic() - started)
        assert [h["samples"] for h in model.history] == [65, 65]
    durations.sort()
    print(
        f"{settings['strategy']}: {FITS} fits, median {durations[len(durations) // 2]:.2f}s, "
        f"max {durations[-1]:.2f}s"
    )
    assert durations[-1] < BOUND_S, durations[-5:]
