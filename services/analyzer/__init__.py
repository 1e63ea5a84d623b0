"""The analyzer: receive a job's device stream, compute the reference, align, compare, diagnose, report."""
