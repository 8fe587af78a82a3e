"""Lightning's own demo models train through ONNX Runtime as they train in plain Lightning.

``lightning.pytorch.demos``' transformer and LSTM language models download WikiText-2; here they train on
synthetic token data, with dropout off so that both runs compute the same function.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import pytest
import torch
from lightning.pytorch.demos import LightningTransformer
from lightning.pytorch.demos.boring_classes import BoringModel
from lightning.pytorch.demos.lstm import LightningLSTM
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from lightning_ort import ORTCallback, ORTModule
from tests.lightning.models import train_three_steps

VOCAB = 64
LOSS_TOLERANCE = {"rtol": 1e-4, "atol": 1e-5}


def _tokens(batch: int, length: int) -> TensorDataset:
    g = torch.Generator().manual_seed(0)
    data = torch.randint(0, VOCAB, (batch * 4, length + 1), generator=g)
    return TensorDataset(data[:, :-1], data[:, 1:])


def _no_dropout(module: nn.Module) -> None:
    for sub in module.modules():
        if isinstance(sub, nn.Dropout):
            sub.p = 0.0
        if isinstance(sub, (nn.MultiheadAttention, nn.LSTM)):
            sub.dropout = 0.0


class SyntheticTransformer(LightningTransformer):
    def __init__(self) -> None:
        super().__init__(vocab_size=VOCAB)
        _no_dropout(self)

    def prepare_data(self) -> None:
        pass

    def train_dataloader(self) -> DataLoader:
        return DataLoader(_tokens(2, 12), batch_size=2)


class SyntheticLSTM(LightningLSTM):
    def __init__(self) -> None:
        super().__init__(vocab_size=VOCAB)
        self.model = type(self.model)(vocab_size=VOCAB, ninp=32, nhid=32, nlayers=2, dropout=0.0)

    def prepare_data(self) -> None:
        pass

    def train_dataloader(self) -> DataLoader:
        return DataLoader(_tokens(4, 10), batch_size=4)


@pytest.mark.parametrize(
    "make", [SyntheticTransformer, SyntheticLSTM, BoringModel], ids=["transformer", "lstm", "boring"]
)
@pytest.mark.parametrize("how", ["strategy", "callback"])
def test_demo_model_trains_like_plain_lightning(
    make: Callable[[], pl.LightningModule], how: str, tmp_path: Path
) -> None:
    expected, _ = train_three_steps(make, tmp_path / "plain")
    ort: dict[str, Any] = {"strategy": "ort"} if how == "strategy" else {"callbacks": [ORTCallback()]}
    actual, model = train_three_steps(make, tmp_path / "ort", **ort)
    torch.testing.assert_close(torch.tensor(actual), torch.tensor(expected), **LOSS_TOLERANCE)
    wrapped = [m for m in model.modules() if isinstance(m, ORTModule)]
    assert wrapped, "no network was wrapped"
    assert sum(m.statistics.forward_runs for m in wrapped) >= 3
    assert sum(m.statistics.backward_runs for m in wrapped) >= 3
