"""Dump directories read where they lie: the directory and its manifest, one reader per format, tiled nodes,
Ascend dumps and overflow records, the dump's graph and config, watch mode, conversion."""
