"""Real 2-process FSDP on CPU (gloo): ``ort_fsdp`` against plain FSDP2, memory, checkpoints both ways."""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import onnxruntime as ort
import pytest
import torch
from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

from tests.lightning.models import token_dataset
from tests.lightning.scripts.fsdp_run import BlockLM

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "tests" / "lightning" / "scripts" / "fsdp_run.py"
STEPS = 5

pytestmark = pytest.mark.slow


def _run(out: Path, *args: str) -> list[dict[str, Any]]:
    out.mkdir()
    result = subprocess.run(
        [sys.executable, str(SCRIPT), "--out", str(out), "--steps", str(STEPS), *args],
        cwd=out,
        env={**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"},
        capture_output=True,
        text=True,
        timeout=900,
    )
    assert result.returncode == 0, result.stderr[-4000:]
    assert "FallbackWarning" not in result.stderr
    return [json.loads((out / f"rank{rank}.json").read_text()) for rank in (0, 1)]


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    root = tmp_path_factory.mktemp("fsdp")
    plain = _run(root / "plain", "--strategy", "fsdp", "--full")
    return {
        "root": root,
        "plain": plain,
        "ort": _run(root / "ort", "--strategy", "ort_fsdp", "--export-onnx", "deploy"),
        "checkpointed": _run(root / "checkpointed", "--strategy", "ort_fsdp", "--checkpointing", "--full"),
        "resumed": _run(root / "resumed", "--strategy", "ort_fsdp", "--resume", str(root / "plain" / "final.ckpt")),
        "empty_init": _run(root / "empty_init", "--strategy", "ort_fsdp", "--empty-init", "--export-onnx", "deploy"),
    }


def _plain_model(state: dict[str, torch.Tensor]) -> BlockLM:
    model = BlockLM()
    model.load_state_dict(state, strict=True)
    return model


def test_ort_fsdp_losses_match_plain_fsdp_and_ranks_agree(runs: dict[str, Any]) -> None:
    plain = runs["plain"][0]["losses"]
    assert len(plain) == STEPS
    for name in ("ort", "checkpointed"):
        ranks = runs[name]
        assert ranks[0]["losses"] == ranks[1]["losses"], f"{name}: ranks disagree"
        for step, (a, b) in enumerate(zip(ranks[0]["losses"], plain, strict=True)):
            assert abs(a - b) <= 1e-3, f"{name} step {step}: {a} vs plain FSDP {b}"


def test_every_block_ran_in_onnx_runtime_on_every_rank(runs: dict[str, Any]) -> None:
    for record in runs["ort"]:
        stats = record["wrapped"]["net"]
        assert stats["forward_runs"] == stats["backward_runs"] == 4 * STEPS, "4 blocks per step, both passes"
        assert stats["graphs"] == 1, "one graph serves the four blocks"


def test_parameters_and_optimizer_state_are_sharded(runs: dict[str, Any]) -> None:
    full = sum(p.numel() * p.element_size() for p in BlockLM().parameters())
    for record in runs["ort"]:
        assert abs(record["parameter_bytes"] - full / 2) <= 0.02 * full, "about half of DDP's full copy"
        assert abs(record["optimizer_bytes"] - full) <= 0.04 * full, "AdamW's two moments of half the parameters"


def test_activation_checkpointing_recomputes_in_the_backward_graph(runs: dict[str, Any]) -> None:
    def forward_graphs(name: str) -> list[int]:  # the block's forward graph (torch 2.11 may name it otherwise)
        return [count for graph, count in runs[name][0]["graph_outputs"].items() if graph.startswith("forward")]

    kept, recomputed = forward_graphs("ort"), forward_graphs("checkpointed")
    assert kept and recomputed, runs["ort"][0]["graph_outputs"]
    assert set(recomputed) == {1} and min(kept) > 1, "the checkpointed forward returns the block output, saves nothing"


def test_sharded_and_full_checkpoints_load_strictly_into_the_plain_model(runs: dict[str, Any]) -> None:
    root: Path = runs["root"]
    reference = _plain_model(torch.load(root / "plain" / "final.ckpt", weights_only=False)["state_dict"])
    dcp_to_torch_save(root / "ort" / "final.ckpt", root / "ort_full.pt")
    sharded = _plain_model(torch.load(root / "ort_full.pt", weights_only=False)["state_dict"])
    full = _plain_model(torch.load(root / "checkpointed" / "final.ckpt", weights_only=False)["state_dict"])
    for model in (sharded, full):
        for (name, a), (_, b) in zip(model.state_dict().items(), reference.state_dict().items(), strict=True):
            torch.testing.assert_close(a, b, rtol=1e-3, atol=1e-4, msg=lambda m, n=name: f"{n}: {m}")


@pytest.mark.parametrize("run", ["ort", "empty_init"])
def test_the_deployment_file_holds_the_gathered_trained_weights(runs: dict[str, Any], run: str) -> None:
    root: Path = runs["root"]
    path = root / run / "deploy" / "net.onnx"
    assert [p.name for p in path.parent.iterdir()] == ["net.onnx"], "rank zero writes one file"
    dcp_to_torch_save(root / run / "final.ckpt", root / f"{run}_export.pt")
    trained = _plain_model(torch.load(root / f"{run}_export.pt", weights_only=False)["state_dict"]).net.eval()
    session = ort.InferenceSession(str(path), providers=["CPUExecutionProvider"])
    assert [i.name for i in session.get_inputs()] == ["ids"]
    for batch in (3, 8):
        ids = token_dataset(batch, seed=4).tensors[0][:, :-1]
        (logits,) = session.run(None, {"ids": ids.numpy()})
        with torch.no_grad():
            torch.testing.assert_close(torch.from_numpy(logits), trained(ids), rtol=1e-4, atol=1e-5)


def test_a_plain_checkpoint_resumes_under_ort_fsdp(runs: dict[str, Any]) -> None:
    state = torch.load(runs["root"] / "plain" / "final.ckpt", weights_only=False)["state_dict"]
    model = _plain_model(state)
    ids = token_dataset().tensors[0][:8]  # Lightning restarts the epoch it resumes in from its first batch
    expected = model.training_step((ids,), 0).item()
    for record in runs["resumed"]:
        assert len(record["losses"]) == 1
        assert abs(record["losses"][0] - expected) <= 1e-4, "the resumed step starts from the plain weights"


def test_a_model_built_on_the_meta_device_is_materialized_sharded_and_trains(runs: dict[str, Any]) -> None:
    full = sum(p.numel() * p.element_size() for p in BlockLM().parameters())
    ranks = runs["empty_init"]
    assert ranks[0]["losses"] == ranks[1]["losses"], "ranks disagree"
    losses = ranks[0]["losses"]
    assert all(math.isfinite(loss) for loss in losses) and losses[-1] < losses[0], losses
    for record in ranks:
        assert abs(record["parameter_bytes"] - full / 2) <= 0.02 * full, "materialized as shards"
        stats = record["wrapped"]["net"]
        assert stats["forward_runs"] == stats["backward_runs"] == 4 * STEPS
