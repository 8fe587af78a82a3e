"""``export_onnx=``: the callback and the strategies write deployment files from the trained weights at the end
of ``fit``; each loads into a plain ``onnxruntime.InferenceSession`` and matches the trained network in eval mode
(rtol 1e-4, atol 1e-5). DDP and FSDP runs export too (``test_ddp.py``, ``test_fsdp.py``), and so does the CLI
(``test_cli.py``)."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import onnxruntime as ort
import pytest
import torch
from torch import nn

from lightning_ort import ExportSpec, ORTCallback, ORTSingleDeviceStrategy
from tests.lightning.models import TinyTransformerLM, token_dataset

TOLERANCE = {"rtol": 1e-4, "atol": 1e-5}


def _fit(tmp_path: Path, **trainer: Any) -> TinyTransformerLM:
    pl.seed_everything(0)
    model = TinyTransformerLM()
    pl.Trainer(
        max_steps=3,
        accelerator="cpu",
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        limit_val_batches=0,
        default_root_dir=tmp_path,
        **trainer,
    ).fit(model)
    return model


def _session(path: Path) -> ort.InferenceSession:
    return ort.InferenceSession(str(path), providers=["CPUExecutionProvider"])


def test_the_callback_writes_the_trained_network_to_a_folder(tmp_path: Path) -> None:
    model = _fit(tmp_path, callbacks=[ORTCallback(modules=["net"], export_onnx=tmp_path / "deploy")])
    path = tmp_path / "deploy" / "net.onnx"
    assert [p.name for p in path.parent.iterdir()] == ["net.onnx"]
    session = _session(path)
    assert [i.name for i in session.get_inputs()] == ["src", "mask"]
    assert session.get_inputs()[0].shape == ["batch", 16, 32]
    net = model.net.module.eval()
    mask = nn.Transformer.generate_square_subsequent_mask(16)
    for batch in (1, 5):
        src = torch.randn(batch, 16, 32)
        (out,) = session.run(None, {"src": src.numpy(), "mask": mask.numpy()})
        with torch.no_grad():
            torch.testing.assert_close(torch.from_numpy(out), net(src, mask=mask, is_causal=True), **TOLERANCE)


def test_the_strategy_names_one_file_per_network_after_the_file_asked_for(tmp_path: Path) -> None:
    model = _fit(tmp_path, strategy=ORTSingleDeviceStrategy(export_onnx=tmp_path / "lm.onnx"))
    names = sorted(p.name for p in tmp_path.glob("*.onnx"))
    assert names == ["lm.embed.onnx", "lm.head.onnx", "lm.net.onnx"]
    ids = token_dataset(3, seed=5).tensors[0][:, :16]
    (embedded,) = _session(tmp_path / "lm.embed.onnx").run(None, {"input": ids.numpy()})
    torch.testing.assert_close(torch.from_numpy(embedded), model.embed.module(ids), **TOLERANCE)


class TwoNetworks(TinyTransformerLM):
    """Holds a network that ``training_step`` never calls: no example input for it is recorded during fit."""

    def __init__(self) -> None:
        super().__init__()
        self.unused = nn.Linear(32, 32)


def test_a_network_fit_never_calls_is_reported_not_exported(tmp_path: Path) -> None:
    pl.seed_everything(0)
    callback = ORTCallback(modules=["net", "unused"], export_onnx=tmp_path / "deploy")
    trainer = pl.Trainer(
        max_steps=2,
        accelerator="cpu",
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        limit_val_batches=0,
        default_root_dir=tmp_path,
        callbacks=[callback],
    )
    with pytest.warns(UserWarning, match=r"export_onnx: `unused` was not called during fit.*unused.onnx was not"):
        trainer.fit(TwoNetworks())
    assert sorted(p.name for p in (tmp_path / "deploy").iterdir()) == ["net.onnx"]


def test_export_onnx_must_be_a_path(tmp_path: Path) -> None:
    with pytest.raises(TypeError, match=r"export_onnx.*a .onnx file or a folder, an ExportSpec"):
        ORTCallback(export_onnx=3)  # type: ignore[arg-type]


class HuggingFaceLM(pl.LightningModule):
    """A default-config GPT-2 (``use_cache=True``) trained on padded batches with its own loss from ``labels``."""

    def __init__(self) -> None:
        super().__init__()
        transformers = pytest.importorskip("transformers")
        config = transformers.GPT2Config(n_layer=2, n_embd=32, n_head=2, vocab_size=100, n_positions=64)
        self.model = transformers.GPT2LMHeadModel(config)

    def training_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> torch.Tensor:
        ids, mask = batch
        return self.model(input_ids=ids, attention_mask=mask, labels=ids.masked_fill(mask == 0, -100)).loss

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.AdamW(self.parameters(), lr=1e-3)

    def train_dataloader(self) -> torch.utils.data.DataLoader:
        generator = torch.Generator().manual_seed(0)
        ids = torch.randint(0, 100, (16, 12), generator=generator)
        mask = torch.ones_like(ids)
        mask[::2, 8:] = 0
        return torch.utils.data.DataLoader(torch.utils.data.TensorDataset(ids, mask), batch_size=4)


@pytest.mark.parametrize("declared", [True, False], ids=["dynamic_axes", "spec"])
def test_a_default_config_hugging_face_model_exports_its_inference_signature_at_fit_end(
    declared: bool, tmp_path: Path
) -> None:
    pl.seed_everything(0)
    model = HuggingFaceLM()
    axes = {"input_ids": [0, 1], "attention_mask": [0, 1]}
    if declared:
        strategy = ORTSingleDeviceStrategy(export_onnx=tmp_path / "deploy", dynamic_axes=axes)
    else:
        sequence = {0: "batch", 1: "sequence"}
        spec = ExportSpec(
            tmp_path / "deploy",
            inputs=["input_ids", "attention_mask"],
            dynamic_shapes={"input_ids": sequence, "attention_mask": sequence},
        )
        strategy = ORTSingleDeviceStrategy(export_onnx=spec)
    pl.Trainer(
        max_steps=2,
        accelerator="cpu",
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        strategy=strategy,
        default_root_dir=tmp_path,
    ).fit(model)
    session = _session(tmp_path / "deploy" / "model.onnx")
    assert [(i.name, i.shape) for i in session.get_inputs()] == [
        ("input_ids", ["batch", "sequence"]),
        ("attention_mask", ["batch", "sequence"]),
    ]
    assert [(o.name, o.shape) for o in session.get_outputs()] == [("logits", ["batch", "sequence", 100])]
    network = model.model.module.eval()
    for batch, length in ((1, 5), (3, 17)):
        ids = torch.randint(0, 100, (batch, length))
        mask = torch.ones_like(ids)
        mask[0, length // 2 :] = 0
        (logits,) = session.run(None, {"input_ids": ids.numpy(), "attention_mask": mask.numpy()})
        with torch.no_grad():
            expected = network(input_ids=ids, attention_mask=mask, use_cache=False).logits
        torch.testing.assert_close(torch.from_numpy(logits), expected, **TOLERANCE)


@pytest.mark.parametrize("target", ["/proc/deploy/", "/etc/hostname/deploy"])
def test_an_unwritable_export_onnx_fails_when_the_strategy_or_callback_is_made(target: str) -> None:
    with pytest.raises(ValueError, match=rf"export_onnx='{re.escape(target.rstrip('/'))}' cannot be written"):
        ORTCallback(export_onnx=target)
    with pytest.raises(ValueError, match=r"export_onnx=.* cannot be written"):
        ORTSingleDeviceStrategy(export_onnx=ExportSpec(target))
