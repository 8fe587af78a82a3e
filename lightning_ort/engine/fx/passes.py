"""Rewrites of the joint forward/backward graph that make it cheaper to run in ONNX Runtime.

They run on AOTAutograd's joint graph, before it is partitioned into forward and backward graphs, so
each rewrite sees a gradient together with the forward op it belongs to.

* :func:`stack_select_gradients`: unpacking a tensor along a dimension (``q, k, v = proj``, ``unbind``)
  has, as gradient, one ``select_backward`` per piece (each a zero tensor of the full size with one slice
  filled in) summed together. Stacking the pieces' gradients builds the same tensor in one write.
* :func:`join_slice_gradients`: a slice's gradient (``slice_backward``) is a zero tensor of the sliced tensor's
  size with the slice filled in, which the ONNX export writes as a ``ScatterND`` between two transposes where the
  slice runs along the last dimension. The gradients of slices that a sum adds together over adjacent ranges of
  one dimension (``rotate_half`` of rotary embeddings: ``cat((-x2, x1))``) become one ``cat``, and any other
  slice's gradient a zero ``pad`` of its gradient.
* :func:`cancel_permutes`: a ``Linear``'s backward transposes the already transposed weight back
  (``t(t(W))``); saved for the backward graph, that identity permutation is a full copy of the weight.
* :func:`reshape_dense_strides`: a channels-last model's pooled ``[N, C, 1, 1]`` features are restrided by an
  ``as_strided`` view, whose gradient is an ``as_strided_scatter`` into zeros; where the strides are row-major
  for the sizes, the view is a reshape and the scatter its source reshaped (ONNX has no translation for the
  scatter, which would otherwise run in PyTorch between two ONNX Runtime partitions).

:func:`move_saved_permutes` runs after partitioning, on the forward and backward graphs together.
"""

from __future__ import annotations

import contextlib
import itertools
import math
from dataclasses import dataclass

import torch
import torch.fx

from lightning_ort.engine.fx.layout import row_major
from lightning_ort.engine.torch_internals import detect_fake_mode
from lightning_ort.logs import get_logger

log = get_logger(__name__)

aten = torch.ops.aten


def optimize_joint_graph(gm: torch.fx.GraphModule) -> torch.fx.GraphModule:
    """Apply every rewrite to ``gm`` in place and return it."""
    stacked = stack_select_gradients(gm)
    joined = join_slice_gradients(gm)
    cancelled = cancel_permutes(gm)
    reshaped = reshape_dense_strides(gm)
    if stacked or joined or cancelled or reshaped:
        log.debug(
            "stacked %d sums of select_backward, joined or padded %d slice_backward, cancelled %d permutations, "
            "made %d strided views reshapes",
            stacked,
            joined,
            cancelled,
            reshaped,
        )
        gm.recompile()
    return gm


