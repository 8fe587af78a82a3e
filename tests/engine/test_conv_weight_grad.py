"""``conv_weight_grad``: where convolutions' weight gradients are computed.

Under ``"auto"`` (the default) a dense CPU convolution whose graph form would unfold a large image takes its weight
gradient from PyTorch's kernel, run after the one ONNX Runtime backward graph that computes every input gradient,
or, for 3x3 layers the kernel takes (AVX-512 CPUs), from lightning_ort's ``ConvWeightGrad3x3`` inside that graph;
``"onnx"`` keeps every weight gradient in the graphs, ``"torch"`` none. Parity is checked against eager PyTorch on
a Hugging Face ResNet, whose layers fall on all sides of the choice.
"""

from __future__ import annotations

import copy
import warnings
from pathlib import Path

import lightning.pytorch as pl
import numpy as np
import onnx
import pytest
import torch
from onnx import helper
from torch import nn
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.fx.experimental.proxy_tensor import make_fx
from torch.nn import functional as F
from torch.utils.data import DataLoader, TensorDataset

from lightning_ort import DebugOptions, ORTConfig, ORTModule, ORTSingleDeviceStrategy
from lightning_ort.engine.capture.backend import backend_options
from lightning_ort.engine.fx.conv_weight_grad import weight_grad_kernel_applies
from lightning_ort.engine.fx.decompositions import capture_decompositions, weight_grad_in_torch
from lightning_ort.engine.onnx.custom_ops import DOMAIN
from lightning_ort.engine.onnx.passes import KERNEL_NCHWC_BLOCK, nchwc_block_size, use_nchwc_convolutions
from tests.helpers import assert_fp64_accuracy, assert_grads_close, kernel_session
from tests.lightning.models import train_three_steps

transformers = pytest.importorskip("transformers")

aten = torch.ops.aten


def _resnet() -> nn.Module:
    """A small Hugging Face ResNet: on 32x32 images its stem and first stage see 16x16 and 8x8 images, its last
    3x3 layer 4x4 ones, and its shortcut is a strided 1x1 convolution."""
    config = transformers.ResNetConfig(
        num_channels=3, embedding_size=16, hidden_sizes=[16, 32], depths=[1, 1], layer_type="basic", num_labels=5
    )
    torch.manual_seed(0)
    return transformers.ResNetForImageClassification(config)


def _batch() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(1)
    return {"pixel_values": torch.randn(6, 3, 32, 32, generator=g), "labels": torch.randint(0, 5, (6,), generator=g)}


KERNEL = torch.backends.cpu.get_cpu_capability() == "AVX512" and nchwc_block_size() == KERNEL_NCHWC_BLOCK
"""Whether this CPU runs lightning_ort's 3x3 weight-gradient kernel."""


def _expected_in_torch(model: nn.Module, batch: dict[str, torch.Tensor], path: str) -> tuple[int, int]:
    """How many of ``model``'s convolutions ``path`` leaves to PyTorch's kernel, and how many of those
    lightning_ort's 3x3 kernel takes under ``"auto"``, judged on the inputs each one sees."""
    chosen: list[tuple[bool, bool]] = []

    def record(conv: nn.Module, inputs: tuple[torch.Tensor, ...]) -> None:
        assert isinstance(conv, nn.Conv2d)
        torch_weight = weight_grad_in_torch(inputs[0], conv.weight, conv.padding, conv.groups, path)  # type: ignore[arg-type]
        kernel = path == "auto" and weight_grad_kernel_applies(
            inputs[0],
            conv.weight,
            conv.stride,
            conv.padding,
            conv.dilation,
            conv.groups,  # type: ignore[arg-type]
        )
        chosen.append((torch_weight, torch_weight and kernel))

    hooks = [m.register_forward_pre_hook(record) for m in model.modules() if isinstance(m, nn.Conv2d)]
    with torch.no_grad():
        model(**batch)
    for hook in hooks:
        hook.remove()
    return sum(torch_weight for torch_weight, _ in chosen), sum(kernel for _, kernel in chosen)


