"""Real 2-process DDP on CPU (gloo): ``ort_ddp`` against plain ``ddp``, and ``ort_ddp_spawn``'s weights."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import onnxruntime
import pytest
import torch

from tests.lightning.models import TinyTransformerLM, token_dataset

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "tests" / "lightning" / "scripts" / "ddp_run.py"

pytestmark = pytest.mark.slow


def _run(
    strategy: str, out: Path, cache_dir: Path | None = None, profile: Path | None = None, export: Path | None = None
) -> list[dict[str, Any]]:
    out.mkdir()
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    extra = ["--cache-dir", str(cache_dir)] if cache_dir is not None else []
    extra += ["--profile", str(profile)] if profile is not None else []
    extra += ["--export-onnx", str(export)] if export is not None else []
    result = subprocess.run(
        [sys.executable, str(SCRIPT), "--strategy", strategy, "--out", str(out), *extra],
        cwd=out,
        env=env,
        capture_output=True,
        text=True,
        timeout=900,
    )
    assert result.returncode == 0, result.stderr[-4000:]
    assert "self.log('ort/" not in result.stderr, "the ort/* metrics are reduced already: no Lightning sync warning"
    return [json.loads((out / f"rank{rank}.json").read_text()) for rank in (0, 1)]


def _assert_same_state(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor], **tolerance: float) -> None:
    assert list(a) == list(b)
    for name in a:
        torch.testing.assert_close(a[name], b[name], msg=lambda m, n=name: f"{n}: {m}", **tolerance)


def test_ort_ddp_matches_plain_ddp_and_ranks_agree(tmp_path: Path) -> None:
    ort = _run("ort_ddp", tmp_path / "ort")
    plain = _run("ddp", tmp_path / "plain")

    ort_states = [torch.load(tmp_path / "ort" / f"rank{r}.pt") for r in (0, 1)]
    _assert_same_state(ort_states[0], ort_states[1], rtol=0, atol=0)
    _assert_same_state(ort_states[0], torch.load(tmp_path / "plain" / "rank0.pt"), rtol=1e-3, atol=1e-4)

    assert len(ort[0]["losses"]) == len(plain[0]["losses"]) == 6
    for step, (a, b) in enumerate(zip(ort[0]["losses"], plain[0]["losses"])):
        assert abs(a - b) <= 1e-3, f"step {step}: ort_ddp {a} vs ddp {b}"

    for record in ort:
        assert set(record["wrapped"]) == {"embed", "net", "head"}, "every rank wraps the same submodules"
        # The encoder `net` is its two layers' block graph, run twice a step; embed and head one graph each. On
        # CPU an embedding's weight gradient is PyTorch's: embed's backward graph has no ONNX Runtime part.
        runs = {name: (stats["forward_runs"], stats["backward_runs"]) for name, stats in record["wrapped"].items()}
        assert runs == {"embed": (6, 0), "net": (12, 12), "head": (6, 6)}, "ORT ran both passes on each rank"
        assert record["wrapped"]["net"]["block_graphs"] == 2
        metrics = record["metrics"]
        assert metrics["ort/export_seconds"] > 0
        assert metrics["ort/cache_misses"] == 3  # max over ranks of 3 training graphs per rank
        assert metrics["ort/cache_hits"] == 2 * 3 * 5  # summed over 2 ranks x 3 modules x 5 reuses
        assert metrics["ort/fallback_ops"] == 0 and metrics["ort/capture_seconds"] > 0
        # Per rank, the second layer reuses the first's forward and backward block graphs.
        assert (metrics["ort/block_graphs"], metrics["ort/block_reuses"]) == (2, 2 * 2)
    assert ort[0]["metrics"] == ort[1]["metrics"], "reduced metrics are identical on every rank"
    assert not plain[0]["wrapped"]


def test_ranks_share_a_cache_dir_and_a_restart_exports_nothing(tmp_path: Path) -> None:
    cache = tmp_path / "graphs"
    deploy = tmp_path / "deploy"
    first = _run("ort_ddp", tmp_path / "first", cache_dir=cache, profile=tmp_path / "profiles", export=deploy)
    profiles = sorted(p.name.rsplit("_", 3)[0] for p in (tmp_path / "profiles").glob("*.json"))
    graphs = {
        "embed": ("forward",),  # its backward, the embedding's weight gradient, is PyTorch's on CPU
        "head": ("backward", "forward"),
        "net": ("backward_block0", "forward_block0"),
    }
    expected = [f"{m}_{g}_profile_rank{r}" for m in graphs for g in graphs[m] for r in (0, 1)]
    assert profiles == expected, "every rank writes its own profile of every graph at the end of fit"
    files = sorted(cache.glob("*.ortgraph"))
    assert len(files) == 5, "forward graphs of 3 modules, backward graphs of 2, written once whichever rank finished"
    assert not list(cache.glob("*.tmp"))
    restart = _run("ort_ddp", tmp_path / "restart", cache_dir=cache)
    for record in restart:
        for name, stats in record["wrapped"].items():
            loads = 1 if name == "embed" else 2
            assert stats["onnx_exports"] == 0 and stats["disk_cache_loads"] == loads, (record["rank"], name, stats)
    assert restart[0]["losses"] == first[0]["losses"]
    assert sorted(cache.glob("*.ortgraph")) == files

    # Rank zero wrote each wrapped network's deployment file from the trained weights.
    assert sorted(p.name for p in deploy.iterdir()) == ["embed.onnx", "head.onnx", "net.onnx"]
    trained = TinyTransformerLM()
    trained.load_state_dict(torch.load(tmp_path / "first" / "rank0.pt"))
    trained.eval()
    session = onnxruntime.InferenceSession(str(deploy / "net.onnx"), providers=["CPUExecutionProvider"])
    assert [i.name for i in session.get_inputs()] == ["src", "mask"]
    hidden = trained.embed(token_dataset(5, seed=3).tensors[0][:, :16])
    mask = torch.nn.Transformer.generate_square_subsequent_mask(16)
    (out,) = session.run(None, {"src": hidden.detach().numpy(), "mask": mask.numpy()})
    with torch.no_grad():
        expected = trained.net(hidden, mask=mask, is_causal=True)
    torch.testing.assert_close(torch.from_numpy(out), expected, rtol=1e-4, atol=1e-5)


def test_ort_ddp_spawn_returns_trained_weights_to_the_main_process(tmp_path: Path) -> None:
    _run("ort_ddp_spawn", tmp_path / "spawn")
    trained = torch.load(tmp_path / "spawn" / "rank0.pt")
    main = torch.load(tmp_path / "spawn" / "main.pt")
    _assert_same_state(main, trained, rtol=0, atol=0)