def reshape_dense_strides(gm: torch.fx.GraphModule) -> int:
    """Replace ``as_strided`` views and ``as_strided_scatter`` writes that lay a whole tensor out in row-major
    order by reshapes.

    ``model.to(memory_format=torch.channels_last)``, which PyTorch's CPU performance guide advises for
    convolutional nets, gives a global average pool's ``[N, C, 1, 1]`` output channels-last strides; AOTAutograd
    restrides it with ``as_strided`` before the head flattens it, and the gradient of that view is an
    ``as_strided_scatter`` of the head's gradient into a zero tensor. ONNX has no translation for the scatter. With
    offset 0, as many elements as the tensor and strides that are row-major for the sizes (a dimension of size 1
    may have any stride), the view reads the (contiguous) input in order, and the scatter overwrites every element
    of its (contiguous) base in order: a reshape of the input, and a reshape of the scattered source. Returns the
    number of nodes replaced.

    Example:
        >>> from torch._subclasses.fake_tensor import FakeTensorMode
        >>> graph = torch.fx.Graph()
        >>> base, grad = graph.placeholder("base"), graph.placeholder("grad")
        >>> scatter = graph.call_function(aten.as_strided_scatter.default, (base, grad, [2, 3], [3, 1], 0))
        >>> _ = graph.output(graph.call_function(aten.as_strided.default, (scatter, [2, 3, 1, 1], [3, 1, 3, 3])))
        >>> with FakeTensorMode():
        ...     base.meta["val"], grad.meta["val"] = torch.zeros(6), torch.empty(2, 3)
        >>> gm = torch.fx.GraphModule(torch.nn.Module(), graph)
        >>> reshape_dense_strides(gm)
        2
        >>> [(n.target.__name__, n.args[1]) for n in gm.graph.nodes if n.op == "call_function"]
        [('reshape.default', [6]), ('reshape.default', [2, 3, 1, 1])]
    """
    replaced = 0
    for node in list(gm.graph.nodes):
        if node.op != "call_function" or node.target not in (aten.as_strided.default, aten.as_strided_scatter.default):
            continue
        scatter = node.target is aten.as_strided_scatter.default
        base = node.args[0]
        layout = node.args[2:] if scatter else node.args[1:]
        size, stride = layout[0], layout[1]
        offset = layout[2] if len(layout) > 2 else node.kwargs.get("storage_offset")
        if not isinstance(base, torch.fx.Node) or offset not in (0, None) or not row_major(size, stride):
            continue
        base_value = base.meta.get("val")
        if not isinstance(base_value, torch.Tensor) or not all(isinstance(d, int) for d in base_value.shape):
            continue
        if not base_value.is_contiguous():
            continue
        if base_value.numel() != math.prod(size):
            continue
        if scatter:
            written = node.args[1]
            value = written.meta.get("val") if isinstance(written, torch.fx.Node) else None
            if not isinstance(value, torch.Tensor) or list(value.shape) != list(size):
                continue
            if value.dtype != base_value.dtype:
                continue
            reshaped, shape = written, list(base_value.shape)
        else:
            reshaped, shape = base, list(size)
        with gm.graph.inserting_before(node):
            reshape = gm.graph.call_function(aten.reshape.default, (reshaped, shape))
        with _fake_mode_of([reshaped.meta["val"]]):
            reshape.meta = {**node.meta, "val": reshaped.meta["val"].reshape(shape)}
        node.replace_all_uses_with(reshape)
        gm.graph.erase_node(node)
        if scatter and base.op == "call_function" and not base.users:
            gm.graph.erase_node(base)
        replaced += 1
    return replaced


def _fake_mode_of(values: list[torch.Tensor]) -> contextlib.AbstractContextManager[object]:
    """The fake tensor mode ``values`` were made under (none for real tensors), under which a new node's value is
    computed from theirs."""
    fake_mode = detect_fake_mode(values)
    return fake_mode if fake_mode is not None else contextlib.nullcontext()


def cancel_permutes(gm: torch.fx.GraphModule) -> int:
    """Replace permutations of permutations that restore the original order by the original tensor.

    Returns the number of permutations removed.

    Example:
        >>> graph = torch.fx.Graph()
        >>> w = graph.placeholder("w")
        >>> t = graph.call_function(aten.permute.default, (w, [1, 0]))
        >>> tt = graph.call_function(aten.permute.default, (t, [1, 0]))
        >>> _ = graph.output((t, tt))
        >>> gm = torch.fx.GraphModule(torch.nn.Module(), graph)
        >>> cancel_permutes(gm)
        1
        >>> [str(arg) for arg in gm.graph.output_node().args[0]]
        ['permute_default', 'w']
    """
    cancelled = 0
    for node in list(gm.graph.nodes):
        inner = node.args[0] if node.op == "call_function" and node.target is aten.permute.default else None
        if not isinstance(inner, torch.fx.Node) or inner.target is not aten.permute.default:
            continue
        outer_dims, inner_dims = _dims(node.args[1]), _dims(inner.args[1])
        rank = len(outer_dims)
        if [inner_dims[d % rank] % rank for d in outer_dims] != list(range(rank)):
            continue
        node.replace_all_uses_with(inner.args[0])
        gm.graph.erase_node(node)
        if not inner.users:
            gm.graph.erase_node(inner)
        cancelled += 1
    return cancelled


def _dims(value: object) -> list[int]:
    assert isinstance(value, (list, tuple)), value
    return [int(d) for d in value]


