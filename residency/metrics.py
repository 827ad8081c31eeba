"""Metric names, and the Redis-backed counters and histograms of pool events.

Request metrics are counted in the web processes with prometheus-client (multiprocess mode under
gunicorn). Pool events happen in the coordinator and the model processes, possibly on other
hosts, so they are counted in Redis (one HINCRBY each) and exported by ``/metrics`` in web
through ``RedisCollector`` together with gauges read from the published health record.
"""

from __future__ import annotations

import json
from collections.abc import Iterator, Sequence
from typing import Any

import redis
from prometheus_client.core import (
    CounterMetricFamily,
    GaugeMetricFamily,
    HistogramMetricFamily,
)
from prometheus_client.registry import Collector

from residency import keys
from residency.auth import subject_label

LOADS_TOTAL = "residency_model_loads_total"
LOAD_SECONDS = "residency_model_load_seconds"
EVICTIONS_TOTAL = "residency_evictions_total"
AGE_AT_EVICTION = "residency_age_at_eviction_seconds"
CANCELLED_TOTAL = "residency_generations_cancelled_total"
CANCELLED_CHUNKS_TOTAL = "residency_cancelled_chunks_total"
REQUESTS_TOTAL = "residency_requests_total"
TTFT = "residency_time_to_first_token_seconds"
MAX_LOADED = "residency_max_loaded_models"
LOADED = "residency_loaded_models"
QUEUE_DEPTH = "residency_queue_depth"
PASSES_TOTAL = "residency_enforcement_passes_total"
RECHECKS_TOTAL = "residency_load_commit_rechecks_total"
DEFERRED = "residency_deferred_shrink"
YIELDS_TOTAL = "residency_yields_total"
DEVICE_BUDGET = "residency_device_budget_bytes"
DEVICE_USED = "residency_device_used_bytes"
MODEL_FOOTPRINT = "residency_model_footprint_bytes"
WORKER_UP = "residency_worker_up"
LOADING_SECONDS = "residency_load_running_seconds"
AUTO_EVICT = "residency_auto_evict_enabled"
# Saved slot caches (counted by the model processes) and the disk they use (per host, from the
# health record).
KV_SAVES_TOTAL = "residency_kv_cache_saves_total"
KV_SAVED_BYTES_TOTAL = "residency_kv_cache_saved_bytes_total"
KV_RESTORES_TOTAL = "residency_kv_cache_restores_total"
KV_RESTORED_TOKENS_TOTAL = "residency_kv_cache_restored_tokens_total"
KV_DROPPED_TOTAL = "residency_kv_cache_entries_dropped_total"
KV_RESTORE_SECONDS = "residency_kv_cache_restore_seconds"
KV_DISK_BYTES = "residency_kv_cache_disk_bytes"
# Live slots: prompt prefixes copied from a busy slot, and requests that waited for their own.
SLOT_COPIES_TOTAL = "residency_slot_prefix_copies_total"
SLOT_WAITS_TOTAL = "residency_slot_waits_total"
# Per user, only with ``[metrics] per_user`` (one series per user and model: unbounded by
# configuration, so off by default).
USER_REQUESTS_TOTAL = "residency_user_requests_total"
USER_TOKENS_TOTAL = "residency_user_tokens_total"
# How far a router policy's predicted wait was from the one measured (per routed request a local
# model served; observed by the model process with the request's finish).
ROUTE_WAIT_ERROR = "residency_route_wait_error_seconds"

LOAD_BUCKETS: Sequence[float] = (0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300, 600)
AGE_BUCKETS: Sequence[float] = (1, 5, 15, 30, 60, 120, 300, 600, 1800, 3600, 14400, 86400)
TTFT_BUCKETS: Sequence[float] = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60)

RESTORE_BUCKETS: Sequence[float] = (0.001, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5)
ROUTE_ERROR_BUCKETS: Sequence[float] = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60)

