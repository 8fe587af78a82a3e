"""ORTCallback in a real Trainer (single process): metrics, loggers, loops, late modules, precision."""

from __future__ import annotations

import csv
import logging
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import lightning.pytorch as pl
import pytest
import torch

from lightning_ort import ExportError, FallbackWarning, ORTCallback, ORTModule
from lightning_ort.engine.capture.backend import ModuleStatistics
from lightning_ort.lightning.callback import _check_precision
from lightning_ort.lightning.metrics import ORTMetrics, onnx_runtime_share, summary_table, total_statistics
from tests.custom_ops import CustomOpMLP
from tests.lightning.models import LateHeadLM, TinyTransformerLM


def _trainer(tmp_path: Path, callbacks: list[Any] | None = None, **kwargs: Any) -> pl.Trainer:
    options: dict[str, Any] = {
        "accelerator": "cpu",
        "devices": 1,
        "max_steps": 6,
        "limit_val_batches": 1,
        "num_sanity_val_steps": 0,
        "log_every_n_steps": 1,
        "enable_progress_bar": False,
        "enable_model_summary": False,
        "enable_checkpointing": False,
        "logger": pl.loggers.CSVLogger(tmp_path, name="csv"),
        "default_root_dir": tmp_path,
        "callbacks": callbacks or [],
    }
    options.update(kwargs)
    return pl.Trainer(**options)


def _csv_rows(tmp_path: Path) -> list[dict[str, str]]:
    (path,) = tmp_path.glob("csv/version_*/metrics.csv")
    with path.open() as handle:
        return list(csv.DictReader(handle))


def test_metrics_reach_callback_metrics_and_csv(tmp_path: Path) -> None:
    model = TinyTransformerLM()
    trainer = _trainer(tmp_path, [ORTCallback(modules=["net"], prog_bar=True)], max_steps=6, val_check_interval=3)
    trainer.fit(model)
    metrics = trainer.callback_metrics
    assert isinstance(model.net, ORTModule)
    assert float(metrics["ort/export_seconds"]) > 0
    assert float(metrics["ort/cache_misses"]) == 2  # the training graph and the validation (eval) graph
    assert (float(metrics["ort/onnx_runtime_share"]), float(metrics["ort/graph_breaks"])) == (1.0, 0.0)
    rows = [r for r in _csv_rows(tmp_path) if r.get("ort/cache_hits")]
    hits = [float(r["ort/cache_hits"]) for r in rows]
    assert len(hits) >= 6
    assert hits == sorted(hits) and hits[-1] > hits[0]
    assert {float(r["ort/cache_misses"]) for r in rows if r["step"] == "5"} <= {1.0, 2.0}
    assert trainer.progress_bar_metrics.keys() >= {"ort/cache_hits", "ort/cache_misses", "ort/export_seconds"}
    stats = model.net.statistics
    assert stats.forward_runs > 0 and stats.backward_runs == 6 * 2, "6 steps, the block graph of 2 layers each"
    assert stats.block_graphs >= 2


