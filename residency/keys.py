"""The Redis key schema: every key residency uses is named here and nowhere else.

Each function documents the key's Redis type, its TTL and the process that owns (writes) it.
Lua scripts never build key names; they receive them through ``KEYS[]`` from these functions.
Model names are validated (see ``residency.settings.MODEL_NAME_RE``) so they cannot contain
the separator.
"""

from __future__ import annotations

PREFIX = "rsd:"


def generation() -> str:
    """string counter (INCR), no TTL. Bumped by every config, registry, policy or pin change (web
    admin API) and by the coordinator at the start of every enforcement pass, which stamps the
    pass and the record it publishes: a record whose generation is above a change's was computed
    after that change."""
    return f"{PREFIX}gen"


def config_admin() -> str:
    """hash ``"section.key" -> JSON value``, no TTL. Admin overrides of settings; written only by
    the admin API, read by every role when it (re)computes effective settings."""
    return f"{PREFIX}config:admin"


def registry() -> str:
    """hash ``model name -> JSON ModelEntry``, no TTL. The model registry. The coordinator leader
    seeds the config file's models at start; the admin API adds, replaces, pins and deletes."""
    return f"{PREFIX}registry"


def policies() -> str:
    """hash ``policy name -> JSON {"spec", "source"}``, no TTL. Router policies. The coordinator
    leader seeds the config file's policies at start; the admin API adds, replaces, deletes."""
    return f"{PREFIX}policies"


def conversation(digest: str) -> str:
    """string: the candidate a conversation was last routed to, TTL ``CONVERSATION_TTL_S``.
    Written by web (GETSET) to count routing switches."""
    return f"{PREFIX}conv:{digest}"


def autosize_state() -> str:
    """hash, no TTL, owned by the coordinator: ``risky`` ("1" while autosize lifts the LLM pool
    above max_loaded_models with auto_evict off, so the warning fires once per entry) and
    ``config_version`` (the config semantics this data dir was last run with, for the one-time
    upgrade notice)."""
    return f"{PREFIX}autosize"


def model(name: str) -> str:
    """hash, no TTL. Residency of one model: ``state`` (see ``residency.states``), ``token`` (the
    load id that owns the state), ``host``, ``device``, ``pid``, ``last_used``, ``loaded_at``,
    ``load_seconds``, ``error``. Written only through the compare-and-set scripts in
    ``residency.lua`` (by the coordinator, the agent and the model process)."""
    return f"{PREFIX}model:{name}"


def model_pattern() -> str:
    """SCAN pattern matching every ``model(name)`` key (the coordinator finds residents of
    models that were deleted from the registry)."""
    return f"{PREFIX}model:*"


def explicit() -> str:
    """hash ``model name -> "load" | "unload"``: residency asked for through the admin API and
    not yet carried out. Written by the admin API; cleared by the coordinator once acted on."""
    return f"{PREFIX}explicit"


def idle_watch() -> str:
    """string flag, TTL ``IDLE_WATCH_TTL_S``: set by the coordinator while some decision waits
    for a busy model to go idle; ``finish.lua`` sends the idle event only while it exists, so
    steady traffic does not wake a coordinator pass per request."""
    return f"{PREFIX}idle-watch"


def queue(name: str) -> str:
    """list of request JSON, no TTL, bounded by ``pool.max_queue_per_model`` in the submit script.
    Web LPUSHes; the model process moves items from the right end to ``processing``."""
    return f"{PREFIX}queue:{name}"


def processing(name: str) -> str:
    """list of request JSON taken by the model process and not yet finished (in flight).
    Handed back to ``queue`` by whoever sees the model process die."""
    return f"{PREFIX}processing:{name}"


def reply(request_id: str) -> str:
    """stream of reply messages for one request, TTL ``REPLY_TTL_S``. Written by the model process
    (or by the coordinator for a rejection), read by the web thread that submitted it."""
    return f"{PREFIX}reply:{request_id}"


