"""Run an exported graph in an ``onnxruntime.InferenceSession`` directly on PyTorch memory.

Inputs are bound to the data pointers of PyTorch tensors; outputs are bound to new PyTorch tensors on CUDA
(where ONNX Runtime runs on PyTorch's stream, so no synchronisation is needed either) and, on CPU,
written into ONNX Runtime's arena and handed to PyTorch through DLPack. Nothing is copied on the way in or out.

The binding goes through ONNX Runtime's pybind11 layer (see :mod:`~lightning_ort.engine.ort_internals`), the
one its own ``IOBinding`` and ``InferenceSession`` wrap. See the performance page for the per-call cost.
"""

from __future__ import annotations

import functools
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import onnx
import onnxruntime as ort
import sympy
import torch

from lightning_ort.engine.fx.dynamic import evaluate
from lightning_ort.engine.fx.layout import OutputSpec
from lightning_ort.engine.once import Once
from lightning_ort.engine.onnx.constant_outputs import ConstantSplit, split_constant_outputs
from lightning_ort.engine.onnx.export import ONNX_ELEMENT_TYPES, ExportedGraph, save_model
from lightning_ort.engine.onnx.passes import DISABLED_ORT_OPTIMIZERS, multiply_through_mkl
from lightning_ort.engine.ort_internals import (
    CDevice,
    OrtValueVector,
    SessionIOBinding,
    c_device,
    failing_nodes,
    pybind_session,
)
from lightning_ort.engine.runtime.cpu_kernels import register_kernels
from lightning_ort.engine.runtime.cpu_matmul import use_mkl
from lightning_ort.engine.runtime.cuda_graph import CapturedGraphs, capture_provider_options, capture_refusal
from lightning_ort.engine.runtime.cuda_memory import cuda_provider_options, cuda_session_config
from lightning_ort.engine.runtime.openmp import release_openmp_threads
from lightning_ort.engine.torch_internals import unset_fake_temporarily
from lightning_ort.errors import CudaGraphWarning, SessionError, first_line, warn
from lightning_ort.logs import get_logger
from lightning_ort.options import DebugOptions, LogLevel, SessionSettings

log = get_logger(__name__)

RELEASE_MIN_RUN_S = 1e-3
"""A graph whose last run took less than this (seconds) runs without releasing PyTorch's OpenMP threads first.

Releasing ends the threads, and PyTorch's next parallel operator starts them again, which costs more than a
sub-millisecond run loses to threads still spinning beside it. A graph's first run always releases.
"""


CUDA_STREAM_LEGACY = 1
"""``cudaStreamLegacy``: the handle that names CUDA's legacy default stream, which PyTorch's default stream is
(handle 0 there). ONNX Runtime reads a ``user_compute_stream`` of 0 as none given: it then runs on a stream of
its own and synchronises that stream at the end of every run. Given this handle, it runs on PyTorch's default
stream, ordered with PyTorch's kernels, and nothing waits for the GPU."""


def stream_handle(stream: Any) -> int:
    """The ``user_compute_stream`` that makes ONNX Runtime run on ``stream``, a ``torch.cuda.Stream``.

    Example:
        >>> from types import SimpleNamespace
        >>> stream_handle(SimpleNamespace(cuda_stream=0)), stream_handle(SimpleNamespace(cuda_stream=94021))
        (1, 94021)
    """
    return int(stream.cuda_stream) or CUDA_STREAM_LEGACY


def allocates_from_pytorch(cuda_options: dict[str, str]) -> bool:
    """Whether CUDA provider options hand ONNX Runtime an external allocator (``cuda_memory="torch"``).

    ONNX Runtime's CUDA provider then runs on CUDA's legacy default stream, which is PyTorch's default stream,
    and refuses a ``user_compute_stream`` beside it (it falls back to the CPU provider).

    Example:
        >>> allocates_from_pytorch({"gpu_external_alloc": "1", "gpu_external_free": "2"})
        True
    """
    return "gpu_external_alloc" in cuda_options


