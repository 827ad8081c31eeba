"""What a host offers: its devices (CUDA GPUs when present, else ``cpu``) and memory, and the
environment that pins a model process to one device."""

from __future__ import annotations

import logging
import os
import shutil
import subprocess

import psutil

log = logging.getLogger(__name__)


def parse_nvidia_smi(output: str) -> list[str]:
    """``nvidia-smi --query-gpu=index --format=csv,noheader`` → ``["cuda:0", …]``."""
    return [f"cuda:{line.strip()}" for line in output.splitlines() if line.strip().isdigit()]


def discover(environ: dict[str, str] | None = None) -> list[str]:
    env = os.environ if environ is None else environ
    forced = env.get("RESIDENCY_DEVICES")
    if forced:
        # e.g. "cuda:0,cuda:1" or "cpu:0-3,cpu:4-7" (cores joined with '+': "cpu:0+2")
        return [d.strip() for d in forced.split(",") if d.strip()]
    smi = shutil.which("nvidia-smi")
    if smi:
        try:
            out = subprocess.run(
                [smi, "--query-gpu=index", "--format=csv,noheader"],
                capture_output=True,
                text=True,
                timeout=10,
                check=True,
            ).stdout
            gpus = parse_nvidia_smi(out)
            if gpus:
                return gpus
        except (subprocess.SubprocessError, OSError):
            pass
    return ["cpu"]


def memory_total() -> int:
    return int(psutil.virtual_memory().total)


def child_env(device: str, base: dict[str, str]) -> dict[str, str]:
    """Environment of a model process on ``device``: exactly one GPU visible, or none."""
    env = dict(base)
    if device.startswith("cuda:"):
        env["CUDA_VISIBLE_DEVICES"] = device.split(":", 1)[1]
    else:
        # A CPU model must not grab a GPU the agent can see (llama.cpp would offload to it).
        env["CUDA_VISIBLE_DEVICES"] = ""
    return env


def cpu_affinity(device: str) -> set[int] | None:
    """``cpu:0-3+6`` → {0, 1, 2, 3, 6}: a CPU device may name the cores its model may use
    (set with RESIDENCY_DEVICES); plain ``cpu`` and GPUs keep the agent's affinity."""
    if not device.startswith("cpu:"):
        return None
    cores: set[int] = set()
    for part in device.split(":", 1)[1].split("+"):
        lo, _, hi = part.partition("-")
        cores.update(range(int(lo), int(hi or lo) + 1))
    return cores


def memory_used(device_list: list[str], pressure_override: float | None = None) -> dict[str, float]:
    """Fraction of memory in use per device: NVML for a GPU when pynvml is installed, system
    memory otherwise (a CPU model lives in it). ``pressure_override`` (the ``memory_pressure``
    fault, for drills) replaces every reading."""
    if pressure_override is not None:
        return {d: pressure_override for d in device_list}
    system = psutil.virtual_memory().percent / 100.0
    out = {d: system for d in device_list}
    gpus = [d for d in device_list if d.startswith("cuda:")]
    if not gpus:
        return out
    try:
        import pynvml
    except ImportError:
        return out  # no NVML bindings: system memory stands in (see the docstring)
    try:
        pynvml.nvmlInit()
        try:
            for d in gpus:
                h = pynvml.nvmlDeviceGetHandleByIndex(int(d.split(":", 1)[1]))
                info = pynvml.nvmlDeviceGetMemoryInfo(h)
                out[d] = float(info.used) / float(info.total)
        finally:
            pynvml.nvmlShutdown()
    except pynvml.NVMLError as e:
        log.warning("GPU memory unknown (%s); auto_evict uses system memory", e)
    return out
