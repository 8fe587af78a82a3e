"""``python -m lightning_ort.bench`` runs every workload in a quick mode and writes its figures (no speed asserts)."""

from __future__ import annotations

import copy
import functools
import json
import math
import os
import subprocess
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

from lightning_ort.bench import runner as bench
from lightning_ort.bench import shapes
from lightning_ort.bench import workloads as bench_workloads
from lightning_ort.bench.conv import ConvLayer
from lightning_ort.engine.fx.conv_weight_grad import CONV3X3_WEIGHT_GRAD

ROOT = Path(__file__).resolve().parents[1]


def tiny_workload(device: torch.device) -> tuple[nn.Module, tuple[torch.Tensor, ...], object]:
    """A ``--module`` factory: ``(module, inputs, loss_fn)``."""
    model = nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 1)).to(device)
    x = torch.randn(4, 8, device=device)
    return model, (x,), lambda out: out.square().mean()


@pytest.mark.slow
def test_quick_benchmark_runs_a_reference_workload_and_a_user_module(tmp_path: Path) -> None:
    out = tmp_path / "bench.json"
    # The Lightning timing runs on the first workload: the mlp's exports are the quickest. The transformer and
    # the cnn, slower to compile, are left to the tests of their FLOPs and of their training in ONNX Runtime.
    args = ["--workload", "mlp"]
    args += ["--module", "tests.test_bench:tiny_workload", "--steps", "2", "--warmup", "0", "--json", str(out)]
    result = subprocess.run(
        [sys.executable, "-m", "lightning_ort.bench", *args], cwd=ROOT, capture_output=True, text=True, timeout=900
    )
    assert result.returncode == 0, result.stderr
    report = json.loads(out.read_text())
    names = [w["workload"] for w in report["workloads"]]
    assert names == ["mlp", "tests.test_bench:tiny_workload"]
    for workload in report["workloads"]:
        assert set(workload["runtimes"]) == {"eager", "inductor", "ort"}
        assert workload["floor_ms"] > 0
        assert workload["max_abs_loss_diff_ort"] < 1e-3
        for runtime in workload["runtimes"].values():
            assert len(runtime["step_ms_all"]) == 2
            assert runtime["first_step_s"] > 0
            assert runtime["peak_memory_mib"] > 0
            assert runtime["pytorch_fallback"] == "", "a reference workload must run wholly in ONNX Runtime"
    assert report["workloads"][0]["matmul_gflop"] == pytest.approx(7.5, rel=0.01)
    assert report["lightning"]["workload"] == "mlp" and report["lightning"]["lightning_ms"] > 0
    assert report["inductor_cache"] == "cold"
    for line in ("vs eager", "x floor", "first step s", "peak MiB", "Trainer(strategy='ort')", "with a cold cache"):
        assert line in result.stdout


@pytest.mark.parametrize("previous", [None, "/somewhere/else"])
def test_cold_inductor_cache_is_an_empty_folder_removed_afterwards(
    monkeypatch: pytest.MonkeyPatch, previous: str | None
) -> None:
    if previous is None:
        monkeypatch.delenv("TORCHINDUCTOR_CACHE_DIR", raising=False)
    else:
        monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", previous)
    with bench.inductor_cache(cold=True) as folder:
        assert os.environ["TORCHINDUCTOR_CACHE_DIR"] == folder != previous
        Path(folder, "compiled").write_text("x")
    assert os.environ.get("TORCHINDUCTOR_CACHE_DIR") == previous
    assert not Path(folder).exists()
    with bench.inductor_cache(cold=False) as folder:
        assert folder == (previous or "")


def test_matmul_flops_of_the_mlp_step() -> None:
    workload = bench_workloads.mlp_workload(torch.device("cpu"))
    forward = 2 * 256 * (512 * 2048 + 2048 * 2048 + 2048 * 10)
    # backward: weight gradients of all three layers, input gradients of the last two (the input needs none)
    backward = 2 * 256 * (512 * 2048 + 2 * 2048 * 2048 + 2 * 2048 * 10)
    assert bench.step_matmul_flops(workload) == forward + backward


def test_matmul_flops_of_the_transformer_step() -> None:
    workload = bench_workloads.transformer_workload(torch.device("cpu"))
    assert bench.step_matmul_flops(workload) / 1e9 == pytest.approx(43, rel=0.1)


