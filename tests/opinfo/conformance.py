"""PyTorch's OpInfo database run through ORTModule: forward, input gradients and input mutations against eager.

Each op's largest float32 CPU sample (of its first few) is wrapped in a module of its own (tensor arguments
become forward arguments, the rest are constants) inside a fresh :class:`~lightning_ort.ORTModule`, and called
once with a backward. With ``in_model=True`` (``--in-model``) each floating-point argument that requires grad
first passes through a layer with a parameter (an elementwise scale of ones, which keeps the sample's values):
the op then reads an intermediate of the graph, not a graph input, as it does inside a model, and its outputs
can be views of that intermediate. Views of inputs and views of intermediates take different paths through
AOTAutograd (a view of an intermediate is an output of the graph whose gradient comes back in as a tangent), so
both modes are needed. An op ends as one of:

* ``pass``: outputs, input gradients and mutated inputs match eager, and everything ran in ONNX Runtime;
* ``fallback``: they match, but some ops (or the whole graph) ran in PyTorch, with a warning;
* ``wrong``: a result differs from eager's (the worst outcome: silent drift);
* ``error``: ORTModule raised (or the op's worker timed out or died);
* ``skip``: eager PyTorch itself cannot run the check (a loss that the op leaves ill-defined).

``python -m tests.opinfo.conformance`` (``nox -s opinfo``) runs every eligible op in worker processes with a
per-op timeout and prints the table; ``--ops`` picks ops by name. ``tests/opinfo/`` runs
:data:`CI_SUBSET` under pytest.
"""

from __future__ import annotations

import argparse
import itertools
import multiprocessing as mp
import os
import sys
import time
import traceback
import warnings
from collections import Counter
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from multiprocessing.connection import Connection
from typing import Any

import torch
import torch.utils._pytree as pytree
from torch import nn

FORWARD_TOLERANCE = {"rtol": 1e-4, "atol": 1e-5}
GRADIENT_TOLERANCE = {"rtol": 1e-3, "atol": 1e-4}

RANDOM = ("rand", "bernoulli", "dropout", "normal", "multinomial", "uniform", "rrelu", "cauchy", "exponential")
"""Name fragments of ops whose results are random draws (eager and ONNX Runtime draw differently)."""

NONDETERMINISTIC = frozenset({"empty", "empty_like", "empty_strided", "new_empty", "new_empty_strided"})

OUR_FAMILIES = (
    "index_put",
    "nn.functional.scaled_dot_product_attention",
    "nn.functional.multi_head_attention_forward",
    "nn.functional.relu",
    "nn.functional.gelu",
    "nn.functional.silu",
    "nn.functional.layer_norm",
    "nn.functional.group_norm",
    "nn.functional.batch_norm",
    "nn.functional.embedding",
    "nn.functional.embedding_bag",
    "nn.functional.cross_entropy",
    "nn.functional.conv2d",
    "nn.functional.conv_transpose2d",
    "nn.functional.max_pool2d",
    "nn.functional.avg_pool2d",
    "nn.functional.adaptive_avg_pool2d",
    "nn.functional.adaptive_max_pool2d",
    "nn.functional.avg_pool3d",
    "nn.functional.adaptive_avg_pool3d",
    "nn.functional.max_pool3d",
    "nn.functional.local_response_norm",
    "nn.functional.pad.reflect",
    "nn.functional.pad.replicate",
    "nn.functional.grid_sample",
    "grid_sampler_2d",
    "nn.functional.bilinear",
    "cdist",
    "nn.functional.linear",
    "addmm",
    "matmul",
    "bmm",
    "sum",
    "mean",
    "softmax",
    "log_softmax",
    "expand",
    "permute",
    "transpose",
    "where",
    "masked_fill",
    "copysign",
    "erfc",
)
"""Op families our decompositions and FX or ONNX rewrites touch."""