def stack_select_gradients(gm: torch.fx.GraphModule) -> int:
    """Replace sums of ``select_backward`` that cover every index of a dimension by one ``stack``.

    Returns the number of sums replaced.

    Example:
        >>> from torch._subclasses.fake_tensor import FakeTensorMode
        >>> graph = torch.fx.Graph()
        >>> grads = [graph.placeholder(f"g{i}") for i in range(2)]
        >>> parts = [graph.call_function(aten.select_backward.default, (g, [2, 3], 0, i)) for i, g in enumerate(grads)]
        >>> total = graph.call_function(aten.add.Tensor, tuple(parts))
        >>> _ = graph.output(total)
        >>> with FakeTensorMode() as mode:
        ...     for node in grads:
        ...         node.meta["val"] = torch.empty(3)
        >>> gm = torch.fx.GraphModule(torch.nn.Module(), graph)
        >>> stack_select_gradients(gm)
        1
        >>> [n.target for n in gm.graph.nodes if n.op == "call_function"]
        [<OpOverload(op='aten.stack', overload='default')>]
    """
    replaced = 0
    for node in list(gm.graph.nodes):
        if node.op != "call_function" or node.target is not aten.add.Tensor:
            continue
        if any(user.target is aten.add.Tensor and len(node.users) == 1 for user in node.users):
            continue
        leaves = _add_tree_leaves(node)
        if not all(leaf.target is aten.select_backward.default and len(leaf.users) == 1 for leaf in leaves):
            continue
        pieces = [piece for leaf in leaves if (piece := _SelectGradient.of(leaf)) is not None]
        if not pieces or len(pieces) != len(leaves):
            continue
        sizes, dim = pieces[0].sizes, pieces[0].dim
        count = sizes[dim]
        assert isinstance(count, int)
        by_index = {piece.index % count: piece.grad for piece in pieces}
        same_shape = all(p.sizes == sizes and p.dim == dim for p in pieces)
        if not same_shape or len(by_index) != len(pieces) or sorted(by_index) != list(range(count)):
            continue
        grads = [by_index[i] for i in range(count)]
        with gm.graph.inserting_before(node):
            stacked = gm.graph.call_function(aten.stack.default, (grads, dim))
        values = [g.meta["val"] for g in grads]
        with _fake_mode_of(values):
            stacked.meta = {**node.meta, "val": torch.stack(values, dim)}
        node.replace_all_uses_with(stacked)
        _erase_add_tree(gm.graph, node)
        for leaf in leaves:
            gm.graph.erase_node(leaf)
        replaced += 1
    return replaced


def join_slice_gradients(gm: torch.fx.GraphModule) -> int:
    """Replace the gradients of slices (``slice_backward``: zeros with the slice's gradient written in) by a
    ``cat`` of those a sum adds over adjacent ranges of one dimension, and by a zero ``pad`` of the
    gradient for the others.

    Slices with a step other than 1, or over a dimension whose size or bounds are symbolic, keep
    ``slice_backward``. Returns the number of ``slice_backward`` nodes replaced.

    Example:
        >>> from torch.fx.experimental.proxy_tensor import make_fx
        >>> def rotation_grad(g):  # the gradient of cat((x[:, 2:], x[:, :2]), 1)
        ...     first = aten.slice_backward(g[:, :2], [3, 4], 1, 2, 4, 1)
        ...     return first + aten.slice_backward(g[:, 2:], [3, 4], 1, 0, 2, 1)
        >>> gm = make_fx(rotation_grad, tracing_mode="fake")(torch.zeros(3, 4))
        >>> join_slice_gradients(gm)
        2
        >>> _ = gm.recompile()
        >>> [n.target for n in gm.graph.nodes if n.op == "call_function"][-1]
        <OpOverload(op='aten.cat', overload='default')>
        >>> gm(torch.arange(12.0).reshape(3, 4))[0].tolist()
        [2.0, 3.0, 0.0, 1.0]
    """
    replaced = 0
    roots = [
        node
        for node in gm.graph.nodes
        if node.op == "call_function"
        and node.target is aten.add.Tensor
        and not (len(node.users) == 1 and next(iter(node.users)).target is aten.add.Tensor)
    ]
    for root in roots:
        replaced += _join_summed_slices(gm.graph, root)
    for node in list(gm.graph.nodes):
        if node.op == "call_function" and node.target is aten.slice_backward.default:
            piece = _SliceGradient.of(node)
            if piece is not None:
                padded = _pad_to_size(gm.graph, node, piece.grad, piece.dim, piece.start, piece.size - piece.end)
                node.replace_all_uses_with(padded)
                gm.graph.erase_node(node)
                replaced += 1
    return replaced


