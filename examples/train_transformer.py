"""Demo: train a small transformer language model through ORTModule on synthetic data, then print statistics.

python examples/train_transformer.py            # 60 steps on CPU
python examples/train_transformer.py --fast     # 8 steps (what CI runs)
"""

from __future__ import annotations

import argparse

import torch
from torch import nn

from lightning_ort import DebugOptions, LogLevel, ORTModule


class TinyLM(nn.Module):
    def __init__(self, vocab: int = 96, width: int = 64, context: int = 32) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab, width)
        self.position = nn.Parameter(torch.randn(context, width) * 0.02)
        layer = nn.TransformerEncoderLayer(width, 4, 4 * width, dropout=0.1, batch_first=True)
        self.encoder = nn.TransformerEncoder(layer, 2, enable_nested_tensor=False)
        self.head = nn.Linear(width, vocab)
        self.register_buffer("mask", nn.Transformer.generate_square_subsequent_mask(context), persistent=False)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        n = ids.shape[1]
        hidden = self.encoder(self.embed(ids) + self.position[:n], mask=self.mask[:n, :n], is_causal=True)
        return self.head(hidden)


def synthetic_batch(generator: torch.Generator, batch: int = 16, length: int = 33, vocab: int = 96) -> torch.Tensor:
    """Sequences that count upwards from a random start: easy to learn, so the loss visibly drops."""
    start = torch.randint(0, vocab, (batch, 1), generator=generator)
    return (start + torch.arange(length)) % vocab


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=60)
    parser.add_argument("--fast", action="store_true", help="8 steps, for CI")
    args = parser.parse_args()
    steps = 8 if args.fast else args.steps

    torch.manual_seed(0)
    model = ORTModule(TinyLM(), DebugOptions(log_level=LogLevel.WARNING))
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3)
    generator = torch.Generator().manual_seed(0)
    for step in range(1, steps + 1):
        ids = synthetic_batch(generator)
        logits = model(ids[:, :-1])
        loss = nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), ids[:, 1:].reshape(-1))
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        if step == 1 or step % 10 == 0 or step == steps:
            print(f"step {step:3d}  loss {loss.item():.4f}")

    model.eval()
    with torch.no_grad():
        ids = synthetic_batch(generator, batch=4)
        accuracy = (model(ids[:, :-1]).argmax(-1) == ids[:, 1:]).float().mean().item()
    stats = model.statistics
    print(f"eval next-token accuracy: {accuracy:.2%}")
    print(f"providers: {model.providers}")
    print(
        f"graph building: {stats.build_seconds:.2f} s, cache hits {stats.cache_hits}, misses {stats.cache_misses}, "
        f"graphs {stats.cached_graphs}, ORT runs: forward {stats.forward_runs}, backward {stats.backward_runs}"
    )


if __name__ == "__main__":
    main()
