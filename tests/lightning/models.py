"""LightningModules and data used by the Lightning integration tests and scripts."""

from __future__ import annotations

import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset
from torchmetrics import MeanMetric


def token_dataset(samples: int = 64, length: int = 17, vocab: int = 40, seed: int = 0) -> TensorDataset:
    """Counting sequences with random starts: learnable, deterministic."""
    g = torch.Generator().manual_seed(seed)
    start = torch.randint(0, vocab, (samples, 1), generator=g)
    return TensorDataset((start + torch.arange(length)) % vocab)


class TinyTransformerLM(pl.LightningModule):
    """An LM with a transformer ``net``, a plain loss module and a torchmetrics metric (neither gets wrapped)."""

    def __init__(self, vocab: int = 40, width: int = 32, lr: float = 0.1, batch_size: int = 8) -> None:
        super().__init__()
        self.save_hyperparameters()
        self.embed = nn.Embedding(vocab, width)
        layer = nn.TransformerEncoderLayer(width, 4, 2 * width, dropout=0.0, batch_first=True)
        self.net = nn.TransformerEncoder(layer, 2, enable_nested_tensor=False)
        self.head = nn.Linear(width, vocab)
        self.loss_fn = nn.CrossEntropyLoss()
        self.train_loss = MeanMetric()

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        n = ids.shape[1]
        mask = nn.Transformer.generate_square_subsequent_mask(n, device=ids.device)
        return self.head(self.net(self.embed(ids), mask=mask, is_causal=True))

    def _loss(self, batch: Any) -> torch.Tensor:
        (ids,) = batch
        logits = self(ids[:, :-1])
        return self.loss_fn(logits.reshape(-1, logits.shape[-1]), ids[:, 1:].reshape(-1))

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        loss = self._loss(batch)
        self.train_loss(loss)
        self.log("train_loss", loss, on_step=True, prog_bar=True)
        return loss

    def validation_step(self, batch: Any, batch_idx: int) -> None:
        self.log("val_loss", self._loss(batch))

    def test_step(self, batch: Any, batch_idx: int) -> None:
        self.log("test_loss", self._loss(batch))

    def predict_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        return self(batch[0][:, :-1]).argmax(-1)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        # SGD, not Adam: the attention key bias has an exactly-zero true gradient, and Adam would turn float noise
        # there into full-size steps, making weight comparisons between implementations meaningless.
        return torch.optim.SGD(self.parameters(), lr=self.hparams.lr, momentum=0.9)

    def train_dataloader(self) -> DataLoader:
        return DataLoader(token_dataset(), batch_size=self.hparams.batch_size)

    def val_dataloader(self) -> DataLoader:
        return DataLoader(token_dataset(16, seed=1), batch_size=self.hparams.batch_size)

    def test_dataloader(self) -> DataLoader:
        return DataLoader(token_dataset(16, seed=2), batch_size=self.hparams.batch_size)

    def predict_dataloader(self) -> DataLoader:
        return DataLoader(token_dataset(8, seed=3), batch_size=self.hparams.batch_size)


class LateHeadLM(TinyTransformerLM):
    """Creates its head in ``configure_model``, after callbacks' ``setup``."""

    def __init__(self, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        del self.head

    def configure_model(self) -> None:
        if not hasattr(self, "head"):
            self.head = nn.Linear(self.hparams.width, self.hparams.vocab)


class Losses(pl.Callback):
    """Records the loss of every training step."""

    def __init__(self) -> None:
        self.values: list[float] = []

    def on_train_batch_end(self, trainer: pl.Trainer, module: pl.LightningModule, outputs: Any, *_: Any) -> None:
        self.values.append(float(outputs["loss"]))


def train_three_steps(
    make: Callable[[], pl.LightningModule], tmp_path: Path, **ort: Any
) -> tuple[list[float], pl.LightningModule]:
    """Seed, make a model and fit it for three steps on CPU, warnings silenced; its losses and the model.

    ``ort`` takes the Trainer's ``strategy`` or ``callbacks`` (an ``ORTCallback``).
    """
    torch.manual_seed(0)
    model = make()
    losses = Losses()
    trainer = pl.Trainer(
        default_root_dir=tmp_path,
        accelerator="cpu",
        devices=1,
        max_steps=3,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        callbacks=[losses, *ort.pop("callbacks", [])],
        **ort,
    )
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        trainer.fit(model)
    return losses.values, model
