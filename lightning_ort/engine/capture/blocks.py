"""Block graphs: a block repeated through a model is exported to ONNX and loaded into ONNX Runtime once.

A transformer's layers (``nn.ModuleList`` items, Hugging Face ``model.layers``) are instances of one class
computing the same graph on their own parameters. :func:`mark_blocks` makes each instance's ``forward`` a
TorchDynamo nested compile region (``torch.compiler.nested_compile_region``): TorchDynamo traces the block once
and calls it as a ``higher_order.invoke_subgraph`` per instance, with the parameters as inputs, and AOTAutograd
keeps the forward and backward subgraphs shared. :class:`BlockGraphs` then builds one ONNX Runtime session per
distinct subgraph and :class:`BlockCall` runs it in place of each ``invoke_subgraph``; the rest of the model
(embeddings, head, loss) runs in ONNX Runtime partitions around the calls. Export and session creation cost
no longer grow with depth.
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Callable, Collection, Iterable, Iterator, Mapping, Sequence
from typing import Any

import torch
import torch.fx
import torch.utils.checkpoint
from torch import nn
from torch.utils.flop_counter import FlopCounterMode

from lightning_ort.engine.torch_internals import INVOKE_SUBGRAPH, FakeTensorMode, nested_compile_region, size_hint
from lightning_ort.errors import BlockError
from lightning_ort.logs import get_logger
from lightning_ort.options import BlockSpec

log = get_logger(__name__)

_MARK = "_lightning_ort_block_forward"
"""Instance attribute set on every marked block: its wrapped ``forward``, to recognize and remove it."""


def repeated_classes(model: nn.Module) -> dict[type[nn.Module], int]:
    """Classes of composite modules held at least twice by one container of ``model``, with their counts.

    A container is an ``nn.ModuleList``, an ``nn.Sequential`` or an ``nn.ModuleDict``. Only composite modules
    count (a class with submodules of its own): a block is worth a graph of its own, a repeated ``nn.Linear``
    or activation is not. Classes inside another repeated class are left out (the outer block holds them).

    Example:
        >>> layers = nn.ModuleList(nn.TransformerEncoderLayer(8, 2) for _ in range(3))
        >>> {cls.__name__: n for cls, n in repeated_classes(nn.ModuleDict({"layers": layers})).items()}
        {'TransformerEncoderLayer': 3}
    """
    found: dict[type[nn.Module], int] = {}
    _collect(model, found)
    return found


_CONTAINERS = (nn.ModuleList, nn.Sequential, nn.ModuleDict)


def _collect(module: nn.Module, found: dict[type[nn.Module], int]) -> None:
    if isinstance(module, _CONTAINERS):
        counts: dict[type[nn.Module], int] = {}
        for child in module.children():
            if next(child.children(), None) is not None and not isinstance(child, _CONTAINERS):
                counts[type(child)] = counts.get(type(child), 0) + 1
        repeated = {cls: n for cls, n in counts.items() if n >= 2}
        for cls, n in repeated.items():
            found[cls] = found.get(cls, 0) + n
        for child in module.children():
            if type(child) not in repeated:
                _collect(child, found)
        return
    for child in module.children():
        _collect(child, found)


def resolve_blocks(
    model: nn.Module, blocks: Sequence[BlockSpec] | str | None, missing_ok: bool = False
) -> list[type[nn.Module]]:
    """The block classes ``blocks`` asks for in ``model``.

    Args:
        model: the model.
        blocks: ``None`` (no block graphs), ``"auto"`` (the classes :func:`repeated_classes` finds), or block
            classes or class names.
        missing_ok: leave out named classes ``model`` does not hold instead of failing.

    Raises:
        BlockError: a named class is not in ``model``; the message lists the repeated classes found.

    Example:
        >>> model = nn.Sequential(*(nn.TransformerEncoderLayer(8, 2) for _ in range(2)))
        >>> [cls.__name__ for cls in resolve_blocks(model, "auto")]
        ['TransformerEncoderLayer']
    """
    if blocks is None:
        return []
    if blocks == "auto":
        found = list(repeated_classes(model))
        if not found:
            log.info(
                "%s has no block repeated within a container (nn.ModuleList, nn.Sequential, nn.ModuleDict): it "
                "is captured as one graph",
                type(model).__name__,
            )
        return found
    if isinstance(blocks, str):
        blocks = [blocks]
    present = {type(module) for module in model.modules()}
    by_name = {cls.__name__: cls for cls in present}
    by_name.update({f"{cls.__module__}.{cls.__qualname__}": cls for cls in present})
    classes: list[type[nn.Module]] = []
    for spec in blocks:
        cls = by_name.get(spec) if isinstance(spec, str) else spec if spec in present else None
        if cls is None and missing_ok:
            continue
        if cls is None:
            repeated = sorted(c.__name__ for c in repeated_classes(model)) or ["none"]
            raise BlockError(
                f"blocks={list(blocks)!r}: {type(model).__name__} holds no module of class "
                f"{spec if isinstance(spec, str) else spec.__name__!r}. Classes repeated within its containers: "
                f"{', '.join(repeated)}. Name one of them, pass blocks='auto', or blocks=None for one graph."
            )
        if cls not in classes:
            classes.append(cls)
    return classes


def mark_blocks(model: nn.Module, classes: Iterable[type[nn.Module]], checkpoint: bool = False) -> list[nn.Module]:
    """Make every instance of ``classes`` in ``model`` a nested compile region; returns the marked instances.

    Each instance gets a ``forward`` attribute calling its class's ``forward`` through one
    ``torch.compiler.nested_compile_region`` per class (the block instance is an argument, so that its
    parameters become the subgraph's inputs). Outside ``torch.compile`` the region is a plain call. Instances
    inside another marked block are left alone, and :func:`unmark_blocks` undoes the marking.

    Args:
        model: the model.
        classes: the block classes.
        checkpoint: recompute each block's forward during the backward (activation checkpointing,
            ``torch.utils.checkpoint`` without reentrancy) instead of keeping its activations. A checkpointed
            block is not a nested compile region (AOTAutograd partitions a region on its own and keeps its
            activations); it is shared when TorchDynamo compiles it as a frame of its own, as under FSDP.

    Example:
        >>> model = nn.Sequential(*(nn.TransformerEncoderLayer(8, 2) for _ in range(2)))
        >>> len(mark_blocks(model, [nn.TransformerEncoderLayer]))
        2
        >>> unmark_blocks(model)
    """
    wanted = tuple(classes)
    if not wanted:
        return []
    marked: list[nn.Module] = []
    for module in _outermost(model, wanted):
        if checkpoint:
            forward = functools.partial(_checkpointed_block_forward, type(module).forward, module)
        else:
            forward = functools.partial(_block_forward, _region(type(module)), module)
        functools.update_wrapper(forward, type(module).forward)
        _mark(module, forward)
        marked.append(module)
    return marked


def _block_forward(region: Callable[..., Any], module: nn.Module, *args: Any, **kwargs: Any) -> Any:
    """A block's forward. TorchDynamo compiles it as a frame of its own when it cannot trace the caller."""
    return region(module, *args, **kwargs)


