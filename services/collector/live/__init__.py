"""Live device runs: onnxruntime (execution providers), TensorFlow, the profiler."""