_HISTOGRAMS = {
    LOAD_SECONDS: ("model",),
    AGE_AT_EVICTION: ("model",),
    KV_RESTORE_SECONDS: ("model",),
    ROUTE_WAIT_ERROR: ("policy",),
}
_BUCKETS = {
    LOAD_SECONDS: LOAD_BUCKETS,
    AGE_AT_EVICTION: AGE_BUCKETS,
    KV_RESTORE_SECONDS: RESTORE_BUCKETS,
    ROUTE_WAIT_ERROR: ROUTE_ERROR_BUCKETS,
}


def _labels(labels: dict[str, str]) -> str:
    return json.dumps(labels, sort_keys=True, separators=(",", ":"))


def inc(pipe: Any, metric: str, labels: dict[str, str], by: float = 1) -> None:
    """Queue a counter increment on a Redis pipeline (or client)."""
    pipe.hincrbyfloat(keys.metric_counters(), f"{metric}|{_labels(labels)}", by)


def histogram_fields(metric: str, labels: dict[str, str], value: float) -> tuple[str, str, str]:
    """Where an observation of ``value`` is counted: (hash key, its bucket's field (HINCRBY 1),
    the sum's field (HINCRBYFLOAT ``value``)); for a script that observes it itself."""
    lab = _labels(labels)
    le = next((str(b) for b in _BUCKETS[metric] if value <= b), "+Inf")
    return keys.metric_histogram(metric), f"{lab}|{le}", f"{lab}|sum"


def observe(pipe: Any, metric: str, labels: dict[str, str], value: float) -> None:
    """Queue a histogram observation: one HINCRBY for its bucket plus sum and count."""
    key, bucket, total = histogram_fields(metric, labels, value)
    pipe.hincrby(key, bucket, 1)
    pipe.hincrbyfloat(key, total, value)


