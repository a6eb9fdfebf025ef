"""A Hugging Face decoder cut by the pipeline between its blocks (issue 55 item 6): a tiny
Llama built from a config, trained as a causal language model on right-padded token rows, on
2 ranks over loopback gloo without Spark, against all-reduce; the rewrite checked against
the model's own forward, and the refusals."""

from __future__ import annotations

import numpy as np
import pyarrow as pa
import pytest
import torch

from sparkdl.config import SparkDLConfig
from sparkdl.data.decoding import decode_block
from sparkdl.data.inputs import plan_data
from sparkdl.data.tensors import to_batch
from sparkdl.errors import ConfigError
from sparkdl.strategies.pipeline import PipelineStrategy
from sparkdl.strategies.pipeline_decoder import check_same_forward, decoder_layers, pipeline_layers
from sparkdl.worker.assembly import TrainSpec
from tests.reference import max_abs_diff
from tests.unit.test_fsdp import spawn

pytest.importorskip("transformers")

VOCAB, WIDTH, LENGTH = 16, 16, 8


def tiny_llama(tied: bool = False, dropout: float = 0.0, blocks: int = 3) -> torch.nn.Module:
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(
        vocab_size=VOCAB,
        hidden_size=WIDTH,
        intermediate_size=32,
        num_hidden_layers=blocks,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=16,
        attention_dropout=dropout,
        tie_word_embeddings=tied,
    )
    config._attn_implementation = "eager"
    return LlamaForCausalLM(config)


def make_llama() -> torch.nn.Module:
    return tiny_llama()


def make_llama_with_dropout() -> torch.nn.Module:
    return tiny_llama(dropout=0.3)


def make_tied_llama() -> torch.nn.Module:
    return tiny_llama(tied=True)


def token_rows(rows: int, seed: int) -> pa.RecordBatch:
    """``rows`` sequences of 3 to 8 ids that count up (mod the vocabulary) from a random start:
    each id's successor is learnable."""
    rng = np.random.default_rng(seed)
    sequences = [
        [(start + i) % VOCAB for i in range(length)]
        for start, length in zip(rng.integers(0, VOCAB, rows), rng.integers(3, 9, rows), strict=True)
    ]
    return pa.RecordBatch.from_arrays([pa.array(sequences, pa.list_(pa.int32()))], ["tok"])


def train(tmp_path, model_fn, strategy, parts, **settings):
    first = parts[0][0]
    plan = plan_data(
        first.schema,
        inputs={"input_ids": "tok"},
        sequence_cols=("tok",),
        mask_input="attention_mask",
        next_token_of="input_ids",
        max_sequence_length=LENGTH,
        pad_to_max_length=True,  # one shape between the stages
    )
    template = to_batch(decode_block(first.slice(0, 2), plan), plan)
    config = SparkDLConfig().replace(
        num_workers=len(parts),
        collective_timeout_s=30.0,
        strategy=strategy,
        seed=0,
        sequence_cols=("tok",),
        max_sequence_length=LENGTH,
        pad_to_max_length=True,
        **settings,
    )
    spec = TrainSpec(config, model_fn, _sgd, "causal_lm", plan, template)
    state: dict = {}
    results = spawn(parts, spec, tmp_path, weights=state)
    errors = {r: e for r, (_, e, _) in results.items() if e is not None}
    assert not errors, errors
    return state, results


def _sgd(params):
    return torch.optim.SGD(params, lr=0.2, momentum=0.9)


@pytest.mark.slow
def test_a_decoder_with_dropout_on_trains_through_the_pipeline(tmp_path):
    parts = [[token_rows(24, seed=3)], [token_rows(24, seed=4)]]
    _, results = train(
        tmp_path, make_llama_with_dropout, "pipeline", parts, microbatches=2, batch_size=4, epochs=3
    )
    losses = [h["loss"] for h in results[0][0]]
    assert all(np.isfinite(losses)) and losses[-1] < losses[0], losses


