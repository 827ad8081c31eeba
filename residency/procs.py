"""Child-process hygiene: children die with their parent and are stopped with a deadline."""

from __future__ import annotations

import ctypes
import os
import signal
import subprocess
import sys
from collections.abc import Callable

_PR_SET_PDEATHSIG = 1

#: The exit status of a model process whose engine thread died (it can decode nothing more).
ENGINE_DIED_EXIT = 70


def exit_reason(code: int) -> str:
    """How the agent names a model process's exit."""
    if code == ENGINE_DIED_EXIT:
        return f"process exited with {code}: its engine thread died"
    return f"process exited with {code}"


def die_with_parent() -> Callable[[], None]:
    """A ``preexec_fn`` for every child: SIGTERM it when the process that spawned it dies, so a
    crashed (even SIGKILLed) supervisor, agent or test leaves no orphans."""
    parent = os.getpid()

    def _preexec() -> None:
        if sys.platform.startswith("linux"):
            libc = ctypes.CDLL(None, use_errno=True)
            libc.prctl(_PR_SET_PDEATHSIG, signal.SIGTERM, 0, 0, 0)
            # The parent may have died before prctl ran: then we were re-parented already.
            if os.getppid() != parent:
                os._exit(1)

    return _preexec


def terminate(proc: subprocess.Popen[bytes], timeout: float) -> int:
    """SIGTERM, wait up to ``timeout``, then SIGKILL. Returns the exit status."""
    if proc.poll() is None:
        try:
            proc.terminate()
            return proc.wait(timeout)
        except subprocess.TimeoutExpired:
            proc.kill()
    return proc.wait()