class RedisCollector(Collector):
    """Exports the Redis-held counters and histograms, and the gauges of the health record."""

    def __init__(self, r: redis.Redis, per_user: bool = False) -> None:
        self.r = r
        self.per_user = per_user

    def collect(self) -> Iterator[Any]:
        pipe = self.r.pipeline(transaction=False)
        pipe.hgetall(keys.metric_counters())
        for name in _HISTOGRAMS:
            pipe.hgetall(keys.metric_histogram(name))
        pipe.hget(keys.health(), "record")
        if self.per_user:
            pipe.hgetall(keys.usage_totals())
        res = pipe.execute()
        counters, hists, raw_health = (
            res[0],
            res[1 : 1 + len(_HISTOGRAMS)],
            res[1 + len(_HISTOGRAMS)],
        )
        yield from self._counters(counters)
        for name, data in zip(_HISTOGRAMS, hists, strict=True):
            yield self._histogram(name, data)
        if raw_health:
            yield from self._gauges(json.loads(raw_health))
        if self.per_user:
            yield from self._users(res[-1])

    @staticmethod
    def _users(data: dict[str, str]) -> Iterator[CounterMetricFamily]:
        """Requests and tokens per user and model, from the all-time usage totals, users
        labelled as ``/admin/usage`` shows them (``residency.auth.subject_label``: ``-`` is the
        anonymous callers). Totals counted before subjects were namespaced (a bare user name)
        are summed into the same series, so no series is exported twice."""
        requests = CounterMetricFamily(
            USER_REQUESTS_TOTAL.removesuffix("_total"),
            "API requests served per user and model",
            labels=["user", "model"],
        )
        tokens = CounterMetricFamily(
            USER_TOKENS_TOTAL.removesuffix("_total"),
            "Tokens per user, model and kind (prompt, completion)",
            labels=["user", "model", "kind"],
        )
        sums: dict[tuple[str, str, str], float] = {}
        for field, value in data.items():
            subject, _, rest = field.partition("|")
            model, _, counter = rest.rpartition("|")
            if counter in ("requests", "prompt_tokens", "completion_tokens"):
                at = (subject_label(subject), model, counter)
                sums[at] = sums.get(at, 0.0) + float(value)
        for (user, model, counter), total in sorted(sums.items()):
            if counter == "requests":
                requests.add_metric([user, model], total)
            else:
                tokens.add_metric([user, model, counter.removesuffix("_tokens")], total)
        yield requests
        yield tokens

    @staticmethod
    def _counters(data: dict[str, str]) -> Iterator[CounterMetricFamily]:
        families: dict[str, tuple[list[str], list[tuple[list[str], float]]]] = {
            LOADS_TOTAL: (["model", "outcome"], []),
            EVICTIONS_TOTAL: (["reason"], []),
            CANCELLED_TOTAL: (["model"], []),
            CANCELLED_CHUNKS_TOTAL: (["model"], []),
            PASSES_TOTAL: (["trigger"], []),
            RECHECKS_TOTAL: (["model"], []),
            YIELDS_TOTAL: (["model"], []),
            KV_SAVES_TOTAL: (["model", "outcome"], []),
            KV_SAVED_BYTES_TOTAL: (["model"], []),
            KV_RESTORES_TOTAL: (["model"], []),
            KV_RESTORED_TOKENS_TOTAL: (["model"], []),
            KV_DROPPED_TOTAL: (["model", "reason"], []),
            SLOT_COPIES_TOTAL: (["model"], []),
            SLOT_WAITS_TOTAL: (["model", "outcome"], []),
        }
        for field, value in data.items():
            metric, _, lab = field.partition("|")
            if metric not in families:
                continue
            names, samples = families[metric]
            labels = json.loads(lab)
            samples.append(([labels.get(n, "") for n in names], float(value)))
        docs = {
            LOADS_TOTAL: "Model loads by outcome (ok, error)",
            EVICTIONS_TOTAL: "Evictions by reason (lru, limit, deleted, admin, helper_unused, "
            "memory, yield, ttl)",
            CANCELLED_TOTAL: "Streamed generations stopped because the client went away",
            CANCELLED_CHUNKS_TOTAL: "Chunks streamed by generations before they were cancelled",
            PASSES_TOTAL: "Coordinator enforcement passes by what woke them (config, idle, "
            "load_commit, retry, event, timer)",
            RECHECKS_TOTAL: "Loads that committed after the limits changed (a full pass re-checked "
            "the pool)",
            YIELDS_TOTAL: "Busy models made to yield their slot to a model that waited "
            "pool.max_busy_s for one",
            KV_SAVES_TOTAL: "Slot states saved at a drain, by outcome (saved; skipped: budget, "
            "disk_full, timeout, error)",
            KV_SAVED_BYTES_TOTAL: "Bytes of slot states written to the slot cache",
            KV_RESTORES_TOTAL: "Saved slot states restored into a slot instead of a prefill",
            KV_RESTORED_TOKENS_TOTAL: "Prompt tokens restored from saved slot states",
            KV_DROPPED_TOTAL: "Saved slot states deleted unused, by reason (corrupt, stale)",
            SLOT_COPIES_TOTAL: "Prompt prefixes copied from a busy slot instead of a prefill",
            SLOT_WAITS_TOTAL: "Requests that waited for their conversation's slot, by how the "
            "wait ended (own, copied, cold)",
        }
        for metric, (names, samples) in families.items():
            fam = CounterMetricFamily(metric.removesuffix("_total"), docs[metric], labels=names)
            for values, v in samples:
                fam.add_metric(values, v)
            yield fam

    @staticmethod
    def _histogram(name: str, data: dict[str, str]) -> HistogramMetricFamily:
        docs = {
            LOAD_SECONDS: "Seconds from load start to ready",
            AGE_AT_EVICTION: "Seconds a model was resident when evicted (low values = thrash)",
            KV_RESTORE_SECONDS: "Seconds to read, check and restore a saved slot state",
            ROUTE_WAIT_ERROR: "Seconds between a routed request's predicted and actual wait "
            "(to its first token), per policy",
        }
        label_names = list(_HISTOGRAMS[name])
        per: dict[str, dict[str, float]] = {}
        for field, value in data.items():
            lab, _, le = field.rpartition("|")
            per.setdefault(lab, {})[le] = float(value)
        fam = HistogramMetricFamily(name, docs[name], labels=label_names)
        for lab, counts in per.items():
            labels = json.loads(lab)
            cum = 0.0
            buckets: list[tuple[str, float]] = []
            for b in [*_BUCKETS[name], "+Inf"]:
                le = str(b)
                cum += counts.get(le, 0.0)
                buckets.append((le, cum))
            fam.add_metric(
                [labels.get(n, "") for n in label_names], buckets, sum_value=counts.get("sum", 0.0)
            )
        return fam

    @staticmethod
    def _gauges(h: dict[str, Any]) -> Iterator[GaugeMetricFamily]:
        mx = GaugeMetricFamily(
            MAX_LOADED, "Model limit per type (configured and effective)", labels=["type", "kind"]
        )
        for typ, v in h.get("max_models", {}).items():
            mx.add_metric([typ, "configured"], v["configured"])
            mx.add_metric([typ, "effective"], v["effective"])
        yield mx
        loaded = GaugeMetricFamily(LOADED, "Resident models", labels=["type", "pool"])
        counts: dict[tuple[str, str], int] = {}
        for typ in h.get("max_models", {}):
            counts[(typ, "standard")] = 0
        depth = GaugeMetricFamily(QUEUE_DEPTH, "Requests waiting per model", labels=["model"])
        for m in h.get("models", []):
            if m["state"] in ("loading", "ready", "draining"):
                k = (m["type"], m["pool"])
                counts[k] = counts.get(k, 0) + 1
            depth.add_metric([m["name"]], m["queued"])
        for (typ, pool), n in sorted(counts.items()):
            loaded.add_metric([typ, pool], n)
        yield loaded
        yield depth
        deferred = GaugeMetricFamily(
            DEFERRED,
            "Models a pool is above its limit by, waiting for busy residents to go idle",
            labels=["type"],
        )
        blocked = (h.get("enforcement") or {}).get("blocked") or {}
        for typ in h.get("max_models", {}):
            deferred.add_metric([typ], blocked.get(typ, 0))
        yield deferred
        # The memory ledger: each live device's budget and what its residents hold (a device
        # without a budget has no budget sample), and each resident's bytes.
        budget = GaugeMetricFamily(
            DEVICE_BUDGET, "Bytes a device may hold in loaded models", labels=["host", "device"]
        )
        used = GaugeMetricFamily(
            DEVICE_USED, "Bytes a device's residents hold (ledger)", labels=["host", "device"]
        )
        for d in h.get("devices", []):
            if d.get("budget_bytes") is not None:
                budget.add_metric([d["host"], d["device"]], d["budget_bytes"])
            used.add_metric([d["host"], d["device"]], d["used_bytes"])
        yield budget
        yield used
        held = GaugeMetricFamily(
            MODEL_FOOTPRINT,
            "A resident's bytes in its device's ledger (measured after its load, else expected)",
            labels=["model", "host", "device"],
        )
        for d in h.get("devices", []):
            for model, n in sorted(d.get("models", {}).items()):
                held.add_metric([model, d["host"], d["device"]], n)
        yield held
        up = GaugeMetricFamily(
            WORKER_UP,
            "1 while a host's agent heartbeats, 0 once it is gone (until it is forgotten)",
            labels=["host"],
        )
        for w in h.get("workers", []):
            up.add_metric([w["host"]], 1 if w.get("alive") else 0)
        yield up
        # A load that hangs shows here long before pool.load_timeout_s fails it (the load
        # seconds histogram only counts loads that finished).
        running = GaugeMetricFamily(
            LOADING_SECONDS, "How long each model's current load has run", labels=["model"]
        )
        at = float(h.get("published_at") or 0.0)
        for m in h.get("models", []):
            if m["state"] == "loading" and m.get("loading_since"):
                running.add_metric([m["name"]], max(at - float(m["loading_since"]), 0.0))
        yield running
        disk = GaugeMetricFamily(
            KV_DISK_BYTES, "Bytes a host's saved slot caches use on its disk", labels=["host"]
        )
        for w in h.get("workers", []):
            if (w.get("slot_cache") or {}).get("bytes") is not None:
                disk.add_metric([w["host"]], w["slot_cache"]["bytes"])
        yield disk
        evict = GaugeMetricFamily(AUTO_EVICT, "1 when the auto_evict memory backstop is on")
        evict.add_metric([], 1 if (h.get("auto_evict") or {}).get("enabled") else 0)
        yield evict
