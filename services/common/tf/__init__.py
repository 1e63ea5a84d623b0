"""TensorFlow model handling shared by the analyzer (reference runs) and the collector (device runs):
formats, archives, loading and freezing, the op sites, running on TensorFlow's own thread. TensorFlow
itself is imported only when a TensorFlow model is given."""
