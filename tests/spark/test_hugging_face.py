"""Hugging Face transformers through real Spark: a model whose forward returns a
``ModelOutput`` and takes ``attention_mask`` trains and transforms like any other (issue 55).
Models are built from a config: no network."""

from __future__ import annotations

import os

import pytest
import torch

from sparkdl import TorchEstimator, TorchModel
from sparkdl.spark.driver import read_tokenizer
from tests.spark.test_inputs_spark import token_dataframe

pytestmark = pytest.mark.spark
transformers = pytest.importorskip("transformers")


def tiny_bert_classifier():
    """A 2-layer BERT for sequence classification over the 20-token vocabulary, no dropout."""
    config = transformers.BertConfig(
        vocab_size=20,
        hidden_size=32,
        num_hidden_layers=2,
        num_attention_heads=2,
        intermediate_size=64,
        max_position_embeddings=16,
        num_labels=2,
        hidden_dropout_prob=0.0,
        attention_probs_dropout_prob=0.0,
    )
    return transformers.BertForSequenceClassification(config)


def token_estimator(model_fn, lr, **settings):
    """A 2-worker estimator of a transformers model on the padded ``tokens`` column, its mask
    passed as ``attention_mask``."""
    base = dict(
        model_fn=model_fn,
        optimizer_fn=lambda p: torch.optim.Adam(p, lr=lr),
        loss_fn="cross_entropy",
        inputs={"input_ids": "tokens"},
        sequence_cols=["tokens"],
        mask_input="attention_mask",
        num_workers=2,
        batch_size=32,
        progress=False,
    )
    return TorchEstimator(**{**base, **settings})


def test_a_transformers_classifier_trains_on_padded_token_ids_with_its_attention_mask_and_predicts(spark):
    train, test = token_dataframe(spark, 600, 1), token_dataframe(spark, 200, 2)
    est = token_estimator(tiny_bert_classifier, 3e-3, epochs=8)
    model = est.fit(train)
    assert set(model.trained_input_shapes) == {"input_ids", "attention_mask"}  # the names it takes
    losses = [epoch["loss"] for epoch in model.history]
    assert losses[-1] < 0.5 * losses[0], losses
    predicted = model.transform(test).select("label", "prediction", "probability").toPandas()
    accuracy = float((predicted["label"] == predicted["prediction"]).mean())
    assert accuracy > 0.9, accuracy
    assert all(abs(sum(p) - 1) < 1e-5 for p in predicted["probability"])  # softmax of the logits


def counting_rows(spark, n, seed):
    """Rows of 3 to 10 tokens counting up mod 20 from a random start: each next token is
    the current one plus one, which a language model learns."""
    import numpy as np

    rng = np.random.default_rng(seed)
    rows = []
    for _ in range(n):
        start, length = int(rng.integers(0, 20)), int(rng.integers(3, 11))
        rows.append(([(start + i) % 20 for i in range(length)],))
    return spark.createDataFrame(rows, "tokens array<int>").repartition(2)


def tiny_gpt2():
    """A 1-layer GPT-2 over the 20-token vocabulary, no dropout."""
    config = transformers.GPT2Config(
        vocab_size=20, n_embd=32, n_layer=1, n_head=2, n_positions=16,
        resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0, bos_token_id=0, eos_token_id=0,
    )  # fmt: skip
    return transformers.GPT2LMHeadModel(config)


