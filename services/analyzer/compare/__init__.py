"""Comparing one node: the metric definitions and their fused kernel, tolerances, coverage of the answer."""
