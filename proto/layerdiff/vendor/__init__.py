"""Vendor file formats the collector reads (generated stubs; see generate.sh)."""