def _checkpointed_block_forward(forward: Callable[..., Any], module: nn.Module, *args: Any, **kwargs: Any) -> Any:
    return torch.utils.checkpoint.checkpoint(forward, module, *args, use_reentrant=False, **kwargs)


def unmark_blocks(model: nn.Module, classes: Iterable[type[nn.Module]] | None = None) -> None:
    """Give the blocks :func:`mark_blocks` marked in ``model`` their class's ``forward`` back: all of them, or
    the instances of ``classes``."""
    kinds = tuple(classes) if classes is not None else (nn.Module,)
    for module in model.modules():
        if isinstance(module, kinds):
            _unmark(module)


@contextlib.contextmanager
def blocks_unmarked(model: nn.Module) -> Iterator[None]:
    """Run ``model``'s marked blocks through their class's ``forward`` while in use; mark them again after.

    For tracers other than ORTModule's (``torch.export``), which need not reuse one region's graph for every
    instance with that instance's own parameters.

    Example:
        >>> model = nn.Sequential(*(nn.TransformerEncoderLayer(8, 2) for _ in range(2)))
        >>> _ = mark_blocks(model, [nn.TransformerEncoderLayer])
        >>> with blocks_unmarked(model):
        ...     len(marked_blocks(model))
        0
        >>> len(marked_blocks(model))
        2
    """
    marks = {module: module.__dict__[_MARK] for module in model.modules() if _MARK in module.__dict__}
    for module in marks:
        _unmark(module)
    try:
        yield
    finally:
        for module, forward in marks.items():
            _mark(module, forward)