ONCE_FAILING = (
    "nn.functional.avg_pool2d",
    "linalg.matrix_power",
    "special.log_ndtr",
    "special.erfcx",
    "complex",
    "polar",
    "cdouble",
    "stft",
    "fft.fft",
    "fft.ifft",
    "fft.rfft",
    "fft.rfft2",
    "fft.rfftn",
    "fft.ihfft",
    "fft.fft2",
    "fft.hfft2",
    "fft.irfft",
    "view_as_complex",
    "linalg.eigh",
    "qr",
    "cumprod",
    "masked.cumprod",
    "unfold",
    "unfold_copy",
    "as_strided",
    "diagonal_copy",
    "cholesky_inverse",
    "linalg.vander",
    "pinverse",
)
"""Ops that once gave wrong results or errors through ORTModule."""

CI_SUBSET = OUR_FAMILIES + ONCE_FAILING
"""The ops CI checks (``tests/opinfo/``)."""


@dataclass
class Outcome:
    """How one op fared: ``status`` is ``pass``, ``fallback``, ``wrong``, ``error`` or ``skip``; ``detail`` says why."""

    op: str
    status: str
    detail: str = ""
    seconds: float = 0.0


def eligible_ops() -> list[Any]:
    """``op_db`` entries with float32 CPU autograd, minus sparse, random, in-place-only and factory ops."""
    from torch.testing._internal.common_methods_invocations import op_db

    chosen = []
    for op in op_db:
        name = op.name if not op.variant_test_name else f"{op.name}.{op.variant_test_name}"
        if torch.float32 not in op.supported_dtypes("cpu") or not op.supports_autograd:
            continue
        if "sparse" in name or any(fragment in name for fragment in RANDOM) or op.name in NONDETERMINISTIC:
            continue
        if op.name.endswith("_") or op.name.startswith(("new_", "full", "ones", "zeros", "arange", "linspace")):
            continue
        chosen.append(op)
    return chosen


def op_key(op: Any) -> str:
    return op.name if not op.variant_test_name else f"{op.name}.{op.variant_test_name}"


class OpModule(nn.Module):
    """Calls ``op`` on ``sample``'s arguments, the tensor leaves taken from ``forward``'s arguments.

    Args:
        op: the OpInfo's callable.
        sample: the sample whose non-tensor arguments become constants.
        in_model: scale each floating-point argument that requires grad by a parameter of ones first.
    """

    def __init__(self, op: Any, sample: Any, in_model: bool = False) -> None:
        super().__init__()
        leaves, self._spec = pytree.tree_flatten((sample.input, sample.args, sample.kwargs))
        self._op = op
        self._tensor_at = [index for index, leaf in enumerate(leaves) if isinstance(leaf, torch.Tensor)]
        self._constants = [None if isinstance(leaf, torch.Tensor) else leaf for leaf in leaves]
        self.scales = nn.ParameterDict(
            {
                str(position): nn.Parameter(torch.ones_like(leaves[index]))
                for position, index in enumerate(self._tensor_at)
                if in_model and leaves[index].is_floating_point() and leaves[index].requires_grad
            }
        )

    def forward(self, *tensors: torch.Tensor) -> Any:
        leaves = list(self._constants)
        for position, (index, tensor) in enumerate(zip(self._tensor_at, tensors)):
            scale = self.scales.get(str(position))
            leaves[index] = tensor if scale is None else tensor * scale
        first, args, kwargs = pytree.tree_unflatten(leaves, self._spec)
        return self._op(first, *args, **kwargs)


def sample_tensors(sample: Any) -> list[torch.Tensor]:
    return [
        leaf
        for leaf in pytree.tree_leaves((sample.input, sample.args, sample.kwargs))
        if isinstance(leaf, torch.Tensor)
    ]


SAMPLES_CONSIDERED = 8


def chosen_sample(op: Any) -> Any:
    """The sample with the most elements among ``op``'s first :data:`SAMPLES_CONSIDERED` (the first of equals).

    First samples are often degenerate (``unfold`` of a 0-d tensor); a larger one exercises the op's general
    case, such as ``unfold`` windows that overlap.
    """
    torch.manual_seed(0)
    samples = itertools.islice(op.sample_inputs("cpu", torch.float32, requires_grad=True), SAMPLES_CONSIDERED)
    return max(samples, key=lambda sample: sum(t.numel() for t in sample_tensors(sample)))


