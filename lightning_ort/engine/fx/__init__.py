"""FX passes on the ATen graphs AOTAutograd produces, before they are exported to ONNX.

* :mod:`.replacements` and :mod:`.decompositions`: ``torch.nn.functional`` calls and ATen ops replaced by forms
  that have ONNX translations and run fast in ONNX Runtime;
* :mod:`.passes`: rewrites of the traced graphs (summed ``select_backward`` as one ``stack``...);
* :mod:`.noise`: random ops lifted out as inputs drawn from PyTorch's generator;
* :mod:`.layout`: graph outputs without duplicates or ``None``, and how to place them back;
* :mod:`.dynamic`: symbolic sizes, and their values per call;
* :mod:`.precision`: the dtypes the CPU fast paths take (float32, and autocast's ``bfloat16``).
"""
