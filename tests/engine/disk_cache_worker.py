"""One training process with an on-disk graph cache; run by tests/engine/test_disk_cache.py in fresh processes.

Usage: ``python -m tests.engine.disk_cache_worker CACHE_DIR RESULT_JSON``. Trains a small GPT for two steps and
writes its statistics, losses and a checksum of the trained parameters.
"""

from __future__ import annotations

import dataclasses
import json
import sys

import torch

from lightning_ort import ORTModule
from tests.zoo import CausalLM


def main(cache_dir: str, result_path: str) -> None:
    torch.manual_seed(0)
    model = ORTModule(CausalLM(layers=3), cache_dir=cache_dir)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    ids = torch.randint(0, 64, (4, 17), generator=torch.Generator().manual_seed(1))
    losses = []
    for _ in range(2):
        logits = model(ids[:, :-1])
        loss = torch.nn.functional.cross_entropy(logits.reshape(-1, 64), ids[:, 1:].reshape(-1))
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        losses.append(loss.item())
    result = {
        "statistics": dataclasses.asdict(model.statistics),
        "losses": losses,
        "checksum": sum(float(p.double().sum()) for p in model.parameters()),
    }
    with open(result_path, "w") as file:
        json.dump(result, file)


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
