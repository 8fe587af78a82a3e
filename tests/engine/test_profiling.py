"""ONNX Runtime profiles: written per graph with ``DebugOptions(profile=True)``, summed by op type."""

from __future__ import annotations

import json
import warnings
from pathlib import Path
from typing import Any

import pytest
import torch

from lightning_ort import DebugOptions, FallbackWarning, ORTModule, ORTModuleError, read_profiles
from tests.custom_ops import CustomOpMLP
from tests.zoo import MLP


def _run(ts: float, dur: float) -> dict[str, Any]:
    return {"cat": "Session", "name": "model_run", "ts": ts, "dur": dur, "ph": "X", "args": {}}


def _kernel(node: str, op: str, ts: float, dur: float, arena: int = 0) -> dict[str, Any]:
    args = {"op_name": op, "provider": "CPUExecutionProvider", "mem_arena_held": str(arena)}
    return {"cat": "Node", "name": f"{node}_kernel_time", "ts": ts, "dur": dur, "ph": "X", "args": args}


def _write(path: Path, events: list[dict[str, Any]]) -> Path:
    path.write_text(json.dumps(events))
    return path


def test_kernel_times_are_summed_by_op_type_over_the_kept_runs(tmp_path: Path) -> None:
    events = [
        {"cat": "Session", "name": "session_initialization", "ts": 0, "dur": 50, "ph": "X", "args": {}},
        _run(100, 100),  # the first run: skipped below
        _kernel("mm", "MatMul", 110, 80, arena=2**30),
        _run(300, 40),
        _kernel("mm", "MatMul", 305, 20, arena=2**20),
        _kernel("relu", "Relu", 326, 5),
        {"cat": "Node", "name": "relu_fence_before", "ts": 325, "dur": 1, "ph": "X", "args": {"op_name": "Relu"}},
        _run(400, 30),
        _kernel("mm", "MatMul", 402, 18),
        _kernel("relu", "Relu", 421, 6),
    ]
    other = _write(tmp_path / "backward.json", [_run(0, 10), _run(20, 10), _kernel("t", "Transpose", 22, 4)])
    profile = read_profiles([_write(tmp_path / "forward.json", events), other], skip_runs=1)
    assert profile.runs == 3  # two forward runs and one backward run after each file's first
    assert profile.run_ms == pytest.approx((40 + 30 + 10) / 1000)
    assert [(op.op_type, op.calls) for op in profile.ops] == [("MatMul", 2), ("Relu", 2), ("Transpose", 1)]
    assert profile.ops[0].milliseconds == pytest.approx(0.038)
    assert profile.kernel_ms == pytest.approx((20 + 5 + 18 + 6 + 4) / 1000)
    assert profile.overhead_ms == pytest.approx(profile.run_ms - profile.kernel_ms)
    assert profile.arena_peak_mib == pytest.approx(1.0), "the skipped run's arena does not count"
    table = profile.format_table(per=1, top=1)
    assert "MatMul" in table and "(2 other op types)" in table and "Relu" not in table

    everything = read_profiles([tmp_path / "forward.json"])
    assert everything.runs == 3 and everything.ops[0].calls == 3


def test_a_file_that_is_not_a_profile_is_named(tmp_path: Path) -> None:
    bad = tmp_path / "model.onnx"
    bad.write_bytes(b"\x08\x07")
    with pytest.raises(ValueError, match=r"model\.onnx is not a readable ONNX Runtime profile"):
        read_profiles([bad])
    _write(tmp_path / "object.json", {"traceEvents": []})  # type: ignore[arg-type]
    with pytest.raises(ValueError, match=r"object\.json is not an ONNX Runtime profile"):
        read_profiles([tmp_path / "object.json"])


def test_training_steps_write_one_profile_per_graph(tmp_path: Path) -> None:
    wrapped = ORTModule(MLP(), DebugOptions(profile=True, save_path=tmp_path, onnx_prefix="mlp"), dynamic=False)
    x = torch.randn(4, 16)
    for _ in range(3):
        wrapped(x).sum().backward()
    profile = wrapped.end_profiling(skip_runs=1)
    assert sorted(f.name.split("_profile_")[0] for f in profile.files) == ["mlp_backward", "mlp_forward"]
    assert all(f.parent == tmp_path for f in profile.files)
    assert profile.runs == 4
    op_types = {op.op_type for op in profile.ops}
    assert op_types & {"MatMul", "FusedMatMul", "Gemm"}, op_types
    assert all(op.provider == "CPUExecutionProvider" for op in profile.ops)
    assert 0 < profile.kernel_ms <= profile.run_ms

    assert wrapped.end_profiling().files == (), "profiling of those graphs has ended"
    wrapped(x).sum().backward()  # still trains
    wrapped(torch.randn(6, 16)).sum().backward()  # a new shape builds new graphs, profiled again
    again = wrapped.end_profiling(skip_runs=0)
    assert sorted(f.name.split("_profile_")[0] for f in again.files) == ["mlp_backward_1", "mlp_forward_1"]
    assert again.runs == 2


def test_partitions_around_a_pytorch_op_are_profiled_each(tmp_path: Path) -> None:
    wrapped = ORTModule(CustomOpMLP(), DebugOptions(profile=True, save_path=tmp_path))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", FallbackWarning)
        wrapped(torch.randn(5, 8)).sum().backward()
    names = sorted(f.name.split("_profile_")[0] for f in wrapped.end_profiling(skip_runs=0).files)
    assert names == ["backward", "forward_part0", "forward_part1"]


def test_end_profiling_without_profiling_says_how_to_switch_it_on() -> None:
    wrapped = ORTModule(MLP())
    wrapped(torch.randn(2, 16))
    with pytest.raises(ORTModuleError, match=r"DebugOptions\(profile=True"):
        wrapped.end_profiling()


def test_unwritable_save_path_fails_when_profiling_is_asked_for(tmp_path: Path) -> None:
    blocker = tmp_path / "file"
    blocker.write_text("")
    with pytest.raises(ValueError, match=r"save_path=.*cannot be written.*set profile=False"):
        DebugOptions(profile=True, save_path=blocker / "sub")
    with pytest.raises(ValueError, match=r"set save_onnx and profile=False"):
        DebugOptions(save_onnx=True, onnx_prefix="m", profile=True, save_path=blocker / "sub")
