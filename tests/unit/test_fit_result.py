"""The driver's merge of every rank's result row into fit's history."""

from __future__ import annotations

import json

import torch

from sparkdl.spark.driver import _fit_result
from sparkdl.training.factory import state_to_bytes


def _row(rank: int, skipped: list[int], dropped: list[int]) -> dict:
    history = [
        {
            "epoch": e + 1,
            "loss": 1.0,
            "local_samples": 96,
            "seconds": 1.0,
            "nan_skips": 0,
            "skipped_steps": s,
            "dropped_pushes": d,
        }
        for e, (s, d) in enumerate(zip(skipped, dropped, strict=True))
    ]
    state = state_to_bytes(torch.nn.Linear(2, 3)) if rank == 0 else b""
    return {
        "rank": rank,
        "rows": 96,
        "bad_rows": 0,
        "history": json.dumps(history),
        "state": state,
        "input_shapes": "{}",
        "output_shape": "[3]",
        "device": "{}",
        "error": "",
    }


def test_backup_workers_skipped_steps_count_whichever_rank_fell_behind():
    rows = [_row(0, [0, 0, 0], [0, 0, 0]), _row(1, [0, 5, 7], [0, 2, 3]), _row(2, [0, 1, 0], [0, 0, 0])]
    history = _fit_result(rows, 3).history
    assert [h["skipped_steps"] for h in history] == [0, 6, 7]
    assert [h["worker_skipped_steps"] for h in history] == [[0, 0, 0], [0, 5, 1], [0, 7, 0]]
    assert [h["dropped_pushes"] for h in history] == [0, 2, 3]