@dataclass(frozen=True)
class _SliceGradient:
    """One ``slice_backward(grad, sizes, dim, start, end, step)`` node with step 1 and static bounds."""

    node: torch.fx.Node
    grad: torch.fx.Node
    dim: int
    size: int
    start: int
    end: int

    @classmethod
    def of(cls, node: torch.fx.Node) -> _SliceGradient | None:
        """The slice gradient's arguments, bounds clamped to the dimension, or ``None`` where ``node`` is no
        ``slice_backward``, or its bounds are symbolic or its step is not 1."""
        if node.target is not aten.slice_backward.default:
            return None
        grad, sizes, dim, start, end, step = node.args
        if not isinstance(grad, torch.fx.Node) or not isinstance(sizes, (list, tuple)) or step != 1:
            return None
        if not isinstance(dim, int) or not all(isinstance(v, int) for v in (start, end)):
            return None
        dim %= len(sizes)
        size = sizes[dim]
        if not isinstance(size, int):
            return None
        assert isinstance(start, int) and isinstance(end, int)
        start, end = (min(max(b + size if b < 0 else b, 0), size) for b in (start, end))
        return cls(node, grad, dim, size, start, max(start, end))


def _join_summed_slices(graph: torch.fx.Graph, root: torch.fx.Node) -> int:
    """Join the slice gradients the ``add`` tree at ``root`` sums over adjacent ranges of one dimension into one
    ``cat``; returns the number of ``slice_backward`` nodes replaced."""
    leaves = _add_tree_leaves(root)
    if any("val" not in leaf.meta for leaf in leaves):
        return 0
    slices = [piece for leaf in leaves if len(leaf.users) == 1 and (piece := _SliceGradient.of(leaf)) is not None]
    if len(slices) < 2 or not all(_same_sizes(piece, slices[0]) for piece in slices[1:]):
        return 0
    slices.sort(key=lambda p: p.start)
    if any(a.end != b.start for a, b in itertools.pairwise(slices)):
        return 0
    first, last = slices[0], slices[-1]
    with graph.inserting_before(root):
        joined = graph.call_function(aten.cat.default, ([p.grad for p in slices], first.dim))
        values = [p.grad.meta["val"] for p in slices]
        with _fake_mode_of(values):
            joined.meta = {**root.meta, "val": torch.cat(values, first.dim)}
        whole = _pad_to_size(graph, root, joined, first.dim, first.start, first.size - last.end)
        total = whole
        for leaf in leaves:
            if leaf not in {p.node for p in slices}:
                values = [total.meta["val"], leaf.meta["val"]]
                total = graph.call_function(aten.add.Tensor, (total, leaf))
                with _fake_mode_of(values):
                    total.meta = {**root.meta, "val": aten.add.Tensor(*values)}
    root.replace_all_uses_with(total)
    _erase_add_tree(graph, root)
    for piece in slices:
        graph.erase_node(piece.node)
    return len(slices)


def _same_sizes(a: _SliceGradient, b: _SliceGradient) -> bool:
    """Whether two slice gradients fill tensors of the same sizes along the same dimension: equal static sizes,
    the same graph node for symbolic ones (compared without evaluating them, which would add guards)."""
    sizes_a, sizes_b = a.node.args[1], b.node.args[1]
    assert isinstance(sizes_a, (list, tuple)) and isinstance(sizes_b, (list, tuple))
    same = len(sizes_a) == len(sizes_b) and all(
        x is y or (isinstance(x, int) and isinstance(y, int) and x == y) for x, y in zip(sizes_a, sizes_b)
    )
    return same and a.dim == b.dim