def test_a_transformers_causal_lm_learns_the_next_token_without_a_label_column(spark):
    """``loss_fn = "causal_lm"``: the targets are each position's next token of the sequence
    input (padding and each row's last position left out), so the table needs no label;
    validation reports the held-out perplexity's log, and transform each position's
    predicted next token."""
    est = token_estimator(tiny_gpt2, 1e-2, loss_fn="causal_lm", validation_fraction=0.2, epochs=6)
    model = est.fit(counting_rows(spark, 500, 3))
    first, last = model.history[0], model.history[-1]
    assert last["loss"] < 0.3 * first["loss"], (first, last)
    assert last["val_loss"] < 0.5 and last["val_accuracy"] > 0.9, last  # perplexity exp(val_loss) < 1.65
    rows = model.transform(counting_rows(spark, 50, 4)).select("tokens", "prediction", "perplexity").collect()
    hits = [
        int(p) == (t + 1) % 20 for row in rows for t, p in zip(row.tokens[:-1], row.prediction, strict=False)
    ]
    assert sum(hits) / len(hits) > 0.9, sum(hits) / len(hits)
    perplexities = sorted(row.perplexity for row in rows)  # each row's, of its own next tokens
    assert 1.0 < perplexities[0] and perplexities[len(rows) // 2] < 1.65, perplexities


def lora_bert_classifier():
    """tiny_bert_classifier with LoRA (r 4) on its attention's query and value, its head
    trained whole: what a PEFT user fine-tunes."""
    peft = pytest.importorskip("peft")
    config = peft.LoraConfig(r=4, target_modules=["query", "value"], modules_to_save=["classifier"])
    return peft.get_peft_model(tiny_bert_classifier(), config)


def test_a_lora_model_saves_whole_adapter_only_or_merged_and_loads_each_way(spark, tmp_path):
    """``model.write().option("weights", ...)``: "adapter" saves only what trained (the
    adapter and the head, for a model_fn that builds the rest: the base model seeded or
    loaded as in training), "merged" the base model with the adapter merged in (for a
    model_fn of the base model); each loads to the same predictions."""
    model = token_estimator(lora_bert_classifier, 3e-3, epochs=2, seed=0).fit(token_dataframe(spark, 200, 1))
    for form in ("whole", "adapter", "merged"):
        model.write().option("weights", form).overwrite().save(str(tmp_path / form))
    sizes = {form: (tmp_path / form / "weights.pt").stat().st_size for form in ("whole", "adapter", "merged")}
    assert sizes["adapter"] < 0.3 * sizes["whole"], sizes

    ids = torch.randint(0, 20, (5, 7))
    mask = torch.ones(5, 7, dtype=torch.bool)

    def logits(module):
        with torch.no_grad():
            return module.eval()(input_ids=ids, attention_mask=mask).logits

    expected = logits(model.module)
    whole = TorchModel.load(str(tmp_path / "whole"), model_fn=lora_bert_classifier)
    torch.manual_seed(0)  # the base model as the workers built it (a real one: loaded from its files)
    adapter = TorchModel.load(str(tmp_path / "adapter"), model_fn=lora_bert_classifier)
    merged = TorchModel.load(str(tmp_path / "merged"), model_fn=tiny_bert_classifier)
    assert torch.equal(logits(whole.module), expected)
    assert torch.allclose(logits(adapter.module), expected, atol=1e-6)
    assert torch.allclose(logits(merged.module), expected, atol=1e-5)
    assert not hasattr(merged.module, "merge_and_unload")  # a plain transformers model now


def test_a_transformers_classifier_trains_on_text_tokenized_on_the_executors_and_predicts(spark, tmp_path):
    """``data.tokenizer``: a string column feeds ``input_ids``, tokenized on the executors by
    a tokenizer.json the driver read and shipped (trained here on the test's words: no
    network), with its ``attention_mask``; transform tokenizes the same way."""
    from tests.unit.test_tokenized_text import sentences, train_tokenizer

    path = train_tokenizer(tmp_path / "tokenizer.json")
    vocab = pytest.importorskip("tokenizers").Tokenizer.from_file(path).get_vocab_size()

    def model_fn():
        torch.manual_seed(0)
        return transformers.BertForSequenceClassification(
            transformers.BertConfig(
                vocab_size=vocab, hidden_size=32, num_hidden_layers=1, num_attention_heads=2,
                intermediate_size=64, max_position_embeddings=16, num_labels=2,
                hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0,
            )
        )  # fmt: skip

    def texts(n, seed):
        return spark.createDataFrame(sentences(n, seed), "text string, label long").repartition(2)

    est = token_estimator(
        model_fn, 1e-2, epochs=5, inputs={"input_ids": "text"}, sequence_cols=[], tokenizer=path,
        max_sequence_length=16, batch_size=16,
    )  # fmt: skip
    model = est.fit(texts(300, 1))
    assert set(model.trained_input_shapes) == {"input_ids", "attention_mask"}
    losses = [epoch["loss"] for epoch in model.history]
    assert losses[-1] < 0.3 * losses[0], losses
    predicted = model.transform(texts(200, 2)).select("label", "prediction").toPandas()
    accuracy = float((predicted["label"] == predicted["prediction"]).mean())
    assert accuracy > 0.9, accuracy

    # saved, it keeps its own copy of the tokenizer: loaded with the original file gone, it
    # tokenizes as it was trained to; so does the estimator (a Pipeline's stage) saved with it
    est.write().save(str(tmp_path / "estimator"))
    os.remove(path)
    model.write().save(str(tmp_path / "saved"))  # the bytes fit read: the file is not needed
    estimator = TorchEstimator.load(str(tmp_path / "estimator"), trust_pickle=True)
    assert estimator.get_config().data.tokenizer == str(tmp_path / "estimator" / "tokenizer.json")
    assert read_tokenizer(spark, estimator.get_config().data) is not None
    loaded = TorchModel.load(str(tmp_path / "saved"), model_fn=model_fn)
    assert loaded.get_config().data.tokenizer == str(tmp_path / "saved" / "tokenizer.json")
    loaded.write().overwrite().save(str(tmp_path / "saved"))  # over itself: its own copy kept
    loaded = TorchModel.load(str(tmp_path / "saved"), model_fn=model_fn)
    # it read its copy at load: the folder pruned since (a streaming version), it still transforms
    os.remove(tmp_path / "saved" / "tokenizer.json")
    again = loaded.transform(texts(200, 2)).select("label", "prediction").toPandas()
    pairs = predicted.value_counts().sort_index()
    assert pairs.equals(again.value_counts().sort_index()), (pairs, again.value_counts())


def first_token_rows(n: int = 256):
    """Rows of 8 token ids whose label says whether the first is 11 or more."""
    generator = torch.Generator().manual_seed(0)
    ids = torch.randint(2, 20, (n, 8), generator=generator)
    return ids, (ids[:, 0] >= 11).long()


def flat_weights(model):
    return torch.cat([p.detach().flatten() for p in model.parameters()])


def rank_spread(flat, group=None):
    """The largest difference between any rank's weights and rank 0's (a collective)."""
    import torch.distributed as dist

    gathered = [torch.empty_like(flat) for _ in range(dist.get_world_size(group))]
    dist.all_gather(gathered, flat, group=group)
    return max(float((g - gathered[0]).abs().max()) for g in gathered)


def hugging_face_trainer_script(output_dir: str, steps: int):
    """A script written for Hugging Face's Trainer, as its docs write one (CPU, no reporting,
    no saving); sparkdl.TorchDistributor gives it torchrun's environment, and the Trainer
    forms the process group itself."""
    import os

    import transformers

    torch.manual_seed(0)
    model = tiny_bert_classifier()
    ids, labels = first_token_rows()
    rows = [
        {"input_ids": i, "attention_mask": torch.ones_like(i), "labels": y}
        for i, y in zip(ids, labels, strict=True)
    ]
    args = transformers.TrainingArguments(
        output_dir=output_dir, per_device_train_batch_size=16, max_steps=steps, learning_rate=1e-2,
        logging_steps=1, report_to="none", use_cpu=True, save_strategy="no", disable_tqdm=True,
        seed=0, dataloader_num_workers=0,
    )  # fmt: skip
    trainer = transformers.Trainer(model=model, args=args, train_dataset=rows)
    trainer.train()
    return {
        "world_size": trainer.args.world_size,
        "environment": {k: os.environ[k] for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_PORT")},
        "losses": [h["loss"] for h in trainer.state.log_history if "loss" in h],
        "spread": rank_spread(flat_weights(model)),
    }


def test_a_hugging_face_trainer_script_runs_unchanged_through_the_distributor(spark, tmp_path):
    from sparkdl import TorchDistributor

    result = TorchDistributor(num_processes=2, local_mode=False, use_gpu=False).run(
        hugging_face_trainer_script, str(tmp_path / "out"), 12
    )
    assert result["world_size"] == 2 and result["environment"]["RANK"] == "0"
    assert result["spread"] == 0.0  # DDP kept the two ranks' weights identical
    losses = result["losses"]
    assert len(losses) == 12 and sum(losses[-3:]) < 0.3 * sum(losses[:3]), losses


def transformers_own_loop(ctx):
    """A transformers model in a user's own loop: the model computes its own loss from the
    labels it is given (``ModelOutput.loss``), ctx prepares it (DDP) and feeds the batches."""
    torch.manual_seed(0)
    model = tiny_bert_classifier()
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-2)
    model, optimizer = ctx.prepare(model, optimizer)
    for epoch in ctx.epochs:
        for batch in ctx.batches(epoch):
            loss = model(**batch.inputs, labels=batch.label).loss
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
            ctx.report(loss=loss.item())
    spread = rank_spread(flat_weights(model), ctx.process_group)
    return {"spread": spread, "state": ctx.state_dict(model)}


def test_a_transformers_model_trains_in_an_own_loop_with_ctx(spark):
    import sparkdl

    ids, labels = first_token_rows()
    df = spark.createDataFrame(
        [(row.tolist(), int(y)) for row, y in zip(ids, labels, strict=True)], "tokens array<int>, label long"
    ).repartition(2)
    result = sparkdl.run(
        transformers_own_loop, df=df, num_workers=2, batch_size=16, epochs=2, progress=False,
        inputs={"input_ids": "tokens"}, sequence_cols=["tokens"], mask_input="attention_mask",
    )  # fmt: skip
    assert result.value["spread"] == 0.0  # the two ranks ended with the same weights
    assert set(result.value["state"]) == set(tiny_bert_classifier().state_dict())  # no DDP prefix
    losses = [h["loss"] for h in result.history]
    assert len(losses) == 16 and sum(losses[-3:]) < 0.3 * sum(losses[:3]), losses


def tiny_llama():
    """A 2-block Llama over the 20-token vocabulary, its head its own (the unit tests tie it)."""
    config = transformers.LlamaConfig(
        vocab_size=20, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=16, tie_word_embeddings=False,
    )  # fmt: skip
    return transformers.LlamaForCausalLM(config)


def test_a_transformers_decoder_trains_as_a_pipeline_cut_between_its_blocks(spark):
    """``strategy = "pipeline"`` takes a Llama as it is: the driver checks that its layers
    give its logits, rank 0 builds it and sends rank 1 its stage (block 1 and the head); the
    model that comes back is the Llama, which predicts the next token."""
    est = token_estimator(
        tiny_llama, 1e-2, loss_fn="causal_lm", strategy="pipeline", microbatches=2, epochs=6,
        max_sequence_length=10, pad_to_max_length=True,
    )  # fmt: skip
    model = est.fit(counting_rows(spark, 320, 5))
    first, last = model.history[0], model.history[-1]
    assert last["loss"] < 0.3 * first["loss"], (first, last)
    assert isinstance(model.module, transformers.LlamaForCausalLM)
    rows = model.transform(counting_rows(spark, 40, 6)).select("tokens", "prediction").collect()
    hits = [
        int(p) == (t + 1) % 20 for row in rows for t, p in zip(row.tokens[:-1], row.prediction, strict=False)
    ]
    assert sum(hits) / len(hits) > 0.9, sum(hits) / len(hits)
