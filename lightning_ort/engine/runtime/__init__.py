"""Runtime: ONNX Runtime sessions over PyTorch memory, and what keeps them fast and cached.

* :mod:`.session`: an ``onnxruntime.InferenceSession`` run over PyTorch memory (IOBinding);
* :mod:`.cuda_memory`: where CUDA sessions allocate (PyTorch's caching allocator by default);
* :mod:`.cuda_graph`: static-shape graphs replayed as CUDA graphs, in fixed buffers;
* :mod:`.cpu_matmul`: CPU matrix products on ONNX Runtime's MLAS or PyTorch's MKL, measured once;
* :mod:`.openmp`: PyTorch's idle OpenMP threads released before CPU runs;
* :mod:`.disk_cache`: exported graphs on disk, keyed by everything that shapes them;
* :mod:`.profiling`: ONNX Runtime's profiles, summed by op type.
"""
