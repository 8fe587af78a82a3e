"""Train a block LM with 2 CPU processes (gloo) and FSDP, and dump what each rank saw, for test_fsdp.py.

    python tests/lightning/scripts/fsdp_run.py --strategy ort_fsdp --out DIR [--checkpointing] [--full] [--resume F]

Strategies: ``ort_fsdp`` (:class:`~lightning_ort.ORTFSDPStrategy`), ``fsdp`` (plain FSDP2: Lightning's
``ModelParallelStrategy`` with ``fully_shard`` per block in ``configure_model``) and ``ddp``. Every rank writes
``DIR/rank<R>.json`` (losses, local parameter bytes, ORT statistics); the run ends with
``trainer.save_checkpoint(DIR/final.ckpt)``: a folder of shards, or one file with ``--full``. ``--resume F``
starts from checkpoint ``F`` (trained one step further from it). ``--export-onnx D`` writes the network's
deployment file to folder ``D`` at the end of fit. ``--empty-init`` builds the model under
``trainer.init_module(empty_init=True)`` (parameters on the meta device until the strategy materializes them).
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import torch
from lightning.pytorch.strategies import ModelParallelStrategy
from torch import nn
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor import DTensor
from torch.utils.data import DataLoader
from typing_extensions import override

import lightning_ort
from lightning_ort.engine.runtime.session import GraphSession
from lightning_ort.lightning.wrapping import wrapped_submodules
from tests.lightning.models import token_dataset
from tests.lightning.scripts import ddp_run


class Attention(nn.MultiheadAttention):
    """``nn.MultiheadAttention`` with the ``reset_parameters`` that materializing a meta-device model calls."""

    def reset_parameters(self) -> None:
        self._reset_parameters()


class Layer(nn.Module):
    def __init__(self, width: int) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(width)
        # No projection biases: the key bias has no gradient, and AdamW turns its rounding noise into updates
        # that differ between any two implementations.
        self.attention = Attention(width, 4, bias=False, batch_first=True)
        self.up = nn.Linear(width, 2 * width)
        self.down = nn.Linear(2 * width, width)

    def forward(self, x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        h = self.norm(x)
        x = x + self.attention(h, h, h, attn_mask=mask, need_weights=False)[0]
        return x + self.down(torch.relu(self.up(self.norm(x))))


class Network(nn.Module):
    def __init__(self, vocab: int = 40, width: int = 32, depth: int = 4) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab, width)
        self.blocks = nn.ModuleList(Layer(width) for _ in range(depth))  # the name of ORTModule.blocks
        self.head = nn.Linear(width, vocab)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        n = ids.shape[1]
        mask = torch.triu(torch.full((n, n), float("-inf"), device=ids.device), diagonal=1)
        x = self.embed(ids)
        for layer in self.blocks:
            x = layer(x, mask)
        return self.head(x)


class BlockLM(pl.LightningModule):
    def __init__(self, lr: float = 0.05) -> None:
        super().__init__()
        self.save_hyperparameters()
        self.net = Network()

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        (ids,) = batch
        logits = self.net(ids[:, :-1])
        return nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), ids[:, 1:].reshape(-1))

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.AdamW(self.parameters(), lr=self.hparams.lr)

    def train_dataloader(self) -> DataLoader:
        return DataLoader(token_dataset(), batch_size=8)


class ShardedBlockLM(BlockLM):
    """Plain FSDP2, as a ``ModelParallelStrategy`` user writes it."""

    def configure_model(self) -> None:
        mesh = self.device_mesh["data_parallel"]
        for layer in self.net.blocks:
            fully_shard(layer, mesh=mesh)
        fully_shard(self.net, mesh=mesh)


class Recorder(ddp_run.Recorder):
    """Losses, local parameter and optimizer bytes and ORT statistics of each rank."""

    @override
    def on_train_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        local = sum(
            (p.to_local() if isinstance(p, DTensor) else p).numel() * p.element_size() for p in pl_module.parameters()
        )
        optimizer = trainer.optimizers[0]
        state = sum(
            (v.to_local() if isinstance(v, DTensor) else v).numel() * v.element_size()
            for s in optimizer.state.values()
            for v in s.values()
            if isinstance(v, torch.Tensor) and v.dim() > 0
        )
        record = {
            "losses": self.losses,
            "parameter_bytes": local,
            "optimizer_bytes": state,
            "wrapped": {name: vars(m.statistics) for name, m in wrapped_submodules(pl_module).items()},
            "graph_outputs": {
                runner.name: len(runner._output_names)
                for m in wrapped_submodules(pl_module).values()
                for _, runner in m._backend.runners()
                if isinstance(runner, GraphSession)
            },
        }
        (self.out / f"rank{trainer.global_rank}.json").write_text(json.dumps(record))


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--strategy", required=True, choices=["ort_fsdp", "fsdp", "ddp"])
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--checkpointing", action="store_true")
    parser.add_argument("--full", action="store_true")
    parser.add_argument("--resume", type=Path, default=None)
    parser.add_argument("--empty-init", action="store_true")
    parser.add_argument("--export-onnx", type=Path, default=None)
    args = parser.parse_args()
    strategy: Any = args.strategy
    model_class = BlockLM
    if args.strategy == "ort_fsdp":
        strategy = lightning_ort.ORTFSDPStrategy(
            activation_checkpointing=args.checkpointing,
            save_distributed_checkpoint=not args.full,
            export_onnx=args.export_onnx,
        )
    elif args.strategy == "fsdp":
        strategy = ModelParallelStrategy(
            data_parallel_size=2, tensor_parallel_size=1, save_distributed_checkpoint=not args.full
        )
        model_class = ShardedBlockLM
    pl.seed_everything(0, workers=True)
    trainer = pl.Trainer(
        strategy=strategy,
        accelerator="cpu",
        devices=2,
        max_steps=args.steps + (1 if args.resume is not None else 0),
        limit_val_batches=0,
        use_distributed_sampler=False,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        callbacks=[Recorder(args.out)],
    )
    if args.empty_init:
        with trainer.init_module(empty_init=True):
            model = model_class()
    else:
        model = model_class()
        model.load_state_dict(BlockLM().state_dict())  # every strategy starts from the same weights
    trainer.fit(model, ckpt_path=args.resume)
    trainer.save_checkpoint(args.out / "final.ckpt")


if __name__ == "__main__":
    main()