def marked_blocks(model: nn.Module) -> list[nn.Module]:
    """The instances of ``model`` that :func:`mark_blocks` marked."""
    return [module for module in model.modules() if _MARK in module.__dict__]


def uncaptured_block(error: BaseException, classes: Sequence[type[nn.Module]]) -> type[nn.Module] | None:
    """The block class whose ``forward`` TorchDynamo could not capture whole, from ``error``'s user stack.

    A graph break inside a nested compile region is an error (``UncapturedHigherOrderOpError``) whose
    ``real_stack`` runs through the block's ``forward``; ``None`` if no frame of it is a class of ``classes``.
    """
    for frame in getattr(error, "real_stack", None) or ():
        for cls in classes:
            code = getattr(cls.forward, "__code__", None)
            if code is None or frame.filename != code.co_filename or frame.name != code.co_name:
                continue
            lines = [line for _, _, line in code.co_lines() if line is not None]
            if frame.lineno is not None and code.co_firstlineno <= frame.lineno <= max(lines, default=0):
                return cls
    return None


def _mark(module: nn.Module, forward: Callable[..., Any]) -> None:
    module.__dict__["forward"] = forward
    module.__dict__[_MARK] = forward


def _unmark(module: nn.Module) -> None:
    mark = module.__dict__.pop(_MARK, None)
    if mark is not None and module.__dict__.get("forward") is mark:
        del module.__dict__["forward"]


def _outermost(module: nn.Module, classes: tuple[type[nn.Module], ...]) -> Iterator[nn.Module]:
    for child in module.children():
        if isinstance(child, classes):
            yield child
        else:
            yield from _outermost(child, classes)


def _region(cls: type[nn.Module]) -> Callable[..., Any]:
    """One nested compile region per block class, so that every instance reuses the same traced subgraph.

    NB: the region must take the instance as an argument; a region bound as a method (``region.__get__(block)``)
    is reused by TorchDynamo with the first instance's parameters.
    """
    region = _REGIONS.get(cls)
    if region is None:
        region = _REGIONS[cls] = nested_compile_region(cls.forward, _MAX_REUSE_ENTRIES)
    return region


_REGIONS: dict[type[nn.Module], Callable[..., Any]] = {}


_MAX_REUSE_ENTRIES = 64
"""Distinct input signatures one block class may be traced with (TorchDynamo raises beyond it)."""


def has_blocks(gm: torch.fx.GraphModule) -> bool:
    """Whether ``gm`` calls block subgraphs (``invoke_subgraph``)."""
    return any(node.op == "call_function" and node.target is INVOKE_SUBGRAPH for node in gm.graph.nodes)


def inline_blocks(gm: torch.fx.GraphModule, subgraphs: Collection[str] | None = None) -> None:
    """Make ``gm``'s block calls plain calls of their subgraphs, which AOTAutograd traces into one graph.

    For blocks AOTAutograd cannot keep apart (``invoke_subgraph`` refuses a block that updates a buffer in
    training, as ``BatchNorm`` does), and blocks too light for graphs of their own (:func:`light_blocks`).

    Args:
        gm: a graph from TorchDynamo (changed in place).
        subgraphs: the names of the subgraph attributes whose calls to inline; ``None`` inlines every call.
    """
    for node in gm.graph.nodes:
        if node.op == "call_function" and node.target is INVOKE_SUBGRAPH:
            holder, _, *operands = node.args
            if subgraphs is not None and holder.target not in subgraphs:
                continue
            node.target = _call_subgraph
            node.args = (holder, *operands)
    gm.recompile()