def stream_options(cuda_options: dict[str, str], stream: Any) -> dict[str, str]:
    """The ``user_compute_stream`` option that makes a session with ``cuda_options`` run on ``stream``; none
    where the options allocate from PyTorch (:func:`allocates_from_pytorch`: ``stream`` is then PyTorch's
    default stream, the one ONNX Runtime takes by itself).

    Example:
        >>> from types import SimpleNamespace
        >>> stream_options({}, SimpleNamespace(cuda_stream=0))
        {'user_compute_stream': '1'}
        >>> stream_options({"gpu_external_alloc": "1", "gpu_external_free": "2"}, SimpleNamespace(cuda_stream=0))
        {}
    """
    return {} if allocates_from_pytorch(cuda_options) else {"user_compute_stream": str(stream_handle(stream))}


def providers_for(
    device: torch.device, settings: SessionSettings, capture: torch.cuda.Stream | None = None
) -> list[str | tuple[str, dict[str, str]]]:
    """Execution providers for a graph whose tensors live on ``device``; on CUDA, ``capture`` is the stream of a
    session whose graph is captured as a CUDA graph (see :mod:`~lightning_ort.engine.runtime.cuda_graph`)."""
    if device.type == "cuda":
        memory = capture_provider_options() if capture is not None else cuda_provider_options(settings.cuda_memory)
        options = {
            "device_id": str(_device_index(device)),
            **stream_options(memory, _run_stream(device, capture, memory)),
            "use_tf32": "1" if torch_allows_tf32_matmul() else "0",
            **memory,
        }
        names = list(settings.providers) if settings.providers else ["CUDAExecutionProvider", "CPUExecutionProvider"]
        if "CUDAExecutionProvider" not in ort.get_available_providers():
            raise SessionError(
                "The model's tensors are on CUDA but this onnxruntime has no CUDAExecutionProvider; "
                "install onnxruntime-gpu (and not the CPU-only onnxruntime beside it)."
            )
        return [(name, options) if name == "CUDAExecutionProvider" else name for name in names]
    if device.type != "cpu":
        raise SessionError(
            f"ORTModule runs on CPU and CUDA tensors, got tensors on {device}: move the model and its inputs to "
            "the CPU or a CUDA device."
        )
    return list(settings.providers) if settings.providers else ["CPUExecutionProvider"]


def _device_index(device: torch.device) -> int:
    return device.index if device.index is not None else torch.cuda.current_device()


def torch_allows_tf32_matmul() -> bool:
    """Whether PyTorch lets float32 matrix products on CUDA use TF32 (``torch.set_float32_matmul_precision``).

    ONNX Runtime's CUDA provider uses TF32 unless told otherwise; PyTorch does not by default. The sessions
    follow PyTorch's setting when they are created, so that ORTModule computes what eager PyTorch computes.

    Example:
        >>> torch_allows_tf32_matmul() == (torch.get_float32_matmul_precision() != "highest")
        True
    """
    return torch.get_float32_matmul_precision() != "highest"


def _names(providers: list[str | tuple[str, dict[str, str]]]) -> list[str]:
    return [p if isinstance(p, str) else p[0] for p in providers]


@Once
def _register_shared_cpu_arena() -> None:
    """Give every CPU session of this process one memory arena (once per process).

    Each session otherwise keeps its own arena at its own peak, so the forward and backward graphs' arenas
    together hold memory that one shared arena does not need. The arena grows by what is asked, not by
    doubling its last extension.
    """
    cpu = ort.OrtMemoryInfo("Cpu", ort.OrtAllocatorType.ORT_ARENA_ALLOCATOR, 0, ort.OrtMemType.DEFAULT)
    ort.create_and_register_allocator(cpu, ort.OrtArenaCfg(0, _ARENA_EXTEND_SAME_AS_REQUESTED, -1, -1))


# OrtArenaCfg's arena_extend_strategy: 0 = kNextPowerOfTwo (ONNX Runtime's default), 1 = kSameAsRequested.
_ARENA_EXTEND_SAME_AS_REQUESTED = 1


