"""The machinery behind :class:`~lightning_ort.ORTModule`, in the order a call travels through it.

Capture (TorchDynamo, then AOTAutograd):

* :mod:`.backend`: the TorchDynamo backend; one :class:`~.capture.CapturedGraph` per graph TorchDynamo traces,
  with the statistics and the warnings of graph breaks;
* :mod:`.capture`: AOTAutograd over a TorchDynamo graph, into forward and backward (or inference) graphs, each
  built into ONNX Runtime sessions; the per-op fallback when some ops cannot be;
* :mod:`.blocks`: block graphs, one pair of sessions shared by every instance of a repeated block class;
* :mod:`.dynamic`: symbolic sizes, and their values per call.

FX passes, on the ATen graphs:

* :mod:`.replacements` and :mod:`.decompositions`: ``torch.nn.functional`` calls and ATen ops replaced by forms
  that have ONNX translations and run fast in ONNX Runtime;
* :mod:`.fx_passes`: rewrites of the traced graphs (summed ``select_backward`` as one ``stack``...);
* :mod:`.noise`: random ops lifted out as inputs drawn from PyTorch's generator;
* :mod:`.layout`: graph outputs without duplicates or ``None``, and how to place them back;
* :mod:`.partition`: the split around ops that run in PyTorch.

Export and ONNX passes:

* :mod:`.export`: an FX graph to an ONNX model through ``torch.onnx``;
* :mod:`.onnx_passes`: rewrites of the ONNX model for faster ONNX Runtime kernels.

Sessions and caches:

* :mod:`.session`: an ``onnxruntime.InferenceSession`` run over PyTorch memory (IOBinding);
* :mod:`.openmp`: PyTorch's idle OpenMP threads released before CPU runs;
* :mod:`.disk_cache`: exported graphs on disk, keyed by everything that shapes them;
* :mod:`.profiling`: ONNX Runtime's profiles, summed by op type.

And :mod:`.torch_internals`, the one place that imports torch's private names; :mod:`.once`, process-wide
initialisation done once.
"""
