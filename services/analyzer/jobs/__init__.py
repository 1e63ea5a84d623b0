"""A job's lifecycle: its runner, the stream consumer, the receiving side of a capture, its memory budget, the records kept across restarts."""
