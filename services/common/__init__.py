"""What the collector, the analyzer and the client share: the wire schema, errors, artifacts, network, security,
limits, model handling."""
