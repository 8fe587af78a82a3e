"""Random ops lifted out of exported graphs: their noise is drawn in PyTorch before each run.

ONNX's random ops have generators of their own, so a graph that drew its dropout masks inside ONNX Runtime would
ignore ``torch.manual_seed``. :func:`lift_random_ops` replaces each random op of an FX graph (``rand_like``,
``randn_like``, ``bernoulli``, dropout's keep mask) by a graph input, and :class:`Noise` draws that input from
PyTorch's generator for every run.
"""

from __future__ import annotations

import math
import operator
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np
import sympy
import torch
import torch.fx

from lightning_ort.engine.fx.dynamic import Size, evaluate, symbolic_shape
from lightning_ort.engine.fx.passes import placeholders_first
from lightning_ort.engine.fx.replacements import DROPOUT_KEEP
from lightning_ort.errors import ExportError

aten = torch.ops.aten


@dataclass(frozen=True)
class Noise:
    """How to draw one lifted random input before each run (plain data, so a graph can be saved to disk).

    ``kind`` is ``"uniform"`` (``torch.rand``), ``"normal"`` (``torch.randn``) or ``"threshold"``: a mask
    ``u <compare> threshold`` for ``u`` uniform on [0, 1), drawn from 16 random bits per element (see
    :func:`_lift_uniform_threshold`), as ``bool`` or as ``uint8`` 0/1 (dropout's keep mask,
    :func:`lightning_ort.engine.fx.replacements.dropout_keep`).

    Example:
        >>> Noise("threshold", (2, 3), torch.bool, compare="gt", threshold=0.5).draw(torch.device("cpu")).dtype
        torch.bool
        >>> keep = Noise("threshold", (1000,), torch.uint8, "gt", 0.5).draw(torch.device("cpu"))
        >>> keep.dtype, sorted(keep.unique().tolist())
        (torch.uint8, [0, 1])
    """

    kind: str
    shape: tuple[Size, ...]
    dtype: torch.dtype
    compare: str = ""
    threshold: float = 0.0

    def draw(self, device: torch.device, env: dict[sympy.Symbol, int] | None = None) -> torch.Tensor:
        """A fresh sample; ``env`` gives the values of symbolic sizes."""
        shape = tuple(evaluate(size, env or {}) for size in self.shape)
        if self.kind == "uniform":
            return torch.rand(shape, dtype=self.dtype, device=device)
        if self.kind == "normal":
            return torch.randn(shape, dtype=self.dtype, device=device)
        limit = self._integer_threshold()
        if not -(2**15) <= limit < 2**15:  # every 16-bit value compares like 0 with an out-of-range limit
            return torch.full(shape, getattr(operator, self.compare)(0, limit), dtype=self.dtype, device=device)
        return _threshold_mask(math.prod(shape), device, self.compare, limit).view(self.dtype).view(shape)

    def _integer_threshold(self) -> int:
        """The integer ``limit`` with ``bits <compare> limit`` exactly when ``u <compare> threshold``.

        ``u = (bits + 2**15) / 2**16`` is uniform on [0, 1) in steps of 2**-16, so ``u > t`` holds when
        ``bits > floor(t * 2**16 - 2**15)`` (``ceil`` for ``ge``/``lt``). Comparing int16 with an integer is
        faster than with a float, which promotes every element.
        """
        bound = self.threshold * 65536.0 - 32768.0
        return math.floor(bound) if self.compare in ("gt", "le") else math.ceil(bound)


_NUMPY_COMPARISONS = {"gt": "greater", "ge": "greater_equal", "lt": "less", "le": "less_equal"}


