"""``ORTModule``: an ``nn.Module`` whose forward and backward run in ONNX Runtime."""

from __future__ import annotations

import functools
import inspect
import itertools
import os
import types
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import nn
from torch.distributed.fsdp import FSDPModule
from typing_extensions import override

from lightning_ort.deployment import DeployedModel, DynamicShapes, export_for_deployment
from lightning_ort.engine.capture.backend import (
    DynamoEvents,
    ModuleStatistics,
    ORTBackend,
    fast_path_modules,
    fast_path_off,
    keep_guards,
    tracing_settings,
)
from lightning_ort.engine.capture.blocks import (
    mark_blocks,
    marked_blocks,
    resolve_blocks,
    uncaptured_block,
    unmark_blocks,
)
from lightning_ort.engine.capture.build import BuildOptions
from lightning_ort.engine.runtime.disk_cache import DiskCache
from lightning_ort.engine.runtime.profiling import KernelProfile, read_profiles
from lightning_ort.engine.torch_internals import (
    GUARDS_FILTER_SAFELY,
    UncapturedHigherOrderOpError,
    maybe_mark_dynamic,
    uncaptured_reason,
)
from lightning_ort.errors import BlockError, FallbackWarning, ORTModuleError, first_line, user_frame, warn
from lightning_ort.logs import get_logger, model_log_level
from lightning_ort.options import (
    AttentionPath,
    BlockSpec,
    ConvWeightGrad,
    DebugOptions,
    Fallback,
    ModuleOptions,
    SessionSettings,
)

log = get_logger(__name__)

_SHARED_STATE = ("_parameters", "_buffers", "_modules", "_non_persistent_buffers_set")
_OWN_STATE = frozenset(
    {
        "_original_module",
        "_build_options",
        "_dynamic",
        "_dynamic_axes",
        "_blocks",
        "_fast_path_modules",
        "_calls",
        "_building_calls",
        "_called",
        "_backend",
        "_compiled",
        "forward",
    }
)
"""Attributes the wrapper keeps for itself; setting any other attribute sets it on the wrapped module."""


def _stays_with_the_wrapped(module: nn.Module, name: str) -> bool:
    """Whether method ``name`` of ``module`` stays bound to it rather than to its wrapper: ``generate`` of a Hugging
    Face model (a ``transformers`` ``GenerationMixin``). It looks its decoding methods up on ``type(self)``, and
    calls the model once per new token with a growing cache, a new shape each time, which eager PyTorch runs
    without building a graph per length.
    """
    return name == "generate" and any(
        cls.__name__ == "GenerationMixin" and cls.__module__.startswith("transformers.") for cls in type(module).__mro__
    )