def test_the_transformer_workload_trains_in_onnx_runtime_within_eagers_float64_spread() -> None:
    # A ReLU's near-zero pre-activations flip with the rounding of the product before it, so single gradient
    # entries may differ from eager's by far more than float32 noise: ORT is held to eager's distance to float64.
    from lightning_ort import ORTModule
    from tests.helpers import assert_fp64_accuracy

    workload = bench_workloads.transformer_workload(torch.device("cpu"))
    workload.model.eval()  # dropout off: eager's and ONNX Runtime's masks differ
    wrapped = ORTModule(copy.deepcopy(workload.model), fallback="raise")
    assert_fp64_accuracy(workload.model, wrapped, *workload.inputs, perturbations=2)
    assert wrapped.statistics.backward_runs == 1 and wrapped.statistics.fallback_ops == 0


def test_matmul_flops_of_the_cnn_step() -> None:
    workload = bench_workloads.cnn_workload(torch.device("cpu"))
    assert bench.step_matmul_flops(workload) / 1e9 == pytest.approx(18.7, rel=0.01)


@pytest.mark.parametrize(("groups", "transposed"), [(1, False), (48, False), (4, True)])
def test_matmul_flops_of_a_convolution_step_count_each_gradient_as_the_forward(groups: int, transposed: bool) -> None:
    layer = nn.ConvTranspose2d if transposed else nn.Conv2d
    model = layer(48, 48, 3, stride=2 if transposed else 1, padding=1, groups=groups, bias=False)
    images = torch.randn(4, 48, 8, 8, requires_grad=True)
    workload = bench_workloads.Workload("conv", model, (images,), lambda out: out.sum())
    # The 8x8 positions of the convolution's output (of the transposed convolution's input) meet every weight once.
    forward = 2 * 4 * 8 * 8 * 48 * (48 // groups) * 9
    assert bench.step_matmul_flops(workload) == 3 * forward, "forward, input gradient and weight gradient"


def test_module_spec_errors_name_the_expected_form() -> None:
    with pytest.raises(ValueError, match=r"package\.module:factory"):
        bench_workloads.load_factory("no_colon_here")


def test_report_marks_an_ort_row_that_ran_in_pytorch() -> None:
    def row(fallback: str = "") -> bench.RuntimeResult:
        return bench.RuntimeResult(10.0, 1.0, 0.1, 2.0, 100.0, [10.0], pytorch_fallback=fallback)

    ort_row = row("the whole model ran in PyTorch (ONNX Runtime could not build its graphs; see the warning)")
    result = bench.WorkloadResult("mlp", 1.0, 5.0, {"eager": row(), "ort": ort_row}, 0.0)
    report = bench.BenchReport("cpu", "2.13", "1.31", 2, "glibc's default heap", 100.0, 1, [result], None)
    lines = report.format().splitlines()
    marked = [i for i, line in enumerate(lines) if "not all ONNX Runtime" in line]
    assert len(marked) == 1 and lines[marked[0] - 1].split()[1] == "ort"
    assert "whole model ran in PyTorch" in lines[marked[0]]


def test_report_columns_fit_long_workload_names_and_short_steps() -> None:
    def row(step_ms: float) -> bench.RuntimeResult:
        return bench.RuntimeResult(step_ms, 1.0, 0.1, 2.0, 100.0, [step_ms])

    name = "my_package.models:small_factory"
    result = bench.WorkloadResult(name, 0.0, 0.0643, {"eager": row(0.9123), "ort": row(1.314)}, 0.0)
    report = bench.BenchReport("cpu", "2.13", "1.31", 2, "glibc's default heap", 100.0, 1, [result], None)
    header, eager, ort = report.format().splitlines()[3:6]
    assert eager.index("eager") == ort.index("ort") == header.index("runtime")
    assert eager.split()[2:4] == ["0.912", "1.00x"] and ort.split()[2] == "1.31"
    assert eager.split()[4] == "0.064"


def test_report_columns_stay_apart_for_a_model_far_above_its_floor() -> None:
    eager = bench.RuntimeResult(0.372, 1.0, 0.01, 1197.5, 9.0, [0.372])
    ort = bench.RuntimeResult(0.818, 0.45, 1.39, 2633.4, 79.0, [0.818])
    result = bench.WorkloadResult("tiny", 0.0, 0.00031, {"eager": eager, "ort": ort}, 0.0)
    report = bench.BenchReport("cpu", "2.13", "1.31", 2, "glibc's default heap", 100.0, 1, [result], None)
    header, *rows = report.format().splitlines()[3:6]
    assert header.split()[-2:] == ["peak", "MiB"]
    assert [row.split()[4:7] for row in rows] == [["3.1e-04", "1198x", "0.01"], ["3.1e-04", "2633x", "1.39"]]


@pytest.mark.slow
def test_profile_prints_kernel_time_per_op_type_and_keeps_the_files(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    # no probe subprocesses in this test
    monkeypatch.setattr(bench, "peak_memory_mib", lambda spec, runtimes, *_: dict.fromkeys(runtimes, 1.0))
    out = tmp_path / "bench.json"
    args = ["--module", "tests.test_bench:tiny_workload", "--steps", "3", "--warmup", "1", "--no-lightning"]
    report = bench.main([*args, "--profile", str(tmp_path / "profiles"), "--json", str(out)])
    (profiled,) = report.profiles
    profile = profiled.profile
    assert profiled.steps == 3
    assert profile.runs == 6, "one forward and one backward run per profiled step"
    assert sorted(f.name.split("_profile")[0] for f in profile.files) == [
        "tests.test_bench_tiny_workload_backward",
        "tests.test_bench_tiny_workload_forward",
    ]
    assert all(f.parent == tmp_path / "profiles" and f.exists() for f in profile.files)
    op_types = {op.op_type for op in profile.ops}
    assert "Tanh" in op_types and op_types & {"MatMul", "FusedMatMul", "Gemm"}, op_types
    assert 0 < profile.kernel_ms <= profile.run_ms
    assert 0 <= profiled.outside_ort_ms < profiled.step_ms
    printed = capsys.readouterr().out
    assert printed.startswith("lightning_ort benchmark on cpu (") and "threads, heap keeps freed memory)" in printed
    assert "ORT profile of tests.test_bench:tiny_workload, per step" in printed
    assert "Tanh" in printed and "(outside kernels)" in printed and "nodes run" in printed
    saved = json.loads(out.read_text())["profiles"][0]
    assert saved["profile"]["runs"] == 6
    assert {Path(f) for f in saved["profile"]["files"]} == set(profile.files)


_PAGE_FAULTS_PER_BLOCK = """
import ctypes, resource, sys
from lightning_ort.bench.heap import apply_heap_setting
print(apply_heap_setting(sys.argv[1]))
libc = ctypes.CDLL(None)
libc.malloc.restype = ctypes.c_void_p
size = 64 << 20
def fill_and_free():
    block = libc.malloc(size)
    ctypes.memset(block, 1, size)
    libc.free(ctypes.c_void_p(block))
fill_and_free()
before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
for _ in range(5):
    fill_and_free()
print((resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before) // 5)
"""


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc's malloc thresholds")
def test_a_kept_heap_serves_a_freed_block_again_without_page_faults() -> None:
    pages = (64 << 20) // os.sysconf("SC_PAGE_SIZE")
    faults = {}
    for setting in ("keep", "default"):
        run = subprocess.run(
            [sys.executable, "-c", _PAGE_FAULTS_PER_BLOCK, setting], capture_output=True, text=True, check=True
        )
        state, per_block = run.stdout.split("\n")[:2]
        faults[state] = int(per_block)
    assert faults["heap keeps freed memory"] < pages // 100, faults
    assert faults["glibc's default heap"] > pages // 2, "glibc hands a 64 MiB block back when it is freed"


@pytest.mark.slow
@pytest.mark.parametrize("precision", ["bf16", "fp16"])
def test_precision_runs_every_runtime_under_autocast(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str], precision: str
) -> None:
    monkeypatch.setattr(bench, "peak_memory_mib", lambda spec, runtimes, *_: dict.fromkeys(runtimes, 1.0))
    args = ["--module", "tests.test_bench:tiny_workload", "--steps", "2", "--warmup", "0", "--no-lightning"]
    report = bench.main([*args, "--precision", precision, "--profile", str(tmp_path)])
    assert report.precision == precision
    (workload,) = report.workloads
    assert workload.runtimes["ort"].pytorch_fallback == ""
    assert workload.max_abs_loss_diff_ort < 1e-2  # eager and ORT under the same autocast
    assert "Cast" in {op.op_type for op in report.profiles[0].profile.ops}, "autocast's casts run in the graphs"
    assert f"{precision}; median of 2 steps" in capsys.readouterr().out


def test_memory_format_channels_last_converts_the_models_inputs_and_memory_probes(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    probed: list[tuple[str, ...]] = []

    def peaks(spec: str, runtimes: list[str], *settings: object) -> dict[str, float]:
        probed.append(tuple(map(str, settings)))
        return dict.fromkeys(runtimes, 1.0)

    monkeypatch.setattr(bench, "peak_memory_mib", peaks)
    layouts: list[tuple[bool, bool]] = []
    warmed = bench.warmed_runner

    def recording(name: str, workload: bench_workloads.Workload, *rest: Any) -> Any:
        (images,) = workload.inputs
        weight = next(p for p in workload.model.parameters() if p.dim() == 4)
        layouts.append(
            (
                images.is_contiguous(memory_format=torch.channels_last) and not images.is_contiguous(),
                weight.is_contiguous(memory_format=torch.channels_last) and not weight.is_contiguous(),
            )
        )
        return warmed(name, workload, *rest)

    monkeypatch.setattr(bench, "warmed_runner", recording)
    args = ["--workload", "cnn", "--runtime", "ort", "--steps", "1", "--warmup", "0", "--no-lightning"]
    report = bench.main([*args, "--memory-format", "channels_last"])
    assert layouts == [(True, True), (True, True)], "eager and ORTModule both on channels-last tensors"
    assert probed == [("cpu", "fp32", "channels_last")], "the memory probes build the same workload"
    (workload,) = report.workloads
    assert workload.runtimes["ort"].pytorch_fallback == "" and workload.max_abs_loss_diff_ort < 1e-4
    assert "fp32; channels_last; median of 1 steps" in capsys.readouterr().out


def test_gpt2_workload_is_hugging_face_defaults_with_its_own_loss() -> None:
    pytest.importorskip("transformers")
    workload = bench_workloads.WORKLOADS["gpt2"](torch.device("cpu"))
    assert type(workload.model).__name__ == "GPT2LMHeadModel"
    defaults = workload.model.config.__class__()
    assert (workload.model.config.n_layer, workload.model.config.n_embd) == (12, 768)
    assert (workload.model.config.n_head, workload.model.config.n_positions) == (defaults.n_head, defaults.n_positions)
    assert workload.inputs == () and workload.kwargs["input_ids"].shape == (8, 512)
    assert workload.kwargs["labels"] is workload.kwargs["input_ids"]
    assert "gpt2" not in bench_workloads.DEFAULT_WORKLOADS


@pytest.mark.slow
def test_depth_study_times_first_steps_in_fresh_processes(tmp_path: Path) -> None:
    pytest.importorskip("transformers")
    out = tmp_path / "depth.json"
    args = ["depth", "2", "--width", "32", "--steps", "1", "--json", str(out)]
    result = subprocess.run(
        [sys.executable, "-m", "lightning_ort.bench", *args], cwd=ROOT, capture_output=True, text=True, timeout=900
    )
    assert result.returncode == 0, result.stderr
    (depth,) = json.loads(out.read_text())["depth"]
    assert depth["layers"] == 2
    assert set(depth["first_step_s"]) == {"ort_blocks", "ort", "inductor"}
    assert all(seconds > 0 for seconds in depth["first_step_s"].values())
    assert set(depth["step_ms"]) == {"eager", "ort_blocks", "ort"}
    assert depth["onnx_exports"]["ort_blocks"] > depth["onnx_exports"]["ort"] > 0, "partitions and block graphs"
    assert set(depth["phases"]) == {"ort_blocks", "ort"}, "inductor has no ORT statistics"
    for runtime, phases in depth["phases"].items():
        parts = phases["translation_seconds"] + phases["session_seconds"]
        assert 0 < parts <= phases["export_seconds"], phases
        built = phases["tracing_seconds"] + phases["capture_seconds"] + phases["export_seconds"]
        assert phases["tracing_seconds"] > 0 and built < depth["first_step_s"][runtime], phases
    assert "blocks/whole" in result.stdout
    assert "where the ORT first step went" in result.stdout


def test_shapes_report_counts_a_recompile_after_the_first_step() -> None:
    run = {"model": "bert", "lengths": [64, 96], "step_ms": [90.0, 100.0], "builds": [6, 12]}
    automatic = shapes.ShapeRun(mode="automatic", first_step_s=[10.0, 19.0], slowest_later_s=[0.1, 0.1], **run)
    declared = shapes.ShapeRun(mode="declared", first_step_s=[12.0, 0.1], slowest_later_s=[9.0, 0.1], **run)
    assert declared.slowest_after_first_s == 9.0, "the first length's second step recompiled"
    report = shapes.format_shapes_report([automatic, declared], layers=2, width=64)
    assert "12.0 9.0 (6)" in report
    assert "slowest step after the first, against the first: automatic 1.90x, declared 0.75x" in report


@pytest.mark.slow
def test_shapes_study_trains_both_models_in_both_modes(tmp_path: Path) -> None:
    pytest.importorskip("transformers")
    out = tmp_path / "shapes.json"
    args = ["shapes", "8", "12", "--layers", "1", "--width", "32", "--steps", "2", "--json", str(out)]
    result = subprocess.run(
        [sys.executable, "-m", "lightning_ort.bench", *args], cwd=ROOT, capture_output=True, text=True, timeout=900
    )
    assert result.returncode == 0, result.stderr
    runs = json.loads(out.read_text())["shapes"]
    assert [(r["model"], r["mode"]) for r in runs] == [(m, mode) for m in shapes.MODELS for mode in shapes.MODES]
    for run in runs:
        assert len(run["first_step_s"]) == len(run["slowest_later_s"]) == len(run["builds"]) == 2
        assert run["builds"][0] > 0
    declared = {r["model"]: r for r in runs if r["mode"] == "declared"}
    assert all(r["builds"][1] == r["builds"][0] for r in declared.values()), "one symbolic graph serves both"
    assert "slowest step after the first" in result.stdout


@pytest.mark.slow
def test_fsdp_study_shards_parameters_and_optimizer_state_over_the_ranks(tmp_path: Path) -> None:
    pytest.importorskip("transformers")
    out = tmp_path / "fsdp.json"
    args = ["fsdp", "2", "--layers", "2", "--width", "32", "--steps", "1", "--json", str(out)]
    result = subprocess.run(
        [sys.executable, "-m", "lightning_ort.bench", *args], cwd=ROOT, capture_output=True, text=True, timeout=900
    )
    assert result.returncode == 0, result.stderr
    fsdp = json.loads(out.read_text())["fsdp"]
    assert fsdp["ranks"] == 2 and set(fsdp["step_ms"]) == {"ddp", "fsdp", "ort_fsdp"}
    for memory in (fsdp["parameter_mib"], fsdp["optimizer_mib"]):
        assert memory["ort_fsdp"] == pytest.approx(memory["ddp"] / 2, rel=0.01)
        assert memory["ort_fsdp"] == pytest.approx(memory["fsdp"])
    assert fsdp["ort_runs"] > 0
    assert "vs fsdp" in result.stdout


def test_the_command_line_is_one_sub_command_per_study_with_no_hidden_options(
    capsys: pytest.CaptureFixture[str],
) -> None:
    with pytest.raises(SystemExit):
        bench.main(["--help"])
    assert "{run,depth,shapes,fsdp,memory,table,conv,breakdown}" in capsys.readouterr().out
    for study in bench.STUDIES:
        with pytest.raises(SystemExit):
            bench.main([study, "--help"])
        assert "==SUPPRESS==" not in capsys.readouterr().out
    with pytest.raises(SystemExit):
        bench.main(["--depth", "2"])  # the studies are sub-commands now
    assert "unrecognized arguments: --depth" in capsys.readouterr().err


def test_runtime_chooses_the_runtimes_and_names_each_ort_memory_route(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    probed: list[str] = []

    def peaks(spec: str, runtimes: list[str], *_: object) -> dict[str, float]:
        probed.extend(runtimes)
        return dict.fromkeys(runtimes, 1.0)

    monkeypatch.setattr(bench, "peak_memory_mib", peaks)
    args = ["--module", "tests.test_bench:tiny_workload", "--steps", "1", "--warmup", "0", "--no-lightning"]
    variants = ["ort/cuda_memory=session_arena", "ort/attention=torch/cuda_memory=torch"]
    report = bench.main([*args, "--runtime", variants[0], "--runtime", variants[1]])
    (workload,) = report.workloads
    assert list(workload.runtimes) == probed == ["eager", *variants], "eager always, first"
    assert workload.max_abs_loss_diff_ort < 1e-4
    assert variants[0] in capsys.readouterr().out
    for wrong in ("ort/nowhere", "ort/cuda_memory=arena", "eager/attention=torch"):
        with pytest.raises(SystemExit):
            bench.main([*args, "--runtime", wrong])
        assert "is not a runtime" in capsys.readouterr().err


def test_memory_study_trains_eager_then_each_route_with_the_shared_arena_last(
    capsys: pytest.CaptureFixture[str],
) -> None:
    args = ["memory", "--device", "cpu", "--module", "tests.test_bench:tiny_workload", "--steps", "2"]
    report = bench.main([*args, "shared_arena", "torch"])
    assert [run.runtime for run in report.memory] == ["eager", "ort/cuda_memory=torch", "ort/cuda_memory=shared_arena"]
    eager = report.memory[0]
    for run in report.memory:
        assert run.peak_mib is None, "the routes are CUDA settings: no peak on CPU"
        assert run.pytorch_fallback == ""
        torch.testing.assert_close(torch.tensor(run.losses), torch.tensor(eager.losses), rtol=1e-4, atol=1e-5)
    assert "ort/cuda_memory=shared_arena" in capsys.readouterr().out
    with pytest.raises(SystemExit):
        bench.main([*args, "arena"])
    report = bench.main([*args, "--attention", "torch", "torch"])
    assert [run.runtime for run in report.memory] == ["eager", "ort/cuda_memory=torch/attention=torch"]


@pytest.mark.parametrize("name", ["cnn", "resnet18", "mobilenet", "convnext", "efficientnet", "unet"])
def test_vision_workloads_train_in_onnx_runtime_within_eagers_float64_spread(name: str) -> None:
    # Batch norm over 16 small images and thousands of ReLUs make float32 gradients sensitive to rounding, so
    # ORT is held to eager float32's own distance to float64 (on inputs perturbed by a few ulps too).
    from lightning_ort import ORTModule
    from tests.helpers import assert_fp64_accuracy

    workload = bench_workloads.WORKLOADS[name](torch.device("cpu"))
    wrapped = ORTModule(copy.deepcopy(workload.model), fallback="raise")
    assert_fp64_accuracy(workload.model, wrapped, *workload.inputs, perturbations=2)
    assert wrapped.statistics.backward_runs == 1 and wrapped.statistics.fallback_ops == 0


def test_table_runs_each_row_with_each_runtime_and_the_lightning_timing(capsys: pytest.CaptureFixture[str]) -> None:
    pytest.importorskip("transformers")
    args = ["table", "--device", "cpu", "--tiny", "--steps", "2", "--warmup", "0", "--runtime", "ort"]
    report = bench.main([*args, "--row", "mlp/fp32", "--row", "gpt2/bf16"])
    assert [(row.workload, row.precision) for row in report.rows] == [("mlp", "fp32"), ("gpt2", "bf16")]
    for row in report.rows:
        assert [run.runtime for run in row.runs] == ["eager", "ort"]
        for run in row.runs:
            assert len(run.step_ms_all) == 2 and run.first_step_s > 0
            assert run.peak_mib is None, "no peak on CPU: one process cannot tell its runtimes' memory apart"
            assert run.pytorch_fallback == ""
    assert report.rows[0].max_abs_loss_diff < 1e-4
    assert report.rows[1].max_abs_loss_diff < 0.1, "bf16 autocast: eager and ORT round differently"
    light = report.lightning
    assert light is not None and light.workload == "mlp"
    assert light.trainer_ms > 0 and light.plain_loop_ms > 0 and light.lightning_ms > 0
    printed = capsys.readouterr()
    out = printed.out
    assert "GPT-2 at --tiny's size" in out and "Trainer(strategy='ort')" in out and "the table took" in out
    # each row also went to stderr as soon as it was measured, before the Lightning timing
    assert [line.split()[:3] for line in printed.err.splitlines() if line.startswith(("mlp ", "gpt2 "))] == [
        ["mlp", "fp32", "eager"],
        ["mlp", "fp32", "ort"],
        ["gpt2", "bf16", "eager"],
        ["gpt2", "bf16", "ort"],
    ]
    with pytest.raises(SystemExit):
        bench.main([*args, "--row", "gpt2/fp8"])
    assert "is not a row" in capsys.readouterr().err


def _block_graphs_built(names: Sequence[str]) -> dict[str, int]:
    from lightning_ort import ORTModule
    from lightning_ort.bench.runtimes import Runner

    device = torch.device("cpu")
    workload = bench_workloads.WORKLOADS["transformer"](device)
    built = {}
    for name in names:
        runner = Runner(name, workload, device)
        runner.step()
        assert isinstance(runner.model, ORTModule)
        built[name] = runner.model.statistics.block_graphs
    return built


def test_ort_blocks_auto_runs_block_graphs_as_the_strategies_do() -> None:
    """The Lightning timing's plain loop must build what ``Trainer(strategy="ort")`` builds by default."""
    built = _block_graphs_built(["ort", "ort/blocks=auto", "ort/blocks=none"])
    assert built["ort"] == built["ort/blocks=none"] == 0 and built["ort/blocks=auto"] > 0


def test_ort_blocks_repeated_keeps_the_blocks_that_auto_inlines(monkeypatch: pytest.MonkeyPatch) -> None:
    """``blocks=repeated`` names the classes ``"auto"`` finds, so that one run compares block graphs with the
    rule that inlines light ones (the CPU has no threshold: one is set for the test)."""
    from lightning_ort.engine.capture import aot

    monkeypatch.setattr(aot, "BLOCK_FLOPS", {"cpu": 1e12})
    built = _block_graphs_built(["ort/blocks=auto", "ort/blocks=repeated"])
    assert built == {"ort/blocks=auto": 0, "ort/blocks=repeated": 2}


def test_breakdown_reports_each_runtimes_step_and_where_its_host_time_goes(capsys: pytest.CaptureFixture[str]) -> None:
    args = ["breakdown", "--device", "cpu", "--workload", "mlp", "--steps", "2", "--warmup", "0", "--top", "5"]
    report = bench.main([*args, "--runtime", "ort/cuda_graph=on"])
    assert [run.runtime for run in report.runs] == ["eager", "ort/cuda_graph=on"]
    for run in report.runs:
        assert run.wall_ms > 0 and run.device_ms is None, "no device time on CPU"
        assert run.launches == 0 and not run.waits and not run.copies
        assert len(run.top_host) == 5 and all(calls > 0 and ms >= 0 for _, calls, ms in run.top_host)
        assert run.top_device == [], "no device kernels on CPU"
    eager, ort = ([name for name, _, _ in run.top_host] for run in report.runs)
    assert "CompiledFunction" in ort and "CompiledFunctionBackward" in ort, "ORTModule's graphs ran"
    assert "aten::mm" in eager and "CompiledFunction" not in eager
    out = capsys.readouterr().out
    assert "mlp; fp32; median of 2 steps; counts from torch.profiler over 2 more steps" in out
    assert "ort/cuda_graph=on: host time per step" in out
    assert "device time per step" not in out


def test_breakdown_lists_each_runtimes_slowest_device_kernels() -> None:
    from lightning_ort.bench.breakdown import StepBreakdown, format_breakdown

    kernels = [("void at::native::vectorized_elementwise_kernel<4, at::native::GeluCUDAKernelImpl>", 12, 1.25)]
    eager = StepBreakdown("eager", 10.0, 9.0, 40, top_host=[("aten::mm", 8, 0.5)], top_device=kernels)
    lines = format_breakdown([eager, StepBreakdown("ort", 12.0, 11.0, 30)])
    assert "eager: device time per step" in lines and "ort: device time per step" not in lines
    (row,) = [line for line in lines if "GeluCUDAKernelImpl" in line]
    assert row.split()[0] == "at::vectorized_elementwise_kernel<4,", "the return type is dropped, at::native shortened"
    assert row.split()[-4:] == ["12", "calls", "1.25", "ms"]


def test_a_runtime_that_fails_is_reported_and_the_table_goes_on(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    from lightning_ort.bench import table

    def warmed_runner(name: str, *args: object) -> object:
        if name == "ort/attention=torch":
            raise RuntimeError("no kernel for this\nsecond line")
        return real(name, *args)

    real = table.warmed_runner
    monkeypatch.setattr(table, "warmed_runner", warmed_runner)
    args = ["table", "--device", "cpu", "--steps", "2", "--warmup", "0", "--row", "mlp/fp32", "--no-lightning"]
    report = bench.main([*args, "--runtime", "ort/attention=torch", "--runtime", "ort"])
    (row,) = report.rows
    assert [run.runtime for run in row.runs] == ["eager", "ort/attention=torch", "ort"]
    failed, ort = row.runs[1:]
    assert failed.error == "RuntimeError: no kernel for this\nsecond line" and math.isnan(failed.step_ms)
    assert ort.error == "" and len(ort.step_ms_all) == 2 and row.max_abs_loss_diff < 1e-4
    (line,) = [line for line in capsys.readouterr().out.splitlines() if "failed:" in line]
    assert line.split() == [
        "mlp",
        "fp32",
        "ort/attention=torch",
        "failed:",
        "RuntimeError:",
        "no",
        "kernel",
        "for",
        "this",
    ]

    monkeypatch.setattr(table, "warmed_runner", lambda *args: (_ for _ in ()).throw(RuntimeError("eager broke")))
    with pytest.raises(RuntimeError, match="eager broke"):
        bench.main(args)


def _backward_nodes(layer: ConvLayer, mask: list[bool], kernels: bool = False) -> list[torch.fx.Node]:
    """The ops the convolution-backward decomposition traces for the conv study's ``layer`` (with lightning_ort's
    CPU kernels built, ``kernels``)."""
    from torch.fx.experimental.proxy_tensor import make_fx

    from lightning_ort.engine.fx.decompositions import convolution_backward

    x = torch.randn(layer.images, layer.channels, layer.size, layer.size)
    w = torch.randn(layer.out_channels, layer.channels, 3, 3)
    gy = torch.randn(layer.images, layer.out_channels, layer.out_size, layer.out_size)
    backward = functools.partial(
        convolution_backward,
        bias_sizes=None,
        stride=[layer.stride] * 2,
        padding=[1, 1],
        dilation=[1, 1],
        transposed=False,
        output_padding=[0, 0],
        groups=1,
        output_mask=mask,
        weight_grad_path="auto",
        kernels=kernels,
        weight_kernel=kernels,
    )
    return [node for node in make_fx(backward)(gy, x, w).graph.nodes if node.op == "call_function"]


def test_conv_study_times_every_form_of_each_gradient_and_marks_the_decompositions_choice(
    capsys: pytest.CaptureFixture[str],
) -> None:
    from lightning_ort.bench import conv

    layers = [
        conv.ConvLayer("cnn", 2, 8, 8, 8, 1),
        conv.ConvLayer("cnn", 2, 8, 4, 8, 1),
        conv.ConvLayer("resnet18", 2, 8, 4, 32, 2),
        conv.ConvLayer("cnn", 2, 8, 8, 32, 2),  # lightning_ort's 3x3 kernel on AVX-512 CPUs
    ]
    results = conv.run_conv_study(layers, steps=1)
    for layer, result in zip(layers, results):
        assert result.max_relative_error < 1e-5, "every form computes eager's gradient"
        assert set(result.weight_ms) == set(conv.WEIGHT_FORMS) - (set() if conv._kernel_runs(layer) else {"kernel"})
        small = layer.size**2 <= 16
        assert set(result.input_ms) == {"transposed"} | ({"flipped"} if layer.stride == 1 else set()) | (
            {"selection"} if small else set()
        )
        # the marked forms are those the decomposition builds for the layer
        convolutions = [
            node
            for node in _backward_nodes(layer, [True, False, False])
            if node.target is torch.ops.aten.convolution.default and node.args[0].op == "placeholder"
        ]
        input_form = ("transposed" if convolutions[0].args[6] else "flipped") if convolutions else "selection"
        weight_nodes = _backward_nodes(layer, [True, True, False], kernels=True)
        if any(node.target is CONV3X3_WEIGHT_GRAD for node in weight_nodes):
            weight_form = "kernel"
        elif any(node.target is torch.ops.aten.convolution_backward.default for node in weight_nodes):
            weight_form = conv.TORCH_WEIGHT
        else:
            per_image = any(node.target is torch.ops.aten.bmm.default for node in weight_nodes)
            weight_form = "per_image" if per_image else "contraction"
        assert result.picked == (input_form, weight_form)
    kernel = "kernel" if conv._kernel_runs(layers[3]) else conv.TORCH_WEIGHT
    assert [result.picked[1] for result in results] == [conv.TORCH_WEIGHT, "per_image", "contraction", kernel]
    with pytest.raises(SystemExit):
        bench.main(["conv", "--device", "meta"])
    assert "CPU kernels" in capsys.readouterr().err
    report = bench.main(["conv", "--steps", "1", "--workload", "resnet18", "--device", "cpu"])
    assert {result.workload for result in report.conv} == {"resnet18"}
    assert "* the form ORTModule picks" in capsys.readouterr().out
