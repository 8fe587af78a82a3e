"""An existing Lightning project: keep your strategy, add ORTCallback in one line.

python examples/existing_project_callback.py [--fast]
"""

from __future__ import annotations

import argparse

import lightning.pytorch as pl
from lit_lm import LitTransformerLM, SyntheticTokens

from lightning_ort import ORTCallback


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--fast", action="store_true")
    args = parser.parse_args()
    pl.seed_everything(0)
    trainer = pl.Trainer(
        accelerator="cpu",
        devices=1,
        max_epochs=1,
        max_steps=4 if args.fast else -1,
        limit_val_batches=1 if args.fast else None,
        enable_checkpointing=False,
        callbacks=[ORTCallback(modules=["encoder"])],  # the one added line
    )
    model = LitTransformerLM()
    trainer.fit(model, SyntheticTokens())
    stats = model.encoder.statistics
    print(
        f"encoder ran in ONNX Runtime: {stats.forward_runs} forward and {stats.backward_runs} backward runs, "
        f"its {len(model.encoder.module.layers)} layers through {stats.block_graphs} block graphs"
    )
    print(f"final metrics: { {k: round(float(v), 3) for k, v in trainer.callback_metrics.items()} }")


if __name__ == "__main__":
    main()
