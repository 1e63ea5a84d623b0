"""What a job writes: tables, the HTML page, plots, the graph-viewer export,
the listing, performance tables, perf-diff."""
