"""The cost of each new input shape: ``python -m lightning_ort.bench shapes 64 96 80 128``.

Hugging Face users pad each batch to its longest sequence, so the model sees a new length every few steps.
Two models as users build them, from default configs but for their size (GPT-2 ``GPT2LMHeadModel`` with its loss
from ``labels``; BERT ``BertForSequenceClassification``), train on right-padded batches of 4 sequences, one
batch per length in the order given, with block graphs. Each is run in a fresh process per mode:

* ``automatic`` (``dynamic=None``, the default): the first length gets a static graph; the second makes
  TorchDynamo rebuild with symbolic sizes; later lengths reuse that graph;
* ``declared`` (``dynamic_axes`` on the batch and sequence axes of every input): the first graph is symbolic
  and serves every length.

Each length's first step (build included, if any), its slowest later step (a model may recompile on its second
call: Hugging Face's ``BertForSequenceClassification`` sets ``config.problem_type`` in its first) and the median
of its later steps are reported, with the builds so far.
"""

from __future__ import annotations

import json
import statistics
import subprocess
import sys
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn
from typing_extensions import override

from lightning_ort.bench.report import Report
from lightning_ort.bench.workloads import hugging_face_step, import_transformers
from lightning_ort.module import ORTModule

MODELS = ("gpt2", "bert")
MODES = ("automatic", "declared")
BATCH = 4
INPUTS = ("input_ids", "attention_mask", "labels")


@dataclass
class ShapeRun:
    """One model in one mode: per length, the first step (s), the slowest later step (s), the median later step
    (ms) and the builds so far."""

    model: str
    mode: str
    lengths: list[int]
    first_step_s: list[float]
    slowest_later_s: list[float]
    step_ms: list[float]
    builds: list[int]

    @property
    def slowest_after_first_s(self) -> float:
        """The slowest step after the model's very first: the costliest rebuild, or a steady step if none."""
        return max([*self.first_step_s[1:], *self.slowest_later_s])


def hugging_face_model(name: str, layers: int, width: int) -> nn.Module:
    """GPT-2 or BERT from its default config, at ``layers`` layers of ``width`` (heads of 64), dropout as it comes.

    Raises:
        ImportError: ``transformers`` is not installed.
    """
    transformers = import_transformers("shapes")
    heads = max(width // 64, 1)
    if name == "gpt2":
        return transformers.GPT2LMHeadModel(transformers.GPT2Config(n_layer=layers, n_embd=width, n_head=heads))
    config = transformers.BertConfig(
        num_hidden_layers=layers, hidden_size=width, num_attention_heads=heads, intermediate_size=4 * width
    )
    return transformers.BertForSequenceClassification(config)


def padded_batch(name: str, length: int, seed: int, vocab: int) -> dict[str, torch.Tensor]:
    """A right-padded batch whose longest sequence has ``length`` tokens, with its attention mask and labels."""
    generator = torch.Generator().manual_seed(seed)
    lengths = torch.randint(length // 2, length + 1, (BATCH,), generator=generator)
    lengths[0] = length
    ids = torch.randint(0, vocab, (BATCH, length), generator=generator)
    mask = (torch.arange(length) < lengths[:, None]).long()
    ids = ids * mask
    if name == "gpt2":
        return {"input_ids": ids, "attention_mask": mask, "labels": ids.masked_fill(mask == 0, -100)}
    return {"input_ids": ids, "attention_mask": mask, "labels": torch.randint(0, 2, (BATCH,), generator=generator)}


def probe(name: str, mode: str, lengths: Sequence[int], layers: int, width: int, steps: int) -> dict[str, Any]:
    """Train ``name`` in ``mode`` on one batch per length (see the module docstring); what the process reports."""
    torch.manual_seed(0)
    model = hugging_face_model(name, layers, width)
    axes = {"input_ids": [0, 1], "attention_mask": [0, 1], "labels": [0, 1] if name == "gpt2" else [0]}
    wrapped = ORTModule(model, blocks="auto", dynamic_axes=axes if mode == "declared" else None)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
    device = torch.device("cpu")
    config: Any = model.config
    vocab = int(config.vocab_size)
    first, slowest, steady, builds = [], [], [], []
    for index, length in enumerate(lengths):
        batch = padded_batch(name, length, index, vocab)
        first.append(hugging_face_step(wrapped, optimizer, batch, device))
        later = [hugging_face_step(wrapped, optimizer, batch, device) for _ in range(steps)]
        slowest.append(max(later))
        steady.append(statistics.median(later) * 1e3)
        builds.append(wrapped.statistics.onnx_exports)
    return {"first_step_s": first, "slowest_later_s": slowest, "step_ms": steady, "builds": builds}


def run_shapes_study(lengths: Sequence[int], layers: int, width: int, steps: int) -> list[ShapeRun]:
    """Every model in every mode, one fresh process each (on the CPU)."""
    runs = []
    for name in MODELS:
        for mode in MODES:
            command = [sys.executable, "-m", "lightning_ort.bench.probe", "shapes", name, mode]
            command += ["--lengths", *map(str, lengths), "--layers", str(layers)]
            command += ["--width", str(width), "--steps", str(steps)]
            result = subprocess.run(command, capture_output=True, text=True, check=False)
            if result.returncode != 0:
                raise RuntimeError(f"the {name} {mode} shapes probe failed:\n{result.stderr[-3000:]}")
            measured = json.loads(result.stdout.strip().splitlines()[-1])
            runs.append(ShapeRun(name, mode, list(lengths), **measured))
    return runs


def format_shapes_report(runs: Sequence[ShapeRun], layers: int, width: int) -> str:
    """The table ``shapes`` prints: per model and mode, each length's first step, steady step and builds."""
    if not runs:
        return ""
    lengths = runs[0].lengths
    lines = [
        f"new padded lengths (batch {BATCH}, {layers} layers of width {width}, block graphs): each length's first "
        "step in s, its slowest later step in s (builds so far), then the last length's steady step",
        f"{'model':<6}{'mode':<11}" + "".join(f"{f'length {n}':>18}" for n in lengths) + f"{'steady ms':>11}",
    ]
    for run in runs:
        cells = "".join(
            f"{f'{s:.1f} {later:.1f} ({b})':>18}"
            for s, later, b in zip(run.first_step_s, run.slowest_later_s, run.builds, strict=True)
        )
        lines.append(f"{run.model:<6}{run.mode:<11}{cells}{run.step_ms[-1]:>11.0f}")
    for name in dict.fromkeys(r.model for r in runs):
        by_mode = {r.mode: r for r in runs if r.model == name}
        if set(by_mode) == set(MODES):
            automatic, declared = by_mode["automatic"], by_mode["declared"]
            lines.append(
                f"{name}: slowest step after the first, against the first: automatic "
                f"{automatic.slowest_after_first_s / automatic.first_step_s[0]:.2f}x, declared "
                f"{declared.slowest_after_first_s / declared.first_step_s[0]:.2f}x; declared first step against "
                f"automatic {declared.first_step_s[0] / automatic.first_step_s[0]:.2f}x, steady "
                f"{declared.step_ms[-1] / automatic.step_ms[-1]:.2f}x"
            )
    return "\n".join(lines)


@dataclass
class ShapesReport(Report):
    """The ``shapes`` study: each model in each mode over the padded lengths."""

    shapes: list[ShapeRun] = field(default_factory=list)
    layers: int = 0
    width: int = 0

    @override
    def body(self) -> list[str]:
        return [format_shapes_report(self.shapes, self.layers, self.width)]