class ORTModule(nn.Module):
    """Run ``module``'s forward and backward passes in ONNX Runtime; behave as ``module`` everywhere else.

    The module is compiled with ``torch.compile`` and an ONNX Runtime backend: TorchDynamo traces the forward
    into graphs, AOTAutograd turns each into forward and backward graphs, and each of those is exported to ONNX
    and loaded into an ``onnxruntime.InferenceSession`` with graph optimizations on. TorchDynamo's guards reuse
    the graphs while input shapes, dtypes, devices, Python constants, train/eval and grad mode stay what they
    were, and recompile (logging why at INFO level) when they change. ``loss.backward()`` runs the backward
    graph in ONNX Runtime and fills ``param.grad``. Under ``torch.no_grad()`` an inference graph without
    gradient work runs instead.

    The wrapper shares the wrapped module's parameters, buffers and submodules: ``state_dict()`` keys,
    ``parameters()`` and checkpoints are the same as without it. Wrap before ``DistributedDataParallel``.

    Ops that ONNX cannot express (custom ops, a few rare ATen ops) run in PyTorch between ONNX Runtime
    partitions of the same graph; Python that TorchDynamo cannot trace (a branch on a tensor's value, ``.item()``)
    is a graph break: it runs in PyTorch, and the graphs before and after it run in ONNX Runtime. Both warn once
    (:class:`~lightning_ort.FallbackWarning`) naming the ops, submodules or reason; ``fallback="raise"`` makes
    them errors. Side effects in ``forward`` (attributes cached on ``self``, counters) happen as in eager.

    Args:
        module: the model to run in ONNX Runtime.
        debug_options: saving ONNX files and log verbosity (see :class:`~lightning_ort.DebugOptions`).
        session_settings: execution providers, optimization level and threads of the sessions.
        fallback: ``"auto"`` (default) runs what ONNX cannot express, and code TorchDynamo cannot trace, in PyTorch
            with a warning; ``"raise"`` fails instead, naming the op and its submodule, or the file and line.
        cache_dir: a folder where exported graphs are saved; a later process training the same model with the
            same input shapes loads them instead of exporting again. ``None`` (default) keeps graphs in memory
            only. An unwritable folder is reported with a warning and training goes on without it.
        dynamic: input sizes captured as symbols, so one graph serves many shapes; passed to ``torch.compile``.
            ``None`` (default, automatic): the first shape gets its own graph; when a later call differs in some
            sizes (another sequence length, a ragged last batch), those dimensions become symbolic in the next
            graph, which then serves every size. ``True``: every dimension is symbolic from the first call.
            ``False``: one graph per input shape (ONNX Runtime optimizes for the exact sizes), up to TorchDynamo's
            recompile limit.
        blocks: block graphs: each block class's forward and backward are exported and loaded into ONNX Runtime
            once, and every instance of it runs those sessions on its own parameters, so the first step's cost
            stops growing with depth. ``None`` (default): one graph for the whole model. ``"auto"``: the classes
            of composite modules repeated within a container (``nn.ModuleList``, ``nn.Sequential``); a model
            without any is captured as one graph, logged at INFO level; on CUDA, blocks whose forward does less
            than 20 GFLOP of work are inlined (logged at INFO level), as each block graph's run costs host time
            that such a block's kernels do not hide. Or the block classes, or their names (``["GPT2Block"]``),
            kept whatever their work. The rest of the model runs in ONNX Runtime around the blocks. Not with
            ``dynamic=True`` (logged at INFO level); automatic dynamic shapes keep them.
        dynamic_axes: the axes of ``forward``'s tensor arguments that vary between calls, by parameter name
            (``{"input_ids": [0, 1], "attention_mask": [0, 1]}`` for batch and sequence). They are symbolic
            from the first call (where the model allows), so the first graph already serves every size: with
            padded batches of changing length, the first build is the only one, instead of a static graph first
            and a dynamic one when a second length comes. Block graphs stay. Not with ``dynamic=False``.
        attention: where ``F.scaled_dot_product_attention`` runs. ``"onnx"``: its math path in the ONNX
            Runtime graphs, the attention scores materialized and saved for the backward. ``"torch"``: SDPA and
            its backward stay single PyTorch ops between ONNX Runtime partitions, so PyTorch's fused kernels
            (flash, memory-efficient, cuDNN on CUDA) compute them without materializing the scores; they are
            not fallbacks (no warning, also under ``fallback="raise"``). ``"auto"`` (default): ``"torch"`` on
            CUDA, ``"onnx"`` on the CPU and under ``SessionSettings(cuda_graph=True)``
            (:func:`~lightning_ort.options.attention_on`). Attention inside ``nn.MultiheadAttention`` keeps its
            math path.
        conv_weight_grad: where the weight gradient of a convolution is computed. ONNX Runtime's public build has
            no convolution-gradient kernel, so the graphs build it from forward ops: the unfolded input (im2col)
            times the output gradient. ``"auto"`` (default): on CPU, a dense convolution whose kernel needs the
            unfolded input, on images of more than 16 positions, takes its weight gradient from a kernel: for 3x3
            layers with stride 1 or 2 and padding 1 (input channels a multiple of 8, output channels of 32, on
            AVX-512 CPUs) lightning_ort's, inside the backward graph, faster than oneDNN's; for the others
            PyTorch's own (oneDNN), about twice as fast there as the graph form, as one op after the ONNX Runtime
            backward graph, which hands it the output gradient. On CUDA every dense convolution takes cuDNN's
            kernel. Everything else (the input gradients, smaller CPU images, 1x1 and depthwise kernels) stays in
            the graphs. ``"onnx"``: every weight gradient in the graphs.
            ``"torch"``: every (non-transposed) convolution's weight gradient in PyTorch. Like ``attention``,
            these ops run by request: no warning, also under ``fallback="raise"``.

    Example:
        >>> model = ORTModule(nn.Linear(4, 2))
        >>> loss = model(torch.randn(3, 4)).sum()
        >>> loss.backward()
        >>> model.statistics.forward_runs, model.statistics.backward_runs
        (1, 1)
    """

    def __init__(
        self,
        module: nn.Module,
        debug_options: DebugOptions | None = None,
        session_settings: SessionSettings | None = None,
        fallback: Fallback = "auto",
        cache_dir: str | os.PathLike[str] | None = None,
        dynamic: bool | None = None,
        blocks: Sequence[BlockSpec] | str | None = None,
        dynamic_axes: Mapping[str, Sequence[int]] | None = None,
        attention: AttentionPath = "auto",
        conv_weight_grad: ConvWeightGrad = "auto",
    ) -> None:
        options = ModuleOptions.checked(
            debug_options=debug_options,
            session_settings=session_settings,
            fallback=fallback,
            cache_dir=cache_dir,
            dynamic=dynamic,
            blocks=blocks,
            dynamic_axes=dynamic_axes,
            attention=attention,
            conv_weight_grad=conv_weight_grad,
        )
        self._wrap(module, options)

    @classmethod
    def with_options(cls, module: nn.Module, *, options: ModuleOptions) -> ORTModule:
        """Wrap ``module`` with options checked already (:meth:`ModuleOptions.checked`), checking none again.

        The Lightning side checks its options once, when a strategy or ``ORTCallback`` is made, and wraps each
        network this way.

        Example:
            >>> options = ModuleOptions.checked(fallback="raise")
            >>> ORTModule.with_options(nn.Linear(4, 2), options=options).fallback
            'raise'
        """
        wrapped = cls.__new__(cls)
        wrapped._wrap(module, options)
        return wrapped

    def _wrap(self, module: nn.Module, options: ModuleOptions) -> None:
        """Wrap ``module``: what depends on it (its block classes, its ``forward``'s parameters) is resolved here.

        Raises:
            TypeError: ``module`` is not an ``nn.Module``.
            ORTModuleError: ``module`` is an ORTModule already, or a ``DistributedDataParallel``.
        """
        if not isinstance(module, nn.Module):
            raise TypeError(f"ORTModule wraps a torch.nn.Module, got {type(module).__name__}.")
        if isinstance(module, ORTModule):
            raise ORTModuleError("This module is already an ORTModule; wrap the original module only once.")
        if isinstance(module, (nn.parallel.DistributedDataParallel, nn.DataParallel)):
            raise ORTModuleError(
                f"ORTModule must wrap the model before {type(module).__name__} does: "
                "use DistributedDataParallel(ORTModule(model)). DataParallel is not supported."
            )
        axes = DynamicAxes.checked(module, options.dynamic_axes)
        block_classes = resolve_blocks(module, options.blocks)
        if options.dynamic is True and block_classes:
            # Every dimension and float symbolic from the start: TorchDynamo passes float attributes (a
            # LayerNorm's eps) into block regions in a form their subgraphs cannot read.
            log.info("%s: dynamic=True captures without block graphs", type(module).__name__)
            block_classes = []
        super().__init__()
        object.__setattr__(self, "_original_module", module)
        for name in _SHARED_STATE:
            self.__dict__[name] = module.__dict__[name]
        self.training = module.training
        self._build_options = BuildOptions(
            options.session_settings,
            options.debug_options,
            options.fallback,
            DiskCache(options.cache_dir) if options.cache_dir is not None else None,
            options.attention,
            options.conv_weight_grad,
            automatic_blocks=options.blocks == "auto",
        )
        self._dynamic = options.dynamic
        self._dynamic_axes = axes
        self._blocks = tuple(block_classes)
        self._fast_path_modules = fast_path_modules(module)
        mark_blocks(module, block_classes)
        self._calls = 0
        self._building_calls = 0
        self._called = False
        self._compile()
        self._expose_forward()

    @property
    def module(self) -> nn.Module:
        """The original module: its methods and attributes, running in PyTorch."""
        return self._original_module

    @property
    def debug_options(self) -> DebugOptions:
        return self._build_options.debug

    @property
    def session_settings(self) -> SessionSettings:
        return self._build_options.settings

    @property
    def fallback(self) -> Fallback:
        """``"auto"`` (ops ONNX Runtime cannot run go to PyTorch) or ``"raise"``."""
        return self._build_options.fallback

    @property
    def attention(self) -> AttentionPath:
        """Where ``F.scaled_dot_product_attention`` runs: ``"auto"`` (by the device), ``"onnx"`` (in the graphs)
        or ``"torch"``."""
        return self._build_options.attention

    @property
    def conv_weight_grad(self) -> ConvWeightGrad:
        """Where convolutions' weight gradients are computed: ``"auto"``, ``"onnx"`` or ``"torch"``."""
        return self._build_options.conv_weight_grad

    @property
    def dynamic(self) -> bool | None:
        """Symbolic input sizes: ``None`` automatic, ``True`` all dimensions, ``False`` one graph per shape."""
        return self._dynamic

    @property
    def dynamic_axes(self) -> dict[str, tuple[int, ...]]:
        """The axes of ``forward``'s arguments that are symbolic from the first call, by parameter name."""
        return dict(self._dynamic_axes.axes) if self._dynamic_axes is not None else {}

    @property
    def block_classes(self) -> tuple[type[nn.Module], ...]:
        """The block classes whose instances share block graphs (empty: one graph for the whole model)."""
        return self._blocks

    @property
    def cache_dir(self) -> Path | None:
        """The on-disk graph cache folder, or ``None`` when graphs are kept in memory only."""
        disk = self._build_options.disk_cache
        return disk.directory if disk is not None else None

    @property
    def statistics(self) -> ModuleStatistics:
        """Build time, graphs and graph breaks, calls that built graphs or reused them, and ONNX Runtime runs."""
        return self._backend.statistics((self._calls - self._building_calls, self._building_calls))

    @property
    def called(self) -> bool:
        """Whether ``forward`` has run since this ORTModule was made (or unpickled)."""
        return self._called

    @property
    def providers(self) -> list[str]:
        """Execution providers of the sessions built so far (empty before the first call)."""
        seen: list[str] = []
        for _, runner in self._backend.runners():
            seen.extend(p for p in runner.providers if p not in seen)
        return seen

    @property
    def graphs(self) -> list[str]:
        """Names of the graphs built so far, as in saved file names (``["forward", "backward", "inference"]``)."""
        return [runner.name for _, runner in self._backend.runners()]

    def end_profiling(self, skip_runs: int = 1) -> KernelProfile:
        """Stop profiling the graphs built so far, write their profiles and sum their kernel times by op type.

        Needs ``DebugOptions(profile=True)``. Graphs built after this call are profiled again until the next call.

        Args:
            skip_runs: runs to leave out of the sums at the start of each graph's profile (the first run allocates
                ONNX Runtime's memory and is slower); the files keep every run.

        Raises:
            ORTModuleError: profiling was not switched on.

        Example:
            >>> import tempfile
            >>> model = ORTModule(nn.Linear(4, 2), DebugOptions(profile=True, save_path=tempfile.mkdtemp()))
            >>> for _ in range(3):
            ...     model(torch.randn(3, 4)).sum().backward()
            >>> profile = model.end_profiling()
            >>> len(profile.files), profile.runs  # forward and backward graphs, two runs each after the first
            (2, 4)
        """
        if not self.debug_options.profile:
            raise ORTModuleError(
                "ORTModule.end_profiling() needs profiling switched on: "
                "ORTModule(module, DebugOptions(profile=True, save_path=...))."
            )
        files = [path for _, runner in self._backend.runners() for path in runner.end_profiling()]
        self._backend.retire_block_graphs()
        return read_profiles(files, skip_runs=skip_runs)

    def export(
        self,
        path: str | os.PathLike[str],
        *example_args: Any,
        dynamic_shapes: DynamicShapes = "batch",
        check: bool = True,
        external_data: bool | None = None,
        **example_kwargs: Any,
    ) -> DeployedModel:
        """Write the wrapped module's inference forward to ``path`` as a portable ONNX model, and check it.

        The file is for deployment, not the training graphs: weights are initializers (external data above 2 GB),
        inputs are named after ``forward``'s parameters and outputs after what it returns (``logits``,
        ``output_0``...), and no ONNX Runtime optimization specific to this machine is in it. The module is
        exported in eval mode (dropout off, batch norm's running statistics) and gets its mode back. With
        ``check`` the file is loaded into a fresh CPU ``onnxruntime.InferenceSession`` and compared with eager
        PyTorch on the example, with its symbolic axes doubled and at sizes 1 and 2; a file that fails is not
        written. See :func:`lightning_ort.deployment.export_for_deployment`.

        Args:
            path: the ``.onnx`` file to write; checked before any work.
            *example_args: example positional arguments of ``forward`` (one batch).
            dynamic_shapes: ``"batch"`` (default): axis 0 of the inputs that share the first input's batch size is
                symbolic where the model allows; ``None``: all axes static; or ``{parameter: {axis: name}}``
                (``{"input_ids": {0: "batch", 1: "sequence"}}``), or ``torch.export``'s format
                (``torch.export.Dim`` objects, tuples in argument order).
            check: compare the file's outputs with eager PyTorch's (raises :class:`~lightning_ort.ExportError`
                where they differ).
            external_data: weights in a separate file: ``None`` (default) above 2 GB.
            **example_kwargs: example keyword arguments of ``forward``.

        Raises:
            ORTModuleError: the module's parameters are sharded (FSDP); the ``"ort_fsdp"`` strategy's
                ``export_onnx`` gathers them first.
            ExportError: the export failed, an axis asked to be symbolic is narrowed by the model, or the file's
                outputs differ from eager PyTorch's.
            ValueError: ``path`` cannot be written.

        Example:
            >>> import tempfile
            >>> model = ORTModule(nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 2)))
            >>> model(torch.randn(3, 4)).sum().backward()
            >>> deployed = model.export(Path(tempfile.mkdtemp()) / "model.onnx", torch.randn(3, 4))
            >>> deployed.inputs, deployed.outputs
            ({'input': ('batch', 4)}, {'output': ('batch', 2)})
        """
        module = self._original_module
        if is_sharded(self):
            raise ORTModuleError(
                f"{type(module).__name__} is sharded by FSDP: ORTModule.export needs its full weights on one "
                "process. Use the 'ort_fsdp' strategy's export_onnx=..., which gathers them first."
            )
        with model_log_level(self._build_options.debug.python_level):
            return export_for_deployment(
                module, path, example_args, example_kwargs, dynamic_shapes, check=check, external_data=external_data
            )

    def clear_cache(self) -> None:
        """Drop every graph built so far; the next call compiles again. Statistics keep counting."""
        self._backend.reset()
        self._compile(self._backend)

    @override
    @torch.compiler.disable
    def forward(self, *args: Any, **kwargs: Any) -> Any:
        """Run the wrapped module's forward through TorchDynamo and ONNX Runtime (see the class docstring).

        Under an outer ``torch.compile`` this call is a graph break: the code around it is compiled, and the
        wrapped module is captured by ORTModule's own TorchDynamo, not traced again into the outer graph.
        """
        graphs = self._backend.build_log.counts.graphs
        self._called = True
        if self._dynamic_axes is not None:
            self._dynamic_axes.mark(args, kwargs)
        try:
            with (
                model_log_level(self._build_options.debug.python_level),
                tracing_settings(),
                fast_path_off(self._fast_path_modules),
                DynamoEvents(self._backend, type(self._original_module).__name__, self.fallback),
            ):
                output = self._compiled(self._original_module, *args, **kwargs)
        except UncapturedHigherOrderOpError as error:
            self._drop_uncaptured_block(error)
            return self.forward(*args, **kwargs)
        if self._backend.build_log.counts.graphs:  # with no graph yet, a call is neither a cache hit nor a miss
            self._calls += 1
        if self._backend.build_log.counts.graphs != graphs:
            self._building_calls += 1
        return output

    def _drop_uncaptured_block(self, error: UncapturedHigherOrderOpError) -> None:
        """Capture the block class TorchDynamo could not capture whole with the model's graph from now on.

        A graph break inside a block's ``forward`` cannot be a block graph. Under ``fallback="raise"`` or when
        FSDP shards the block (its parameters are gathered around the block's own graph) this is an error.

        Raises:
            BlockError: the block must be a block graph, or ``error`` did not come from a marked block.
        """
        owner = type(self._original_module).__name__
        cls = uncaptured_block(error, self._blocks)
        if cls is None:
            raise error
        marked = marked_blocks(self._original_module)
        reason = uncaptured_reason(error)
        where = f"{user_frame(error)}: {first_line(reason)}"
        instances = {
            name: module
            for name, module in self._original_module.named_modules()
            if isinstance(module, cls) and module in marked
        }
        path = next(iter(instances), "?")
        if self.fallback == "raise" or any(isinstance(module, FSDPModule) for module in instances.values()):
            raise BlockError(
                f"{owner}: block {cls.__name__} (`{path}`) cannot be captured as one graph: TorchDynamo stops at "
                f"{where}. Remove that graph break from {cls.__name__}.forward, or name the other block classes "
                f"in blocks=[...] (blocks=None for none)."
            ) from error
        unmark_blocks(self._original_module, [cls])
        self._blocks = tuple(block for block in self._blocks if block is not cls)
        warn(
            f"lightning_ort: {owner}: block {cls.__name__} (`{path}`) is captured with the model's graphs, not as "
            f"a block graph of its own: TorchDynamo stops at {where}. Remove that graph break from "
            f"{cls.__name__}.forward to share one graph between its instances.",
            FallbackWarning,
        )

    def _expose_forward(self) -> None:
        """Give this instance a ``forward`` that carries the wrapped module's signature and docstring.

        Tools read ``inspect.signature(model.forward)``: Hugging Face's ``Trainer`` drops the dataset columns
        that ``forward`` does not name, Lightning checks which arguments a step takes.
        """
        forward = functools.partial(ORTModule.forward, self)
        functools.update_wrapper(forward, self._original_module.forward)
        self.__dict__["forward"] = forward

    def _compile(self, backend: ORTBackend | None = None) -> None:
        """Compile an entry point of this ORTModule's own with ``backend`` (a new one if ``None``).

        TorchDynamo keeps compiled graphs and counts recompilations per code object, and remembers which sizes
        changed (automatic dynamic shapes) per function name and line. An entry point with a code object and a
        name of its own keeps another ORTModule's graphs, recompilations and input sizes from affecting this one.
        """
        if backend is None:
            backend = ORTBackend(self._build_options, type(self._original_module).__name__)
        code = _call_module.__code__
        name = f"{code.co_name}_{next(_ENTRY_POINTS)}"
        entry = types.FunctionType(code.replace(co_name=name), _call_module.__globals__, name)
        self.__dict__["_backend"] = backend
        self.__dict__["_compiled"] = torch.compile(
            entry,
            backend=backend,
            dynamic=self._dynamic,
            fullgraph=self.fallback == "raise",
            options={"guard_filter_fn": keep_guards} if GUARDS_FILTER_SAFELY else None,
        )

    @override
    def train(self, mode: bool = True) -> ORTModule:
        self._original_module.train(mode)
        self.training = mode
        return self

    @override
    def apply(self, fn: Callable[[nn.Module], None]) -> ORTModule:
        self._original_module.apply(fn)
        return self

    @override
    def state_dict(self, *args: Any, **kwargs: Any) -> Any:
        return self._original_module.state_dict(*args, **kwargs)

    @override
    def load_state_dict(self, state_dict: Mapping[str, Any], strict: bool = True, assign: bool = False) -> Any:
        return self._original_module.load_state_dict(state_dict, strict=strict, assign=assign)

    @override
    def _load_from_state_dict(self, *args: Any, **kwargs: Any) -> None:
        self._original_module._load_from_state_dict(*args, **kwargs)

    @override
    def add_module(self, name: str, module: nn.Module | None) -> None:
        raise ORTModuleError(
            f"ORTModule does not take new submodules (add_module({name!r}, ...)): its graphs were traced from the "
            "wrapped module. Add the submodule to the original module before wrapping it."
        )

    @override
    def __setattr__(self, name: str, value: Any) -> None:
        """Set ``name`` on the wrapped module (where ``forward`` reads it), except the wrapper's own state.

        TorchDynamo guards on the attributes ``forward`` read, so a changed value takes effect on the next call.
        """
        if isinstance(value, nn.Module):
            self.add_module(name, value)
        original = self.__dict__.get("_original_module")
        own = original is None or self._keeps(name)
        if own:
            super().__setattr__(name, value)
        if original is not None and (not own or name == "training"):
            setattr(original, name, value)

    @override
    def __delattr__(self, name: str) -> None:
        if "_original_module" not in self.__dict__ or self._keeps(name):
            super().__delattr__(name)
        else:
            delattr(self._original_module, name)

    def _keeps(self, name: str) -> bool:
        """Whether attribute ``name`` belongs to the wrapper (its own state, ``nn.Module``'s, dunders)."""
        return name in _OWN_STATE or name in self.__dict__ or name.startswith("__")

    @override
    def __getattribute__(self, name: str) -> Any:
        """A submodule, parameter or buffer of the wrapped module comes before the wrapper's property of that name.

        ``state_dict()`` keys and ``named_parameters()`` paths are the wrapped module's: tools that walk them
        with ``getattr`` (``torch.distributed.checkpoint``, FSDP) must reach the same objects (a network whose
        layers are ``self.layers`` keeps them under ``ORTModule.layers``, and one whose layers are
        ``self.module`` under ``ORTModule.module``).
        """
        if name in _PROPERTIES:
            state = object.__getattribute__(self, "__dict__")
            for kind in _SHARED_STATE[:3]:
                table = state.get(kind)
                if table is not None and name in table:
                    return table[name]
        return super().__getattribute__(name)

    @override
    def __getattr__(self, name: str) -> Any:
        """The wrapped module's attribute; its own methods come bound to the wrapper.

        A method of the model's class (not of ``nn.Module``) that calls ``self(...)`` then runs through ONNX
        Runtime, as it did under onnxruntime-training's ORTModule. Hugging Face's ``generate`` stays bound to the
        wrapped model and runs in PyTorch (:func:`_stays_with_the_wrapped`).
        """
        try:
            return super().__getattr__(name)
        except AttributeError:
            original = self.__dict__.get("_original_module")
            if original is None:
                raise
            value = getattr(original, name)
            if _stays_with_the_wrapped(original, name):
                return value
            if isinstance(value, types.MethodType) and value.__self__ is original and not hasattr(nn.Module, name):
                return types.MethodType(value.__func__, self)
            return value

    @override
    def __getstate__(self) -> dict[str, Any]:
        state = self.__dict__.copy()
        state["_backend"] = state["_compiled"] = None
        del state["forward"]
        return state

    @override
    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state)
        self.__dict__["_calls"] = self.__dict__["_building_calls"] = 0
        self.__dict__["_called"] = False
        self._compile()
        self._expose_forward()

    @override
    def __repr__(self) -> str:
        return f"ORTModule({self._original_module!r})"


