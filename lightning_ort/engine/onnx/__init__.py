"""ONNX: an FX graph exported through ``torch.onnx`` (:mod:`.export`), then rewritten for faster ONNX Runtime
kernels (:mod:`.passes`)."""
