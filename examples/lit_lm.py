"""The LightningModule and DataModule the Lightning examples share: a small causal transformer LM."""

from __future__ import annotations

from typing import Any

import lightning.pytorch as pl
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset


class SyntheticTokens(pl.LightningDataModule):
    """Counting sequences (``start, start+1, ...`` modulo ``vocab``): made here, learnable in a few steps."""

    def __init__(self, vocab: int = 64, length: int = 33, samples: int = 256, batch_size: int = 16) -> None:
        super().__init__()
        self.save_hyperparameters()

    def _split(self, samples: int, seed: int) -> TensorDataset:
        g = torch.Generator().manual_seed(seed)
        start = torch.randint(0, self.hparams.vocab, (samples, 1), generator=g)
        return TensorDataset((start + torch.arange(self.hparams.length)) % self.hparams.vocab)

    def train_dataloader(self) -> DataLoader:
        return DataLoader(self._split(self.hparams.samples, 0), batch_size=self.hparams.batch_size, shuffle=True)

    def val_dataloader(self) -> DataLoader:
        return DataLoader(self._split(64, 1), batch_size=self.hparams.batch_size)


class LitTransformerLM(pl.LightningModule):
    """Embedding + ``nn.TransformerEncoder`` (causal) + head; loss and logging stay in PyTorch."""

    def __init__(self, vocab: int = 64, width: int = 64, heads: int = 4, layers: int = 2, lr: float = 3e-3) -> None:
        super().__init__()
        self.save_hyperparameters()
        self.embed = nn.Embedding(vocab, width)
        layer = nn.TransformerEncoderLayer(width, heads, 4 * width, dropout=0.1, batch_first=True)
        self.encoder = nn.TransformerEncoder(layer, layers, enable_nested_tensor=False)
        self.head = nn.Linear(width, vocab)
        self.loss = nn.CrossEntropyLoss()

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        mask = nn.Transformer.generate_square_subsequent_mask(ids.shape[1], device=ids.device)
        return self.head(self.encoder(self.embed(ids), mask=mask, is_causal=True))

    def _step(self, batch: Any) -> torch.Tensor:
        (ids,) = batch
        logits = self(ids[:, :-1])
        return self.loss(logits.reshape(-1, logits.shape[-1]), ids[:, 1:].reshape(-1))

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        loss = self._step(batch)
        self.log("train_loss", loss, prog_bar=True)
        return loss

    def validation_step(self, batch: Any, batch_idx: int) -> None:
        self.log("val_loss", self._step(batch), prog_bar=True, sync_dist=True)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.AdamW(self.parameters(), lr=self.hparams.lr)
