"""Vendor performance counters beside a dump."""
