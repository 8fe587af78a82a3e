"""How the benchmark's own process allocates host memory: ``--heap keep|default``.

glibc's ``malloc`` serves large blocks (above 128 KiB, a threshold it raises as blocks are freed) with fresh
``mmap`` pages and hands freed memory back to the system. A CPU training step allocates and frees tens of such
blocks (activations, gradients, oneDNN's reordered copies of a convolution's operands), and each fresh page
costs a page fault when it is first written. How many of those a step takes depends on what the process did
before, so the same step can take 80 ms in one process and 95 in the next, and a runtime's ratio to eager
moves with the order the runtimes ran in.

``keep`` (the default) turns that off for the benchmark's process: large blocks come from the heap and freed
memory stays there for reuse (``mallopt(M_MMAP_THRESHOLD)`` and ``mallopt(M_TRIM_THRESHOLD)``, what the
environment variables ``MALLOC_MMAP_THRESHOLD_`` and ``MALLOC_TRIM_THRESHOLD_`` set at start-up). It is the
setting PyTorch's CPU performance guide recommends, with jemalloc or tcmalloc as the alternatives; it speeds up
eager and compiled runtimes alike. ``default`` measures glibc as it comes. The processes the benchmark starts
(the peak-memory probes; the ``depth``, ``shapes`` and ``fsdp`` studies) run with glibc's defaults.
"""

from __future__ import annotations

import ctypes
import platform
from typing import Literal

HeapSetting = Literal["keep", "default"]
HEAP_SETTINGS: tuple[HeapSetting, ...] = ("keep", "default")

M_TRIM_THRESHOLD = -1
"""glibc's ``mallopt`` parameter: free memory at the heap's top above this many bytes is handed back."""
M_MMAP_THRESHOLD = -3
"""glibc's ``mallopt`` parameter: blocks of at least this many bytes are served by ``mmap``."""
KEPT_BYTES = 1 << 30
"""Both thresholds under ``keep``: blocks below 1 GiB come from the heap, which keeps up to 1 GiB it freed."""


def keep_freed_memory() -> bool:
    """Make glibc's ``malloc`` in this process serve large blocks from the heap and keep what is freed there.

    Returns whether it did: ``False`` where the C library is not glibc (musl, macOS, Windows), which have no
    such thresholds. The setting lasts as long as the process.

    Example:
        >>> import subprocess, sys
        >>> code = "from lightning_ort.bench.heap import keep_freed_memory; print(keep_freed_memory())"
        >>> subprocess.run([sys.executable, "-c", code], capture_output=True, text=True).stdout.strip()
        'True'
    """
    if platform.libc_ver()[0] != "glibc":
        return False
    libc = ctypes.CDLL(None)
    return bool(libc.mallopt(M_MMAP_THRESHOLD, KEPT_BYTES)) and bool(libc.mallopt(M_TRIM_THRESHOLD, KEPT_BYTES))


def apply_heap_setting(setting: HeapSetting) -> str:
    """Apply ``setting`` to this process; returns how its heap now allocates, for a report's header.

    Example:
        >>> apply_heap_setting("default")
        "glibc's default heap"
    """
    if setting == "keep":
        return "heap keeps freed memory" if keep_freed_memory() else "heap as the C library sets it"
    return "glibc's default heap" if platform.libc_ver()[0] == "glibc" else "heap as the C library sets it"
