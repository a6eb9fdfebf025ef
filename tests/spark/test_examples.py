"""The scripts in examples/ train to the figures they promise, on small sizes."""

from __future__ import annotations

import importlib.util
from pathlib import Path
from types import ModuleType

import pytest

EXAMPLES = Path(__file__).resolve().parents[2] / "examples"

pytestmark = pytest.mark.spark


def load_example(name: str) -> ModuleType:
    """examples/<name>.py as a module. It stays out of sys.modules on purpose: cloudpickle
    then ships its model classes to the executors by value, as it does for a script run as
    __main__; registered, they would go by reference to a module the executors cannot import."""
    spec = importlib.util.spec_from_file_location(f"example_{name}", EXAMPLES / f"{name}.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_the_recommender_comes_within_10_percent_of_als_and_beats_the_global_mean(spark, tmp_path):
    if spark.sparkContext.getCheckpointDir() is None:
        spark.sparkContext.setCheckpointDir(str(tmp_path))  # else main makes a temporary folder
    figures = load_example("recommender").main(
        spark, n_users=150, n_items=100, n_ratings=6000, epochs=10, progress=False
    )
    assert figures["train_rows"] + figures["test_rows"] == 6000
    assert figures["sparkdl_rmse"] < 1.1 * figures["als_rmse"], figures
    assert figures["sparkdl_rmse"] < 0.8 * figures["global_mean_rmse"], figures


def test_the_image_classifier_reads_png_files_as_an_image_column_and_learns_the_digits(spark):
    figures = load_example("image_classifier").main(spark, n_images=600, epochs=8, progress=False)
    assert figures["train_rows"] + figures["test_rows"] == 600
    assert figures["input_shape"] == [1, 8, 8]  # grayscale PNGs: one channel
    assert figures["accuracy"] > 0.9, figures


def test_the_image_classifier_decodes_binary_files_with_a_transform_fn(spark):
    figures = load_example("image_classifier").main(
        spark, n_images=600, epochs=8, decoder="binaryFile", progress=False
    )
    assert figures["input_shape"] == [1, 8, 8]
    assert figures["accuracy"] > 0.9, figures


def test_the_sequence_classifier_learns_sentiment_from_padded_token_ids(spark):
    figures = load_example("sequence_classifier").main(spark, n_rows=1500, epochs=6, progress=False)
    assert figures["train_rows"] + figures["test_rows"] == 1500
    assert figures["model_inputs"] == ["tokens", "tokens_mask"]
    assert figures["accuracy"] > 0.9, figures


def test_the_gan_trains_two_models_from_a_dataframe_with_weight_averaging(spark):
    figures = load_example("gan_digits").main(spark, epochs=12, progress=False)
    assert figures["rows"] == 1797
    # the generated digits' per-pixel mean and spread move toward the real ones'
    assert figures["moment_distance_after"] < 0.5 * figures["moment_distance_before"], figures


def test_the_text_example_pretrains_a_causal_lm_then_lora_fine_tunes_it_to_classify(spark):
    """Pre-trained on unlabelled reviews tokenized on the executors, the language model's
    held-out perplexity is a fraction of the unigram model's; its LoRA classifier (the
    transformer frozen) separates the held-out reviews, training 4% of the parameters."""
    pytest.importorskip("peft")
    figures = load_example("text_lm_then_lora").main(
        spark, n_texts=600, lm_epochs=3, lora_epochs=8, progress=False
    )
    assert figures["held_out_perplexity"] < 0.2 * figures["unigram_perplexity"], figures
    assert figures["accuracy"] > 0.9, figures
    assert figures["trainable_fraction"] < 0.1, figures
