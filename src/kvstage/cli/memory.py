"""Refuse an allocation sized from user input before it is made.

A command that sizes a pool, a host buffer or a request from a flag computes what it will
allocate and calls `check_fits` first: over what the machine has free, it raises
``argparse.ArgumentTypeError`` with one line naming the flag, the bytes needed and the
bytes available, and the fix (the CLI turns it into exit 2). Host memory is
``MemAvailable`` from /proc/meminfo (else ``os.sysconf``'s available pages); CUDA memory
is ``torch.cuda.mem_get_info`` (torch imported only for ``device="cuda"``). Pure
functions, no state; imports neither NIXL nor CUDA at import time.
"""

from __future__ import annotations

import argparse
import os

#: the share of the free memory a command may plan to use: the interpreter, torch and
#: the allocator's own overhead need the rest
USABLE_FRACTION = 0.9


def host_available_bytes(meminfo: str = "/proc/meminfo") -> int | None:
    """Bytes of host memory available to a new allocation, or None where unknown."""
    try:
        with open(meminfo) as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024  # the kernel reports kB
    except (OSError, ValueError, IndexError):
        pass
    try:
        return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError, AttributeError):
        return None


def device_available_bytes(device: str) -> int | None:
    """Free bytes on ``device`` (cuda), or None for cpu or where unknown."""
    if not device.startswith("cuda"):
        return None
    import torch  # only for a CUDA device

    if not torch.cuda.is_available():
        return None
    free, _total = torch.cuda.mem_get_info()
    return int(free)


def gib(nbytes: float) -> str:
    return f"{nbytes / 2**30:.1f} GiB" if nbytes >= 2**30 else f"{nbytes / 2**20:.1f} MiB"


def check_fits(what: str, host_bytes: int, fix: str, *, device: str = "cpu",
               device_bytes: int = 0, available: int | None = None) -> None:
    """Raise ArgumentTypeError if ``host_bytes`` (plus ``device_bytes`` when the device is
    the CPU) exceed `USABLE_FRACTION` of the available host memory, or ``device_bytes``
    that of the CUDA device's. ``what`` names the flags that set the size (e.g.
    ``"--blocks-per-request 100000"``); ``fix`` says what to change. ``available``
    overrides the host figure (tests)."""
    on_host = host_bytes + (device_bytes if not device.startswith("cuda") else 0)
    free = host_available_bytes() if available is None else available
    if free is not None and on_host > USABLE_FRACTION * free:
        raise argparse.ArgumentTypeError(
            f"{what} needs {gib(on_host)} of host memory but {gib(free)} is available "
            f"(MemAvailable); {fix}")
    if device.startswith("cuda") and device_bytes:
        dev_free = device_available_bytes(device)
        if dev_free is not None and device_bytes > USABLE_FRACTION * dev_free:
            raise argparse.ArgumentTypeError(
                f"{what} needs {gib(device_bytes)} of {device} memory but {gib(dev_free)} "
                f"is free; {fix}")