def _threshold_mask(numel: int, device: torch.device, compare: str, limit: int) -> torch.Tensor:
    """``bits <compare> limit`` for ``numel`` uniformly random int16 ``bits`` drawn from PyTorch's generator for
    ``device``: a flat boolean mask.

    On CPU, PyTorch's generator (a serial Mersenne Twister) only draws the seed of a NumPy SFC64 generator,
    which fills the bits about twice as fast, and NumPy compares them. ``torch.manual_seed`` still fixes every
    mask.
    """
    words = -(-numel // 4)
    if device.type != "cpu":
        bits = torch.empty(words, dtype=torch.int64, device=device).random_(-(2**63), None)
        return getattr(torch, compare)(bits.view(torch.int16)[:numel], limit)
    seed = int(torch.empty((), dtype=torch.int64).random_())
    values = np.random.SFC64(seed).random_raw(words).view(np.int16)[:numel]
    return torch.from_numpy(getattr(np, _NUMPY_COMPARISONS[compare])(values, limit))


def lift_random_ops(gm: torch.fx.GraphModule, device: torch.device) -> tuple[list[Noise], list[torch.Tensor]]:
    graph = gm.graph
    placeholders = placeholders_first(graph)
    last_placeholder: torch.fx.Node | None = placeholders[-1] if placeholders else None
    noises: list[Noise] = []
    examples: list[torch.Tensor] = []

    def new_input(noise: Noise, shape: Sequence[int | torch.SymInt]) -> torch.fx.Node:
        nonlocal last_placeholder
        # A graph (partition) may read no input at all: its noise inputs then come first.
        where = graph.inserting_after(last_placeholder) if last_placeholder else graph.inserting_before()
        with where:
            node = graph.placeholder(f"noise_{len(noises)}")
        example = torch.zeros(tuple(shape), dtype=noise.dtype, device=device)
        node.meta["val"] = example
        last_placeholder = node
        noises.append(noise)
        examples.append(example)
        return node

    for node in list(graph.nodes):
        if node.op != "call_function":
            continue
        val = node.meta.get("val")
        if node.target in _UNIFORM_OPS and _lift_uniform_threshold(graph, node, new_input):
            continue
        if node.target in _UNIFORM_OPS or node.target in _NORMAL_OPS:
            kind = "uniform" if node.target in _UNIFORM_OPS else "normal"
            node.replace_all_uses_with(new_input(Noise(kind, symbolic_shape(val.shape), val.dtype), val.shape))
            graph.erase_node(node)
        elif node.target in (aten.bernoulli.default, aten.bernoulli.p):
            _lift_bernoulli(graph, node, new_input)
        elif node.target is DROPOUT_KEEP:
            p = _scalar(node.args[1])
            keep = Noise("threshold", symbolic_shape(val.shape), val.dtype, "gt", p)
            node.replace_all_uses_with(new_input(keep, val.shape))
            graph.erase_node(node)
    graph.eliminate_dead_code()
    return noises, examples


def _scalar(value: object) -> float:
    if not isinstance(value, (int, float)):
        raise ExportError(f"Expected a constant probability in a random op, got {value!r}.")
    return float(value)


def _lift_uniform_threshold(
    graph: torch.fx.Graph, node: torch.fx.Node, new_input: Callable[..., torch.fx.Node]
) -> bool:
    """Lift ``rand_like(x) > p`` (dropout's keep mask) as a boolean input drawn from 16 random bits per element.

    Drawing 64 random bits and splitting them into four 16-bit uniforms is several times cheaper than
    ``torch.rand`` on CPU, where random numbers are a large share of a training step with dropout. The mask's
    probability is exact up to 2**-16 (``rand`` itself is quantised to 2**-24). Returns ``False`` (nothing
    lifted) unless the uniform sample's only use is one comparison with a constant.
    """
    users = list(node.users)
    if len(users) != 1:
        return False
    (compare,) = users
    if compare.target not in _THRESHOLD_OPS or compare.args[0] is not node or not isinstance(compare.args[1], float):
        return False
    shape = node.meta["val"].shape
    noise = Noise("threshold", symbolic_shape(shape), torch.bool, _THRESHOLD_OPS[compare.target], compare.args[1])
    mask = new_input(noise, shape)
    compare.replace_all_uses_with(mask)
    graph.erase_node(compare)
    graph.erase_node(node)
    return True


def _lift_bernoulli(graph: torch.fx.Graph, node: torch.fx.Node, new_input: Callable[..., torch.fx.Node]) -> None:
    val = node.meta["val"]
    uniform = new_input(Noise("uniform", symbolic_shape(val.shape), torch.float32), val.shape)
    dtype = val.dtype
    with graph.inserting_before(node):
        if node.target is aten.bernoulli.p:
            draw = graph.call_function(aten.lt.Scalar, (uniform, _scalar(node.args[1])))
        else:
            draw = graph.call_function(aten.lt.Tensor, (uniform, node.args[0]))
        out = graph.call_function(aten._to_copy.default, (draw,), {"dtype": dtype})
    # The mask can be a graph output (saved for the backward), and outputs are described by their values.
    draw.meta["val"] = torch.empty_like(val, dtype=torch.bool)
    out.meta["val"] = val
    node.replace_all_uses_with(out)
    graph.erase_node(node)


_THRESHOLD_OPS: dict[object, str] = {
    aten.gt.Scalar: "gt",
    aten.ge.Scalar: "ge",
    aten.lt.Scalar: "lt",
    aten.le.Scalar: "le",
}


_UNIFORM_OPS = {aten.rand.default, aten.rand_like.default}


_NORMAL_OPS = {aten.randn.default, aten.randn_like.default}
