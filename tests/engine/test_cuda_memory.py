"""The CUDA memory routes' settings, provider options and allocator bridge, as far as a machine without a GPU
shows them (``tests/test_cuda.py`` trains under each route on a GPU)."""

from __future__ import annotations

import ctypes
import logging
from types import SimpleNamespace

import onnx
import onnxruntime as ort
import pytest
import torch

import lightning_ort.engine.runtime.session as session_module
from lightning_ort import ORTConfig, SessionSettings
from lightning_ort.engine.runtime import cuda_memory
from lightning_ort.engine.runtime.cuda_memory import TorchAllocator
from lightning_ort.options import CUDA_MEMORY, CudaMemory


def test_pytorchs_allocator_is_the_default_route() -> None:
    assert SessionSettings().cuda_memory == "torch"
    assert ORTConfig(cuda_memory="shared_arena").session_settings.cuda_memory == "shared_arena"


def test_an_unknown_route_names_the_routes() -> None:
    with pytest.raises(ValueError, match=r"cuda_memory='arena' is not one of 'torch', 'shared_arena', 'session_arena'"):
        SessionSettings(cuda_memory="arena")  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="cuda_memory"):
        SessionSettings(cuda_memory=1)  # type: ignore[arg-type]


def test_the_torch_route_hands_the_bridges_addresses_to_the_cuda_provider(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(cuda_memory, "torch_allocator", lambda: TorchAllocator(16, 32, 48, kind="compiled"))
    assert cuda_memory.cuda_provider_options("torch") == {
        "gpu_external_alloc": "16",
        "gpu_external_free": "32",
        "gpu_external_empty_cache": "48",
    }
    assert cuda_memory.cuda_provider_options("shared_arena") == cuda_memory.cuda_provider_options("session_arena") == {}
    assert cuda_memory.cuda_session_config("torch", 0) == cuda_memory.cuda_session_config("session_arena", 0) == {}


def test_the_callback_bridge_calls_the_allocator_through_c_pointers() -> None:
    calls: list[tuple[str, int]] = []
    bridge = cuda_memory.callback_allocator(
        lambda size: calls.append(("alloc", size)) or 4096,
        lambda pointer: calls.append(("free", pointer)),
        lambda: calls.append(("empty", 0)),
    )
    alloc = ctypes.CFUNCTYPE(ctypes.c_void_p, ctypes.c_size_t)(bridge.alloc)
    free = ctypes.CFUNCTYPE(None, ctypes.c_void_p)(bridge.free)
    empty = ctypes.CFUNCTYPE(None)(bridge.empty_cache)
    assert alloc(256) == 4096
    free(4096)
    empty()
    assert calls == [("alloc", 256), ("free", 4096), ("empty", 0)]
    assert bridge.kind == "callbacks"


def test_a_bridge_that_cannot_be_built_falls_back_to_callbacks_and_says_why(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    def no_compiler() -> TorchAllocator:
        raise RuntimeError("no CUDA toolkit found (CUDA_HOME is unset and nvcc is not on PATH)")

    monkeypatch.setattr(cuda_memory, "compiled_allocator", no_compiler)
    cuda_memory.torch_allocator.cache_clear()
    try:
        with caplog.at_level(logging.WARNING, logger="lightning_ort"):
            bridge = cuda_memory.torch_allocator()
    finally:
        cuda_memory.torch_allocator.cache_clear()
    assert bridge.kind == "callbacks"
    (record,) = [r for r in caplog.records if "caching allocator" in r.getMessage()]
    assert "no CUDA toolkit found" in record.getMessage() and "cuda_memory='shared_arena'" in record.getMessage()


@pytest.fixture
def cuda_here(monkeypatch: pytest.MonkeyPatch) -> None:
    """What :func:`~lightning_ort.engine.runtime.session.providers_for` reads of a CUDA machine: the provider,
    device 0, PyTorch's default stream (handle 0) current, the bridge's addresses."""
    monkeypatch.setattr(session_module.ort, "get_available_providers", lambda: ["CUDAExecutionProvider"])
    monkeypatch.setattr(session_module, "_device_index", lambda device: 0)
    default = SimpleNamespace(cuda_stream=0)
    monkeypatch.setattr(torch.cuda, "default_stream", lambda device=None: default)
    monkeypatch.setattr(torch.cuda, "current_stream", lambda device=None: default)
    monkeypatch.setattr(cuda_memory, "torch_allocator", lambda: TorchAllocator(16, 32, 48, kind="compiled"))


@pytest.mark.usefixtures("cuda_here")
@pytest.mark.parametrize("memory", CUDA_MEMORY)
def test_a_stream_is_named_to_onnx_runtime_only_beside_its_own_allocators(memory: CudaMemory) -> None:
    # ONNX Runtime's CUDA provider refuses a user_compute_stream beside an external allocator (it falls back to
    # the CPU provider); given the allocator alone, it runs on CUDA's legacy default stream, PyTorch's default.
    ((name, options), cpu) = session_module.providers_for(torch.device("cuda"), SessionSettings(cuda_memory=memory))
    assert (name, cpu) == ("CUDAExecutionProvider", "CPUExecutionProvider")
    if memory == "torch":
        assert "user_compute_stream" not in options and options["gpu_external_alloc"] == "16"
    else:
        assert options["user_compute_stream"] == str(session_module.CUDA_STREAM_LEGACY)
        assert "gpu_external_alloc" not in options


@pytest.mark.usefixtures("cuda_here")
def test_a_captured_graph_runs_on_its_capture_stream_in_an_arena_of_its_own() -> None:
    capture = SimpleNamespace(cuda_stream=4242)
    ((_, options), _) = session_module.providers_for(torch.device("cuda"), SessionSettings(), capture)  # type: ignore[arg-type]
    assert options["user_compute_stream"] == "4242" and options["enable_cuda_graph"] == "1"
    assert "gpu_external_alloc" not in options


def test_a_cuda_provider_that_onnx_runtime_could_not_create_is_an_error(monkeypatch: pytest.MonkeyPatch) -> None:
    # onnxruntime.InferenceSession prints the provider's error and quietly retries on the CPU provider alone; the
    # graph's CUDA tensors could then not even be bound.
    class FellBack:
        def __init__(self, *args: object, **kwargs: object) -> None:
            pass

        def get_providers(self) -> list[str]:
            return ["CPUExecutionProvider"]

    monkeypatch.setattr(session_module.ort, "InferenceSession", FellBack)
    providers: list[str | tuple[str, dict[str, str]]] = [
        ("CUDAExecutionProvider", {"device_id": "0"}),
        "CPUExecutionProvider",
    ]
    with pytest.raises(RuntimeError, match=r"could not create its CUDA execution provider with the options \{'device_"):
        session_module.GraphSession._create(onnx.ModelProto(), ort.SessionOptions(), providers)
    assert isinstance(
        session_module.GraphSession._create(onnx.ModelProto(), ort.SessionOptions(), ["CPUExecutionProvider"]), FellBack
    )
