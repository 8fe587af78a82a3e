"""Run a zoo model through ORTModule and eager PyTorch; classify where it ran; print the coverage summary."""

from __future__ import annotations

import copy
import warnings
from dataclasses import dataclass

import torch
from torch.utils._pytree import tree_map_only

from lightning_ort import FallbackWarning, ORTModule
from tests.helpers import (
    GRAD_TOLERANCE,
    OUTPUT_TOLERANCE,
    clone_inputs,
    float64_drift,
    leaf_tensors,
    weighted_loss,
)
from tests.zoo.features import Case

FULL, PARTIAL, PYTORCH = "ONNX Runtime", "partly (per-op fallback)", "PyTorch (whole call)"
ZOO_PROPERTY = "zoo_result"
"""The test-report property (``record_property``) that carries a :class:`ZooResult` as a dict."""


@dataclass(frozen=True)
class ZooResult:
    """How one architecture trained through ORTModule.

    Attributes:
        name: the case name.
        runs_in: :data:`FULL`, :data:`PARTIAL` or :data:`PYTORCH`.
        output_error: largest absolute output difference from eager.
        grad_error: largest absolute gradient difference from eager (parameters and inputs).
        correct: outputs and gradients within the stated tolerances of eager's, and every parameter gradient
            within 3x eager float32's distance (+ 1e-4) of a float64 copy's.
        fallback_ops: ops that ran in PyTorch.
        note: the fallback warning, if any.
    """

    name: str
    runs_in: str
    output_error: float
    grad_error: float
    correct: bool
    fallback_ops: int
    note: str


def run_case(case: Case) -> ZooResult:
    """One training step of ``case`` in eager PyTorch and through ORTModule, compared."""
    torch.manual_seed(0)
    eager = case.make_model().train(case.train)
    wrapped = ORTModule(copy.deepcopy(eager)).train(case.train)
    args, kwargs = case.make_inputs(torch.Generator().manual_seed(1))
    eager_inputs, ort_inputs = clone_inputs((args, kwargs)), clone_inputs((args, kwargs))
    reference = copy.deepcopy(eager).double()
    reference_inputs = tree_map_only(torch.Tensor, _as_float64, clone_inputs((args, kwargs)))
    weighted_loss(reference(*reference_inputs[0], **reference_inputs[1])).backward()

    expected = eager(*eager_inputs[0], **eager_inputs[1])
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always", FallbackWarning)
        actual = wrapped(*ort_inputs[0], **ort_inputs[1])
        weighted_loss(actual).backward()
    weighted_loss(expected).backward()

    correct, output_error = _compare(leaf_tensors(actual), leaf_tensors(expected), OUTPUT_TOLERANCE)
    eager_grads = [t.grad for t in (*leaf_tensors(eager_inputs), *eager.parameters())]
    ort_grads = [t.grad for t in (*leaf_tensors(ort_inputs), *wrapped.parameters())]
    grads_correct, grad_error = _compare(ort_grads, eager_grads, GRAD_TOLERANCE)
    reference_grads = [p.grad for p in reference.parameters()]
    drift = float64_drift(
        [name for name, _ in wrapped.named_parameters()],
        [p.grad for p in wrapped.parameters()],
        [p.grad for p in eager.parameters()],
        reference_grads,
    )

    stats = wrapped.statistics
    if stats.eager_signatures:
        runs_in = PYTORCH
    elif stats.fallback_ops:
        runs_in = PARTIAL
    else:
        runs_in = FULL if stats.forward_runs and stats.backward_runs else PYTORCH
    notes = [str(w.message) for w in caught if issubclass(w.category, FallbackWarning)]
    if drift:
        notes.append(drift)
    return ZooResult(
        case.name,
        runs_in,
        output_error,
        grad_error,
        correct and grads_correct and not drift,
        stats.fallback_ops,
        " ".join(notes),
    )


def _as_float64(tensor: torch.Tensor) -> torch.Tensor:
    value = tensor.detach().double() if tensor.is_floating_point() else tensor.detach()
    return value.requires_grad_(tensor.requires_grad)


def _compare(
    actual: list[torch.Tensor | None], expected: list[torch.Tensor | None], tolerance: dict[str, float]
) -> tuple[bool, float]:
    if len(actual) != len(expected):
        return False, float("inf")
    worst, ok = 0.0, True
    for a, e in zip(actual, expected):
        if a is None or e is None:
            ok = ok and a is None and e is None
            continue
        if a.is_floating_point():
            worst = max(worst, float((a.detach() - e.detach()).abs().max()) if a.numel() else 0.0)
        ok = ok and torch.allclose(a.detach(), e.detach(), **tolerance) if a.is_floating_point() else torch.equal(a, e)
    return ok, worst


def summary(results: list[ZooResult]) -> str:
    """The coverage table and the totals line."""
    rows = [("model", "runs in", "out err", "grad err", "correct")]
    rows += [
        (r.name, r.runs_in, f"{r.output_error:.1e}", f"{r.grad_error:.1e}", "yes" if r.correct else "NO")
        for r in results
    ]
    widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]))]
    lines = ["  ".join(cell.ljust(w) for cell, w in zip(row, widths)) for row in rows]
    lines.insert(1, "  ".join("-" * w for w in widths))
    total = len(results)
    full = sum(r.runs_in == FULL for r in results)
    partial = sum(r.runs_in == PARTIAL for r in results)
    correct = sum(r.correct for r in results)
    lines.append(
        f"{total} architectures: {full} fully in ONNX Runtime ({100 * full / total:.0f}%), {partial} partly, "
        f"{total - full - partial} in PyTorch; {correct}/{total} train correctly ({100 * correct / total:.0f}%)"
    )
    lines += [f"  {r.name}: {r.note}" for r in results if r.note]
    return "\n".join(lines)
