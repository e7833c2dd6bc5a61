"""Helpers shared by the P/D test files (not a test module)."""

from __future__ import annotations

import threading
from collections.abc import Iterator
from contextlib import contextmanager

from kvstage.pd.prefill import PrefillWorker


@contextmanager
def serving(worker: PrefillWorker) -> Iterator[PrefillWorker]:
    """Serve ``worker`` from a daemon thread; stop, join and close it on exit."""
    stop = threading.Event()

    def loop() -> None:
        while not stop.is_set():
            worker.serve_once(0.002)

    thread = threading.Thread(target=loop, daemon=True, name="prefill")
    thread.start()
    try:
        yield worker
    finally:
        stop.set()
        thread.join(timeout=5)
        worker.close()
