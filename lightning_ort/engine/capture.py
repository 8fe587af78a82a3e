"""Capture a module's computation as forward/backward (or inference) FX graphs with AOTAutograd.

:class:`CapturedGraphs` wraps ``module`` as a pure function of ``(parameters, buffers, input tensors)``
and hands it to :func:`torch._functorch.aot_autograd.aot_function`: AOTAutograd traces it once with fake
tensors, decomposes it to core ATen, rewrites the joint graph (:mod:`lightning_ort.engine.rewrites`),
partitions it with ``min_cut_rematerialization_partition`` and calls :meth:`CapturedGraphs._compile` for
each graph. Each graph becomes an ONNX model run by a :class:`~lightning_ort.engine.session.GraphSession`.
AOTAutograd's runtime wrapper then bridges the two sessions to PyTorch autograd (``param.grad`` is filled
as in eager) and writes buffer updates back.
"""

from __future__ import annotations

import contextlib
import logging
import time
from collections.abc import Callable, Iterator, Sequence
from typing import TYPE_CHECKING, Any

import torch
import torch.fx
from torch._functorch.aot_autograd import aot_function
from torch._functorch.partitioners import min_cut_rematerialization_partition
from torch.fx import traceback as fx_traceback
from torch.nn.attention import SDPBackend, sdpa_kernel

from lightning_ort.engine.decompositions import capture_decompositions
from lightning_ort.engine.export import ExportError, export_graph
from lightning_ort.engine.rewrites import optimize_joint_graph
from lightning_ort.engine.session import GraphSession, SessionError
from lightning_ort.engine.signature import FlatInputs, FlatOutputs
from lightning_ort.options import DebugOptions, SessionSettings

if TYPE_CHECKING:
    from torch._functorch._aot_autograd.schemas import AOTDispatchCompiler

log = logging.getLogger(__name__)

_DECOMPOSITIONS = capture_decompositions()


class CapturedGraphs:
    """The graphs of one call signature of ``module``: built on first call, then reused.

    Args:
        module: the wrapped module.
        state_names: names of the parameters and buffers passed as graph inputs (in that order).
        inputs: the flattened call this signature was made from.
        device: where the graph runs.
        tag: distinguishes this signature's saved files (``"forward"``, ``"forward_1"``...).
        settings: ONNX Runtime session settings.
        debug: debug options.
        on_build: called with seconds spent building: tracing on the first call, then each graph's export
            and session creation.
    """

    def __init__(
        self,
        module: torch.nn.Module,
        state_names: Sequence[str],
        inputs: FlatInputs,
        device: torch.device,
        tag: str,
        settings: SessionSettings,
        debug: DebugOptions,
        on_build: Callable[[float], None],
    ) -> None:
        self._module = module
        self._state_names = list(state_names)
        self._inputs = inputs
        self._device = device
        self._tag = tag
        self._settings = settings
        self._debug = debug
        self._on_build = on_build
        self._rebuild_output: Callable[[Sequence[torch.Tensor]], Any] | None = None
        self._compile_seconds = 0.0
        self.sessions: dict[str, GraphSession] = {}
        self._function = aot_function(
            self._functional_forward,
            fw_compiler=self._compiler("forward"),
            bw_compiler=self._compiler("backward"),
            inference_compiler=self._compiler("inference"),
            partition_fn=_partition,
            decompositions=_DECOMPOSITIONS,
        )

    def __call__(self, state: Sequence[torch.Tensor], tensors: Sequence[torch.Tensor]) -> Any:
        """Run the graphs on the current ``state`` (parameters, buffers) and input ``tensors``."""
        if self._rebuild_output is None:
            start, compiled_before = time.perf_counter(), self._compile_seconds
            with _capture_context(self._module):
                flat = self._function(*state, *tensors)
            self._on_build(time.perf_counter() - start - (self._compile_seconds - compiled_before))
        else:
            flat = self._function(*state, *tensors)
        assert self._rebuild_output is not None
        return self._rebuild_output(flat)

    def _functional_forward(self, *flat: torch.Tensor) -> list[torch.Tensor]:
        count = len(self._state_names)
        state = dict(zip(self._state_names, flat[:count]))
        args, kwargs = self._inputs.rebuild(flat[count:])
        output = torch.func.functional_call(self._module, state, args, kwargs)
        flat_output = FlatOutputs.from_output(output)
        self._rebuild_output = flat_output.rebuild
        return flat_output.tensors

    def _compiler(self, kind: str) -> AOTDispatchCompiler:
        def compile_graph(gm: torch.fx.GraphModule, example_inputs: Sequence[Any]) -> GraphSession:
            name = kind if not self._tag else f"{kind}_{self._tag}"
            start = time.perf_counter()
            owner = type(self._module).__name__
            with torch.random.fork_rng(devices=_rng_devices(self._device)):
                try:
                    graph = export_graph(gm, example_inputs, name, verbose=self._debug.log_level.ort_severity == 0)
                    session = GraphSession(graph, self._device, self._settings, self._debug)
                except (ExportError, SessionError) as err:
                    raise type(err)(f"{owner}: {err}") from err
            seconds = time.perf_counter() - start
            log.info(
                "built %s graph of %s in %.2fs (providers %s)",
                name,
                owner,
                seconds,
                session.providers,
            )
            self.sessions[kind] = session
            self._compile_seconds += seconds
            self._on_build(seconds)
            return session

        return compile_graph


def _partition(
    joint: torch.fx.GraphModule, joint_inputs: Sequence[Any], **kwargs: Any
) -> tuple[torch.fx.GraphModule, torch.fx.GraphModule]:
    return min_cut_rematerialization_partition(optimize_joint_graph(joint), joint_inputs, **kwargs)


def _rng_devices(device: torch.device) -> list[int]:
    return [device.index or 0] if device.type == "cuda" else []


@contextlib.contextmanager
def _capture_context(module: torch.nn.Module) -> Iterator[None]:
    """Settings that make tracing produce ONNX-exportable graphs.

    * SDPA takes its math path, so its backward is built from plain ops (the fused kernels' backward
      ops have no ONNX translation);
    * the ``nn.TransformerEncoder`` fast path (a fused inference kernel) is off;
    * each traced node records the submodule it came from, for export error messages.
    """
    names = {id(m): (name or type(module).__name__, type(m)) for name, m in module.named_modules()}
    stack: list[tuple[str, type]] = []

    def enter(mod: torch.nn.Module, _args: Any) -> None:
        if id(mod) in names:
            stack.append(names[id(mod)])
            fx_traceback.get_current_meta()["nn_module_stack"] = {path: (path, t) for path, t in stack}

    def leave(mod: torch.nn.Module, _args: Any, _output: Any) -> None:
        if id(mod) in names and stack:
            stack.pop()
            fx_traceback.get_current_meta()["nn_module_stack"] = {path: (path, t) for path, t in stack}

    fastpath = torch.backends.mha.get_fastpath_enabled()
    with contextlib.ExitStack() as stack_ctx:
        stack_ctx.enter_context(sdpa_kernel(SDPBackend.MATH))
        stack_ctx.enter_context(fx_traceback.preserve_node_meta())
        pre = torch.nn.modules.module.register_module_forward_pre_hook(enter)
        post = torch.nn.modules.module.register_module_forward_hook(leave)
        stack_ctx.callback(pre.remove)
        stack_ctx.callback(post.remove)
        torch.backends.mha.set_fastpath_enabled(False)
        stack_ctx.callback(torch.backends.mha.set_fastpath_enabled, fastpath)
        yield
