"""The CUDA path: CUDAExecutionProvider, tensors staying on the GPU, parity with eager on the GPU."""

from __future__ import annotations

import copy
from typing import Any

import pytest
import torch
from torch import nn

import lightning_ort.engine.runtime.session as session_module
from lightning_ort import CudaGraphWarning, ORTModule, SessionSettings
from lightning_ort.engine.runtime import cuda_memory
from lightning_ort.engine.torch_internals import FUSED_ATTENTION
from lightning_ort.options import CUDA_MEMORY, AttentionPath, CudaMemory
from tests.helpers import assert_grads_close, assert_outputs_close, clone_inputs, weighted_loss
from tests.zoo import CASES, Case, CausalLM

pytestmark = pytest.mark.cuda

CUDA_CASES = [
    c for c in CASES if c.name in {"mlp", "cnn_batchnorm_train", "transformer_encoder", "causal_lm", "dict_output"}
]


def _to_cuda(value: Any) -> Any:
    return torch.utils._pytree.tree_map_only(
        torch.Tensor, lambda t: t.detach().cuda().requires_grad_(t.requires_grad), value
    )


@pytest.mark.parametrize("case", CUDA_CASES, ids=[c.name for c in CUDA_CASES])
def test_parity_on_cuda(case: Case) -> None:
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    torch.manual_seed(0)
    eager = case.make_model().cuda().train(case.train)
    wrapped = ORTModule(copy.deepcopy(eager)).train(case.train)
    args, kwargs = _to_cuda(case.make_inputs(torch.Generator().manual_seed(1)))
    eager_in, ort_in = clone_inputs((args, kwargs)), clone_inputs((args, kwargs))
    expected = eager(*eager_in[0], **eager_in[1])
    actual = wrapped(*ort_in[0], **ort_in[1])
    assert_outputs_close(actual, expected)
    weighted_loss(expected).backward()
    weighted_loss(actual).backward()
    assert_grads_close(wrapped, eager)
    assert wrapped.providers[0] == "CUDAExecutionProvider"
    assert (wrapped.statistics.forward_runs, wrapped.statistics.backward_runs) == (1, 1)


def test_cuda_tensors_are_bound_in_place(monkeypatch: pytest.MonkeyPatch) -> None:
    devices: list[str] = []
    original = session_module._bind

    def recording(bind: Any, name: str, tensor: torch.Tensor) -> None:
        devices.append(tensor.device.type)
        original(bind, name, tensor)

    monkeypatch.setattr(session_module, "_bind", recording)
    wrapped = ORTModule(CausalLM().cuda())
    ids = torch.randint(0, 64, (2, 16), device="cuda")
    logits = wrapped(ids)
    logits.float().mean().backward()
    assert logits.is_cuda and set(devices) == {"cuda"}
    assert all(p.grad is not None and p.grad.is_cuda for p in wrapped.parameters())


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=["fp16", "bf16"])
def test_autocast_with_grad_scaler_matches_eager(dtype: torch.dtype) -> None:
    torch.manual_seed(0)
    eager = CausalLM().cuda()
    wrapped = ORTModule(copy.deepcopy(eager))
    optimizers = [torch.optim.AdamW(m.parameters(), lr=1e-3) for m in (eager, wrapped)]
    scalers = [torch.amp.GradScaler("cuda", enabled=dtype == torch.float16) for _ in range(2)]
    g = torch.Generator().manual_seed(3)
    for _step in range(4):
        ids = torch.randint(0, 64, (4, 17), generator=g).cuda()
        losses = []
        for model, optimizer, scaler in zip((eager, wrapped), optimizers, scalers):
            with torch.autocast("cuda", dtype=dtype):
                logits = model(ids[:, :-1])
                loss = torch.nn.functional.cross_entropy(logits.float().reshape(-1, 64), ids[:, 1:].reshape(-1))
            optimizer.zero_grad()
            scaler.scale(loss).backward()
            scaler.step(optimizer)
            scaler.update()
            losses.append(loss.item())
        assert abs(losses[0] - losses[1]) <= 2e-2 * abs(losses[0]), losses
    assert scalers[0].get_scale() == scalers[1].get_scale(), "loss scaling must behave as in eager"
    assert wrapped.statistics.backward_runs == 4 and wrapped.providers[0] == "CUDAExecutionProvider"