class GraphSession:
    """One exported graph in one ``InferenceSession``, called like an AOTAutograd compiled function.

    Args:
        graph: the exported graph.
        device: where the graph's inputs and outputs live.
        settings: session creation settings.
        debug: where to save the ORT-optimised model and the profile, and the ORT log severity.
    """

    def __init__(
        self, graph: ExportedGraph, device: torch.device, settings: SessionSettings, debug: DebugOptions
    ) -> None:
        # AOTAutograd's boxed convention; an instance attribute, so that TorchDynamo's wrapper around backward
        # graphs copies it (functools.wraps).
        self._boxed_call = True
        self._graph = graph
        self._device = device
        self._release_torch_threads = device.type == "cpu" and settings.release_torch_threads
        options = ort.SessionOptions()
        options.graph_optimization_level = settings.graph_optimization_level
        options.intra_op_num_threads = settings.intra_op_num_threads
        options.add_session_config_entry("session.intra_op.allow_spinning", "1" if settings.allow_spinning else "0")
        options.add_session_config_entry("session.force_spinning_stop", "1")
        if device.type == "cpu":
            _register_shared_cpu_arena()
            options.add_session_config_entry("session.use_env_allocators", "1")
            # A memory pattern reserves one block per graph for all its intermediates, planned apart from the
            # other graphs' blocks; without it the shared arena reuses freed space across the forward and
            # backward graphs.
            options.enable_mem_pattern = False
        options.log_severity_level = LogLevel(debug.log_level).ort_severity
        if debug.save_onnx:
            save_model(graph.model, debug.onnx_file(graph.name))
            options.optimized_model_filepath = str(debug.onnx_file(f"{graph.name}_optimized"))
        if debug.profile:
            options.enable_profiling = True
            options.profile_file_prefix = str(debug.profile_prefix(graph.name))
        self._profiling = debug.profile
        model, self._constants = _split_constants(graph, device)
        if device.type == "cpu":
            model = _cpu_products(model, settings)
        self._output_specs = [spec for i, spec in enumerate(graph.outputs) if i not in self._constants]
        captures = _captures(graph, device, settings)
        capture = torch.cuda.Stream(device) if captures and device.type == "cuda" else None
        providers = providers_for(device, settings, capture)
        register_kernels(options, model)
        if captures:
            try:
                self._session = self._create(model, options, providers)
            except Exception as err:
                _warn_uncaptured(graph, f"ONNX Runtime refused it ({first_line(err)})")
                captures, capture = False, None
                providers = providers_for(device, settings)
        try:
            if not captures:
                if device.type == "cuda":
                    for key, value in cuda_session_config(settings.cuda_memory, _device_index(device)).items():
                        options.add_session_config_entry(key, value)
                self._session = self._create(model, options, providers)
        except Exception as err:
            raise SessionError(
                f"ONNX Runtime could not load the {graph.name} graph with providers {_names(providers)}: {err}\n"
                "If it names an op without an implementation, that op/dtype has no kernel on this provider "
                "(e.g. float64 Erf on CPU): use float32, another provider, keep that submodule out of ORTModule, "
                "or pass fallback='auto' to run such ops in PyTorch.",
                failing_nodes(err),
            ) from err
        self._run_session = pybind_session(self._session)
        self._input_names = [i.name for i in self._session.get_inputs()]
        self._output_names = [o.name for o in self._session.get_outputs()]
        self._stream = _session_stream(providers, device, capture)
        self._unsynchronized = ort.RunOptions()
        self._unsynchronized.add_run_config_entry("disable_synchronize_execution_providers", "1")
        self._synchronized: ort.RunOptions | None = None
        self._captured = None
        if captures:
            self._captured = CapturedGraphs(
                self._run_session, self._input_names, self._output_names, self._output_specs, device, capture, _bind
            )
            # A run beside the captured graphs (more parameter sets than they hold) must not count towards the
            # capture of graph 0, the default id.
            self._synchronized = ort.RunOptions()
            for options_ in (self._unsynchronized, self._synchronized):
                options_.add_run_config_entry("gpu_graph_id", "-1")
        self.runs = 0
        self._last_run_s = float("inf")

    @staticmethod
    def _create(
        model: onnx.ModelProto, options: ort.SessionOptions, providers: list[str | tuple[str, dict[str, str]]]
    ) -> ort.InferenceSession:
        session = ort.InferenceSession(
            model.SerializeToString(),
            sess_options=options,
            providers=providers,
            disabled_optimizers=list(DISABLED_ORT_OPTIMIZERS),
        )
        cuda_options = _cuda_options(providers)
        if cuda_options is not None and "CUDAExecutionProvider" not in session.get_providers():
            # onnxruntime.InferenceSession prints why the provider failed, then retries with the CPU provider.
            raise RuntimeError(
                f"ONNX Runtime could not create its CUDA execution provider with the options {cuda_options} and "
                "fell back to the CPU provider; its 'EP Error' message above says why"
            )
        return session

    @property
    def captured(self) -> bool:
        """Whether the graph is replayed as a CUDA graph (``SessionSettings(cuda_graph=True)`` on CUDA, and
        nothing in it kept it out)."""
        return self._captured is not None

    @property
    def name(self) -> str:
        """The graph's name, as in saved file names (``"forward"``, ``"backward_1"``...)."""
        return self._graph.name

    @property
    def providers(self) -> list[str]:
        """Execution providers the session actually uses."""
        return list(self._session.get_providers())

    def end_profiling(self) -> list[Path]:
        """Stop profiling this session and write its profile; the file, or nothing if it was not profiling."""
        if not self._profiling:
            return []
        self._profiling = False
        return [Path(self._session.end_profiling())]

    def __call__(self, args: list[Any]) -> list[Any]:
        """Run the graph on ``args`` (AOTAutograd's boxed convention: the list may be cleared)."""
        graph = self._graph
        if graph.dropped_inputs:
            inputs = [_contiguous(t) for i, t in enumerate(args) if i not in graph.dropped_inputs]
        else:
            inputs = [_contiguous(t) for t in args]
        if graph.carried_sizes:
            carried = (*(int(args[i]) for i in graph.carried_sizes), 0)
            inputs.append(torch.empty(carried, dtype=torch.uint8, device=self._device))
        args.clear()
        env = {symbol: inputs[index].shape[dim] for symbol, (index, dim) in graph.symbols.items()}
        inputs.extend(noise.draw(self._device, env) for noise in graph.noise)
        if self._captured is not None:
            replayed = self._replay(inputs)
            if replayed is not None:
                return graph.layout.place(self._with_constants(replayed), inputs, env)
        binding = SessionIOBinding(self._run_session)
        for name, tensor in zip(self._input_names, inputs):
            _bind(binding.bind_input, name, tensor)
        outputs = self._bind_outputs(binding, env)
        if self._release_torch_threads and self._last_run_s >= RELEASE_MIN_RUN_S:
            release_openmp_threads()
        start = time.perf_counter()
        try:
            self._run(binding)
        except Exception as err:
            raise SessionError(
                f"ONNX Runtime failed while running the {self.name} graph: {err}\n"
                "Nothing was written to the parameters, their gradients or the optimizer state by this call: "
                "save a checkpoint or retry the step. If it repeats, run with DebugOptions(save_onnx=True, "
                "onnx_prefix='model', log_level=LogLevel.VERBOSE) and report the saved model."
            ) from err
        self._last_run_s = time.perf_counter() - start
        self.runs += 1
        if outputs is None:
            outputs = _from_onnx_runtime(binding.get_outputs(), self._output_specs)
        return graph.layout.place(self._with_constants(outputs), inputs, env)

    def _with_constants(self, outputs: list[torch.Tensor]) -> list[torch.Tensor]:
        """``outputs`` with the graph's input-independent outputs put back in their places, each call's a copy of
        its own (autograd may accumulate into a gradient in place)."""
        if not self._constants:
            return outputs
        outputs = list(outputs)
        for position, value in self._constants.items():
            outputs.insert(position, value.clone())
        return outputs

    def _replay(self, inputs: list[torch.Tensor]) -> list[torch.Tensor] | None:
        """Run the captured graph for ``inputs`` (see :class:`CapturedGraphs`); ``None`` when it holds no room
        for their parameters."""
        assert self._captured is not None
        try:
            outputs = self._captured.run(inputs)
        except Exception as err:
            raise SessionError(
                f"ONNX Runtime failed while running the captured CUDA graph of the {self.name} graph: {err}\n"
                "Run without SessionSettings(cuda_graph=True) to train on; please report it with "
                "DebugOptions(save_onnx=True) output attached."
            ) from err
        if outputs is not None:
            self.runs += 1
        return outputs

    def _run(self, binding: SessionIOBinding) -> None:
        self._run_session.run_with_iobinding(binding, self._run_options())

    def _run_options(self) -> ort.RunOptions | None:
        """Run without waiting for the GPU when PyTorch's current stream is the one ONNX Runtime runs on.

        ONNX Runtime otherwise synchronises its CUDA stream at the end of every run, so the CPU could not queue
        the next kernels while the GPU works. On the same stream, PyTorch's later kernels (the loss, the
        optimizer) and its caching allocator's reuse of the inputs' memory are ordered after the graph's
        kernels, as they are after its own. Under another stream (``torch.cuda.stream(...)``), that stream's
        work so far is waited for first and the run ends synchronised, so its outputs are complete there too.
        """
        if self._stream is None:
            return None
        current = torch.cuda.current_stream(self._device)
        if current.cuda_stream == self._stream.cuda_stream:
            return self._unsynchronized
        self._stream.wait_stream(current)
        return self._synchronized

    def _bind_outputs(self, binding: SessionIOBinding, env: dict[sympy.Symbol, int]) -> list[torch.Tensor] | None:
        """Bind the outputs: to new PyTorch tensors (returned) on CUDA; to ONNX Runtime's arena on CPU (``None``:
        the run's outputs are handed to PyTorch afterwards through DLPack, still without a copy).

        On CPU, outputs written into fresh PyTorch (``malloc``) memory made some kernels (convolutions, large
        backward products) several times slower, and the arena reuses the space of freed outputs across runs,
        which lowers the peak. CUDA keeps PyTorch's caching allocator, whose stream-ordered reuse the outputs'
        consumers rely on.
        """
        if self._device.type == "cpu":
            cpu = _ort_device(self._device)
            for name in self._output_names:
                binding.bind_output(name, cpu)
            return None
        outputs = [
            torch.empty(tuple(evaluate(size, env) for size in spec.shape), dtype=spec.dtype, device=self._device)
            for spec in self._output_specs
        ]
        for name, tensor in zip(self._output_names, outputs):
            _bind(binding.bind_output, name, tensor)
        return outputs