@pytest.mark.parametrize("path", ["auto", "onnx", "torch"])
@pytest.mark.parametrize("blocks", [None, "auto"], ids=["one-graph", "block-graphs"])
def test_resnet_trains_as_eager_with_each_weight_gradient_path(path: str, blocks: str | None) -> None:
    eager = _resnet()
    wrapped = ORTModule(copy.deepcopy(eager), blocks=blocks, conv_weight_grad=path, fallback="raise")  # type: ignore[arg-type]
    batch = _batch()
    in_torch, in_kernel = _expected_in_torch(eager, batch, path)
    assert (in_torch, path) in {(4, "auto"), (0, "onnx"), (6, "torch")}, "the model has layers on both sides"
    assert in_kernel == (KERNEL and path == "auto"), "one stride-2 layer (16 -> 32 channels) takes the 3x3 kernel"
    in_torch -= in_kernel
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # weight gradients kept in PyTorch are no fallback: no warning
        actual = wrapped(**batch).loss
        actual.backward()
    expected = eager(**batch).loss
    expected.backward()
    torch.testing.assert_close(actual, expected, rtol=1e-5, atol=1e-5)
    assert_grads_close(wrapped, eager)
    stats = wrapped.statistics
    assert stats.fallback_ops == 0 and stats.eager_signatures == 0
    assert stats.forward_runs > 0 and stats.backward_runs > 0, "the rest ran in ONNX Runtime"
    wrapped(**batch).loss.backward()  # the loss sets config.problem_type on the first call: one more graph
    with torch.profiler.profile() as profile:
        wrapped(**batch).loss.backward()
    ran = [event.name for event in profile.events()]
    assert ran.count("aten::convolution_backward") == in_torch, path
    assert "aten::mkldnn_convolution" not in ran and "aten::convolution" not in ran, "the forward ran in ORT"


def test_weight_gradients_leave_a_backward_split_around_pytorchs_kernel_without_a_copy(tmp_path: Path) -> None:
    # The first layer (16x16 images) takes PyTorch's kernel, which splits the backward graph; the last (4x4)
    # computes its weight gradient in the graph as a product, reshaped to the weight's shape. ONNX Runtime copies
    # a reshape that is a graph output, so the gradient leaves as the product and is viewed in PyTorch.
    torch.manual_seed(0)
    eager = nn.Sequential(
        nn.Conv2d(3, 16, 3, padding=1), nn.ReLU(), nn.Conv2d(16, 16, 3, stride=4, padding=1), nn.Conv2d(16, 8, 3)
    )
    debug = DebugOptions(save_onnx=True, onnx_prefix="m", save_path=tmp_path)
    wrapped = ORTModule(copy.deepcopy(eager), debug, fallback="raise")
    x = torch.randn(4, 3, 16, 16)
    wrapped(x).square().sum().backward()
    eager(x).square().sum().backward()
    assert_grads_close(wrapped, eager)
    backward = onnx.load(str(tmp_path / "m_training_backward_part0.onnx")).graph
    returned = {value.name for value in backward.output}
    reshaped = [n.name for n in backward.node if n.op_type == "Reshape" and n.output[0] in returned]
    assert reshaped == []
    assert wrapped.statistics.fallback_ops == 0