def test_metrics_are_reduced_on_the_steps_lightning_logs_and_at_epoch_end(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    reductions: list[int] = []
    reduce = ORTMetrics.reduce

    def counted(self: ORTMetrics, stats: Any, share: float | None = None) -> dict[str, torch.Tensor]:
        reductions.append(self.rows[0].numel() if self.rows else 0)
        return reduce(self, stats, share)

    monkeypatch.setattr(ORTMetrics, "reduce", counted)
    model = TinyTransformerLM()
    trainer = _trainer(tmp_path, [ORTCallback()], max_steps=6, log_every_n_steps=3, limit_val_batches=0)
    trainer.fit(model)
    assert len(reductions) == 3, "steps 3 and 6, then the end of the epoch; not every step"
    rows = [r for r in _csv_rows(tmp_path) if r.get("ort/cache_hits")]
    assert [r["step"] for r in rows] == ["2", "5", "5"]
    assert float(trainer.callback_metrics["ort/cache_hits"]) == float(rows[-1]["ort/cache_hits"]) > 0


def test_metrics_gather_every_rank_in_one_collective() -> None:
    gathers: list[torch.Tensor] = []

    def two_ranks(tensor: torch.Tensor, group: Any = None) -> list[torch.Tensor]:
        gathers.append(tensor)
        other = tensor.clone()
        other[:, 0] += 1.0  # the other rank took a second longer to export
        other[:, 2] = 10  # and reused graphs 10 times
        other[:, -1] = 0.5  # and ran half its ops in ONNX Runtime
        return [tensor, other]

    metrics = ORTMetrics(dist_sync_fn=two_ranks, distributed_available_fn=lambda: True)
    values = metrics.reduce(ModuleStatistics(export_seconds=2.0, cache_hits=3, graph_ops=40))
    assert len(gathers) == 1
    assert float(values["ort/export_seconds"]) == 3.0  # maximum over ranks
    assert float(values["ort/cache_hits"]) == 13.0  # sum over ranks
    assert float(values["ort/onnx_runtime_share"]) == 0.5  # minimum over ranks


def test_training_matches_plain_lightning_with_accumulation_and_clipping(tmp_path: Path) -> None:
    losses = {}
    for name, callbacks in (("plain", []), ("ort", [ORTCallback()])):
        torch.manual_seed(0)
        model = TinyTransformerLM()
        trainer = _trainer(
            tmp_path / name,
            callbacks,
            max_steps=4,
            accumulate_grad_batches=2,
            gradient_clip_val=0.5,
            limit_val_batches=0,
        )
        trainer.fit(model)
        losses[name] = [float(r["train_loss"]) for r in _csv_rows(tmp_path / name) if r.get("train_loss")]
    assert len(losses["ort"]) == len(losses["plain"]) == 4  # one logged loss per optimizer step
    for step, (a, b) in enumerate(zip(losses["ort"], losses["plain"])):
        assert abs(a - b) <= 1e-3, f"batch {step}: ORT {a} vs plain {b}"


def test_validate_test_and_predict_run_eval_graphs(tmp_path: Path) -> None:
    model = TinyTransformerLM()
    trainer = _trainer(tmp_path, [ORTCallback(modules=["net"])])
    trainer.validate(model)
    (test_results,) = trainer.test(model)
    predictions = trainer.predict(model)
    assert predictions is not None and predictions[0].shape == (8, 16)
    stats = model.net.statistics
    assert stats.backward_runs == 0 and stats.forward_runs > 0
    assert model.net.graphs == ["inference", "inference_block0"]
    assert test_results["test_loss"] > 0
    assert test_results["ort/cache_misses"] == 1  # validate built the eval graph; test reused it


def test_profiles_are_written_and_summarised_at_the_end_of_each_stage(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    model = TinyTransformerLM()
    callback = ORTCallback(modules=["net"], profile=True, save_path=tmp_path / "profiles", onnx_prefix="lm")
    trainer = _trainer(tmp_path, [callback], max_steps=4, val_check_interval=2)
    with caplog.at_level(logging.INFO):
        trainer.fit(model)
    stems = sorted(p.name.split("_profile_")[0] for p in (tmp_path / "profiles").glob("*.json"))
    # The encoder is its layers' block graphs: one file per block graph.
    assert stems == ["lm_net_backward_block0", "lm_net_forward_block0", "lm_net_inference_block0"]
    (summary,) = [r.getMessage() for r in caplog.records if "ONNX Runtime profile of `net`" in r.getMessage()]
    assert "(fit, " in summary and "(outside kernels)" in summary and "ONNX Runtime runs" in summary
    assert str(tmp_path / "profiles") in summary

    # trainer.validate() runs under torch.inference_mode(): TorchDynamo compiles an inference graph for its
    # inference tensors, profiled and summarised with the validate stage; the fit stage's files stay as they were.
    caplog.clear()
    with caplog.at_level(logging.INFO):
        trainer.validate(model)
    (summary,) = [r.getMessage() for r in caplog.records if "ONNX Runtime profile of `net`" in r.getMessage()]
    assert "(validate, " in summary
    stems = sorted(p.name.split("_profile_")[0] for p in (tmp_path / "profiles").glob("*.json"))
    assert stems == [
        "lm_net_backward_block0",
        "lm_net_forward_block0",
        "lm_net_inference_1_block0",
        "lm_net_inference_block0",
    ]


def test_module_created_in_configure_model_is_wrapped_later(tmp_path: Path) -> None:
    model = LateHeadLM()
    trainer = _trainer(tmp_path, [ORTCallback(modules=["net", "head"])], max_steps=2)
    trainer.fit(model)
    assert isinstance(model.head, ORTModule)
    assert model.head.statistics.backward_runs == 2


def test_bf16_mixed_trains_like_plain_lightning_in_onnx_runtime_on_cpu(tmp_path: Path) -> None:
    losses: dict[str, list[float]] = {}
    for name, callbacks in (("plain", []), ("ort", [ORTCallback()])):
        pl.seed_everything(0)
        model = TinyTransformerLM()
        recorder = LossRecorder()
        _trainer(tmp_path / name, [*callbacks, recorder], precision="bf16-mixed", max_steps=4).fit(model)
        losses[name] = recorder.losses
    for step, (ort, plain) in enumerate(zip(losses["ort"], losses["plain"])):
        assert abs(ort - plain) <= 2e-2 * abs(plain), f"step {step}: ORT {ort} vs eager bf16 {plain}"
    assert isinstance(model.net, ORTModule)
    assert model.net.statistics.backward_runs == 4 * 2, "4 steps, the block graph of 2 layers each"
    assert model.net.statistics.fallback_ops == 0  # bfloat16 ops computed in float32 inside the graphs
    assert model.trainer.callback_metrics["ort/fallback_ops"] == 0
    assert model.trainer.callback_metrics["ort/onnx_runtime_share"] == 1


@pytest.mark.parametrize(("precision", "rtol"), [("bf16-true", 2e-2), ("16-true", 2e-3), ("64-true", 1e-9)])
def test_true_precision_trains_like_plain_lightning(precision: str, rtol: float, tmp_path: Path) -> None:
    """``precision="bf16-true"`` and ``"16-true"`` convert the model's parameters to 16 bits, ``"64-true"`` to
    float64: every gradient comes back in its parameter's dtype, and each step's loss is plain Lightning's."""
    losses: dict[str, list[float]] = {}
    for name, callbacks in (("plain", []), ("ort", [ORTCallback()])):
        pl.seed_everything(0)
        model = TinyTransformerLM()
        recorder = LossRecorder()
        _trainer(tmp_path / name, [*callbacks, recorder], precision=precision, max_steps=3).fit(model)
        losses[name] = recorder.losses
    for step, (ort, plain) in enumerate(zip(losses["ort"], losses["plain"], strict=True)):
        assert abs(ort - plain) <= rtol * abs(plain), f"step {step}: ORT {ort} vs plain Lightning {plain}"
    assert isinstance(model.net, ORTModule)
    assert model.net.statistics.backward_runs == 3 * 2, "3 steps, the block graph of 2 layers each"


class LossRecorder(pl.Callback):
    def __init__(self) -> None:
        self.losses: list[float] = []

    def on_train_batch_end(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        self.losses.append(float(outputs["loss"]))


def test_transformer_engine_precision_is_refused_with_a_clear_message() -> None:
    trainer = SimpleNamespace(precision="transformer-engine")
    with pytest.raises(ValueError, match=r"precision='transformer-engine'\) is not supported.*'bf16-mixed'"):
        _check_precision(trainer)  # type: ignore[arg-type]


def test_module_without_trainable_children_is_an_error(tmp_path: Path) -> None:
    model = TinyTransformerLM()
    model.freeze()
    trainer = _trainer(tmp_path, [ORTCallback()])
    with pytest.raises(ValueError, match="found nothing to wrap"):
        trainer.validate(model)


class CustomOpModule(pl.LightningModule):
    """A network with a custom op ONNX cannot express: it must train, with the op counted as a fallback."""

    def __init__(self) -> None:
        super().__init__()
        self.net = CustomOpMLP()

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        (x,) = batch
        return self.net(x).square().mean()

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.1)

    def train_dataloader(self) -> torch.utils.data.DataLoader:
        data = torch.utils.data.TensorDataset(torch.randn(16, 8, generator=torch.Generator().manual_seed(0)))
        return torch.utils.data.DataLoader(data, batch_size=4)


def test_fallback_ops_metric_and_cache_dir_through_the_callback(tmp_path: Path) -> None:
    cache = tmp_path / "graphs"
    model = CustomOpModule()
    with pytest.warns(FallbackWarning, match="lightning_ort_tests.softsign"):
        _trainer(tmp_path, [ORTCallback(cache_dir=cache)], max_steps=3, limit_val_batches=0).fit(model)
    assert float(_trainer_metrics(model)["ort/fallback_ops"]) == 1
    assert isinstance(model.net, ORTModule) and model.net.cache_dir == cache
    assert len(list(cache.glob("*.ortgraph"))) == 3  # two forward partitions and the backward graph

    again = CustomOpModule()
    _trainer(tmp_path / "again", [ORTCallback(cache_dir=cache)], max_steps=1, limit_val_batches=0).fit(again)
    assert again.net.statistics.onnx_exports == 0 and again.net.statistics.disk_cache_loads == 3

    with pytest.raises(ExportError, match=r"(?s)softsign.*fallback='auto'"):
        _trainer(tmp_path / "strict", [ORTCallback(fallback="raise")], max_steps=1).fit(CustomOpModule())


def _trainer_metrics(model: pl.LightningModule) -> dict[str, Any]:
    return dict(model.trainer.callback_metrics)


class RunsInPyTorch(torch.nn.Linear):
    """A network TorchDynamo captures nothing of: all of it runs in PyTorch."""

    @torch._dynamo.disable
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return super().forward(x)


def test_the_onnx_runtime_share_counts_a_network_in_pytorch_and_leaves_out_one_never_called() -> None:
    dense, in_pytorch, unused = (
        ORTModule(torch.nn.Linear(8, 8)),
        ORTModule(RunsInPyTorch(8, 8)),
        ORTModule(torch.nn.Linear(8, 8)),
    )
    x = torch.randn(2, 8)
    in_pytorch(dense(x)).sum().backward()
    assert dense.statistics.forward_runs == 1 and in_pytorch.statistics.forward_runs == 0
    assert onnx_runtime_share({"dense": dense, "unused": unused}) == 1.0
    assert onnx_runtime_share({"dense": dense, "in_pytorch": in_pytorch, "unused": unused}) == 0.5
    values = ORTMetrics().reduce(total_statistics({"dense": dense, "in_pytorch": in_pytorch}), 0.5)
    assert float(values["ort/onnx_runtime_share"]) == 0.5
    rows = {
        line.split()[0]: line
        for line in summary_table({"dense": dense, "in_pytorch": in_pytorch, "unused": unused}).splitlines()
    }
    assert "ONNX Runtime" in rows["dense"] and "PyTorch" in rows["in_pytorch"] and "ONNX" not in rows["in_pytorch"]
    assert "not called" in rows["unused"]