def _split_constants(graph: ExportedGraph, device: torch.device) -> tuple[onnx.ModelProto, dict[int, torch.Tensor]]:
    """The model the session runs: ``graph``'s, less the outputs that depend on no input (see
    :mod:`~lightning_ort.engine.onnx.constant_outputs`), which are computed here once, on the CPU provider, and
    returned by position (ascending) on ``device``. Where they cannot be computed apart, the model is whole."""
    split = split_constant_outputs(graph.model)
    if split is None:
        return graph.model, {}
    try:  # sessions are made while TorchDynamo compiles, under its fake tensor mode
        with unset_fake_temporarily():
            constants = _compute_constants(split, [graph.outputs[position] for position in split.positions], device)
    except Exception as err:
        log.debug("the %s graph keeps its constant outputs: %s", graph.name, first_line(err))
        return graph.model, {}
    log.debug("the %s graph's outputs %s are constants, computed once", graph.name, split.positions)
    return split.graph, constants


def _cpu_products(model: onnx.ModelProto, settings: SessionSettings) -> onnx.ModelProto:
    """``model``, or a copy whose matrix products run through MKL where ``settings.cpu_matmul`` chooses it (see
    :mod:`~lightning_ort.engine.runtime.cpu_matmul`); the exported graph itself is never changed."""
    threads = settings.intra_op_num_threads or torch.get_num_threads()
    if not use_mkl(settings.cpu_matmul, threads):
        return model
    copy = onnx.ModelProto()
    copy.CopyFrom(model)
    return copy if multiply_through_mkl(copy, threads) else model