def test_the_weight_gradient_stays_one_op_asking_for_the_weight_alone() -> None:
    x, w, gy = torch.randn(2, 4, 8, 8), torch.randn(6, 4, 3, 3), torch.randn(2, 6, 8, 8)

    def backward(gy: torch.Tensor, x: torch.Tensor, w: torch.Tensor) -> tuple[torch.Tensor, ...]:
        return aten.convolution_backward(gy, x, w, [6], [1, 1], [1, 1], [1, 1], False, [0, 0], 1, [True, True, True])

    expected = backward(gy, x, w)
    for path, kept in (("torch", 1), ("auto", 1), ("onnx", 0)):
        gm = make_fx(backward, decomposition_table=capture_decompositions("cpu", "onnx", path))(gy, x, w)  # type: ignore[arg-type]
        ops = [n for n in gm.graph.nodes if n.target is aten.convolution_backward.default]
        assert len(ops) == kept, path
        assert all(list(n.args[10]) == [False, True, False] for n in ops), "asks for the weight gradient alone"
        for actual, reference in zip(gm(gy, x, w), expected, strict=True):
            torch.testing.assert_close(actual, reference, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize(
    ("size", "kernel", "padding", "groups", "device", "expected"),
    [
        (16, 3, 1, 1, "cpu", True),  # 256 positions: the one-hot unfold costs as much as the product
        (5, 3, 0, 1, "cpu", True),  # 25 positions
        (4, 3, 1, 1, "cpu", False),  # 16 positions: the selection product
        (16, 1, 0, 1, "cpu", False),  # pointwise: a strided slice and one product
        (16, 1, 1, 1, "cpu", True),  # padded 1x1: unfolded
        (16, 3, 1, 4, "cpu", False),  # depthwise: NCHWc convolutions
        (4, 3, 1, 1, "cuda", True),  # CUDA: cuDNN's kernel for every dense layer
        (16, 1, 0, 1, "cuda", True),
        (16, 3, 1, 4, "cuda", False),  # depthwise on CUDA: not measured, stays in the graphs
        (16, 3, 1, 1, "meta", False),  # neither CPU nor CUDA: stays in the graphs
    ],
)
def test_auto_chooses_pytorch_where_the_graph_would_unfold_a_large_image(
    size: int, kernel: int, padding: int, groups: int, device: str, expected: bool
) -> None:
    with FakeTensorMode():  # CUDA tensors without a GPU: only their device and sizes are read
        images = torch.empty(2, 4, size, size, device=device)
        weight = torch.empty(4, 4 // groups, kernel, kernel, device=device)
    assert weight_grad_in_torch(images, weight, [padding] * 2, groups, "auto") is expected
    assert weight_grad_in_torch(images, weight, [padding] * 2, groups, "torch")
    assert not weight_grad_in_torch(images, weight, [padding] * 2, groups, "onnx")


def test_conv_weight_grad_is_checked_and_reaches_every_entry_point() -> None:
    with pytest.raises(ValueError, match="conv_weight_grad='oneDNN' is not one of 'auto', 'onnx', 'torch'"):
        ORTModule(nn.Linear(2, 2), conv_weight_grad="oneDNN")  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="conv_weight_grad"):
        ORTModule(nn.Linear(2, 2), conv_weight_grad=None)  # type: ignore[arg-type]
    assert ORTModule(nn.Linear(2, 2)).conv_weight_grad == "auto"
    assert ORTConfig(conv_weight_grad="onnx").module_options.conv_weight_grad == "onnx"
    assert backend_options({"conv_weight_grad": "torch"}).conv_weight_grad == "torch"


class _ConvClassifier(pl.LightningModule):
    """Conv, batch norm and ReLU on 16x16 images: a stride-1 and a stride-2 layer whose weight gradients
    ``"auto"`` leaves to PyTorch, trained on a few synthetic batches."""

    def __init__(self) -> None:
        super().__init__()
        self.net = nn.Sequential(
            nn.Conv2d(3, 16, 3, padding=1, bias=False),
            nn.BatchNorm2d(16),
            nn.ReLU(),
            nn.Conv2d(16, 16, 3, stride=2, padding=1),
            nn.ReLU(),
            nn.AdaptiveAvgPool2d(1),
            nn.Flatten(),
            nn.Linear(16, 4),
        )

    def training_step(self, batch: tuple[torch.Tensor, torch.Tensor], _: int) -> torch.Tensor:
        images, labels = batch
        return F.cross_entropy(self.net(images), labels)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.1, momentum=0.9)

    def train_dataloader(self) -> DataLoader:
        g = torch.Generator().manual_seed(0)
        data = TensorDataset(torch.randn(24, 3, 16, 16, generator=g), torch.randint(0, 4, (24,), generator=g))
        return DataLoader(data, batch_size=8)


@pytest.mark.parametrize("path", ["auto", "onnx"])
def test_a_conv_net_trains_in_lightning_as_in_plain_lightning(path: str, tmp_path: Path) -> None:
    expected_losses, expected = train_three_steps(_ConvClassifier, tmp_path / "plain")
    strategy = ORTSingleDeviceStrategy(conv_weight_grad=path)
    actual_losses, actual = train_three_steps(_ConvClassifier, tmp_path / "ort", strategy=strategy)
    assert isinstance(actual, _ConvClassifier) and isinstance(expected, _ConvClassifier)
    torch.testing.assert_close(torch.tensor(actual_losses), torch.tensor(expected_losses), rtol=1e-4, atol=1e-5)
    for mine, reference in zip(actual.net.parameters(), expected.net.parameters(), strict=True):
        torch.testing.assert_close(mine, reference, rtol=1e-4, atol=1e-5)
    wrapped = actual.net
    assert isinstance(wrapped, ORTModule) and wrapped.conv_weight_grad == path
    assert wrapped.statistics.backward_runs == 3 and wrapped.statistics.fallback_ops == 0