def cancel(request_id: str) -> str:
    """string flag, TTL ``REPLY_TTL_S``. Set by web when the client went away; the model process
    stops generating when it sees it."""
    return f"{PREFIX}cancel:{request_id}"


def events() -> str:
    """list of event JSON, no TTL. The coordinator's inbox (demand, ready, idle, gone, config)."""
    return f"{PREFIX}events"


def control(name: str) -> str:
    """list of control JSON for the model process serving ``name`` (unload). Owned by the
    coordinator (writes) and that model process (reads)."""
    return f"{PREFIX}ctl:{name}"


def agent_commands(host: str) -> str:
    """list of command JSON for the worker agent on ``host`` (load). Written by the coordinator."""
    return f"{PREFIX}agent:{host}:cmds"


def standby(host: str, ident: str) -> str:
    """list holding at most one load command for the warm standby process ``ident`` of the agent
    on ``host`` (a process that has already started and imported llama.cpp, waiting for a
    model). Written by that agent, read and deleted by the standby process."""
    return f"{PREFIX}standby:{host}:{ident}"


def worker(host: str) -> str:
    """hash, TTL ``WORKER_TTL_S`` renewed by the agent's heartbeat: devices, memory, pid,
    last_heartbeat. Its absence means the host is gone."""
    return f"{PREFIX}worker:{host}"


def workers() -> str:
    """set of host names that ever registered, no TTL. Written by the agent; the coordinator
    removes a host once it has reaped its models."""
    return f"{PREFIX}workers"


def leader() -> str:
    """string lease ``token``, PX ``LEADER_TTL_MS`` renewed by the coordinator leader."""
    return f"{PREFIX}leader"


def leader_epoch() -> str:
    """string counter: the fencing token, INCR'd by each coordinator that becomes leader."""
    return f"{PREFIX}leader:epoch"


def health() -> str:
    """hash ``generation``, ``record`` (JSON): the one published health record, no TTL. Written
    only by the coordinator leader, through a script that refuses an older generation and a
    caller that no longer holds the lease."""
    return f"{PREFIX}health"


def limits() -> str:
    """hash ``llm``, ``embedding`` (effective limits) and ``generation`` (the pass generation
    that last changed them), no TTL. Written by the coordinator leader together with the health
    record; a model process reads it when it commits a load, so a load decided under older
    limits triggers a full enforcement pass."""
    return f"{PREFIX}limits"


#: rq queue name (rq keeps its own keys under ``rq:``) of the coordinator's retry jobs: a shrink
#: that only busy or pinned residents block is retried there with backoff.
RETRY_QUEUE = "rsd-retry"
#: rq job id of the one deferred-shrink job (a fixed id: deferring twice never queues two).
SHRINK_JOB_ID = "rsd-deferred-shrink"


def metric_counters() -> str:
    """hash ``"metric|label=value,..." -> count``: counters owned by the coordinator and model
    processes (loads, evictions) so that they survive process restarts and span hosts."""
    return f"{PREFIX}metrics:counters"


def metric_histogram(name: str) -> str:
    """hash ``"labels|le" -> count`` plus ``"labels|sum"``: one Redis-backed histogram."""
    return f"{PREFIX}metrics:hist:{name}"


def faults() -> str:
    """hash of fault-injection settings (``load_delay_s:<model>``, ``fail_next_load``,
    ``hold:<model>``, ``memory_pressure``). Written by ``POST /admin/faults`` only when
    ``[debug] fault_injection`` is on; read by model processes."""
    return f"{PREFIX}faults"


def audit() -> str:
    """list of audit JSON (newest first), capped at ``AUDIT_MAX`` by LTRIM. Admin API writes."""
    return f"{PREFIX}audit"


REPLY_TTL_S = 600
WORKER_TTL_S = 10
LEADER_TTL_MS = 5000
AUDIT_MAX = 1000
IDLE_WATCH_TTL_S = 30
CONVERSATION_TTL_S = 3600
