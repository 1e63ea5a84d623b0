"""The client: the layerdiff command and the Python API."""
