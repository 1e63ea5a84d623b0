"""A job's lifecycle: the job and its runner, its preparation at submit time,
the stream consumer, the receiving side of a capture, its memory budget, the
records kept across restarts."""