def check_op(op: Any, in_model: bool = False) -> Outcome:
    """Run ``op``'s chosen sample through eager and a fresh ORTModule and compare (see :class:`OpModule`)."""
    from lightning_ort import ORTModule
    from lightning_ort.errors import FallbackWarning

    start = time.perf_counter()
    key = op_key(op)
    sample = chosen_sample(op)
    originals = sample_tensors(sample)
    try:
        eager = _run(OpModule(op, sample, in_model), originals)
    except Exception as err:  # eager itself refuses (a loss that is ill-defined for this op, say)
        return Outcome(key, "skip", "eager: " + _first_line(err), time.perf_counter() - start)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always", FallbackWarning)
        model = ORTModule(OpModule(op, sample, in_model))
        try:
            ort = _run(model, originals)
        except Exception as err:  # reported, not raised: the table lists every op
            return Outcome(key, "error", _first_line(err), time.perf_counter() - start)
    mismatch = _compare(eager, ort)
    seconds = time.perf_counter() - start
    if mismatch:
        return Outcome(key, "wrong", mismatch, seconds)
    fallbacks = [str(w.message) for w in caught if issubclass(w.category, FallbackWarning)]
    stats = model.statistics
    if fallbacks or stats.forward_runs == 0:
        detail = fallbacks[0] if fallbacks else "no ONNX Runtime run"
        return Outcome(key, "fallback", detail.splitlines()[0][:300], seconds)
    return Outcome(key, "pass", "", seconds)


@dataclass
class _Result:
    outputs: list[Any]
    gradients: list[torch.Tensor | None]
    inputs_after: list[torch.Tensor]


def _run(module: nn.Module, originals: Sequence[torch.Tensor]) -> _Result:
    inputs = [t.detach().clone().requires_grad_(t.requires_grad) for t in originals]
    # Mutating ops need leaves that are not views of graph inputs requiring grad: feed clones of the leaves.
    fed = [t.clone() if t.requires_grad else t for t in inputs]
    outputs = pytree.tree_leaves(module(*fed))
    differentiable = [o for o in outputs if isinstance(o, torch.Tensor) and o.requires_grad]
    if differentiable:
        generator = torch.Generator().manual_seed(1)
        weights = [torch.randn(_real_part(o).shape, generator=generator, dtype=_real(o.dtype)) for o in differentiable]
        total = sum((_real_part(o) * w).sum() for o, w in zip(differentiable, weights))
        wants = [t for t in inputs if t.requires_grad] + list(module.parameters())
        grads = torch.autograd.grad(total, wants, allow_unused=True) if wants else ()
        gradients: list[torch.Tensor | None] = list(grads)
    else:
        gradients = []
    detached = [o.detach() if isinstance(o, torch.Tensor) else o for o in outputs]
    return _Result(detached, gradients, [t.detach() for t in fed])


def _real(dtype: torch.dtype) -> torch.dtype:
    return dtype.to_real() if dtype.is_complex else dtype


def _real_part(tensor: torch.Tensor) -> torch.Tensor:
    return torch.view_as_real(tensor.resolve_conj()) if tensor.is_complex() else tensor


def _compare(eager: _Result, ort: _Result) -> str:
    checks = (
        ("output", eager.outputs, ort.outputs, FORWARD_TOLERANCE),
        ("gradient", eager.gradients, ort.gradients, GRADIENT_TOLERANCE),
        ("mutated input", eager.inputs_after, ort.inputs_after, FORWARD_TOLERANCE),
    )
    for what, expected, actual, tolerance in checks:
        if len(expected) != len(actual):
            return f"{what} count {len(actual)} != eager's {len(expected)}"
        for index, (e, a) in enumerate(zip(expected, actual)):
            if not isinstance(e, torch.Tensor):
                unused_input_given_zeros = e is None and isinstance(a, torch.Tensor)
                if e != a and not unused_input_given_zeros:
                    return f"{what} {index}: {a!r} != eager's {e!r}"
                continue
            if not isinstance(a, torch.Tensor):
                return f"{what} {index}: {type(a).__name__} where eager has a tensor"
            try:
                torch.testing.assert_close(a, e, equal_nan=True, **tolerance)
            except AssertionError as err:
                return f"{what} {index}: " + " ".join(str(err).split())[:300]
    return ""