def test_the_layers_are_the_models_own_modules_and_compute_its_logits():
    model = make_llama()
    layers = pipeline_layers(model)
    assert [name for name, _ in layers.named_children()] == ["embed", "block_0", "block_1", "block_2", "head"]
    check_same_forward(model, layers)  # raises where they differ
    assert layers.block_1.layer is model.model.layers[1]  # not copies
    assert sorted(layers.model_names.values()) == sorted(model.state_dict())
    assert layers.model_names["block_2.layer.mlp.up_proj.weight"] == "model.layers.2.mlp.up_proj.weight"
    # the parameters come in the model's order, which numbers the optimizer's state
    names = layers.model_names
    assert [names[n] for n, _ in layers.named_parameters()] == [n for n, _ in model.named_parameters()]
    # the rotary embedding is rebuilt where each block runs, not part of a stage's state
    assert not any("rotary" in key or "inv_freq" in key for key in layers.state_dict())


@pytest.mark.slow
def test_a_decoder_cut_between_its_blocks_trains_to_all_reduces_weights_its_tied_head_kept(tmp_path):
    """Its head tied to its embedding (stages 0 and 1 each train a copy, their gradients
    summed), clipped by the whole model's norm, on uneven partitions (the last steps pad):
    all-reduce's weights, under the model's own names, the tie held (the Spark test takes an
    untied one, whose stages rank 0 sends)."""
    parts = [[token_rows(21, seed=5)], [token_rows(14, seed=6)]]
    settings = {"batch_size": 4, "epochs": 2, "shuffle": True, "grad_clip_norm": 0.5}
    piped, results = train(
        tmp_path / "pipeline", make_tied_llama, "pipeline", parts, microbatches=2, **settings
    )
    reference, _ = train(tmp_path / "allreduce", make_tied_llama, "allreduce", parts, **settings)
    assert max_abs_diff(piped, reference) < 1e-5
    assert torch.equal(piped["model.embed_tokens.weight"], piped["lm_head.weight"])
    make_tied_llama().load_state_dict(piped, strict=True)  # the model's names, every one
    history = results[0][0]
    assert history[-1]["loss"] < history[0]["loss"] and all(h["bytes_sent"] > 0 for h in history)


def test_a_decoder_whose_forward_does_more_than_its_plan_is_refused_on_the_driver():
    config = SparkDLConfig().replace(num_workers=2, strategy="pipeline")
    PipelineStrategy.check_model(make_tied_llama(), config)  # a tie is kept: taken

    class Scaled(type(make_llama())):  # type: ignore[misc]
        """Its forward scales the embeddings, which its pipeline plan does not say."""

        def forward(self, input_ids=None, **kwargs):
            embeds = self.model.embed_tokens(input_ids) * 2.0
            return super().forward(inputs_embeds=embeds, **kwargs)

    scaled = Scaled(make_llama().config)
    with pytest.raises(ConfigError, match=r"Scaled's forward does more than those: its logits differ"):
        PipelineStrategy.check_model(scaled, config)
    with pytest.raises(ConfigError, match=r"an nn.Sequential or a Hugging Face decoder with a pipeline plan"):
        pipeline_layers(torch.nn.Linear(2, 2))
    decoder_layers(make_llama())  # the plain one is taken
    padded_per_batch = config.replace(sequence_cols=("tok",))
    with pytest.raises(ConfigError, match=r"set data.pad_to_max_length = true"):
        PipelineStrategy.check_settings(padded_per_batch)


def test_a_decoder_whose_window_is_shorter_than_its_rows_is_refused():
    """Mistral attends through a sliding window: the same as the full causal mask the blocks
    take here for rows within it, not past it (which an 8-token check cannot see)."""
    from transformers import MistralConfig, MistralForCausalLM

    config = MistralConfig(
        vocab_size=VOCAB, hidden_size=WIDTH, intermediate_size=32, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64, sliding_window=6,
    )  # fmt: skip

    def settings(length):
        return SparkDLConfig().replace(num_workers=2, strategy="pipeline", max_sequence_length=length)

    with pytest.raises(ConfigError, match=r"sliding window of 6 positions and the rows are 8 long"):
        PipelineStrategy.check_model(MistralForCausalLM(config), settings(8))
    PipelineStrategy.check_model(MistralForCausalLM(config), settings(6))
