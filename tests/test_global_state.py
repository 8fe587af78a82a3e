"""lightning_ort leaves the process as it found it: torch's configuration, MHA fast-path switch and oneDNN
settings, warnings filters, loggers' levels, handlers and filters, ``sys.meta_path``, and, after
``torch._dynamo.reset()``, no graphs or sessions; two models train from two threads at once."""

from __future__ import annotations

import copy
import gc
import logging
import os
import sys
import threading
import warnings
import weakref
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from torch import nn

from lightning_ort import DebugOptions, ORTModule, export_for_deployment
from lightning_ort.engine.capture.backend import fast_path_modules, fast_path_off, ort
from lightning_ort.engine.torch_internals import GUARDS_FILTER_SAFELY
from tests.helpers import assert_grads_close, weighted_loss
from tests.zoo import MLP
from tests.zoo.architectures import LSTMTagger

WATCHED_LOGGERS = ("lightning_ort", "torch", "onnxscript", "onnx_ir", "lightning")


def _loggers() -> dict[str, tuple[object, ...]]:
    """Level and filters of the root logger and of every logger of the libraries we touch, and the handlers of
    the root and of ours (torch adds handlers of its own on first use)."""
    names = [name for name in list(logging.root.manager.loggerDict) if name.split(".")[0] in WATCHED_LOGGERS]
    loggers = {name: logging.getLogger(name) for name in names}
    loggers["root"] = logging.getLogger()
    return {
        name: (
            lg.level,
            tuple(lg.filters),
            tuple(lg.handlers) if name.split(".")[0] in ("root", "lightning_ort") else (),
        )
        for name, lg in loggers.items()
    }


def _globals() -> tuple[object, ...]:
    return (
        torch._dynamo.config.allow_rnn,
        set(torch._dynamo.config.ignore_logging_functions),
        torch._functorch.config.guess_tangent_strides_as_outputs,
        torch.backends.mha.get_fastpath_enabled(),
        list(warnings.filters),
        list(sys.meta_path),
        (torch.backends.mkldnn.enabled, torch.backends.mkldnn.deterministic, torch.backends.mkldnn.allow_tf32),
    )


def _same_loggers(before: dict[str, tuple[object, ...]], after: dict[str, tuple[object, ...]]) -> None:
    """Every logger that existed before is as it was (loggers created since, by imports, are left out)."""
    changed = {name: (before[name], after[name]) for name in before if after.get(name) != before[name]}
    assert not changed, changed


def test_training_and_reset_leave_torch_warnings_and_logging_as_they_were(tmp_path: Path) -> None:
    before, loggers = _globals(), _loggers()
    model = ORTModule(LSTMTagger(), DebugOptions(log_level="VERBOSE"))
    model(torch.randint(0, 40, (2, 7))).sum().backward()
    compiled = torch.compile(nn.Linear(4, 2), backend="ort")
    compiled(torch.randn(3, 4)).sum().backward()
    encoder = nn.TransformerEncoder(nn.TransformerEncoderLayer(16, 2, 32, batch_first=True), 1).eval()
    with torch.no_grad():
        ORTModule(encoder)(torch.randn(2, 5, 16))  # the MHA fast path is off while it is traced
    export_for_deployment(nn.Linear(4, 2), tmp_path / "m.onnx", (torch.randn(3, 4),))
    assert _globals() == before
    _same_loggers(loggers, _loggers())
    handlers = logging.getLogger("lightning_ort").handlers
    assert all(isinstance(handler, logging.NullHandler) for handler in handlers)


@pytest.mark.parametrize("strategy", ["ort", "ort_ddp", "ort_fsdp"])
def test_training_under_each_strategy_leaves_the_process_as_it_was(strategy: str, tmp_path: Path) -> None:
    import lightning.pytorch as pl

    from tests.lightning.models import TinyTransformerLM

    _ = pl.Trainer(accelerator="cpu", devices=1, max_steps=1, logger=False).strategy  # Lightning's first-use state
    before, loggers = _globals(), _loggers()
    during: list[tuple[object, ...]] = []

    class Watch(pl.Callback):
        def on_train_batch_end(self, *args: object) -> None:
            during.append((list(warnings.filters), list(sys.meta_path)))

    trainer = pl.Trainer(
        accelerator="cpu",
        devices=1,
        strategy=strategy,
        max_steps=2,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        limit_val_batches=0,
        default_root_dir=tmp_path,
        callbacks=[Watch()],
    )
    environment = dict(os.environ)  # Lightning sets MASTER_PORT and the like for its process group
    try:
        trainer.fit(TinyTransformerLM())
    finally:
        if torch.distributed.is_initialized():
            torch.distributed.destroy_process_group()
        os.environ.clear()
        os.environ.update(environment)
    assert during and all(seen == (before[4], before[5]) for seen in during), "no filter while training either"
    assert _globals() == before
    _same_loggers(loggers, _loggers())