def test_variable_lengths_build_two_graphs_on_cuda() -> None:
    torch.manual_seed(0)
    eager = CausalLM().cuda()
    wrapped = ORTModule(copy.deepcopy(eager))
    for length in (16, 9, 12, 5):
        ids = torch.randint(0, 64, (2, length), device="cuda")
        torch.testing.assert_close(wrapped(ids), eager(ids), rtol=1e-3, atol=1e-3)
    assert wrapped.statistics.cache_misses == 2


def test_a_side_stream_waits_for_and_sees_the_graphs_results() -> None:
    # Sessions run on the stream current when they were made; under another one the run first waits for that
    # stream's work (here: the input written on it) and ends synchronised.
    torch.manual_seed(0)
    eager = CausalLM().cuda()
    wrapped = ORTModule(copy.deepcopy(eager))
    ids = torch.randint(0, 64, (2, 16), device="cuda")
    wrapped(ids)
    side = torch.cuda.Stream()
    with torch.cuda.stream(side):
        flipped = ids.flip(1)
        actual = wrapped(flipped) * 2
        expected = eager(flipped) * 2
    side.synchronize()
    torch.testing.assert_close(actual, expected, rtol=1e-3, atol=1e-3)


@pytest.mark.parametrize("memory", CUDA_MEMORY)
def test_each_memory_route_trains_as_eager(memory: CudaMemory) -> None:
    torch.manual_seed(0)
    eager = CausalLM().cuda()
    wrapped = ORTModule(copy.deepcopy(eager), session_settings=SessionSettings(cuda_memory=memory))
    ids = torch.randint(0, 64, (4, 16), device="cuda")
    expected, actual = eager(ids), wrapped(ids)
    torch.testing.assert_close(actual, expected, rtol=1e-4, atol=1e-4)
    expected.square().mean().backward()
    actual.square().mean().backward()
    assert_grads_close(wrapped, eager)
    assert wrapped.providers[0] == "CUDAExecutionProvider"


def _allocations_of_one_step(memory: CudaMemory) -> int:
    torch.manual_seed(0)
    wrapped = ORTModule(CausalLM().cuda(), session_settings=SessionSettings(cuda_memory=memory))
    ids = torch.randint(0, 64, (4, 16), device="cuda")
    wrapped(ids).square().mean().backward()  # sessions built and their arenas grown
    torch.cuda.synchronize()
    before = torch.cuda.memory_stats()["allocation.all.allocated"]
    wrapped(ids).square().mean().backward()
    torch.cuda.synchronize()
    return int(torch.cuda.memory_stats()["allocation.all.allocated"] - before)


def test_the_torch_route_allocates_the_graphs_intermediates_from_pytorchs_pool() -> None:
    # Under "session_arena" PyTorch allocates the step's inputs, outputs and gradients only; under "torch" ONNX
    # Runtime's intermediates come from PyTorch's caching allocator too.
    assert _allocations_of_one_step("torch") > _allocations_of_one_step("session_arena")


def test_the_bridge_to_pytorchs_allocator_is_compiled_where_a_compiler_is_at_hand() -> None:
    assert cuda_memory.torch_allocator().kind == "compiled"


