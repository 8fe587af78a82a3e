"""Capture: TorchDynamo's graphs through AOTAutograd into forward and backward graphs, built into runners.

* :mod:`.backend`: the TorchDynamo backend (:class:`~.backend.ORTBackend`), its statistics, and the warnings
  of graph breaks;
* :mod:`.aot`: AOTAutograd over one TorchDynamo graph (:class:`~.aot.CapturedGraph`), into forward and
  backward (or inference) graphs, with bisection to the ops that cannot run in ONNX Runtime;
* :mod:`.build`: a captured graph built into runners (:class:`~.build.GraphBuilder`): export, sessions, the
  per-op fallback, and the build log;
* :mod:`.partition`: the split of a graph around the ops that run in PyTorch;
* :mod:`.blocks`: block graphs, one pair of sessions shared by every instance of a repeated block class.
"""
