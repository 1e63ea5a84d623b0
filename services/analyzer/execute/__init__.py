"""Where comparisons run: the local pool, or Celery workers fed through the
tensor store. Everything a worker imports is here."""
