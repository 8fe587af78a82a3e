"""Where ONNX Runtime's CUDA sessions take their memory: PyTorch's caching allocator, one arena, or one per session.

By default each CUDA session grows an arena of its own, doubling each extension, and keeps it at its peak. A
model's forward and backward graphs then hold two arenas beside PyTorch's own pool, and memory the forward
frees cannot serve the backward or PyTorch's autograd and optimizer. ``SessionSettings(cuda_memory=...)``
picks one of:

* ``"torch"``: sessions allocate from PyTorch's CUDA caching allocator (the CUDA provider's
  ``gpu_external_alloc``, ``gpu_external_free`` and ``gpu_external_empty_cache`` options), so ONNX Runtime and
  PyTorch share one pool, as in eager PyTorch, and ``torch.cuda.memory_allocated`` counts ONNX Runtime's
  intermediates. The functions are a small C++ library over ``c10::cuda::CUDACachingAllocator``
  (``torch_cuda_allocator.cpp``), built on first use with ``torch.utils.cpp_extension`` and kept in its build
  folder; without a compiler or CUDA headers, Python callbacks over ``torch.cuda.caching_allocator_alloc`` stand
  in (slower per allocation) and a warning says so. Allocations follow PyTorch's current stream, which is the
  one the sessions run on.
* ``"shared_arena"``: one ONNX Runtime arena per device, shared by every session of the process
  (``create_and_register_allocator_v2`` and ``session.use_env_allocators``), growing by what is asked.
* ``"session_arena"``: ONNX Runtime's default, an arena per session.

The performance page measures the three on a GPU.
"""

from __future__ import annotations

import ctypes
import functools
import os
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

import onnxruntime as ort
import torch

from lightning_ort.engine.once import Once
from lightning_ort.logs import get_logger
from lightning_ort.options import CudaMemory

log = get_logger(__name__)

_SOURCE = Path(__file__).with_name("torch_cuda_allocator.cpp")
_LIBRARY = "lightning_ort_torch_cuda_allocator"
# OrtArenaCfg's arena_extend_strategy: 1 = kSameAsRequested.
_ARENA_EXTEND_SAME_AS_REQUESTED = 1


@dataclass(frozen=True)
class TorchAllocator:
    """The addresses of the C functions ONNX Runtime calls to allocate from PyTorch's CUDA caching allocator.

    Args:
        alloc: ``void* alloc(size_t)``.
        free: ``void free(void*)``.
        empty_cache: ``void empty_cache()``.
        kind: ``"compiled"`` (the C++ library) or ``"callbacks"`` (Python functions behind C pointers).
        keep: the objects the addresses point into, kept alive as long as this value.
    """

    alloc: int
    free: int
    empty_cache: int
    kind: Literal["compiled", "callbacks"]
    keep: tuple[Any, ...] = ()

    @property
    def provider_options(self) -> dict[str, str]:
        """The CUDA execution provider's options that make a session allocate through these functions."""
        return {
            "gpu_external_alloc": str(self.alloc),
            "gpu_external_free": str(self.free),
            "gpu_external_empty_cache": str(self.empty_cache),
        }


def cuda_provider_options(memory: CudaMemory) -> dict[str, str]:
    """The CUDA execution provider's options for ``memory`` (besides the device and stream)."""
    return torch_allocator().provider_options if memory == "torch" else {}


def cuda_session_config(memory: CudaMemory, device_index: int) -> dict[str, str]:
    """Session configuration entries for ``memory`` on CUDA device ``device_index``; registers the shared arena."""
    if memory != "shared_arena":
        return {}
    _register_shared_cuda_arena(device_index)
    return {"session.use_env_allocators": "1"}


