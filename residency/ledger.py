"""What a load is counted for in a device's memory ledger, and what each device may hold.

A model's bytes on a device are the footprint measured at its last load of the same spec (its
``keys.footprint`` record, see ``residency.footprint.spec_digest``) or, before any, the estimate
from its GGUF header. A device's budget is ``[worker] device_budget_mb`` or, by default, its total
memory less a reserve. Both the coordinator (placement) and the model process (what it records
after its load) use these functions, so they agree on what a load is.
"""

from __future__ import annotations

import functools
import logging
import os

from residency import footprint
from residency.settings import ModelSpec

log = logging.getLogger(__name__)

MIB = footprint.MIB

#: Slots per model when ``[models.X] parallel`` is unset. A CPU's decode is compute-bound:
#: 4 sequences already give most of the batching gain on a few cores (measured on 2 cores, Gemma
#: 3 270M: 8 clients made 1.3x the tokens/s of one at a time with 4 slots, 1.5x with 8) while
#: keeping the context memory at 4x. A GPU batches almost for free, so it gets more.
DEFAULT_PARALLEL = {"cpu": 4, "gpu": 8}


def is_cpu(device: str) -> bool:
    """``cpu``, or ``cpu:0-3`` (a CPU device naming its cores)."""
    return device == "cpu" or device.startswith("cpu:")


def default_parallel(device: str) -> int:
    return DEFAULT_PARALLEL["cpu" if is_cpu(device) else "gpu"]


def slots(spec: ModelSpec, device: str) -> int:
    """Sequences a load of ``spec`` on ``device`` decodes together: embedding and rerank models
    one, chat models their ``parallel`` or the device kind's default."""
    if spec.type in ("embedding", "rerank"):
        return 1
    return spec.parallel or default_parallel(device)


def gpu_layers(spec: ModelSpec, device: str) -> int:
    """The n_gpu_layers a load on ``device`` uses (a CPU device never offloads)."""
    return spec.n_gpu_layers if not is_cpu(device) else 0


@functools.lru_cache(maxsize=256)
def _header(path: str, size: int, mtime_ns: int) -> footprint.Header:
    # Keyed by size and mtime too: a file replaced in place is read again.
    return footprint.read_header(path)


def estimated(spec: ModelSpec, device: str, n_slots: int | None = None) -> int | None:
    """The estimate's total for ``spec`` on ``device``; None when the file's header cannot be
    read (a load of it fails on its own; the estimate never fails anything)."""
    if spec.path is None:
        return None
    try:
        st = os.stat(spec.path)
        h = _header(spec.path, st.st_size, st.st_mtime_ns)
        return footprint.estimate(
            h,
            n_ctx=spec.n_ctx,
            slots=slots(spec, device) if n_slots is None else n_slots,
            n_batch=spec.n_batch,
            model_type=spec.type,
            n_gpu_layers=gpu_layers(spec, device),
            device=device,
        ).total + projector_bytes(spec)
    except (OSError, ValueError, KeyError, TypeError) as e:
        log.warning("no footprint estimate for %s: %s", spec.path, e)
        return None


def digest(spec: ModelSpec, device: str, n_slots: int | None = None) -> str | None:
    """``footprint.spec_digest`` of a load of ``spec`` on ``device``; None for a file that is
    gone."""
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
        slots=slots(spec, device) if n_slots is None else n_slots,
        n_batch=spec.n_batch,
        n_gpu_layers=gpu_layers(spec, device),
        device=device,
        mmproj=None if spec.mmproj is None else (spec.mmproj, projector_bytes(spec)),
    )


def projector_bytes(spec: ModelSpec) -> int:
    """What a model's vision projector adds to its estimate: its file's size (its weights are
    read whole, beside the model's, on the model's device); 0 without one, or when it is gone
    (its load fails on its own)."""
    if spec.mmproj is None:
        return 0
    try:
        return os.stat(spec.mmproj).st_size
    except OSError:
        return 0


def expected(spec: ModelSpec, device: str, recorded: dict[str, str] | None) -> int | None:
    """What a load of ``spec`` on ``device`` is counted for before it happens: the bytes its
    last load of the same digest measured (``recorded``: its ``keys.footprint`` hash), else the
    estimate; None when neither is known."""
    est = estimated(spec, device)
    dig = digest(spec, device)
    if dig is not None and recorded:
        measured = footprint.expected_bytes(-1, recorded, dig)
        if measured >= 0:
            return measured
    return est


def budgets(
    totals: dict[str, int | None], budget_mb: int, reserve_mb: int
) -> dict[str, int | None]:
    """Each device's budget in bytes: ``budget_mb`` when set (> 0); else its total memory less
    ``reserve_mb`` — CPU devices of one host share its memory, so they split what is left evenly.
    None: no byte limit on that device (its total is unknown, e.g. a GPU without NVML)."""
    if budget_mb > 0:
        return {d: budget_mb * MIB for d in totals}
    cpus = [d for d in totals if is_cpu(d)]
    out: dict[str, int | None] = {}
    for d, total in totals.items():
        if total is None:
            out[d] = None
            continue
        left = max(total - reserve_mb * MIB, 0)
        out[d] = left // len(cpus) if is_cpu(d) else left
    return out
