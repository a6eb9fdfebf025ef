"""Your own loop: a GAN (two models, two optimizers) on scikit-learn's bundled digits, from a
DataFrame, kept in sync by weight averaging.

Run it with ``.venv/bin/python examples/gan_digits.py``. The 1,797 8x8 digits become a
DataFrame of 64 floats in [-1, 1]; ``sparkdl.run`` calls ``train`` on two workers, each fed
its partition by ``ctx.batches``; ``ctx.prepare`` puts the generator and the
discriminator, each with its Adam, under weight averaging (every ``sync_every`` steps of
its own optimizer, Adam's moments averaged too); the loop is plain PyTorch. It prints one
JSON line: how far the generated images' per-pixel mean and spread are from the real
digits', before and after training (the moment distance; lower is closer).
"""

from __future__ import annotations

import json
import time

import numpy as np
import torch
import torch.nn.functional as F
from sklearn.datasets import load_digits
from torch import nn

import sparkdl

NOISE = 16


def generator() -> nn.Module:
    return nn.Sequential(nn.Linear(NOISE, 128), nn.ReLU(), nn.Linear(128, 64), nn.Tanh())


def discriminator() -> nn.Module:
    return nn.Sequential(nn.Linear(64, 128), nn.LeakyReLU(0.2), nn.Linear(128, 1))


def moment_distance(fake: torch.Tensor, real: torch.Tensor) -> float:
    """Mean absolute gap of the per-pixel mean and standard deviation."""
    gap = (fake.mean(0) - real.mean(0)).abs().mean() + (fake.std(0) - real.std(0)).abs().mean()
    return float(gap)


def train(ctx, lr: float) -> dict[str, torch.Tensor]:
    """Runs on every worker: a textbook GAN loop, with ctx for the data and the sync."""
    torch.manual_seed(0)
    gen, disc = generator(), discriminator()
    gen_opt = torch.optim.Adam(gen.parameters(), lr=lr, betas=(0.5, 0.999))
    disc_opt = torch.optim.Adam(disc.parameters(), lr=lr, betas=(0.5, 0.999))
    gen, disc, gen_opt, disc_opt = ctx.prepare(gen, disc, gen_opt, disc_opt)
    noise = torch.Generator(device=ctx.device).manual_seed(1000 + ctx.rank)
    for epoch in ctx.epochs:
        for batch in ctx.batches(epoch):
            (real,) = batch.inputs.values()
            z = torch.randn(len(real), NOISE, generator=noise, device=ctx.device)
            fake = gen(z)
            real_logits, fake_logits = disc(real), disc(fake.detach())
            disc_loss = F.binary_cross_entropy_with_logits(
                real_logits, torch.ones_like(real_logits)
            ) + F.binary_cross_entropy_with_logits(fake_logits, torch.zeros_like(fake_logits))
            disc_opt.zero_grad()
            disc_loss.backward()
            disc_opt.step()
            fooled = disc(fake)
            gen_loss = F.binary_cross_entropy_with_logits(fooled, torch.ones_like(fooled))
            gen_opt.zero_grad()
            gen_loss.backward()
            gen_opt.step()
        ctx.report(loss=gen_loss.item(), disc_loss=disc_loss.item())
    return gen.state_dict()


def digits_dataframe(spark):
    pixels = load_digits().data.astype(np.float32) / 8.0 - 1.0  # 0..16 -> -1..1
    return spark.createDataFrame([(row.tolist(),) for row in pixels], "features array<float>"), pixels


def main(spark=None, epochs: int = 40, sync_every: int = 4, progress: bool = True) -> dict:
    spark = spark or sparkdl.session("local[2]", "gan_digits")
    df, pixels = digits_dataframe(spark)
    real = torch.from_numpy(pixels)
    z = torch.randn(1000, NOISE, generator=torch.Generator().manual_seed(7))
    torch.manual_seed(0)
    before = moment_distance(generator()(z).detach(), real)
    start = time.perf_counter()
    result = sparkdl.run(
        train,
        2e-3,
        df=df.repartition(2),
        num_workers=2,
        strategy="weight_averaging",
        sync_every=sync_every,
        batch_size=32,
        epochs=epochs,
        progress=progress,
    )
    seconds = time.perf_counter() - start
    trained = generator()
    trained.load_state_dict(result.value)
    after = moment_distance(trained(z).detach(), real)
    return {
        "rows": len(pixels),
        "epochs": epochs,
        "moment_distance_before": round(before, 4),
        "moment_distance_after": round(after, 4),
        "generator_loss": round(result.history[-1]["loss"], 4),
        "discriminator_loss": round(result.history[-1]["disc_loss"], 4),
        "run_s": round(seconds, 1),
    }


if __name__ == "__main__":
    print(json.dumps(main()))
