"""Stopping a run cleanly on SIGINT/SIGTERM: finish the step, checkpoint, stop.

Owns: :class:`StopSignal` (the handlers on the event loop; the first signal asks for a stop
after the current step, a second stops at once) and :class:`StopRequested`.

Imports: nothing of relayrl.
"""

from __future__ import annotations

import asyncio
import signal
import sys
import threading
from collections.abc import Callable
from typing import Any


class StopRequested(KeyboardInterrupt):
    """SIGINT/SIGTERM asked the run to checkpoint and stop (a KeyboardInterrupt, so that
    ``except Exception`` never swallows it and the CLI exits with 130 as for Ctrl-C)."""


class StopSignal:
    """SIGINT/SIGTERM during the loop: finish the current step, checkpoint, stop. A second
    signal stops at once (KeyboardInterrupt, no checkpoint). ``on_stop(StopRequested)`` is
    called on the first signal (the loop passes ``controller.fail``, so a wait for a batch
    ends at once). Only the main thread can own signal handlers; elsewhere this is inert.
    """

    SIGNALS = (signal.SIGINT, signal.SIGTERM)

    def __init__(self, on_stop: Callable[[BaseException], None]) -> None:
        self.on_stop = on_stop
        self.signal_name: str | None = None
        self._previous: dict[int, Any] = {}
        self._loop: asyncio.AbstractEventLoop | None = None

    @property
    def requested(self) -> bool:
        return self.signal_name is not None

    def install(self) -> None:
        if threading.current_thread() is not threading.main_thread():
            return
        self._loop = asyncio.get_running_loop()
        for sig in self.SIGNALS:
            self._previous[sig] = signal.getsignal(sig)
            self._loop.add_signal_handler(sig, self._handle, sig)

    def uninstall(self) -> None:
        if self._loop is None:
            return
        for sig, previous in self._previous.items():
            self._loop.remove_signal_handler(sig)
            signal.signal(sig, previous)
        self._previous.clear()
        self._loop = None

    def _handle(self, sig: int) -> None:
        if self.requested:
            raise KeyboardInterrupt
        self.signal_name = signal.Signals(sig).name
        print(
            f"\n{self.signal_name}: stopping after this step with a checkpoint "
            "(send it again to stop at once)",
            file=sys.stderr,
            flush=True,
        )
        self.on_stop(StopRequested(self.signal_name))