def _compute_constants(split: ConstantSplit, specs: list[OutputSpec], device: torch.device) -> dict[int, torch.Tensor]:
    """The values of ``split``'s constant outputs by position, computed on the CPU provider, on ``device``."""
    session = ort.InferenceSession(split.constants.SerializeToString(), providers=["CPUExecutionProvider"])
    run_session = pybind_session(session)
    binding = SessionIOBinding(run_session)
    cpu = _ort_device(torch.device("cpu"))
    for output in session.get_outputs():
        binding.bind_output(output.name, cpu)
    run_session.run_with_iobinding(binding, None)
    values = _from_onnx_runtime(binding.get_outputs(), specs)
    return {position: value.to(device, copy=True) for position, value in zip(split.positions, values)}


def _captures(graph: ExportedGraph, device: torch.device, settings: SessionSettings) -> bool:
    """Whether ``graph``'s session replays it as CUDA graphs: asked for, on CUDA, and not refused (said once,
    with the reason: see :func:`~lightning_ort.engine.runtime.cuda_graph.capture_refusal`)."""
    if device.type != "cuda" or not settings.cuda_graph:
        return False
    refusal = capture_refusal(graph)
    if refusal is not None:
        _warn_uncaptured(graph, refusal)
        return False
    return True


def _warn_uncaptured(graph: ExportedGraph, reason: str) -> None:
    warn(f"lightning_ort: the {graph.name} graph runs without CUDA graph capture: {reason}.", CudaGraphWarning)


