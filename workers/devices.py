"""What a host offers: its devices (CUDA GPUs when present, else ``cpu``) and memory, and the
environment that pins a model process to one device."""

from __future__ import annotations

import logging
import os
import shutil
import subprocess
from collections.abc import Mapping

import psutil

# Slots and device kinds are the ledger's too (what a load is counted for): defined there.
from residency.ledger import DEFAULT_PARALLEL as DEFAULT_PARALLEL
from residency.ledger import default_parallel as default_parallel
from residency.ledger import is_cpu as is_cpu

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


def device_totals(device_list: list[str]) -> dict[str, int | None]:
    """Total memory per device in bytes: the host's memory for a CPU device, NVML's total for a
    GPU (None when unknown: no pynvml, or NVML fails; that device then has no byte budget unless
    ``[worker] device_budget_mb`` sets one)."""
    out: dict[str, int | None] = {d: (memory_total() if is_cpu(d) else None) for d in device_list}
    gpus = [d for d in device_list if d.startswith("cuda:")]
    if not gpus:
        return out
    try:
        import pynvml
    except ImportError:
        return out
    try:
        pynvml.nvmlInit()
        try:
            for d in gpus:
                h = pynvml.nvmlDeviceGetHandleByIndex(int(d.split(":", 1)[1]))
                out[d] = int(pynvml.nvmlDeviceGetMemoryInfo(h).total)
        finally:
            pynvml.nvmlShutdown()
    except (pynvml.NVMLError, ValueError) as e:
        log.warning("GPU memory totals unknown (%s): no byte budget without device_budget_mb", e)
    return out


#: Variables a model process inherits by exact name. Everything else of the agent's environment
#: (the admin key, remote API keys, cloud credentials...) stays behind: a model process runs
#: third-party native code on untrusted prompts and needs none of it.
CHILD_ENV_NAMES = frozenset(
    {
        "PATH",
        "HOME",
        "USER",
        "LOGNAME",
        "LANG",
        "LANGUAGE",
        "TZ",
        "TMPDIR",
        "PYTHONPATH",
        "PYTHONHOME",
        "PYTHONUNBUFFERED",
        "PYTHONDONTWRITEBYTECODE",
        "VIRTUAL_ENV",
        "LD_LIBRARY_PATH",
        "XDG_CACHE_HOME",
        "RESIDENCY_LOG_LEVEL",
        "RESIDENCY_REDIS_URL",
    }
)
#: ... and by prefix: locale, GPU runtimes (device selection, caches), OpenMP/BLAS and llama.cpp
#: tuning.
CHILD_ENV_PREFIXES = (
    "LC_",
    "CUDA_",
    "HIP_",
    "ROCR_",
    "HSA_",
    "OMP_",
    "KMP_",
    "GOMP_",
    "OPENBLAS_",
    "MKL_",
    "GGML_",
    "LLAMA_CPP_",
)
#: A prefixed name that looks like a secret is dropped all the same.
_SECRET_WORDS = ("KEY", "TOKEN", "SECRET", "PASSWORD", "PASSWD", "CREDENTIAL", "AUTH")


def _inherited(name: str) -> bool:
    if name in CHILD_ENV_NAMES:
        return True
    return name.startswith(CHILD_ENV_PREFIXES) and not any(w in name for w in _SECRET_WORDS)


#: How long llama.cpp's OpenMP threads spin for the next decode before they sleep, unless the
#: operator sets GOMP_SPINCOUNT or OMP_WAIT_POLICY. libgomp's default (300,000 spins, several
#: milliseconds) keeps a core busy after every decode: between a model process's decodes its
#: own serving threads, the web tier and Redis need that core (measured on 2 cores, tiny model:
#: 12.2 ms of CPU per request with the default, 6.0 ms with this; Gemma 3 270M streamed as fast).
#: Sleeping at once (OMP_WAIT_POLICY=passive) made every decode wait for woken threads: 15x slower.
OMP_SPIN_COUNT = "10000"


def child_env(device: str, base: Mapping[str, str]) -> dict[str, str]:
    """Environment of a model process on ``device``: only the allow-listed variables of
    ``base`` (see ``CHILD_ENV_NAMES``), and exactly one GPU visible, or none; OpenMP spins
    ``OMP_SPIN_COUNT`` unless ``base`` says how it should wait."""
    env = {k: v for k, v in base.items() if _inherited(k)}
    if "GOMP_SPINCOUNT" not in env and "OMP_WAIT_POLICY" not in env:
        env["GOMP_SPINCOUNT"] = OMP_SPIN_COUNT
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


def default_threads(affinity: set[int] | None = None) -> int:
    """llama.cpp threads for a model process that does not set ``n_threads``: one per core it
    may run on (its CPU affinity, which the agent pins per device). llama-cpp-python's own
    default is half the machine's cores — one thread on a 2-core box, about 0.65x the tokens/s
    of two."""
    cores = affinity if affinity is not None else os.sched_getaffinity(0)
    return max(1, len(cores))


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
