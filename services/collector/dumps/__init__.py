"""Dump directories read where they lie: formats, Ascend dumps and overflow records, the dump's graph and config, watch mode, conversion."""
