"""Which tensors the CPU fast paths written for float32 also take: ``bfloat16`` ones, computed in float32.

Under CPU autocast (Lightning's ``precision="bf16-mixed"``) a convolution or matmul returns ``bfloat16``, and so
do the batch norms, activations and poolings that read it, and their gradients. ONNX Runtime's CPU provider has
float32 kernels for them and ``bfloat16`` kernels for casts only, so before a CPU graph's session is built
:func:`~lightning_ort.engine.onnx.passes.compute_bfloat16_in_float` widens every ``bfloat16`` op to float32,
lightning_ort's own kernels included. A fast path (a fused batch norm, a values-only max pooling, a stride-2
convolution's phase gradient, an activation's one-pass gradient) that declined ``bfloat16`` operands would leave
their op to a decomposition of a dozen nodes that the pass then also computes in float32, with a cast around
each; taking them gives the same float32 kernel the float32 model runs. The ops' PyTorch forms compute
``bfloat16`` operands in float32 too and return their operands' dtypes, for a graph that runs in PyTorch.
"""

from __future__ import annotations

import torch


def computed_in_float32(*tensors: torch.Tensor) -> bool:
    """Whether ONNX Runtime computes ops on ``tensors`` in float32: each float32, or ``bfloat16`` on the
    CPU.

    Example:
        >>> x = torch.ones(2)
        >>> computed_in_float32(x, x.bfloat16()), computed_in_float32(x.double()), computed_in_float32(x.half())
        (True, False, False)
    """
    return all(t.dtype == torch.float32 or (t.dtype == torch.bfloat16 and t.device.type == "cpu") for t in tensors)


def in_compute_dtype(*tensors: torch.Tensor) -> list[torch.Tensor]:
    """``tensors`` in the dtype the kernels compute them in: float32 for 16-bit floats, their own otherwise.

    Example:
        >>> [t.dtype for t in in_compute_dtype(torch.ones(2).bfloat16(), torch.ones(2).double())]
        [torch.float32, torch.float64]
    """
    return [t.to(torch.promote_types(t.dtype, torch.float32)) for t in tensors]
