"""Process memory behaviour for large tensors.

glibc serves allocations below a dynamic threshold (which grows up to 32 MiB
after large blocks are freed) from its heap, and keeps freed heap memory
instead of returning it to the system. A job frees hundreds of node tensors
of 1-30 MiB one after the other, so without this the process keeps its peak
for the whole job. A fixed threshold makes every large tensor its own mapping,
returned as soon as it is freed.

What stays on the heaps (the many small arrays and objects of each
comparison) churns at their tops: with glibc's default padding of 128 KiB
each heap is shrunk and grown again for nearly every tensor, and every page
grown again is a page fault (four in five of a two-dump comparison's, a
third of its system time). A padding of 16 MiB a heap keeps most of that
memory mapped (168k -> 53k faults comparing two PP-OCRv4 dumps): bounded
by the padding, large tensors unaffected. It costs the analyzer's peak
about 60 MiB on a large job (32 MiB: 34k faults, 100 MiB).

And the cyclic collector: what a server's process has loaded is alive as
long as it is, and is left out of its passes.
"""
from __future__ import annotations

import ctypes
import gc

_M_TOP_PAD = -2
_M_MMAP_THRESHOLD = -3
MMAP_THRESHOLD_BYTES = 256 * 1024
TOP_PAD_BYTES = 16 << 20
_done = False
_frozen = False


def release_freed_tensors_to_system() -> bool:
    """Apply the fixed threshold and the heaps' padding once per process;
    False where not glibc."""
    global _done
    if _done:
        return True
    try:
        # the C library this process runs on, as loaded: find_library would
        # run ldconfig (a fork of the whole process) to name it
        libc = ctypes.CDLL(None)
        _done = bool(libc.mallopt(_M_MMAP_THRESHOLD, MMAP_THRESHOLD_BYTES)) \
            and bool(libc.mallopt(_M_TOP_PAD, TOP_PAD_BYTES))
    except (OSError, AttributeError):
        _done = False
    return _done


def leave_loaded_out_of_collection() -> None:
    """What the process has loaded by now (modules, classes, functions,
    alive as long as it is) is left out of the cyclic collector's passes
    (gc.freeze): its one full pass in a two-dump job went over them, 29 ms
    in the middle of the comparisons. Once a process, when its first server
    has started (a program that runs job after job freezes what it held
    then, once); what is made later is collected as ever, and as often."""
    global _frozen
    if not _frozen:
        _frozen = True
        gc.freeze()