def _session_stream(
    providers: list[str | tuple[str, dict[str, str]]], device: torch.device, capture: torch.cuda.Stream | None
) -> torch.cuda.Stream | None:
    """The CUDA stream the session runs on (:func:`_run_stream`, the one :func:`providers_for` gave ONNX
    Runtime); ``None`` without the CUDA provider."""
    cuda_options = _cuda_options(providers)
    if device.type != "cuda" or cuda_options is None:
        return None
    return _run_stream(device, capture, cuda_options)


def _cuda_options(providers: list[str | tuple[str, dict[str, str]]]) -> dict[str, str] | None:
    """The options ``providers`` give the CUDA execution provider; ``None`` where it is not among them.

    Example:
        >>> _cuda_options([("CUDAExecutionProvider", {"device_id": "0"}), "CPUExecutionProvider"])
        {'device_id': '0'}
    """
    named = [p if isinstance(p, tuple) else (p, {}) for p in providers]
    return next((options for name, options in named if name == "CUDAExecutionProvider"), None)


def _run_stream(
    device: torch.device, capture: torch.cuda.Stream | None, cuda_options: dict[str, str]
) -> torch.cuda.Stream:
    """``capture`` for a session whose graph is captured; PyTorch's default stream on ``device`` for one that
    allocates from PyTorch (ONNX Runtime runs those there and takes no other); else PyTorch's current stream."""
    if capture is not None:
        return capture
    if allocates_from_pytorch(cuda_options):
        return torch.cuda.default_stream(device)
    return torch.cuda.current_stream(device)


def _from_onnx_runtime(values: OrtValueVector, specs: Sequence[OutputSpec]) -> list[torch.Tensor]:
    """A run's outputs as PyTorch tensors sharing their memory (DLPack carries booleans as uint8)."""
    tensors = list(values.to_dlpacks(torch.utils.dlpack.from_dlpack))
    for index, (tensor, spec) in enumerate(zip(tensors, specs)):
        if tensor.dtype == spec.dtype:
            continue
        if (tensor.dtype, spec.dtype) != (torch.uint8, torch.bool):
            raise SessionError(
                f"ONNX Runtime returned a {tensor.dtype} tensor as output {index}, where PyTorch's graph gives a "
                f"{spec.dtype} one. Run with DebugOptions(save_onnx=True, onnx_prefix='model') and report the "
                "saved model."
            )
        tensors[index] = tensor.view(torch.bool)
    return tensors


def _contiguous(tensor: torch.Tensor) -> torch.Tensor:
    return tensor if tensor.is_contiguous() else tensor.contiguous()


@functools.cache
def _ort_device(device: torch.device) -> CDevice:
    """ONNX Runtime's description of the memory of tensors on ``device``, made once per device."""
    return c_device(device.type, device.index or 0)


def _bind(bind: Any, name: str, tensor: torch.Tensor) -> None:
    element_type = ONNX_ELEMENT_TYPES.get(tensor.dtype)
    if element_type is None:
        raise TypeError(f"ORTModule cannot pass a {tensor.dtype} tensor ({name}) to ONNX Runtime.")
    bind(name, _ort_device(tensor.device), element_type, tensor.shape, tensor.data_ptr())
