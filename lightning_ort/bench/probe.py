"""One measurement in a fresh process, for the benchmark's studies: ``python -m lightning_ort.bench.probe``.

The studies start it themselves (a fresh process per runtime or layer count, so that neither memory nor
compiled state carries over) and read the one JSON line it prints:

* ``depth KIND --layers N``: a first step at one layer count (:func:`lightning_ort.bench.depth.probe`);
* ``shapes MODEL MODE --lengths ...``: one model in one shapes mode (:func:`lightning_ort.bench.shapes.probe`);
* ``memory WORKLOAD --runtime R``: the peak memory of one runtime (:func:`lightning_ort.bench.runner.memory_probe`).
"""

from __future__ import annotations

import argparse
import json
from collections.abc import Sequence
from typing import Any

import torch

from lightning_ort.bench import depth, shapes
from lightning_ort.bench.runner import build_workloads, memory_probe
from lightning_ort.bench.runtimes import runtime_name
from lightning_ort.bench.workloads import WORKLOADS


def main(argv: Sequence[str] | None = None) -> dict[str, Any]:
    """Take one measurement and print it as one JSON line; returns it."""
    parser = argparse.ArgumentParser(prog="python -m lightning_ort.bench.probe", description=__doc__)
    kinds = parser.add_subparsers(dest="kind", required=True)
    first = kinds.add_parser("depth")
    first.add_argument("runtime")
    first.add_argument("--layers", type=int, required=True)
    first.add_argument("--width", type=int, required=True)
    first.add_argument("--steps", type=int, required=True)
    first.add_argument("--device", default="cpu")
    padded = kinds.add_parser("shapes")
    padded.add_argument("model", choices=shapes.MODELS)
    padded.add_argument("mode", choices=shapes.MODES)
    padded.add_argument("--lengths", type=int, nargs="+", required=True)
    padded.add_argument("--layers", type=int, required=True)
    padded.add_argument("--width", type=int, required=True)
    padded.add_argument("--steps", type=int, required=True)
    memory = kinds.add_parser("memory")
    memory.add_argument("workload", help=f"one of {sorted(WORKLOADS)}, or package.module:factory")
    memory.add_argument("--runtime", type=runtime_name, required=True)
    memory.add_argument("--device", default="cpu")
    memory.add_argument("--precision", default="fp32")
    memory.add_argument("--memory-format", default="contiguous")
    args = parser.parse_args(argv)
    measured: dict[str, Any]
    if args.kind == "depth":
        measured = depth.probe(args.runtime, args.layers, args.width, args.steps, torch.device(args.device))
    elif args.kind == "shapes":
        measured = shapes.probe(args.model, args.mode, args.lengths, args.layers, args.width, args.steps)
    else:
        device = torch.device(args.device)
        names, modules = ([args.workload], []) if args.workload in WORKLOADS else ([], [args.workload])
        (workload,) = build_workloads(names, modules, device, args.memory_format)
        measured = {"peak_mib": memory_probe(workload, args.runtime, device, args.precision)}
    print(json.dumps(measured))
    return measured


if __name__ == "__main__":
    main()
