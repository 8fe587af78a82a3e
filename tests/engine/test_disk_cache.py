"""The on-disk graph cache: a second process skips the ONNX export; damage is detected and repaired."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch

from lightning_ort import DiskCacheWarning, ORTModule
from tests.helpers import OUTPUT_TOLERANCE
from tests.zoo import MLP

ROOT = Path(__file__).resolve().parents[2]


def _run_worker(cache_dir: Path, result: Path) -> dict[str, Any]:
    subprocess.run(
        [sys.executable, "-m", "tests.engine.disk_cache_worker", str(cache_dir), str(result)],
        cwd=ROOT,
        check=True,
        timeout=600,
        env={**os.environ, "PYTHONWARNINGS": "error::lightning_ort.DiskCacheWarning"},
    )
    return json.loads(result.read_text())


@pytest.mark.slow
def test_second_process_loads_graphs_instead_of_exporting(tmp_path: Path) -> None:
    cache = tmp_path / "graphs"
    first = _run_worker(cache, tmp_path / "first.json")
    second = _run_worker(cache, tmp_path / "second.json")

    assert first["statistics"]["onnx_exports"] == 2 and first["statistics"]["disk_cache_loads"] == 0
    assert second["statistics"]["onnx_exports"] == 0, "the second process must not export"
    assert second["statistics"]["disk_cache_loads"] == 2
    assert first["statistics"]["translation_seconds"] > 0
    assert second["statistics"]["translation_seconds"] == 0, "a loaded graph is not translated again"
    assert second["statistics"]["session_seconds"] > 0
    assert second["losses"] == first["losses"]
    assert second["checksum"] == first["checksum"]
    assert len(list(cache.glob("*.ortgraph"))) == 2
    assert not list(cache.glob("*.tmp")), "temporary files must be renamed or removed"


def _train_once(cache_dir: Path, x: torch.Tensor) -> ORTModule:
    torch.manual_seed(0)
    model = ORTModule(MLP(), cache_dir=cache_dir)
    model(x).sum().backward()
    return model


@pytest.mark.parametrize("damage", ["truncate", "flip_byte", "garbage"])
def test_damaged_file_is_reported_rebuilt_and_never_loaded(tmp_path: Path, damage: str) -> None:
    x = torch.randn(3, 16)
    reference = _train_once(tmp_path, x)
    files = sorted(tmp_path.glob("*.ortgraph"))
    assert len(files) == 2
    for path in files:
        data = path.read_bytes()
        if damage == "truncate":
            path.write_bytes(data[: len(data) // 2])
        elif damage == "flip_byte":
            path.write_bytes(data[:-10] + bytes([data[-10] ^ 0xFF]) + data[-9:])
        else:
            path.write_bytes(b"not a graph")

    with pytest.warns(DiskCacheWarning, match=r"is damaged .*deleting it and exporting the (forward|backward) graph"):
        again = _train_once(tmp_path, x)
    assert again.statistics.onnx_exports == 2 and again.statistics.disk_cache_loads == 0
    for a, e in zip(again.parameters(), reference.parameters()):
        torch.testing.assert_close(a.grad, e.grad, **OUTPUT_TOLERANCE)

    repaired = _train_once(tmp_path, x)
    assert repaired.statistics.disk_cache_loads == 2 and repaired.statistics.onnx_exports == 0


def test_different_shapes_get_different_files(tmp_path: Path) -> None:
    model = ORTModule(MLP(), cache_dir=tmp_path, dynamic=False)
    with torch.no_grad():
        model(torch.randn(3, 16))
        model(torch.randn(5, 16))
    assert len(list(tmp_path.glob("*.ortgraph"))) == 2

    fresh = ORTModule(MLP(), cache_dir=tmp_path, dynamic=False)
    with torch.no_grad():
        fresh(torch.randn(5, 16))
    assert fresh.statistics.disk_cache_loads == 1 and fresh.statistics.onnx_exports == 0


def test_changed_model_code_is_a_different_graph(tmp_path: Path) -> None:
    with torch.no_grad():
        ORTModule(torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.ReLU()), cache_dir=tmp_path)(torch.ones(2, 4))
        other = ORTModule(torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.GELU()), cache_dir=tmp_path)
        out = other(torch.ones(2, 4))
        torch.testing.assert_close(out, other.module(torch.ones(2, 4)), **OUTPUT_TOLERANCE)
    assert other.statistics.onnx_exports == 1 and other.statistics.disk_cache_loads == 0


def test_unwritable_cache_dir_warns_and_training_continues(tmp_path: Path) -> None:
    blocker = tmp_path / "file"
    blocker.write_text("not a folder")
    with pytest.warns(DiskCacheWarning, match=r"cache_dir=.* cannot be written.*continuing without"):
        model = ORTModule(MLP(), cache_dir=blocker / "graphs")
    model(torch.randn(2, 16)).sum().backward()
    assert model.statistics.onnx_exports == 2 and model.statistics.backward_runs == 1


def test_failed_write_leaves_no_temporary_file_and_training_continues(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    def full_disk(source: str, destination: str) -> None:
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(os, "replace", full_disk)
    model = ORTModule(MLP(), cache_dir=tmp_path)
    with pytest.warns(DiskCacheWarning, match=r"cannot write .*No space left on device.*continuing without"):
        model(torch.randn(2, 16)).sum().backward()
    assert model.statistics.backward_runs == 1
    assert not [p for p in tmp_path.iterdir() if p.name.endswith(".tmp")]


def test_another_vector_width_misses_the_cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from lightning_ort.engine.runtime import disk_cache

    x = torch.randn(3, 16)
    first = _train_once(tmp_path, x)
    assert first.statistics.onnx_exports == 2
    assert _train_once(tmp_path, x).statistics.disk_cache_loads == 2  # same machine: loaded
    block = disk_cache.nchwc_block_size()
    monkeypatch.setattr(disk_cache, "nchwc_block_size", lambda: 8 if block == 16 else 16)
    other_machine = _train_once(tmp_path, x)
    assert other_machine.statistics.disk_cache_loads == 0 and other_machine.statistics.onnx_exports == 2
    assert len(list(tmp_path.glob("*.ortgraph"))) == 4


def test_changed_package_source_or_provider_options_miss_the_cache(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from lightning_ort.engine.runtime import disk_cache

    x = torch.randn(3, 16)
    _train_once(tmp_path, x)
    monkeypatch.setattr(disk_cache, "source_hash", lambda: "a different translation")
    assert _train_once(tmp_path, x).statistics.disk_cache_loads == 0
    monkeypatch.undo()
    gm = torch.fx.symbolic_trace(torch.nn.Linear(2, 2))
    cache = disk_cache.DiskCache(tmp_path)
    cpu = torch.device("cpu")
    plain = cache.key(gm, [torch.zeros(2)], cpu, ["CPUExecutionProvider"])
    tuned = cache.key(gm, [torch.zeros(2)], cpu, [("CPUExecutionProvider", {"some_option": "1"})])
    assert plain != tuned


def test_size_expressions_round_trip_without_evaluating_text() -> None:
    import sympy

    from lightning_ort.engine.runtime.disk_cache import _size_from_json, _size_to_json
    from lightning_ort.engine.torch_internals import FloorDiv

    s0, s1 = sympy.Symbol("s0"), sympy.Symbol("s1")
    for size in (7, None, s0, 4 * s0 + 1, FloorDiv(s0 * s1, 2), s0**2 - s1):
        assert _size_from_json(json.loads(json.dumps(_size_to_json(size)))) == size
    with pytest.raises(ValueError, match="not a size expression"):
        _size_from_json("__import__('os').system('echo pwned')")
    with pytest.raises(ValueError, match="not a size expression"):
        _size_from_json({"exec": ["print(1)"]})


def test_a_foreign_entry_is_a_miss_with_a_warning(tmp_path: Path) -> None:
    x = torch.randn(3, 16)
    _train_once(tmp_path, x)
    for path in tmp_path.glob("*.ortgraph"):  # another program's file under our name
        path.write_bytes(b"LORTGRF2" + bytes(32) + b"\x05\x00\x00\x00{}")
    with pytest.warns(DiskCacheWarning, match="damaged"):
        model = _train_once(tmp_path, x)
    assert model.statistics.disk_cache_loads == 0 and model.statistics.onnx_exports == 2
    torch.testing.assert_close(model(x), _train_once(tmp_path, x)(x), **OUTPUT_TOLERANCE)