def _pad_to_size(
    graph: torch.fx.Graph, anchor: torch.fx.Node, value: torch.fx.Node, dim: int, before: int, after: int
) -> torch.fx.Node:
    """``value`` with ``before`` zeros in front and ``after`` behind along ``dim``, inserted before ``anchor``."""
    if not before and not after:
        return value
    val = value.meta["val"]
    pad = [0, 0] * (val.dim() - 1 - dim) + [before, after]
    with graph.inserting_before(anchor):
        padded = graph.call_function(aten.constant_pad_nd.default, (value, pad, 0.0))
    with _fake_mode_of([val]):
        padded.meta = {**anchor.meta, "val": aten.constant_pad_nd.default(val, pad, 0.0)}
    return padded


def _add_tree_leaves(root: torch.fx.Node) -> list[torch.fx.Node]:
    """The operands summed by the tree of single-use, two-operand ``add`` nodes rooted at ``root``."""
    leaves: list[torch.fx.Node] = []
    pending = [root]
    while pending:
        node = pending.pop()
        for arg in node.args:
            if not isinstance(arg, torch.fx.Node):
                continue
            if arg.target is aten.add.Tensor and len(arg.users) == 1 and _plain_add(arg):
                pending.append(arg)
            else:
                leaves.append(arg)
    return leaves if _plain_add(root) else []


def _plain_add(node: torch.fx.Node) -> bool:
    """Whether ``node`` adds two computed tensors without scaling either.

    Shapes are not compared: comparing symbolic sizes would add guards to the capture. A sum's terms may be
    reordered whatever they broadcast to.
    """
    if len(node.args) != 2 or node.kwargs.get("alpha", 1) != 1:
        return False
    return all(isinstance(arg, torch.fx.Node) for arg in node.args)


def _erase_add_tree(graph: torch.fx.Graph, root: torch.fx.Node) -> None:
    """Erase ``root`` and the single-use ``add`` nodes under it (as :func:`_add_tree_leaves` walks them)."""
    inner = [arg for arg in root.args if isinstance(arg, torch.fx.Node) and arg.target is aten.add.Tensor]
    graph.erase_node(root)
    for node in inner:
        if not node.users and _plain_add(node):
            _erase_add_tree(graph, node)


@dataclass(frozen=True)
class _SelectGradient:
    """The arguments of one ``select_backward(grad, sizes, dim, index)`` node."""

    grad: torch.fx.Node
    sizes: tuple[int | torch.fx.Node, ...]
    dim: int
    index: int

    @classmethod
    def of(cls, node: torch.fx.Node) -> _SelectGradient | None:
        """The select gradient's arguments, if the selected dimension has a fixed size (others may be symbolic)."""
        grad, sizes, dim, index = node.args
        if not isinstance(grad, torch.fx.Node) or not isinstance(sizes, (list, tuple)):
            return None
        if not isinstance(dim, int) or not isinstance(index, int) or not isinstance(sizes[dim], int):
            return None
        parts = tuple(size for size in sizes if isinstance(size, (int, torch.fx.Node)))
        return cls(grad, parts, dim % len(sizes), index) if len(parts) == len(sizes) else None


def move_saved_permutes(forward: torch.fx.GraphModule, backward: torch.fx.GraphModule, saved_from: int) -> int:
    """Save the tensor under a permuted view for the backward graph, and permute it there instead.

    A view costs nothing in PyTorch, so AOTAutograd saves transposed views (attention's ``q``, ``k`` and
    probabilities, reshaped for batched products); ONNX Runtime writes each as a transposed copy. Permuted in
    the backward graph, the transpose folds into the product that reads it (``FusedMatMul(transB=1)``, see
    :mod:`lightning_ort.engine.onnx.passes`) or stays one copy, made when it is needed.

    Only chains of ``permute``/``view`` with constant arguments are moved, and only where the forward graph does
    not compute the permuted tensor anyway: a view that an op other than a view, a copy or a matrix product
    reads in the forward (ConvNeXt's channels-last activations, read by a layer norm) is written there in any
    case, and saving it spares the backward graph a transpose. The forward graph keeps its number of outputs
    (AOTAutograd counts them); a moved output's backward placeholder receives the base tensor. Returns the
    number of saved tensors moved.
    """
    returned = forward.graph.output_node().args[0]
    assert isinstance(returned, (list, tuple)), returned
    outputs = list(returned)
    placeholders = {node.name: node for node in backward.graph.nodes if node.op == "placeholder"}
    first_computation = next(node for node in backward.graph.nodes if node.op != "placeholder")
    moved = 0
    for index in range(saved_from, len(outputs)):
        value = outputs[index]
        chain = _permuting_view_chain(value) if isinstance(value, torch.fx.Node) else []
        if chain and _computed_in_forward(chain[-1]):
            continue
        placeholder = placeholders.get(value.name) if chain else None
        base = chain[0].args[0] if chain else None
        if placeholder is None or not isinstance(base, torch.fx.Node):
            continue
        outputs[index] = base
        users = list(placeholder.users)
        view = _replay(backward.graph, chain, placeholder, before=first_computation)
        for user in users:
            user.replace_input_with(placeholder, view)
        placeholder.meta["val"] = base.meta["val"]
        moved += 1
    if moved:
        forward.graph.output_node().args = (tuple(outputs),)
        forward.graph.eliminate_dead_code()
        forward.recompile()
        backward.recompile()
    return moved


