"""What a model process measures of its own footprint after its load, and the estimate it
keeps beside it (``residency.footprint``)."""

from __future__ import annotations

import logging
import os

import psutil

from residency import footprint
from residency.settings import ModelSpec

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


def effective_gpu_layers(spec: ModelSpec, device: str) -> int:
    """The n_gpu_layers a load on ``device`` uses (a CPU device never offloads)."""
    return spec.n_gpu_layers if footprint.device_kind(device) != "cpu" else 0


def estimated(spec: ModelSpec, device: str, slots: int) -> int | None:
    """The estimate's total for ``spec`` on ``device`` with ``slots`` slots; None when the file's
    header cannot be read (the load itself succeeded: the estimate never fails it)."""
    if spec.path is None:
        return None
    try:
        h = footprint.read_header(spec.path)
        return footprint.estimate(
            h,
            n_ctx=spec.n_ctx,
            slots=slots,
            n_batch=spec.n_batch,
            model_type=spec.type,
            n_gpu_layers=effective_gpu_layers(spec, device),
            device=device,
        ).total
    except (OSError, ValueError, KeyError, TypeError) as e:
        log.warning("no footprint estimate for %s: %s", spec.path, e)
        return None


def digest(spec: ModelSpec, device: str, slots: int) -> str | None:
    """``footprint.spec_digest`` of this load; None for a file that is gone."""
    if spec.path is None:
        return None
    try:
        size = os.stat(spec.path).st_size
    except OSError:
        return None
    return footprint.spec_digest(
        path=spec.path,
        size=size,
        model_type=spec.type,
        n_ctx=spec.n_ctx,
        slots=slots,
        n_batch=spec.n_batch,
        n_gpu_layers=effective_gpu_layers(spec, device),
        device=device,
    )
