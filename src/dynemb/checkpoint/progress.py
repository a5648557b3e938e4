"""Progress bars and throughput logs for checkpoint I/O."""

from __future__ import annotations

import contextlib
import logging
import time
from collections.abc import Iterator

from tqdm.auto import tqdm

__all__ = ["logger", "transfer", "PROGRESS_MIN_BYTES"]

logger = logging.getLogger("dynemb.checkpoint")

#: Transfers smaller than this get no progress bar (they finish before a bar would help).
PROGRESS_MIN_BYTES = 256 << 20


@contextlib.contextmanager
def transfer(what: str, total_bytes: int) -> Iterator:
    """Count the bytes of one save or load; yields ``update(n)``.

    A tqdm bar is shown for transfers of at least :data:`PROGRESS_MIN_BYTES` when stderr is a terminal. When the
    block ends without an error, the throughput is logged at INFO level on the ``dynemb.checkpoint`` logger.
    """
    bar = tqdm(total=total_bytes, desc=what, unit="B", unit_scale=True, unit_divisor=1024, leave=False,
               disable=None if total_bytes >= PROGRESS_MIN_BYTES else True)
    start = time.perf_counter()
    try:
        yield bar.update
    finally:
        bar.close()
    seconds = time.perf_counter() - start
    logger.info("%s: %.1f MB in %.2f s (%.0f MB/s)", what, total_bytes / 1e6, seconds,
                total_bytes / 1e6 / max(seconds, 1e-9))
