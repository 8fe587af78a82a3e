"""Checkpoints written under ORT are plain Lightning checkpoints, and resume both ways (all strict)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import torch

from lightning_ort import ORTModule
from tests.lightning.models import TinyTransformerLM


def _fit(
    tmp_path: Path, strategy: str, max_steps: int, ckpt_path: Path | None = None, **kwargs: Any
) -> tuple[pl.Trainer, TinyTransformerLM]:
    torch.manual_seed(0)
    model = TinyTransformerLM()
    trainer = pl.Trainer(
        strategy=strategy,
        accelerator="cpu",
        devices=1,
        max_steps=max_steps,
        limit_val_batches=0,
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        default_root_dir=tmp_path,
        **kwargs,
    )
    trainer.fit(model, ckpt_path=ckpt_path)
    return trainer, model


def _save(trainer: pl.Trainer, path: Path) -> Path:
    trainer.save_checkpoint(path)
    return path


def test_checkpoint_keys_are_plain_and_load_strictly_into_the_plain_class(tmp_path: Path) -> None:
    trainer, model = _fit(tmp_path, "ort", max_steps=2)
    assert isinstance(model.net, ORTModule)
    path = _save(trainer, tmp_path / "ort.ckpt")
    checkpoint = torch.load(path, weights_only=False)
    assert list(checkpoint["state_dict"]) == list(TinyTransformerLM().state_dict())
    assert "ORTCallback" not in str(checkpoint.get("callbacks", {}))
    restored = TinyTransformerLM.load_from_checkpoint(path, strict=True)
    for (name, a), (_, b) in zip(restored.state_dict().items(), model.state_dict().items()):
        torch.testing.assert_close(a, b, msg=lambda m, n=name: f"{n}: {m}")


def test_fit_resumes_from_an_ort_checkpoint_under_ort(tmp_path: Path) -> None:
    trainer, _ = _fit(tmp_path, "ort", max_steps=2)
    path = _save(trainer, tmp_path / "ort.ckpt")
    resumed_trainer, resumed = _fit(tmp_path, "ort", max_steps=4, ckpt_path=path)
    assert resumed_trainer.global_step == 4
    assert isinstance(resumed.net, ORTModule)
    plain_trainer, plain = _fit(tmp_path, "auto", max_steps=4, ckpt_path=path)
    for (name, a), (_, b) in zip(resumed.state_dict().items(), plain.state_dict().items()):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-5, msg=lambda m, n=name: f"{n}: {m}")
    ort_momentum = resumed_trainer.optimizers[0].state_dict()["state"]
    plain_momentum = plain_trainer.optimizers[0].state_dict()["state"]
    for key in plain_momentum:
        torch.testing.assert_close(
            ort_momentum[key]["momentum_buffer"], plain_momentum[key]["momentum_buffer"], rtol=1e-3, atol=1e-4
        )


def test_plain_checkpoint_resumes_under_ort(tmp_path: Path) -> None:
    trainer, _ = _fit(tmp_path, "auto", max_steps=2)
    path = _save(trainer, tmp_path / "plain.ckpt")
    resumed_trainer, resumed = _fit(tmp_path, "ort", max_steps=3, ckpt_path=path)
    assert resumed_trainer.global_step == 3
    assert isinstance(resumed.net, ORTModule)
    assert resumed.net.statistics.backward_runs == 2, "one step: the block graph of each of the two layers"