def _blocked(t: torch.Tensor) -> np.ndarray:
    """``t`` ([N, C, H, W], C a multiple of 16) in ONNX Runtime's NCHWc layout with 16-channel blocks."""
    n, c, h, w = t.shape
    return t.view(n, c // 16, 16, h, w).permute(0, 1, 3, 4, 2).contiguous().view(n, c, h, w).numpy()


@pytest.mark.skipif(not KERNEL, reason="the 3x3 weight-gradient kernel runs on AVX-512 CPUs")
@pytest.mark.parametrize(
    ("images", "channels", "size", "outputs", "stride"),
    [
        (2, 16, 5, 32, 1),  # odd size: every tap's rows and columns clipped differently
        (3, 16, 7, 64, 2),  # odd size, stride 2: the last output row reads the last input row
        (2, 32, 6, 32, 2),  # even size, stride 2: the last input row is read by no tap 2
        (9, 24, 8, 96, 1),  # more images than chunks, three output tiles, three input tiles
        (5, 16, 1, 32, 1),  # a 1x1 image: only the centre tap
        (2, 16, 1, 32, 2),  # stride 2 on a 1x1 image: tap 2 reads past it
        (2, 8, 2, 32, 2),  # one tile of input channels
    ],
)
def test_the_kernel_matches_pytorchs_weight_gradient_in_float64(
    images: int, channels: int, size: int, outputs: int, stride: int
) -> None:
    g = torch.Generator().manual_seed(0)
    x = torch.randn(images, channels, size, size, generator=g)
    out_size = (size - 1) // stride + 1
    gy = torch.randn(images, outputs, out_size, out_size, generator=g)
    node = helper.make_node("ConvWeightGrad3x3", ["X", "dY"], ["dW"], domain=DOMAIN, stride=stride)
    (actual,) = kernel_session(node, {"X": None, "dY": None}).run(None, {"X": x.numpy(), "dY": _blocked(gy)})
    weight = torch.empty(outputs, channels, 3, 3, dtype=torch.float64)
    args = (None, [stride] * 2, [1, 1], [1, 1], False, [0, 0], 1, [False, True, False])
    expected = aten.convolution_backward(gy.double(), x.double(), weight, *args)[1]
    eager = aten.convolution_backward(gy, x, weight.float(), *args)[1]
    spread = (eager.double() - expected).abs().max().item()
    assert (torch.from_numpy(actual).double() - expected).abs().max().item() <= max(2 * spread, 1e-6)


@pytest.mark.skipif(not KERNEL, reason="the 3x3 weight-gradient kernel runs on AVX-512 CPUs")
def test_the_kernel_refuses_tensors_it_cannot_read() -> None:
    node = helper.make_node("ConvWeightGrad3x3", ["X", "dY"], ["dW"], domain=DOMAIN, stride=1)
    session = kernel_session(node, {"X": None, "dY": None})
    x, gy = np.zeros((1, 16, 4, 4), np.float32), np.zeros((1, 16, 4, 4), np.float32)  # 16 outputs: half a tile
    with pytest.raises(Exception, match="O of 32"):
        session.run(None, {"X": x, "dY": gy})
    x, gy = np.zeros((1, 16, 4, 4), np.float32), np.zeros((1, 32, 3, 3), np.float32)  # not stride 1's size
    with pytest.raises(Exception, match="O of 32"):
        session.run(None, {"X": x, "dY": gy})


@pytest.mark.parametrize(
    ("channels", "outputs", "stride", "padding", "dilation", "groups", "expected"),
    [
        (16, 32, 1, 1, 1, 1, True),
        (32, 64, 2, 1, 1, 1, True),
        (8, 32, 1, 1, 1, 1, True),
        (12, 32, 1, 1, 1, 1, False),  # input channels: not whole register tiles
        (16, 16, 1, 1, 1, 1, False),  # output channels: not whole register tiles
        (16, 32, 3, 1, 1, 1, False),
        (16, 32, 1, 0, 1, 1, False),
        (16, 32, 1, 1, 2, 1, False),
        (32, 32, 1, 1, 1, 2, False),
    ],
)
def test_the_kernel_takes_dense_3x3_layers_with_whole_blocks(
    channels: int, outputs: int, stride: int, padding: int, dilation: int, groups: int, expected: bool
) -> None:
    x, w = torch.empty(2, channels, 16, 16), torch.empty(outputs, channels // groups, 3, 3)
    applies = weight_grad_kernel_applies(x, w, [stride] * 2, [padding] * 2, [dilation] * 2, groups)
    assert applies == (expected and torch.backends.cpu.get_cpu_capability() == "AVX512")
    assert not weight_grad_kernel_applies(x.double(), w.double(), [stride] * 2, [padding] * 2, [dilation] * 2, groups)


def test_the_nchwc_pass_blocks_the_kernels_inputs_and_refuses_another_block() -> None:
    values = [helper.make_tensor_value_info(name, onnx.TensorProto.FLOAT, None) for name in ("x", "gy")]
    node = helper.make_node("ConvWeightGrad3x3", ["x", "gy"], ["gw"], "node_gw", domain=DOMAIN, stride=1)
    model = helper.make_model(helper.make_graph([node], "g", values, []))
    assert use_nchwc_convolutions(model, 16) == 1
    assert [(n.op_type, list(n.input)) for n in model.graph.node] == [
        ("ReorderInput", ["gy"]),
        ("ConvWeightGrad3x3", ["x", "gy_nchwc"]),
    ]
    node = helper.make_node("ConvWeightGrad3x3", ["x", "gy"], ["gw"], "node_gw", domain=DOMAIN, stride=1)
    model = helper.make_model(helper.make_graph([node], "g", values, []))
    with pytest.raises(RuntimeError, match=r"node_gw: .* reads 16-channel NCHWc blocks, but ONNX Runtime blocks 8"):
        use_nchwc_convolutions(model, 8)


class _Blocks(nn.Module):
    """Two 3x3 layers the kernel takes (stride 1 on 8x8 images, stride 2 on 8x8 to 4x4), between batch norms."""

    def __init__(self) -> None:
        super().__init__()
        self.stem = nn.Conv2d(3, 16, 3, padding=1)
        self.body = nn.Sequential(
            nn.BatchNorm2d(16),
            nn.ReLU(),
            nn.Conv2d(16, 32, 3, padding=1, bias=False),
            nn.BatchNorm2d(32),
            nn.ReLU(),
            nn.Conv2d(32, 32, 3, stride=2, padding=1),
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.body(self.stem(x)).mean((2, 3))


@pytest.mark.skipif(not KERNEL, reason="the 3x3 weight-gradient kernel runs on AVX-512 CPUs")
def test_a_conv_net_has_eagers_float64_accuracy_with_the_kernel_in_its_backward_graph(tmp_path: Path) -> None:
    torch.manual_seed(0)
    eager = _Blocks()
    debug = DebugOptions(save_onnx=True, onnx_prefix="m", save_path=tmp_path)
    wrapped = ORTModule(copy.deepcopy(eager), debug, fallback="raise")
    x = torch.randn(6, 3, 8, 8, generator=torch.Generator().manual_seed(1))
    assert_fp64_accuracy(eager, wrapped, x, perturbations=2)
    backward = onnx.load(str(tmp_path / "m_training_backward_part0.onnx")).graph
    kernels = [n for n in backward.node if n.op_type == "ConvWeightGrad3x3"]
    assert sorted(a.i for n in kernels for a in n.attribute if a.name == "stride") == [1, 2]
    readers = {name: [n.op_type for n in backward.node if name in n.input] for n in kernels for name in n.input[1:]}
    assert all(set(ops) == {"Conv", "ConvWeightGrad3x3"} for ops in readers.values()), "one blocked copy of dY"
    with torch.profiler.profile() as profile:
        wrapped(x).sum().backward()
    ran = [event.name for event in profile.events()]
    assert ran.count("aten::convolution_backward") == 1, "only the stem's 3 input channels: PyTorch's kernel"
    assert wrapped.statistics.fallback_ops == 0


@pytest.mark.skipif(not KERNEL, reason="the 3x3 weight-gradient kernel runs on AVX-512 CPUs")
def test_where_onnx_runtime_blocks_other_channel_counts_pytorchs_kernel_keeps_the_weight_gradients(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    from lightning_ort.engine.capture import aot

    monkeypatch.setattr(aot, "nchwc_block_size", lambda: 8)  # as ONNX Runtime blocks on AVX2 CPUs
    torch.manual_seed(0)
    eager = _Blocks()
    wrapped = ORTModule(copy.deepcopy(eager), fallback="raise")
    x = torch.randn(6, 3, 8, 8, generator=torch.Generator().manual_seed(1))
    wrapped(x).sum().backward()
    eager(x).sum().backward()
    assert_grads_close(wrapped, eager)
    with torch.profiler.profile() as profile:
        wrapped(x).sum().backward()
    assert [event.name for event in profile.events()].count("aten::convolution_backward") == 3
