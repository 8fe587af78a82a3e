"""Graphs replayed as CUDA graphs (``SessionSettings(cuda_graph=True)``): the fixed memory a replay works in.

ONNX Runtime's CUDA provider, with ``enable_cuda_graph``, runs a session's graph twice as usual, captures the
third run as one CUDA graph and from then on replays it: one launch instead of one per kernel, which is most of
a small model's step on a GPU. A replay reads and writes the addresses bound when it was captured, so a captured
graph here:

* reads its inputs from buffers of its own, which each call copies the inputs into; ``nn.Parameter`` inputs,
  which optimizers update in place, are bound as they are, and each set of them gets a graph of its own
  (``gpu_graph_id``): one per instance of a block graph, the same set on every step;
* writes its outputs into buffers of its own, copied out after each replay, since the next replay overwrites
  them (autograd keeps gradients and saved tensors that must outlive it);
* allocates from its session's own ONNX Runtime arena: its intermediates must keep their addresses for every
  replay, which PyTorch's caching allocator would hand to other tensors;
* runs on a CUDA stream of its own, after the work queued on PyTorch's current stream and before what comes
  next there (capture is not possible on the legacy default stream that PyTorch uses by default).

A graph with symbolic sizes, control flow or a node the CUDA provider runs on the host cannot be captured:
:func:`capture_refusal` says why, and the session runs it uncaptured.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import onnxruntime as ort
import torch
from torch import nn

from lightning_ort.engine.fx.layout import OutputSpec
from lightning_ort.engine.onnx.export import ExportedGraph
from lightning_ort.engine.onnx.passes import cuda_host_nodes
from lightning_ort.engine.ort_internals import SessionIOBinding

MAX_GRAPHS = 16
"""Captured graphs per session (sets of parameters bound); calls with another set then run uncaptured."""

CONTROL_FLOW = frozenset({"If", "Loop", "Scan"})
"""ONNX ops a CUDA graph cannot hold: what they run depends on values computed during the run."""


def capture_refusal(graph: ExportedGraph) -> str | None:
    """Why ``graph`` cannot be replayed as a CUDA graph, or ``None`` if it can.

    Example:
        >>> from onnx import helper
        >>> model = helper.make_model(helper.make_graph([helper.make_node("Loop", [], [], "loop")], "g", [], []))
        >>> capture_refusal(ExportedGraph("forward", model, [], [], None))  # type: ignore[arg-type]
        'it holds control flow (Loop loop), which a CUDA graph cannot replay'
    """
    if graph.symbols or graph.carried_sizes:
        return "its sizes are symbolic (dynamic shapes), and a CUDA graph replays one shape"
    nodes = graph.model.graph.node
    flow = [f"{node.op_type} {node.name}" for node in nodes if node.op_type in CONTROL_FLOW]
    if flow:
        return f"it holds control flow ({', '.join(flow[:3])}), which a CUDA graph cannot replay"
    host = cuda_host_nodes(graph.model)
    if host:
        return f"the CUDA provider would run {', '.join(host[:3])} on the host"
    return None


def capture_provider_options() -> dict[str, str]:
    """The CUDA provider options of a session whose graph is captured: capture on, and an arena of its own that
    grows by what a run asks (the third run, the one captured, must allocate nothing new)."""
    return {"enable_cuda_graph": "1", "arena_extend_strategy": "kSameAsRequested"}


@dataclass
class _Captured:
    """One captured graph: the binding of its fixed buffers, the buffers (``None`` where an input is a parameter
    bound as it is), and the run options that name its ``gpu_graph_id``."""

    binding: SessionIOBinding
    inputs: list[torch.Tensor | None]
    outputs: list[torch.Tensor]
    run_options: ort.RunOptions


class CapturedGraphs:
    """The captured graphs of one session, one per set of parameters it is called with.

    Args:
        run_session: the session's pybind11 session (see :func:`~lightning_ort.engine.ort_internals.pybind_session`).
        input_names: the session's input names, in the order of the calls' inputs.
        output_names: the session's output names, in the order of ``outputs``.
        outputs: the graph's outputs (static shapes).
        device: where the inputs and outputs live.
        stream: the CUDA stream the session runs on (``None`` on CPU, where the provider ignores graph ids, so
            that the buffers can be tested without a GPU).
        bind: binds one tensor to a binding's input or output by name (the session's own binder).
    """

    def __init__(
        self,
        run_session: Any,
        input_names: list[str],
        output_names: list[str],
        outputs: list[OutputSpec],
        device: torch.device,
        stream: torch.cuda.Stream | None,
        bind: Any,
    ) -> None:
        self._run_session = run_session
        self._input_names = input_names
        self._output_names = output_names
        self._outputs = outputs
        self._device = device
        self._stream = stream
        self._bind = bind
        self._graphs: dict[tuple[int, ...], _Captured] = {}

    def __len__(self) -> int:
        return len(self._graphs)

    def run(self, inputs: list[torch.Tensor]) -> list[torch.Tensor] | None:
        """Run the captured graph for ``inputs``' parameters (captured on its third call): copy ``inputs`` in,
        replay, and return copies of the outputs; ``None`` if this session holds :data:`MAX_GRAPHS` graphs
        already and ``inputs`` need another, which the caller runs uncaptured."""
        key = tuple(tensor.data_ptr() for tensor in inputs if isinstance(tensor, nn.Parameter))
        captured = self._graphs.get(key)
        if captured is None:
            if len(self._graphs) >= MAX_GRAPHS:
                return None
            captured = self._graphs[key] = self._buffers(inputs)
        for buffer, tensor in zip(captured.inputs, inputs):
            if buffer is not None:
                buffer.copy_(tensor)
        if self._stream is not None:
            self._stream.wait_stream(torch.cuda.current_stream(self._device))
        self._run_session.run_with_iobinding(captured.binding, captured.run_options)
        if self._stream is not None:
            torch.cuda.current_stream(self._device).wait_stream(self._stream)
        return [output.clone() for output in captured.outputs]

    def _buffers(self, inputs: list[torch.Tensor]) -> _Captured:
        """The fixed buffers and the binding of a new graph for ``inputs``, and its run options."""
        binding = SessionIOBinding(self._run_session)
        buffers: list[torch.Tensor | None] = []
        for name, tensor in zip(self._input_names, inputs):
            buffer = None if isinstance(tensor, nn.Parameter) else torch.empty_like(tensor)
            self._bind(binding.bind_input, name, tensor if buffer is None else buffer)
            buffers.append(buffer)
        outputs = [
            torch.empty(tuple(int(size) for size in spec.shape), dtype=spec.dtype, device=self._device)
            for spec in self._outputs
        ]
        for name, output in zip(self._output_names, outputs):
            self._bind(binding.bind_output, name, output)
        options = ort.RunOptions()
        options.add_run_config_entry("gpu_graph_id", str(len(self._graphs)))
        options.add_run_config_entry("disable_synchronize_execution_providers", "1")
        return _Captured(binding, buffers, outputs, options)