def test_the_callback_bridge_trains_as_eager(monkeypatch: pytest.MonkeyPatch) -> None:
    callbacks = cuda_memory.callback_allocator()
    monkeypatch.setattr(cuda_memory, "torch_allocator", lambda: callbacks)
    torch.manual_seed(0)
    eager = CausalLM().cuda()
    wrapped = ORTModule(copy.deepcopy(eager), session_settings=SessionSettings(cuda_memory="torch"))
    ids = torch.randint(0, 64, (4, 16), device="cuda")
    torch.testing.assert_close(wrapped(ids), eager(ids), rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("attention", ["torch", "auto"])
def test_attention_in_pytorch_trains_as_eager_on_cuda(attention: AttentionPath) -> None:
    # SDPA runs as PyTorch's fused CUDA kernels (flash or memory-efficient) between ONNX Runtime partitions, by
    # request and by default ("auto" on CUDA).
    transformers = pytest.importorskip("transformers")
    config = transformers.GPT2Config(n_layer=2, n_embd=64, n_head=4, vocab_size=128)
    config.resid_pdrop = config.embd_pdrop = config.attn_pdrop = 0.0
    torch.manual_seed(0)
    eager = transformers.GPT2LMHeadModel(config).cuda()
    wrapped = ORTModule(copy.deepcopy(eager), attention=attention, fallback="raise")
    ids = torch.randint(0, 128, (2, 16), device="cuda")
    expected, actual = eager(input_ids=ids, labels=ids).loss, wrapped(input_ids=ids, labels=ids).loss
    torch.testing.assert_close(actual, expected, rtol=1e-4, atol=1e-4)
    expected.backward()
    actual.backward()
    assert_grads_close(wrapped, eager)
    assert wrapped.statistics.fallback_ops == 0 and wrapped.providers[0] == "CUDAExecutionProvider"
    with torch.profiler.profile() as profile:
        wrapped(input_ids=ids, labels=ids).loss.backward()
    assert {event.name for event in profile.events()} & {op.name() for op in FUSED_ATTENTION}


def _recorded_sessions(monkeypatch: pytest.MonkeyPatch) -> list[session_module.GraphSession]:
    """Every GraphSession created from now on."""
    sessions: list[session_module.GraphSession] = []
    original = session_module.GraphSession.__init__

    def recording(self: session_module.GraphSession, *args: Any, **kwargs: Any) -> None:
        original(self, *args, **kwargs)
        sessions.append(self)

    monkeypatch.setattr(session_module.GraphSession, "__init__", recording)
    return sessions


def _train_alike(eager: torch.nn.Module, wrapped: torch.nn.Module, step: Any, steps: int = 5) -> None:
    """SGD steps with momentum (in-place updates of the bound parameters) of both models on the same batch: their
    losses, then their parameters, agree. Not AdamW: the gradient of an attention key's bias is rounding noise
    (softmax ignores a constant added to every key), which Adam scales up to full-size steps, so that the key
    biases of two correct runs drift apart by ~1e-3 in five steps (seen on CPU without CUDA graphs too)."""
    optimizers = [torch.optim.SGD(m.parameters(), lr=0.1, momentum=0.9) for m in (eager, wrapped)]
    for _ in range(steps):
        losses = []
        for model, optimizer in zip((eager, wrapped), optimizers):
            loss = step(model)
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            optimizer.step()
            losses.append(loss.detach())
        torch.testing.assert_close(losses[1], losses[0], rtol=1e-4, atol=1e-5)
    for (name, expected), actual in zip(eager.named_parameters(), wrapped.parameters()):
        torch.testing.assert_close(actual, expected, rtol=1e-4, atol=1e-5, msg=name)


def test_cuda_graphs_replay_training_steps_with_eagers_parity(monkeypatch: pytest.MonkeyPatch) -> None:
    """Captured on the third run and replayed after: losses and parameters follow eager's over optimizer steps."""
    torch.backends.cuda.matmul.allow_tf32 = False
    sessions = _recorded_sessions(monkeypatch)
    torch.manual_seed(0)
    eager = CausalLM().cuda()
    wrapped = ORTModule(copy.deepcopy(eager), session_settings=SessionSettings(cuda_graph=True))
    ids = torch.randint(0, 64, (2, 16), device="cuda")
    _train_alike(eager, wrapped, lambda model: model(ids).float().logsumexp(-1).mean())
    assert sessions and all(session.captured for session in sessions)


def test_cuda_graphs_replay_each_block_of_hugging_face_gpt2(monkeypatch: pytest.MonkeyPatch) -> None:
    """GPT-2's graphs hold nothing for the host once its labels' Pad is a Concat, so every graph is captured;
    the block graph's forward replays one graph per GPT2Block instance (its own parameters), its backward one
    graph into which every call copies its inputs."""
    transformers = pytest.importorskip("transformers")
    torch.backends.cuda.matmul.allow_tf32 = False
    sessions = _recorded_sessions(monkeypatch)
    torch.manual_seed(0)
    config = transformers.GPT2Config(
        n_layer=3, n_embd=64, n_head=4, vocab_size=128, resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0
    )
    eager = transformers.GPT2LMHeadModel(config).cuda()
    settings = SessionSettings(cuda_graph=True)
    wrapped = ORTModule(copy.deepcopy(eager), session_settings=settings, blocks=["GPT2Block"])
    ids = torch.randint(0, 128, (2, 32), device="cuda")
    _train_alike(eager, wrapped, lambda model: model(input_ids=ids, labels=ids).loss)
    assert sessions and all(session.captured for session in sessions)


class _ResidualMLP(nn.Module):
    def __init__(self, width: int) -> None:
        super().__init__()
        self.up = nn.Linear(width, 2 * width)
        self.down = nn.Linear(2 * width, width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.down(torch.relu(self.up(x)))


@pytest.mark.parametrize(("width", "tokens", "block_graphs"), [(64, 256, 0), (2048, 4096, 2)])
def test_automatic_blocks_keep_graphs_of_their_own_only_where_their_work_hides_a_runs_host_time(
    width: int, tokens: int, block_graphs: int
) -> None:
    # A block's forward: 4 * tokens * width * 2 * width operations, 8.4 MFLOP and 137 GFLOP here, against the
    # 20 GFLOP threshold for CUDA.
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.manual_seed(0)
    eager = nn.Sequential(*(_ResidualMLP(width) for _ in range(3))).cuda()
    wrapped = ORTModule(copy.deepcopy(eager), blocks="auto")
    x = torch.randn(tokens, width, device="cuda") / width**0.5
    _train_alike(eager, wrapped, lambda model: model(x).square().mean(), steps=2)
    assert wrapped.statistics.block_graphs == block_graphs


def test_graphs_with_symbolic_sizes_run_uncaptured_and_say_why() -> None:
    wrapped = ORTModule(CausalLM().cuda(), session_settings=SessionSettings(cuda_graph=True), dynamic=True)
    with pytest.warns(CudaGraphWarning, match="symbolic"):
        wrapped(torch.randint(0, 64, (2, 16), device="cuda")).sum().backward()
    assert wrapped.statistics.forward_runs == 1


@pytest.mark.parametrize("memory", CUDA_MEMORY)
def test_onnx_runtime_runs_on_pytorchs_default_stream_without_waiting_for_the_gpu(memory: CudaMemory) -> None:
    """Each memory route runs on PyTorch's default stream (named as ``cudaStreamLegacy``, or, beside PyTorch's
    allocator, taken by ONNX Runtime itself), so a training step leaves the host free to run ahead of the GPU."""
    from torch.profiler import ProfilerActivity, profile

    torch.manual_seed(0)
    wrapped = ORTModule(CausalLM().cuda(), session_settings=SessionSettings(cuda_memory=memory))
    ids = torch.randint(0, 64, (2, 16), device="cuda")
    for _ in range(2):
        wrapped(ids).float().logsumexp(-1).mean().backward()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as profiler:
        for _ in range(2):
            wrapped(ids).float().logsumexp(-1).mean().backward()
    torch.cuda.synchronize()
    waits = {
        event.key: event.count
        for event in profiler.key_averages()
        if event.key.startswith(("cudaStreamSynchronize", "cudaDeviceSynchronize", "cudaEventSynchronize"))
    }
    assert not waits, waits
    assert wrapped.statistics.forward_runs == 4 and wrapped.statistics.backward_runs == 4


def test_the_breakdown_lists_the_kernels_onnx_runtime_launched() -> None:
    from lightning_ort.bench import breakdown
    from lightning_ort.bench.workloads import WORKLOADS

    device = torch.device("cuda")
    # Every kernel, not only the matrix products that lead.
    eager, ort = breakdown.break_down(WORKLOADS["mlp"](device), ["eager", "ort"], device, 2, 1, "fp32", top=100)
    for run in (eager, ort):
        assert run.device_ms is not None and run.device_ms > 0
        assert run.top_device and all(calls > 0 and ms > 0 for _, calls, ms in run.top_device)
    assert any("onnxruntime" in name for name, _, _ in ort.top_device), "ONNX Runtime's own kernels are profiled"
    assert not any("onnxruntime" in name for name, _, _ in eager.top_device)
