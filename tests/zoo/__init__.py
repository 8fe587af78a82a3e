"""Models the tests run through ORTModule and eager PyTorch.

* :mod:`tests.zoo.features`: small models exercising ORTModule's contract (argument and output structures,
  shared and frozen parameters, BatchNorm buffers...), used by the parity tests.
* :mod:`tests.zoo.architectures`: the coverage zoo, one model per common architecture, used by
  ``tests/zoo/test_zoo.py`` and ``python -m tests.zoo`` (which prints the coverage summary).
"""

from __future__ import annotations

from tests.zoo.features import (
    CASES,
    MLP,
    Case,
    CausalLM,
    ConvBN,
    ModelOutput,
    Shared,
)

__all__ = ["CASES", "MLP", "Case", "CausalLM", "ConvBN", "ModelOutput", "Shared"]
