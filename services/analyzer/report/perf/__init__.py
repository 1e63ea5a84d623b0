"""Performance beside accuracy: the per-node table, the CSV tables, the timeline, the report sections,
and perf-diff (two runs against each other)."""