def test_dynamo_reset_releases_the_backends_graphs_and_sessions() -> None:
    compiled = torch.compile(nn.Linear(4, 2), backend="ort")
    compiled(torch.randn(3, 4)).sum().backward()
    backends = ort.backends()
    assert backends and any(True for backend in backends for _ in backend.runners())
    sessions = [weakref.ref(runner) for backend in backends for _, runner in backend.runners()]
    torch._dynamo.reset()
    del compiled
    gc.collect()
    assert ort.backends() == []
    assert all(backend.statistics().cached_graphs == 0 for backend in backends)
    assert all(session() is None for session in sessions), "sessions must be released"


def test_a_backend_used_alone_reports_what_it_does_not_track_as_none() -> None:
    compiled = torch.compile(nn.Linear(4, 2), backend="ort")
    compiled(torch.randn(3, 4))
    stats = ort.backends()[0].statistics()
    assert stats.graphs >= 1 and stats.forward_runs >= 1
    assert (stats.cache_hits, stats.cache_misses, stats.graph_breaks, stats.recompile_limit_hits) == (None,) * 4
    torch._dynamo.reset()


def test_two_models_train_from_two_threads_at_once() -> None:
    """Each model's graphs are built on its first call; torch's tracing cannot overlap another thread's backward,
    so the models are built first, then both threads train at once."""
    torch.manual_seed(0)
    eagers = [MLP(), MLP()]
    wrapped = [ORTModule(copy.deepcopy(model)) for model in eagers]
    inputs = [torch.randn(4, 16, generator=torch.Generator().manual_seed(i)) for i in range(2)]
    for eager, model, x in zip(eagers, wrapped, inputs):
        weighted_loss(eager(x)).backward()
        weighted_loss(model(x)).backward()

    def train(index: int) -> None:
        for _ in range(3):
            weighted_loss(wrapped[index](inputs[index])).backward()

    errors = _at_once(train, 2)
    assert not errors, errors
    for eager, model, x in zip(eagers, wrapped, inputs):
        for _ in range(3):
            weighted_loss(eager(x)).backward()
        assert_grads_close(model, eager)
        assert model.statistics.backward_runs == 4 and model.statistics.cache_misses == 1


def test_first_use_initialisers_run_once_under_threads() -> None:
    import time

    from lightning_ort.engine.once import Once

    calls: list[int] = []

    def slow() -> int:
        calls.append(1)
        time.sleep(0.05)
        return len(calls)

    shared = Once(slow)
    results: list[int] = []
    assert not _at_once(lambda _: results.append(shared()), 8)
    assert calls == [1] and results == [1] * 8


def test_held_back_warnings_belong_to_their_thread() -> None:
    from lightning_ort.engine.capture.build import PENDING_WARNINGS

    seen: list[bool] = []
    PENDING_WARNINGS.collecting = True
    try:
        thread = threading.Thread(target=lambda: seen.append(PENDING_WARNINGS.collecting))
        thread.start()
        thread.join()
    finally:
        PENDING_WARNINGS.collecting = False
    assert seen == [False]


def test_two_models_compile_and_infer_from_two_threads_at_once() -> None:
    torch.manual_seed(0)
    eagers = [MLP(), MLP()]
    wrapped = [ORTModule(copy.deepcopy(model)) for model in eagers]
    inputs = [torch.randn(4, 16, generator=torch.Generator().manual_seed(i)) for i in range(2)]
    outputs: dict[int, torch.Tensor] = {}

    def infer(index: int) -> None:
        with torch.no_grad():
            outputs[index] = wrapped[index](inputs[index])

    errors = _at_once(infer, 2)
    assert not errors, errors
    for index, (eager, model) in enumerate(zip(eagers, wrapped)):
        with torch.no_grad():
            torch.testing.assert_close(outputs[index], eager(inputs[index]), rtol=1e-4, atol=1e-5)
        assert model.statistics.forward_runs == 1


def _at_once(work: Callable[[int], None], count: int) -> list[BaseException]:
    """Run ``work(0)`` to ``work(count - 1)`` in threads released together; the exceptions they raised."""
    errors: list[BaseException] = []
    barrier = threading.Barrier(count)

    def run(index: int) -> None:
        try:
            barrier.wait()
            work(index)
        except BaseException as err:  # reported by the caller
            errors.append(err)

    threads = [threading.Thread(target=run, args=(index,)) for index in range(count)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=600)
    return errors


