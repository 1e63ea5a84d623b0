"""Pairing device tensors with reference tensors: by name, by graph structure, Keras layers, values, layouts."""
