"""Why a node fails: verdicts and evidence, impact on the outputs, weights, INT8 ranges."""