def _first_line(err: BaseException) -> str:
    lines = [line for line in str(err).splitlines() if line.strip()]
    return f"{type(err).__name__}: {lines[0][:300] if lines else ''}"


def _worker(connection: Connection, in_model: bool) -> None:
    warnings.filterwarnings("ignore")
    ops = {op_key(op): op for op in eligible_ops()}
    while True:
        name = connection.recv()
        if name is None:
            return
        try:
            outcome = check_op(ops[name], in_model)
        except Exception as err:  # a sample that eager itself cannot run, for instance
            outcome = Outcome(name, "error", _first_line(err) + " | " + traceback.format_exc(limit=-1).strip()[-200:])
        connection.send(outcome)


@dataclass
class _Worker:
    process: mp.process.BaseProcess
    connection: Connection
    op: str | None = None
    started: float = 0.0


def run_ops(names: Sequence[str], workers: int, timeout: float, in_model: bool = False) -> Iterator[Outcome]:
    """Check ``names`` in ``workers`` processes; an op running past ``timeout`` seconds ends as an error."""
    context = mp.get_context("spawn")
    pending = list(names)
    pool: list[_Worker] = []

    def start() -> _Worker:
        parent, child = context.Pipe()
        process = context.Process(target=_worker, args=(child, in_model), daemon=True)
        process.start()
        return _Worker(process, parent)

    pool = [start() for _ in range(min(workers, len(pending)))]
    while pending or any(w.op for w in pool):
        for index, worker in enumerate(pool):
            if worker.op is None and pending:
                worker.op, worker.started = pending.pop(0), time.perf_counter()
                worker.connection.send(worker.op)
            if worker.op is None:
                continue
            if worker.connection.poll(0.05):
                try:
                    outcome = worker.connection.recv()
                except EOFError:
                    outcome = Outcome(worker.op, "error", "worker process died")
                    pool[index] = start()
                worker.op = None
                yield outcome
            elif not worker.process.is_alive() or time.perf_counter() - worker.started > timeout:
                reason = "worker process died" if not worker.process.is_alive() else f"timed out after {timeout:.0f}s"
                yield Outcome(worker.op, "error", reason, time.perf_counter() - worker.started)
                worker.process.kill()
                pool[index] = start()
    for worker in pool:
        worker.connection.send(None)
        worker.process.join(timeout=5)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m tests.opinfo.conformance", description=__doc__)
    parser.add_argument("--ops", nargs="*", help="op names (default: every eligible op)")
    parser.add_argument("--ci-subset", action="store_true", help="run the CI subset only")
    parser.add_argument("--workers", type=int, default=os.cpu_count() or 1)
    parser.add_argument("--timeout", type=float, default=180.0, help="seconds per op (default 180)")
    parser.add_argument("--in-model", action="store_true", help="feed each op from a layer with a parameter")
    args = parser.parse_args(argv)
    available = [op_key(op) for op in eligible_ops()]
    names = list(CI_SUBSET) if args.ci_subset else (args.ops or available)
    unknown = sorted(set(names) - set(available))
    if unknown:
        parser.error(f"not eligible op names: {', '.join(unknown)}")
    outcomes = []
    for outcome in run_ops(names, args.workers, args.timeout, args.in_model):
        outcomes.append(outcome)
        print(f"{outcome.status:9s} {outcome.op:45s} {outcome.seconds:6.1f}s {outcome.detail}", flush=True)
    counts = Counter(o.status for o in outcomes)
    total = len(outcomes) - counts["skip"]
    matched = counts["pass"] + counts["fallback"]
    print(
        f"\n{total} ops: {counts['pass']} pass (fully ONNX Runtime), {counts['fallback']} fallback, "
        f"{counts['wrong']} wrong, {counts['error']} error; {matched / max(total, 1):.1%} match eager "
        f"({counts['skip']} skipped: eager cannot run their sample's check)"
    )
    return 1 if counts["wrong"] else 0


if __name__ == "__main__":
    sys.exit(main())
