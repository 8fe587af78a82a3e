"""Quickstart: train a transformer LM with DDP on 2 CPU processes, every network running in ONNX Runtime.

python examples/lightning_quickstart.py          # 2 epochs
python examples/lightning_quickstart.py --fast   # a few steps (CI)
"""

from __future__ import annotations

import argparse

import lightning.pytorch as pl
from lit_lm import LitTransformerLM, SyntheticTokens

import lightning_ort  # noqa: F401  (registers strategy="ort_ddp")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--fast", action="store_true")
    args = parser.parse_args()
    pl.seed_everything(0)
    trainer = pl.Trainer(
        strategy="ort_ddp",
        accelerator="cpu",
        devices=2,
        max_epochs=2,
        max_steps=4 if args.fast else -1,
        limit_val_batches=1 if args.fast else None,
        log_every_n_steps=2,
        enable_checkpointing=False,
    )
    trainer.fit(LitTransformerLM(), SyntheticTokens())
    if trainer.is_global_zero:
        metrics = {name: round(float(value), 3) for name, value in trainer.callback_metrics.items()}
        print(f"final metrics: {metrics}")


if __name__ == "__main__":
    main()
