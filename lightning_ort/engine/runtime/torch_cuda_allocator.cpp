// The allocation functions handed to ONNX Runtime's CUDA execution provider (its gpu_external_alloc,
// gpu_external_free and gpu_external_empty_cache options), so that its sessions allocate from PyTorch's CUDA
// caching allocator: one memory pool for PyTorch and ONNX Runtime. Built on first use by
// lightning_ort.engine.runtime.cuda_memory through torch.utils.cpp_extension.
#include <c10/cuda/CUDACachingAllocator.h>

#include <cstddef>

extern "C" {

void* lightning_ort_cuda_alloc(size_t size) { return c10::cuda::CUDACachingAllocator::raw_alloc(size); }

void lightning_ort_cuda_free(void* pointer) { c10::cuda::CUDACachingAllocator::raw_delete(pointer); }

void lightning_ort_cuda_empty_cache() { c10::cuda::CUDACachingAllocator::emptyCache(); }
}
