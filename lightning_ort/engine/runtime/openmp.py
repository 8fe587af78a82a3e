"""Make PyTorch's idle OpenMP worker threads give the cores back before ONNX Runtime runs on them (CPU).

After each parallel PyTorch operator, its OpenMP worker threads busy-wait for the next one: GNU libgomp for
about 300,000 spins (milliseconds), Intel's and LLVM's runtimes for ``KMP_BLOCKTIME`` (200 ms by default). A
training step alternates PyTorch (loss, autograd, optimizer) and ONNX Runtime, so an ONNX Runtime run starts
while those threads still spin, and its own threads share their cores with threads that do no work, so its
matrix products run well below their standalone rate on a machine with few cores.

:func:`release_openmp_threads` calls the OpenMP 5.0 ``omp_pause_resource_all(omp_pause_soft)``: libgomp ends
the calling thread's worker threads (the next parallel PyTorch operator starts them again),
Intel's and LLVM's runtimes put them to sleep. ``GOMP_SPINCOUNT`` / ``KMP_BLOCKTIME`` would do the same for
the whole process but only take effect when set before PyTorch is imported.
"""

from __future__ import annotations

import contextlib
import ctypes
import os
from collections.abc import Callable

from lightning_ort.engine.once import Once
from lightning_ort.logs import get_logger

log = get_logger(__name__)

# omp_pause_resource_t's omp_pause_soft: keep the runtime usable, let its threads go.
_OMP_PAUSE_SOFT = 1
_OPENMP_RUNTIMES = ("libgomp.so.1", "libiomp5.so", "libomp.so", "libgomp.1.dylib", "libomp.dylib")


def release_openmp_threads() -> bool:
    """Stop the calling thread's OpenMP worker threads from busy-waiting; ``False`` where that is not possible.

    Not possible means: no OpenMP runtime is loaded, it predates OpenMP 5.0, or the call comes from inside a
    parallel region. Harmless to call often: PyTorch's next parallel operator gets its threads back.

    Example:
        >>> import torch
        >>> _ = torch.ones(4) + 1
        >>> release_openmp_threads() in (True, False)
        True
    """
    pause = _pause_function()
    return pause is not None and pause(_OMP_PAUSE_SOFT) == 0


@Once
def _pause_function() -> Callable[[int], int] | None:
    """``omp_pause_resource_all`` of the OpenMP runtime already loaded in this process (PyTorch's), if any."""
    candidates: list[ctypes.CDLL] = []
    with contextlib.suppress(OSError):
        candidates.append(ctypes.CDLL(None))
    if hasattr(os, "RTLD_NOLOAD"):  # look up runtimes already loaded without the global flag; never load one
        for name in _OPENMP_RUNTIMES:
            try:
                candidates.append(ctypes.CDLL(name, mode=os.RTLD_NOLOAD | os.RTLD_LAZY))
            except OSError:
                continue
    for library in candidates:
        function = getattr(library, "omp_pause_resource_all", None)
        if function is not None:
            function.argtypes = [ctypes.c_int]
            function.restype = ctypes.c_int
            log.debug("releasing OpenMP threads with omp_pause_resource_all from %s", library)
            return function
    log.debug("no OpenMP runtime with omp_pause_resource_all is loaded: PyTorch's threads are left as they are")
    return None