@functools.cache
def _register_shared_cuda_arena(device_index: int) -> None:
    """Register one ONNX Runtime arena for CUDA device ``device_index``, for every session of the process."""
    cuda = ort.OrtMemoryInfo("Cuda", ort.OrtAllocatorType.ORT_ARENA_ALLOCATOR, device_index, ort.OrtMemType.DEFAULT)
    arena = ort.OrtArenaCfg(0, _ARENA_EXTEND_SAME_AS_REQUESTED, -1, -1)
    ort.create_and_register_allocator_v2("CUDAExecutionProvider", cuda, {"device_id": str(device_index)}, arena)


def _bridge(keep: tuple[Any, ...], kind: Literal["compiled", "callbacks"]) -> TorchAllocator:
    """A :class:`TorchAllocator` of the alloc, free and empty-cache functions first in ``keep``, which holds
    what they live in."""
    alloc, free, empty_cache = (_address(function) for function in keep[:3])
    return TorchAllocator(alloc, free, empty_cache, kind=kind, keep=keep)


def _address(function: Any) -> int:
    address = ctypes.cast(function, ctypes.c_void_p).value
    assert address is not None
    return address


def compiled_allocator() -> TorchAllocator:
    """Build (once per installation and torch version, in torch's extension folder) and load the C++ functions.

    Raises:
        Exception: whatever building or loading raised (no compiler, no CUDA headers, a link error).
    """
    from torch.utils import cpp_extension

    if cpp_extension.CUDA_HOME is None:
        raise RuntimeError("no CUDA toolkit found (CUDA_HOME is unset and nvcc is not on PATH)")
    # Plain C++ linked to c10_cuda: with_cuda=True would add nvcc's architecture flags, which need a visible GPU.
    path = cpp_extension.load(
        _LIBRARY,
        [str(_SOURCE)],
        extra_cflags=["-O2"],
        extra_include_paths=[os.path.join(cpp_extension.CUDA_HOME, "include")],
        extra_ldflags=["-lc10_cuda"],
        is_python_module=False,
        verbose=False,
    )
    library = ctypes.CDLL(str(path))
    functions = (
        library.lightning_ort_cuda_alloc,
        library.lightning_ort_cuda_free,
        library.lightning_ort_cuda_empty_cache,
    )
    return _bridge((*functions, library), "compiled")


_AllocFunction = ctypes.CFUNCTYPE(ctypes.c_void_p, ctypes.c_size_t)
_FreeFunction = ctypes.CFUNCTYPE(None, ctypes.c_void_p)
_EmptyCacheFunction = ctypes.CFUNCTYPE(None)


def callback_allocator(
    alloc: Callable[[int], int] = torch.cuda.caching_allocator_alloc,
    free: Callable[[int], None] = torch.cuda.caching_allocator_delete,
    empty_cache: Callable[[], None] = torch.cuda.empty_cache,
) -> TorchAllocator:
    """PyTorch's caching allocator behind C function pointers that call back into Python (holding the GIL).

    Example:
        >>> held = {}
        >>> allocator = callback_allocator(lambda size: held.update({4096: size}) or 4096, held.pop, held.clear)
        >>> ctypes.CFUNCTYPE(ctypes.c_void_p, ctypes.c_size_t)(allocator.alloc)(64), held
        (4096, {4096: 64})
    """
    functions = (_AllocFunction(alloc), _FreeFunction(free), _EmptyCacheFunction(empty_cache))
    return _bridge(functions, "callbacks")


@Once
def torch_allocator() -> TorchAllocator:
    """The functions of the ``"torch"`` route: compiled where a compiler and CUDA's headers are at hand."""
    try:
        return compiled_allocator()
    except Exception as err:
        log.warning(
            "lightning_ort could not build its C++ bridge to PyTorch's CUDA caching allocator (%s); ONNX Runtime "
            "allocates through Python callbacks instead, which cost more per allocation. Install a C++ compiler "
            "and the CUDA toolkit's headers (set CUDA_HOME) to build it, or pass "
            "SessionSettings(cuda_memory='shared_arena').",
            str(err).strip().splitlines()[-1] if str(err).strip() else type(err).__name__,
        )
        return callback_allocator()