BLOCK_FLOPS: Mapping[str, float] = {"cuda": 20e9}
"""The forward work (floating-point operations) below which ``blocks="auto"`` inlines a block, by device type.

A block graph runs as ONNX Runtime runs of its own, each with a fixed host cost (binding inputs and outputs,
starting the run). On a GPU the host launches work ahead of the device, so that cost is hidden while a block's
kernels take longer than it and shows in the step when they do not: a small block then costs more time and, its
activations held at the boundaries, more memory than the whole model in one graph. The threshold sits between
the heaviest block measured to lose from its own graphs and the lightest measured to gain (see the performance
guide, "Block graphs on CUDA"). On the CPU a run's host cost is small beside any block's kernels, and block graphs
keep the first step's build time flat with depth: no device type but ``cuda`` inlines blocks.
"""


def light_blocks(gm: torch.fx.GraphModule, min_flops: float) -> dict[str, float]:
    """The block subgraphs ``gm`` calls whose forward counts fewer than ``min_flops``; their names and counts.

    The count is ``torch.utils.flop_counter``'s (matrix products, convolutions, attention) for one call of the
    subgraph on the shapes TorchDynamo traced it with, run on fake tensors: nothing is computed. A subgraph whose
    count fails (an op fake tensors cannot run) is left out, and so kept.

    Args:
        gm: a graph from TorchDynamo.
        min_flops: the forward work a block needs to keep graphs of its own.
    """
    light: dict[str, float] = {}
    counted: set[str] = set()
    for node in gm.graph.nodes:
        if node.op != "call_function" or node.target is not INVOKE_SUBGRAPH:
            continue
        holder, _, *operands = node.args
        if holder.target in counted:
            continue
        counted.add(holder.target)
        flops = _forward_flops(getattr(gm, holder.target), operands)
        if flops is not None and flops < min_flops:
            light[holder.target] = flops
    return light


def _forward_flops(subgraph: torch.fx.GraphModule, operands: Sequence[Any]) -> float | None:
    """``subgraph``'s floating-point operations on fake tensors like ``operands``' traced values; ``None`` if
    a shape has no known value or an op cannot run on fake tensors."""
    examples = [arg.meta.get("example_value") if isinstance(arg, torch.fx.Node) else arg for arg in operands]
    try:
        with FakeTensorMode(allow_non_fake_inputs=True), torch.no_grad():
            values = [_fake_like(example) for example in examples]
            if any(value is None for value in values):
                return None
            with FlopCounterMode(display=False) as counter:
                subgraph.forward(*values)
    except Exception as err:  # any failure only means that the block keeps its graphs
        log.debug("the forward work of block subgraph %s was not counted: %s", subgraph, err)
        return None
    return float(counter.get_total_flops())


def _fake_like(example: Any) -> Any:
    """A fake tensor of ``example``'s traced shape, strides and type (sizes at their traced values); ``None``
    where a size has none."""
    if isinstance(example, torch.SymInt):
        return size_hint(example)
    if not isinstance(example, torch.Tensor):
        return example
    sizes = [size_hint(size) for size in (*example.shape, *example.stride())]
    known = [size for size in sizes if size is not None]
    if len(known) < len(sizes):
        return None
    rank = example.dim()
    return torch.empty_strided(known[:rank], known[rank:], dtype=example.dtype, device=example.device)


def _call_subgraph(subgraph: torch.fx.GraphModule, *args: Any) -> Any:
    return subgraph(*args)


