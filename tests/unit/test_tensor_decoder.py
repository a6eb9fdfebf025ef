"""A Hugging Face decoder split by tensor parallelism (issue 55 item 6): a tiny Llama built
from a config takes its own plan (``base_model_tp_plan``: q/k/v and the MLP's gate and up by
columns, the attention's output and the MLP's down by rows), each worker holding whole
heads; its tied embedding and head stay whole. Two workers on loopback gloo, no Spark."""

from __future__ import annotations

import io

import pytest
import torch
from torch import nn

from sparkdl.config import SparkDLConfig
from sparkdl.errors import ConfigError
from sparkdl.strategies.tensor import TensorParallelStrategy
from sparkdl.strategies.tensor_plan import hugging_face_plan, inside_pairs
from sparkdl.worker.assembly import TrainSpec
from tests.reference import make_shards, max_abs_diff, reference_sgd, shard_plan, shard_to_batch
from tests.unit.test_tensor_parallel import Buckets
from tests.unit.test_tensor_parallel import train as train_tensor
from tests.unit.test_worker_gloo import LR, MOMENTUM, _sgd
from tests.workers import keep_built_strategies, worker_context

pytest.importorskip("transformers")


class TinyLlama(nn.Module):
    """LlamaForCausalLM (2 blocks, width 16, 4 heads over 2 key/value heads, MLP 32, 12 ids,
    embedding tied to the head) reading a row's 6 features as 6 ids; its last position's
    logits read as classes."""

    def __init__(self, dropout: float = 0.0) -> None:
        super().__init__()
        from transformers import LlamaConfig, LlamaForCausalLM

        config = LlamaConfig(
            vocab_size=12,
            hidden_size=16,
            intermediate_size=32,
            num_hidden_layers=2,
            num_attention_heads=4,
            num_key_value_heads=2,
            max_position_embeddings=8,
            attention_dropout=dropout,
            tie_word_embeddings=True,
        )
        config._attn_implementation = "eager"
        self.ids = Buckets()
        self.lm = LlamaForCausalLM(config)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.lm(input_ids=self.ids(x)).logits[:, -1]


def make_llama() -> nn.Module:
    return TinyLlama()


def make_llama_with_dropout() -> nn.Module:
    return TinyLlama(dropout=0.3)


def _worker_keeping_its_layers(rank, world, record_batches, spec, store_path, out):
    """run_worker, then this rank's layers that every worker of the group holds whole, and
    its history."""
    import os

    from sparkdl.worker.assembly import Placement, run_worker
    from tests.unit.test_worker_gloo import file_all_gather

    os.environ["GLOO_SOCKET_IFNAME"] = "lo"
    built = keep_built_strategies()
    try:
        gather = file_all_gather(store_path, rank, world)
        result = run_worker(spec, iter(record_batches), Placement(rank, world, "127.0.0.1"), gather)
        module = built[0].ctx.module
        whole = {n: p.detach().clone() for n, p in module.named_parameters() if not hasattr(p, "placements")}
        buffer = io.BytesIO()
        torch.save(whole, buffer)
        out.put((rank, buffer.getvalue(), [h["loss"] for h in result.history], None))
    except Exception as exc:  # reported to the test process
        out.put((rank, b"", [], f"{type(exc).__name__}: {exc}"))


def test_a_hugging_face_decoder_brings_its_plan_split_by_block_and_whole_heads():
    model = make_llama()
    assert hugging_face_plan(model)[0] == "lm.model.layers.*.self_attn.q_proj:columns"
    plan = TensorParallelStrategy.plan(model, 2)
    assert len(plan) == 2 * 7 and plan["lm.model.layers.1.mlp.down_proj"] == "rows"
    assert "lm.lm_head" not in plan and "lm.model.embed_tokens" not in plan  # tied: whole
    # inside each attention and MLP block each worker computes on its slice (its own dropout masks)
    assert sorted(inside_pairs(model, plan)) == [
        f"lm.model.layers.{i}.{b}" for i in (0, 1) for b in ("mlp", "self_attn")
    ]
    # 2 key/value heads do not split in 4
    with pytest.raises(
        ConfigError, match=r"holds 2 attention heads \(head_dim 4\), which do not divide by 4"
    ):
        TensorParallelStrategy.plan(model, 4)
    # a plan by name, '*' for one part of a name
    given = ("lm.model.layers.*.mlp.up_proj:columns", "lm.model.layers.*.mlp.down_proj:rows")
    assert TensorParallelStrategy.plan(model, 2, given) == {
        f"lm.model.layers.{i}.mlp.{name}": how
        for i in (0, 1)
        for name, how in (("up_proj", "columns"), ("down_proj", "rows"))
    }


@pytest.mark.slow
def test_a_split_decoder_gives_single_process_sgds_weights(tmp_path):
    shards = make_shards([24, 16])
    state, results = train_tensor(shards, tmp_path, model_fn=make_llama, batch_size=8, epochs=1, shuffle=True)
    expected = reference_sgd(shards, 8, 1, 0, LR, MOMENTUM, True, model_fn=make_llama)
    assert max_abs_diff(state, expected) < 1e-5
    assert all(h["bytes_sent"] > 0 for h in results[0][0])  # the blocks' partial sums


@pytest.mark.slow
def test_a_split_decoder_with_attention_dropout_trains_and_its_whole_layers_agree(tmp_path):
    shards = make_shards([32, 32])
    config = SparkDLConfig().replace(
        num_workers=2, collective_timeout_s=30.0, strategy="tensor", batch_size=8, epochs=2, lr=0.3
    )
    plan, template = shard_plan(shards)
    spec = TrainSpec(config, make_llama_with_dropout, _sgd, "cross_entropy", plan, template)
    ctx = worker_context()
    out = ctx.Queue()
    procs = [
        ctx.Process(
            target=_worker_keeping_its_layers,
            args=(r, 2, [shard_to_batch(*shards[r])], spec, str(tmp_path / "store"), out),
        )
        for r in range(2)
    ]
    for p in procs:
        p.start()
    layers, losses = {}, {}
    for _ in procs:
        rank, data, losses[rank], error = out.get(timeout=120)
        assert error is None, error
        layers[rank] = torch.load(io.BytesIO(data), weights_only=True)
    for p in procs:
        p.join(30)
    assert "lm.model.embed_tokens.weight" in layers[0] and "lm.model.norm.weight" in layers[0]
    assert max_abs_diff(layers[0], layers[1]) == 0.0  # the same masks on the whole activations
    torch.manual_seed(config.training.seed)
    initial = {n: t for n, t in make_llama_with_dropout().state_dict().items() if n in layers[0]}
    assert max_abs_diff(layers[0], initial) > 1e-3  # it trained
    assert losses[0] == losses[1] and losses[0][-1] < 0.8 * losses[0][0], losses
