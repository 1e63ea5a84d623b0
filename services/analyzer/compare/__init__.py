"""Comparing one node: the metric definitions, their fused kernel and the
worst-element search, tolerances, coverage of the answer."""
