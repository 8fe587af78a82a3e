"""Train TinyTransformerLM with 2 CPU processes (gloo) and dump what each rank saw, for tests/lightning/test_ddp.py.

    python tests/lightning/scripts/ddp_run.py --strategy ort_ddp --out DIR [--steps N] [--cache-dir DIR] [--profile DIR]

``--cache-dir`` trains with ``ORTDDPStrategy(cache_dir=...)`` (both ranks share the folder); ``--profile`` with
``ORTDDPStrategy(profile=True, save_path=...)``; ``--export-onnx DIR`` with ``ORTDDPStrategy(export_onnx=DIR)``.

Every rank writes ``DIR/rank<R>.json`` (losses, ORT statistics, logged metrics) and ``DIR/rank<R>.pt`` (state
dict); with a spawn strategy the main process also writes ``DIR/main.pt`` after ``fit`` returns.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import torch

import lightning_ort
from lightning_ort.lightning.wrapping import wrapped_submodules
from tests.lightning.models import TinyTransformerLM


class Recorder(pl.Callback):
    def __init__(self, out: Path) -> None:
        self.out = out
        self.losses: list[float] = []

    def on_train_batch_end(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        self.losses.append(float(outputs["loss"]))

    def on_train_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        rank = trainer.global_rank
        modules = wrapped_submodules(pl_module)
        record = {
            "rank": rank,
            "losses": self.losses,
            "wrapped": {name: vars(m.statistics) for name, m in modules.items()},
            "metrics": {k: float(v) for k, v in trainer.callback_metrics.items()},
        }
        (self.out / f"rank{rank}.json").write_text(json.dumps(record))
        torch.save(pl_module.state_dict(), self.out / f"rank{rank}.pt")


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--strategy", required=True)
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--cache-dir", type=Path, default=None)
    parser.add_argument("--profile", type=Path, default=None)
    parser.add_argument("--export-onnx", type=Path, default=None)
    args = parser.parse_args()
    strategy: Any = args.strategy
    if args.cache_dir is not None or args.profile is not None or args.export_onnx is not None:
        profiling = {"profile": True, "save_path": args.profile} if args.profile is not None else {}
        strategy = lightning_ort.ORTDDPStrategy(cache_dir=args.cache_dir, export_onnx=args.export_onnx, **profiling)
    pl.seed_everything(0, workers=True)
    model = TinyTransformerLM()
    trainer = pl.Trainer(
        strategy=strategy,
        accelerator="cpu",
        devices=2,
        max_steps=args.steps,
        limit_val_batches=0,
        use_distributed_sampler=False,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        callbacks=[Recorder(args.out)],
    )
    trainer.fit(model)
    if trainer.global_rank == 0 and "spawn" in args.strategy:
        torch.save(model.state_dict(), args.out / "main.pt")


if __name__ == "__main__":
    main()
