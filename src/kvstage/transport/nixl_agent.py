"""Creating a NIXL agent whose progress thread sleeps while idle.

nixl-cu12 1.5.1's ``nixl_agent.__init__`` builds the C++ ``nixlAgentConfig`` itself and
writes ``pthrDelay = 0`` into it. The C++ progress thread waits on UCX's event fd with
that delay as its timeout, so 0 is a busy loop (an idle agent burns a whole core),
while any delay >= 1 ms lets it sleep when idle and still wake
on traffic. Only the Python wrapper offers no way to pass one. `create_agent` passes
one: while the wrapper runs, the ``nixlBind`` it reads sees a config subclass whose
``pthrDelay`` keeps our value whatever the wrapper writes. Everything else the wrapper
does (backends, bookkeeping) is unchanged, so a later NIXL that exposes the delay needs
only this module changed. Measured cost and effect: BENCHMARKS.md "What do idle
instances cost?".

`progress_delay` is the same as a context manager, for agents others create: kvstage's
vLLM connector wraps vLLM's NIXL worker construction in it.

No NIXL import here: the caller passes the imported ``_api`` module.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Iterator
from types import ModuleType
from typing import Any

__all__ = [
    "DEFAULT_PROGRESS_DELAY_US", "MAX_PROGRESS_DELAY_US", "check_progress_delay", "create_agent",
    "progress_delay",
]

# 1 ms: the shortest delay NIXL honours (it rounds a timeout up to 1 ms); traffic still
# wakes the thread at once (figures: BENCHMARKS.md "What do idle instances cost?").
DEFAULT_PROGRESS_DELAY_US = 1000
MAX_PROGRESS_DELAY_US = 100_000

_SWAP = threading.Lock()  # the wrapper's module global is swapped for one construction


class _BindingsView:
    """NIXL's bindings module with ``nixlAgentConfig`` replaced."""

    def __init__(self, bindings: ModuleType, config_cls: type) -> None:
        self._bindings = bindings
        self.nixlAgentConfig = config_cls

    def __getattr__(self, name: str) -> Any:
        return getattr(self._bindings, name)


def _delayed_config(base: Any, delay_us: int) -> type:
    field = base.pthrDelay  # the C++ field's descriptor

    class DelayedConfig(base):
        def __init__(self) -> None:
            super().__init__()
            field.__set__(self, delay_us)

        @property
        def pthrDelay(self) -> int:  # noqa: N802 - NIXL's name
            return int(field.__get__(self))

        @pthrDelay.setter
        def pthrDelay(self, _value: int) -> None:  # noqa: N802
            field.__set__(self, delay_us)

    return DelayedConfig


def check_progress_delay(delay_us: object) -> int:
    """``delay_us`` as an int in 0..MAX_PROGRESS_DELAY_US, or ValueError saying so."""
    if isinstance(delay_us, bool) or not isinstance(delay_us, int) or not (
            0 <= delay_us <= MAX_PROGRESS_DELAY_US):
        raise ValueError(
            f"progress_delay_us must be an int 0..{MAX_PROGRESS_DELAY_US} (microseconds; "
            f"0: NIXL's busy poll); got {delay_us!r}")
    return delay_us


@contextlib.contextmanager
def progress_delay(api: Any, delay_us: int) -> Iterator[None]:
    """While inside, every ``api.nixl_agent`` created (by kvstage, or by vLLM's NIXL
    connector) gets a progress thread waiting up to ``delay_us`` between polls. One
    construction at a time: the wrapper's module global is swapped back on exit."""
    check_progress_delay(delay_us)
    if delay_us == 0:
        yield
        return
    bindings = api.nixlBind
    view = _BindingsView(bindings, _delayed_config(bindings.nixlAgentConfig, delay_us))
    with _SWAP:
        api.nixlBind = view
        try:
            yield
        finally:
            api.nixlBind = bindings


def create_agent(api: Any, name: str, *, progress_thread: bool, delay_us: int) -> Any:
    """``api.nixl_agent(name)`` with no backend; its progress thread waits on UCX's event
    fd for up to ``delay_us`` (at least 1 ms in NIXL) between polls, so it wakes on
    traffic and sleeps when idle; 0 is NIXL's busy loop. ``progress_thread`` False: no
    thread at all."""
    config = api.nixl_agent_config(enable_prog_thread=progress_thread, backends=[])
    with progress_delay(api, delay_us if progress_thread else 0):
        return api.nixl_agent(name, config)
