"""The FP32 reference: ONNX on onnxruntime, TensorFlow, a golden dump; computed in segments within the memory budget."""
