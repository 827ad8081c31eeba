"""What a model process measures of its own footprint after its load (the estimate it keeps
beside it is ``residency.ledger``'s)."""

from __future__ import annotations

import logging
import os

import psutil

from residency import footprint

log = logging.getLogger(__name__)


def measured(device: str, pid: int | None = None) -> int | None:
    """Bytes the process ``pid`` (this one by default) holds on ``device``: its whole resident
    set on a CPU; its device memory by NVML on a GPU (None without pynvml, or when NVML does
    not list the process, e.g. inside a container whose pids it does not see)."""
    pid = os.getpid() if pid is None else pid
    if footprint.device_kind(device) == "cpu":
        return int(psutil.Process(pid).memory_info().rss)
    try:
        import pynvml
    except ImportError:
        return None
    try:
        pynvml.nvmlInit()
        try:
            h = pynvml.nvmlDeviceGetHandleByIndex(int(device.split(":", 1)[1]))
            for p in pynvml.nvmlDeviceGetComputeRunningProcesses(h):
                if p.pid == pid and p.usedGpuMemory is not None:
                    return int(p.usedGpuMemory)
            return None
        finally:
            pynvml.nvmlShutdown()
    except (pynvml.NVMLError, ValueError, IndexError) as e:
        log.warning("no GPU memory reading for %s: %s", device, e)
        return None