class BlockCall:
    """Runs a block's ONNX Runtime graph in place of an ``invoke_subgraph`` node; returns a tuple like it.

    Args:
        runner: the block graph's session (AOTAutograd's boxed convention), shared by every instance.
    """

    def __init__(self, runner: Callable[[list[Any]], list[Any]]) -> None:
        self.runner = runner
        self.__name__ = "block_call"

    def __call__(self, *args: Any) -> tuple[Any, ...]:
        return tuple(self.runner(list(args)))


class BlockGraphs:
    """The block graphs of one backend: one runner per distinct subgraph and input signature.

    Example:
        >>> BlockGraphs().built, BlockGraphs().reused
        (0, 0)
    """

    def __init__(self) -> None:
        self._reusable: dict[tuple[str, tuple[str, ...]], tuple[str, Any]] = {}
        self._built: list[tuple[str, Any]] = []
        self.built = 0
        """Block graphs built (each exported and loaded once, or read from the disk cache)."""
        self.reused = 0
        """Block calls served by a graph built for an earlier call."""

    def runners(self) -> list[tuple[str, Any]]:
        """``(kind, runner)`` of every block graph built so far."""
        return list(self._built)

    def reset(self) -> None:
        """Forget the runners (the counts stay)."""
        self._reusable.clear()
        self._built.clear()

    def retire(self) -> None:
        """Build new block graphs for graphs captured from now on; the built ones keep serving their graphs.

        After :meth:`~lightning_ort.ORTModule.end_profiling`, so that later graphs are profiled again.
        """
        self._reusable.clear()

    def snapshot(self) -> tuple[int, int, int]:
        """What :meth:`restore` returns to: the runners and counts so far."""
        return len(self._built), self.built, self.reused

    def restore(self, snapshot: tuple[int, int, int]) -> None:
        """Forget the runners built since ``snapshot`` (a build that did not finish) and their counts."""
        kept, self.built, self.reused = snapshot
        removed = [runner for _, runner in self._built[kept:]]
        del self._built[kept:]
        for key, (_, runner) in list(self._reusable.items()):
            if any(runner is other for other in removed):
                del self._reusable[key]

    def substitute(
        self,
        gm: torch.fx.GraphModule,
        kind: str,
        build: Callable[[torch.fx.GraphModule, Sequence[Any], str], Any],
        name: str,
    ) -> set[str]:
        """Replace ``gm``'s ``invoke_subgraph`` nodes by :class:`BlockCall` nodes; returns their names.

        Args:
            gm: a forward, backward or inference graph from AOTAutograd (changed in place).
            kind: ``"forward"``, ``"backward"`` or ``"inference"``, for the statistics.
            build: builds a runner from a subgraph, its example inputs and a name.
            name: the graph's name; block graphs are named ``f"{name}_block{i}"``.
        """
        calls: set[str] = set()
        for node in list(gm.graph.nodes):
            if node.op != "call_function" or node.target is not INVOKE_SUBGRAPH:
                continue
            holder, _, *operands = node.args
            subgraph = getattr(gm, holder.target)
            examples = [arg.meta["val"] if isinstance(arg, torch.fx.Node) else arg for arg in operands]
            key = (subgraph.code, tuple(_signature(value) for value in examples))
            entry = self._reusable.get(key)
            if entry is None:
                index = sum(1 for _, runner in self._built if runner.name.startswith(f"{name}_block"))
                entry = self._reusable[key] = (kind, build(subgraph, examples, f"{name}_block{index}"))
                self._built.append(entry)
                self.built += 1
            else:
                self.reused += 1
            node.target = BlockCall(entry[1])
            node.args = tuple(operands)
            calls.add(node.name)
            if not holder.users:
                gm.graph.erase_node(holder)
        if calls:
            gm.delete_all_unused_submodules()
            gm.recompile()
        return calls


def _signature(value: Any) -> str:
    if isinstance(value, torch.Tensor):
        return f"{value.dtype}{tuple(value.shape)}{value.stride()}{value.device}"
    return repr(value)
