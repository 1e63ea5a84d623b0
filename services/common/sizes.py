"""Message sizes every stream keeps to (gRPC's and Arrow Flight's, and the
files a collector reads for them), apart from the network code itself: the
modules that cut or check data by them do not load gRPC."""
from __future__ import annotations

# Payload per message of a stream. 1-4 MiB messages stream faster than larger
# ones (fewer fresh allocations); the hard limit below leaves headroom.
DEFAULT_CHUNK_BYTES = 2 * 1024 * 1024
MAX_MESSAGE_BYTES = 16 * 1024 * 1024
