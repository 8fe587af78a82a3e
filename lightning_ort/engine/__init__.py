"""The machinery behind :class:`~lightning_ort.ORTModule`, a package per stage in the order a call travels:

1. :mod:`.capture`: TorchDynamo's backend, AOTAutograd into forward and backward graphs, and the build of
   each graph into runners (block graphs, the per-op fallback);
2. :mod:`.fx`: passes over those ATen graphs (replacements, decompositions, random ops as inputs, outputs);
3. :mod:`.onnx`: the export to ONNX through ``torch.onnx``, and passes over the ONNX model;
4. :mod:`.runtime`: ONNX Runtime sessions over PyTorch memory, the disk cache, profiles.

Imports point down that list only: a stage uses what the later ones make (capture builds sessions), never the
reverse. Beside them, :mod:`.torch_internals` and :mod:`.ort_internals` are the one place for each library's
private names, and :mod:`.once` holds process-wide initialisation done once.
"""