def _replay(
    graph: torch.fx.Graph, chain: list[torch.fx.Node], source: torch.fx.Node, before: torch.fx.Node
) -> torch.fx.Node:
    """Apply the views of ``chain`` (another graph's nodes, base first) to ``source`` in ``graph``."""
    with graph.inserting_before(before):
        for node in chain:
            source = graph.call_function(node.target, (source, *node.args[1:]))  # type: ignore[arg-type]
            source.meta["val"] = node.meta["val"]
    return source


def _permuting_view_chain(node: torch.fx.Node) -> list[torch.fx.Node]:
    """The views (base first) that ``node`` is made of, if they include a permutation; else ``[]``."""
    chain: list[torch.fx.Node] = []
    while (
        node.op == "call_function"
        and node.target in _VIEWS
        and isinstance(node.args[0], torch.fx.Node)
        and not _reads_nodes(node.args[1:])
    ):
        chain.append(node)
        node = node.args[0]
    if not any(link.target in _PERMUTES for link in chain):
        return []
    return chain[::-1]


def _computed_in_forward(view: torch.fx.Node) -> bool:
    """Whether an op other than a view, a copy or a matrix product (whose transposed operands ONNX Runtime
    reads in place) reads ``view``: the forward graph then writes the permuted tensor in any case."""
    return any(user.op == "call_function" and user.target not in _VIEW_READERS for user in view.users)


def _reads_nodes(args: tuple[object, ...]) -> bool:
    """Whether ``args`` contain graph values (symbolic sizes), which the backward graph does not have."""
    found: list[torch.fx.Node] = []
    torch.fx.node.map_arg(args, found.append)  # type: ignore[type-var]
    return bool(found)


_PERMUTES = {aten.permute.default, aten.t.default, aten.transpose.int}
_VIEWS = _PERMUTES | {aten.view.default, aten._unsafe_view.default, aten.reshape.default}
_VIEW_READERS = _VIEWS | {
    aten.expand.default,
    aten.clone.default,
    aten.mm.default,
    aten.bmm.default,
    aten.addmm.default,
    aten.baddbmm.default,
}


def placeholders_first(graph: torch.fx.Graph) -> list[torch.fx.Node]:
    """Move every placeholder of ``graph`` before its first op, in their order; returns them.

    A split graph's partitions interleave placeholders with ops; passes that add inputs after the last
    placeholder need them all in front, so that a new input is defined before any op reads it.

    Example:
        >>> graph = torch.fx.Graph()
        >>> x = graph.placeholder("x")
        >>> y = graph.call_function(torch.neg, (x,))
        >>> with graph.inserting_after(y):
        ...     z = graph.placeholder("z")
        >>> [node.name for node in placeholders_first(graph)], [node.name for node in graph.nodes]
        (['x', 'z'], ['x', 'z', 'neg'])
    """
    placeholders = [node for node in graph.nodes if node.op == "placeholder"]
    first_op = next((node for node in graph.nodes if node.op != "placeholder"), None)
    if first_op is not None:
        for node in placeholders:
            first_op.prepend(node)
    return placeholders
