"""The benchmark, ``python -m lightning_ort.bench``: speed and memory reported as ratios measured in one run.

* :mod:`~lightning_ort.bench.runner`: the command line, and the training-step comparison of eager PyTorch,
  ``torch.compile`` (inductor) and ORTModule on each workload;
* :mod:`~lightning_ort.bench.workloads`: the reference workloads and the ``--module`` factory contract;
* :mod:`~lightning_ort.bench.runtimes`: the runtimes by name (``ort/attention=torch``...) and the step each runs;
* :mod:`~lightning_ort.bench.vision`: the vision networks of the ``resnet18``, ``mobilenet``, ``convnext``,
  ``efficientnet`` and ``unet`` workloads, in plain ``torch.nn``;
* :mod:`~lightning_ort.bench.depth`: ``depth``, the first step against layer count;
* :mod:`~lightning_ort.bench.shapes`: ``shapes``, the build cost of each new padded length;
* :mod:`~lightning_ort.bench.fsdp`: ``fsdp``, sharded training against replicated;
* :mod:`~lightning_ort.bench.memory`: ``memory``, the CUDA memory routes side by side;
* :mod:`~lightning_ort.bench.report`: what every study's report holds first; each study has its own type;
* :mod:`~lightning_ort.bench.probe`: the measurements the studies take in fresh processes.
"""
