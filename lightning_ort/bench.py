"""Benchmark: training and inference steps of a transformer LM, eager PyTorch vs ORTModule, in one run.

Run ``python -m lightning_ort.bench --help``. Results are ratios measured in the same process, eager and
ORT steps alternating in blocks so that machine noise hits both alike; ``speedup > 1`` means ORTModule is faster.
"""

from __future__ import annotations

import argparse
import copy
import json
import statistics
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
from torch import nn

from lightning_ort.module import ORTModule


class TransformerLM(nn.Module):
    """Embedding, positional table, ``nn.TransformerEncoder`` with a causal mask, and an LM head.

    Example:
        >>> TransformerLM(vocab=50, width=16, heads=2, layers=1, context=8)(torch.zeros(2, 8, dtype=torch.long)).shape
        torch.Size([2, 8, 50])
    """

    def __init__(self, vocab: int, width: int, heads: int, layers: int, context: int, dropout: float = 0.0) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab, width)
        self.position = nn.Parameter(torch.zeros(context, width))
        layer = nn.TransformerEncoderLayer(width, heads, 4 * width, dropout=dropout, batch_first=True, norm_first=True)
        self.encoder = nn.TransformerEncoder(layer, layers, enable_nested_tensor=False)
        self.head = nn.Linear(width, vocab)
        self.causal_mask: torch.Tensor
        self.register_buffer("causal_mask", nn.Transformer.generate_square_subsequent_mask(context), persistent=False)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        length = ids.shape[1]
        hidden = self.embed(ids) + self.position[:length]
        hidden = self.encoder(hidden, mask=self.causal_mask[:length, :length], is_causal=True)
        return self.head(hidden)


@dataclass
class BenchResult:
    """One benchmark run's numbers (milliseconds are medians over the timed steps)."""

    device: str
    config: dict[str, int]
    eager_train_ms: float
    ort_train_ms: float
    train_speedup: float
    eager_infer_ms: float
    ort_infer_ms: float
    infer_speedup: float
    export_seconds: float
    max_abs_loss_diff: float


def run(
    device: str, steps: int, warmup: int, batch: int, seq: int, width: int, layers: int, heads: int, vocab: int
) -> BenchResult:
    """Time ``steps`` alternating training and inference steps of eager and ORTModule copies of one model."""
    torch.manual_seed(0)
    target = torch.device(device)
    eager = TransformerLM(vocab, width, heads, layers, seq).to(target)
    wrapped = ORTModule(copy.deepcopy(eager))
    optimizers = {
        "eager": torch.optim.AdamW(eager.parameters(), lr=1e-3),
        "ort": torch.optim.AdamW(wrapped.parameters(), lr=1e-3),
    }
    models: dict[str, nn.Module] = {"eager": eager, "ort": wrapped}
    g = torch.Generator().manual_seed(1)
    batches = [torch.randint(0, vocab, (batch, seq + 1), generator=g).to(target) for _ in range(steps + warmup)]

    def train_step(name: str, ids: torch.Tensor) -> float:
        logits = models[name](ids[:, :-1])
        loss = nn.functional.cross_entropy(logits.reshape(-1, vocab), ids[:, 1:].reshape(-1))
        optimizers[name].zero_grad(set_to_none=True)
        loss.backward()
        optimizers[name].step()
        return loss.item()

    def infer_step(name: str, ids: torch.Tensor) -> float:
        with torch.no_grad():
            return float(models[name](ids[:, :-1]).float().mean().item())

    train_ms, losses = _alternating(train_step, batches, warmup, target)
    for model in models.values():
        model.eval()
    infer_ms, _ = _alternating(infer_step, batches, warmup, target)
    eager_train, ort_train = statistics.median(train_ms["eager"]), statistics.median(train_ms["ort"])
    eager_infer, ort_infer = statistics.median(infer_ms["eager"]), statistics.median(infer_ms["ort"])
    return BenchResult(
        device=device,
        config={
            "batch": batch,
            "seq": seq,
            "width": width,
            "layers": layers,
            "heads": heads,
            "vocab": vocab,
            "steps": steps,
        },
        eager_train_ms=eager_train,
        ort_train_ms=ort_train,
        train_speedup=eager_train / ort_train,
        eager_infer_ms=eager_infer,
        ort_infer_ms=ort_infer,
        infer_speedup=eager_infer / ort_infer,
        export_seconds=wrapped.statistics.export_seconds,
        max_abs_loss_diff=max(abs(a - b) for a, b in zip(losses["eager"], losses["ort"])),
    )


def _alternating(
    step: Callable[[str, torch.Tensor], float],
    batches: list[torch.Tensor],
    warmup: int,
    device: torch.device,
    block: int = 5,
) -> tuple[dict[str, list[float]], dict[str, list[float]]]:
    """Run both models on the same batches, alternating blocks of ``block`` timed steps.

    Blocks rather than single steps: each runtime's thread pools settle between its own steps, so one runtime's
    idle threads are not timed as the other's cost; alternation still spreads machine drift over both.
    """
    times: dict[str, list[float]] = {"eager": [], "ort": []}
    values: dict[str, list[float]] = {"eager": [], "ort": []}
    for name in times:
        values[name].extend(step(name, ids) for ids in batches[:warmup])
    timed = batches[warmup:]
    for first in range(0, len(timed), block):
        for name in times:
            for ids in timed[first : first + block]:
                _sync(device)
                start = time.perf_counter()
                values[name].append(step(name, ids))
                _sync(device)
                times[name].append((time.perf_counter() - start) * 1e3)
    return times, values


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def main(argv: list[str] | None = None) -> BenchResult:
    parser = argparse.ArgumentParser(prog="python -m lightning_ort.bench", description=__doc__)
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--seq", type=int, default=64)
    parser.add_argument("--width", type=int, default=128)
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--heads", type=int, default=4)
    parser.add_argument("--vocab", type=int, default=1000)
    parser.add_argument("--json", type=Path, help="also write the result as JSON to this file")
    args = parser.parse_args(argv)
    result = run(
        args.device, args.steps, args.warmup, args.batch, args.seq, args.width, args.layers, args.heads, args.vocab
    )
    print(f"lightning_ort benchmark on {result.device}: {result.config}")
    for label, eager_ms, ort_ms, speedup in (
        ("train", result.eager_train_ms, result.ort_train_ms, result.train_speedup),
        ("infer", result.eager_infer_ms, result.ort_infer_ms, result.infer_speedup),
    ):
        print(f"  {label} step  eager {eager_ms:8.2f} ms   ORT {ort_ms:8.2f} ms   speedup {speedup:5.2f}x")
    print(f"  first-call graph building: {result.export_seconds:.2f} s")
    print(f"  max |loss eager - loss ORT| over the run: {result.max_abs_loss_diff:.2e}")
    if args.json:
        args.json.write_text(json.dumps(asdict(result), indent=2))
    return result


if __name__ == "__main__":
    main()