IMPORT_CHECK = """
import logging, sys
import torch, torch._dynamo, torch.export, torch.onnx, onnxruntime, onnxscript, onnx_ir

def loggers():
    names = [n for n in list(logging.root.manager.loggerDict) if n.split(".")[0] in ("torch", "onnxscript", "onnx_ir")]
    return {n: (logging.getLogger(n).level, tuple(logging.getLogger(n).filters)) for n in names}

before, finders = loggers(), list(sys.meta_path)
import lightning_ort
after = loggers()
changed = [n for n in before if after.get(n) != before[n]]
added = [type(f).__name__ for f in sys.meta_path if f not in finders]
import lightning.pytorch
from lightning.pytorch.strategies import StrategyRegistry
left = [type(f).__name__ for f in sys.meta_path if f not in finders and type(f).__module__.startswith("lightning_ort")]
print(changed, added, left, "ort_ddp" in StrategyRegistry)
"""


def test_importing_the_package_touches_no_other_library_and_registers_the_strategies_with_lightning() -> None:
    import subprocess

    result = subprocess.run([sys.executable, "-c", IMPORT_CHECK], capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    assert result.stdout.strip().splitlines()[-1] == "[] ['_RegisterWithLightning'] [] True", result.stdout


needs_guard_filters = pytest.mark.skipif(
    not GUARDS_FILTER_SAFELY, reason="this torch cannot drop the switch's guard: the switch is off for whole calls"
)


@needs_guard_filters
def test_the_fast_path_switch_is_off_only_while_an_eval_call_compiles(monkeypatch: pytest.MonkeyPatch) -> None:
    switched: list[bool] = []
    switch = torch.backends.mha.set_fastpath_enabled
    monkeypatch.setattr(torch.backends.mha, "set_fastpath_enabled", lambda on: (switched.append(on), switch(on)))
    torch.manual_seed(0)
    encoder = nn.TransformerEncoder(nn.TransformerEncoderLayer(16, 2, 32, batch_first=True), 1)
    wrapped = ORTModule(copy.deepcopy(encoder))
    wrapped(torch.randn(2, 5, 16)).sum().backward()
    assert switched == [], "a training call with autograd cannot take the fast path"
    x = torch.randn(2, 5, 16)
    with torch.no_grad():
        first = wrapped.eval()(x)
        assert switched == [False, True], "off while the eval graphs compile, then restored"
        graphs = wrapped.statistics.cached_graphs
        second = wrapped(x)
        assert switched == [False, True], "a call of compiled graphs leaves the switch alone"
        switch(False)  # the user's own setting, between calls: the compiled graphs still serve
        third = wrapped(x)
        switch(True)
        expected = encoder.eval()(x)  # eager, with the fast path on: the same attention, fused
    assert wrapped.statistics.cached_graphs == graphs, "no recompilation for the switch"
    assert wrapped.statistics.fallback_ops == 0, "the graphs hold no fast-path op"
    for output in (first, second, third):
        torch.testing.assert_close(output, expected, rtol=1e-4, atol=1e-5)


@needs_guard_filters
def test_the_switch_is_held_off_from_the_start_to_the_end_of_compilations_during_such_calls() -> None:
    """TorchDynamo's compilation events, listened to only during calls that could take the fast path, hold the
    switch off while anything compiles; the last call to return stops listening and restores the switch."""
    events = torch._dynamo.callback.callback_handler
    listening = (len(events.start_callbacks), len(events.end_callbacks))

    def probe(x: torch.Tensor) -> torch.Tensor:
        return x + int(torch.backends.mha.get_fastpath_enabled())  # the switch as TorchDynamo traced it

    compiled = torch.compile(probe, backend="eager")
    encoder = nn.TransformerEncoder(nn.TransformerEncoderLayer(8, 2, 16, batch_first=True), 1).eval()
    first, second = fast_path_off(fast_path_modules(encoder)), fast_path_off(fast_path_modules(encoder))
    with torch.no_grad():
        first.__enter__()
        second.__enter__()
        assert torch.backends.mha.get_fastpath_enabled() is True, "nothing compiles: the switch is left alone"
        assert compiled(torch.zeros(1)).item() == 0, "off while TorchDynamo traced"
        assert torch.backends.mha.get_fastpath_enabled() is True, "restored when the compilation ended"
        first.__exit__(None, None, None)
        assert (len(events.start_callbacks), len(events.end_callbacks)) != listening, "the other call still runs"
        second.__exit__(None, None, None)
    assert (len(events.start_callbacks), len(events.end_callbacks)) == listening
    assert torch.backends.mha.get_fastpath_enabled() is True
