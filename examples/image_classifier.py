"""Images -> a CNN: scikit-learn's bundled digits as PNG files, read by Spark, classified by sparkdl.

Run it with ``.venv/bin/python examples/image_classifier.py``. It writes the 1,797 8x8 grayscale
digits as PNG files into a temporary folder (the label in each file's name), reads them
with ``spark.read.format("image")`` and trains a small CNN: sparkdl turns Spark's image
struct into float32 ``[N, C, H, W]`` in [0, 1] with no user code. It prints the held-out
accuracy as one JSON line. ``--decoder binaryFile`` reads the raw PNG bytes instead and
decodes them with a ``transform_fn``, the way to feed formats Spark cannot read.
"""

from __future__ import annotations

import argparse
import io
import json
import tempfile
import time
from pathlib import Path

import numpy as np
import torch
from PIL import Image
from pyspark.ml.evaluation import MulticlassClassificationEvaluator
from pyspark.sql import functions as F
from sklearn.datasets import load_digits
from torch import nn

import sparkdl


def write_digits(folder: Path, n: int | None = None) -> None:
    """The first ``n`` digits (all by default) as ``digit<label>_<index>.png``, 8-bit grayscale."""
    digits = load_digits()
    for index, (pixels, label) in enumerate(zip(digits.images[:n], digits.target[:n], strict=True)):
        image = Image.fromarray((pixels * (255 / 16)).astype(np.uint8), mode="L")  # 0..16 -> 0..255
        image.save(folder / f"digit{label}_{index:04d}.png")


def small_cnn() -> nn.Module:
    return nn.Sequential(
        nn.Conv2d(1, 16, kernel_size=3, padding=1),  # [N, 1, 8, 8] -> [N, 16, 8, 8]
        nn.ReLU(),
        nn.MaxPool2d(2),  # -> [N, 16, 4, 4]
        nn.Flatten(),
        nn.Linear(16 * 4 * 4, 10),
    )


def decode_png(batch) -> dict[str, np.ndarray]:
    """transform_fn for binaryFile rows: PNG bytes -> float32 [N, 1, 8, 8] in [0, 1]."""
    pngs = batch.column("content").to_pylist()
    pixels = np.stack([np.asarray(Image.open(io.BytesIO(png)).convert("L")) for png in pngs])
    return {"image": pixels[:, None].astype(np.float32) / 255}


def read_images(spark, folder: Path, decoder: str):
    """(image or content, label): the label is the digit in the file's name."""
    if decoder == "image":  # a struct column "image"; origin is the file's path
        df = spark.read.format("image").load(str(folder))
        origin = "image.origin"
    else:  # raw bytes in "content", decoded by decode_png on the executors
        df = spark.read.format("binaryFile").load(str(folder)).select("path", "content")
        origin = "path"
    return df.withColumn("label", F.regexp_extract(origin, r"digit(\d)_", 1).cast("long"))


def main(
    spark=None, n_images: int | None = None, epochs: int = 10, decoder: str = "image", progress: bool = True
) -> dict:
    """Train on 80% of the digits and return the accuracy on the other 20%."""
    spark = spark or sparkdl.session("local[2]", "image_classifier")
    with tempfile.TemporaryDirectory(prefix="digits-") as folder:
        write_digits(Path(folder), n_images)
        images = read_images(spark, Path(folder), decoder).cache()  # read the files once
        train, test = images.randomSplit([0.8, 0.2], seed=42)
        rows = train.count(), test.count()  # reads the files, into the cache
        # image: the built-in decoder, no user code; binaryFile: decode_png makes the input "image"
        reading = {"inputs": {"image": "image"}} if decoder == "image" else {"transform_fn": decode_png}
        estimator = sparkdl.TorchEstimator(
            model_fn=small_cnn,
            optimizer_fn=lambda params: torch.optim.Adam(params, lr=0.01),
            loss_fn="cross_entropy",
            label_col="label",
            num_workers=2,
            batch_size=32,
            epochs=epochs,
            seed=0,
            progress=progress,
            **reading,
        )
        start = time.perf_counter()
        model = estimator.fit(train)
        fit_s = time.perf_counter() - start
        accuracy = MulticlassClassificationEvaluator(labelCol="label", metricName="accuracy")
        result = {
            "decoder": decoder,
            "train_rows": rows[0],
            "test_rows": rows[1],
            "input_shape": list(model.trained_input_shapes["image"]),
            "accuracy": round(accuracy.evaluate(model.transform(test)), 4),
            "fit_s": round(fit_s, 1),
        }
        images.unpersist()
    return result


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--decoder", choices=["image", "binaryFile"], default="image")
    print(json.dumps(main(decoder=parser.parse_args().decoder)))
