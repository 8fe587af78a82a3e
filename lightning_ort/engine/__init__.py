"""The machinery behind :class:`~lightning_ort.ORTModule`.

A call travels through these modules in order:

* :mod:`.signature` flattens the user's arguments into tensors plus a hashable structure (the cache key).
* :mod:`.capture` traces the module with AOTAutograd into forward/backward (or inference) FX graphs.
* :mod:`.export` turns each FX graph into an ONNX model (random ops lifted out, optional saving).
* :mod:`.session` runs an ONNX model in an ``onnxruntime.InferenceSession`` over PyTorch memory (IOBinding).
* :mod:`.cache` keeps the built graphs per signature and counts hits, misses and export time.
"""