@dataclass(frozen=True)
class DynamicAxes:
    """The axes of ``forward``'s tensor arguments that are marked symbolic before each call, by parameter name.

    ``forward``'s signature is read once, when the module is wrapped, not on every call.

    Example:
        >>> DynamicAxes.checked(nn.Linear(4, 2), {"input": (0,)}).axes
        {'input': (0,)}
    """

    signature: inspect.Signature
    axes: dict[str, tuple[int, ...]]

    @classmethod
    def checked(cls, module: nn.Module, dynamic_axes: Mapping[str, tuple[int, ...]] | None) -> DynamicAxes | None:
        """``dynamic_axes`` (checked by :meth:`ModuleOptions.checked`) against ``module.forward``'s parameters;
        ``None`` when there are none.

        Raises:
            ValueError: a name is not a parameter of ``forward``.
        """
        if not dynamic_axes:
            return None
        owner = type(module).__name__
        signature = inspect.signature(module.forward)
        parameters = signature.parameters
        takes_any = any(p.kind is inspect.Parameter.VAR_KEYWORD for p in parameters.values())
        unknown = sorted(name for name in dynamic_axes if name not in parameters and not takes_any)
        if unknown:
            raise ValueError(
                f"ORTModule(dynamic_axes=...): {unknown} are not parameters of {owner}.forward; its parameters are "
                f"{list(parameters)}."
            )
        return cls(signature, dict(dynamic_axes))

    def mark(self, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
        """Mark the axes of this call's tensor arguments symbolic for TorchDynamo (where it can)."""
        try:
            bound = self.signature.bind_partial(*args, **kwargs).arguments
        except TypeError:  # the call itself fails, as it would without the marks
            return
        for name, axes in self.axes.items():
            value = bound.get(name)
            if isinstance(value, torch.Tensor):
                maybe_mark_dynamic(value, [axis % value.dim() for axis in axes if -value.dim() <= axis < value.dim()])


def is_sharded(wrapped: ORTModule) -> bool:
    """Whether FSDP shards ``wrapped`` itself or any module inside the module it wraps."""
    return any(isinstance(m, FSDPModule) for m in (wrapped, *original_module(wrapped).modules()))


def original_module(wrapped: ORTModule) -> nn.Module:
    """The module ``wrapped`` runs, even where that module has a submodule named ``module`` of its own."""
    return wrapped.__dict__["_original_module"]


_PROPERTIES = frozenset(name for name, value in vars(ORTModule).items() if isinstance(value, property))
"""The wrapper's properties (``statistics``, ``module``...), which yield to the wrapped module's own state."""


def _call_module(module: nn.Module, *args: Any, **kwargs: Any) -> Any:
    return module(*args, **kwargs)


_ENTRY_POINTS = itertools.count()
