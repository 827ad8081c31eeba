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


def config_generation() -> str:
    """string counter (INCR), no TTL. Bumped by every admin config, registry, policy or pin change
    (``box.commit_change``, in the same MULTI as ``generation()``) and never by the coordinator's
    passes: web processes reload their cached settings only when it moves (or the config file
    changes on disk), not twice a second."""
    return f"{PREFIX}config:gen"


def replication_mark() -> str:
    """string counter (INCR), no TTL. Written only to be waited on: an admin change is answered
    after ``WAIT`` on a connection that just wrote this (``redis_conn.confirm_replicated``), so
    the replicas that acknowledge it hold every write acknowledged before it."""
    return f"{PREFIX}replication:mark"


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


def route_prefix(subject: str, digest: str) -> str:
    """string JSON ``{candidate: [routed at (epoch s), prompt bytes]}``, TTL
    ``CONVERSATION_TTL_S``: which candidates served this caller's conversation (its system prompt
    and first user message, ``web.routing.conversation_digest``) and how long its prompt was, so
    the router can expect that prefix in a slot or the slot cache of that candidate. Keyed by the
    caller's subject: one caller's routing never depends on what another asked. Written by web
    after each routed request; read by ``route_view.lua``."""
    return f"{PREFIX}route-prefix:{subject}:{digest}"


def route_samples(policy: str) -> str:
    """list of JSON samples, newest first, at most ``ROUTE_SAMPLES_MAX``, TTL
    ``ROUTE_SAMPLES_TTL_S`` (renewed at each write): one per routed request a local model
    served, ``{"t", "candidate", "rule", "predicted": {"wait", "queue", "load", "room",
    "prefill"}, "actual": {"wait", "queue", "first"}}`` (seconds). Written by the model process
    with the request's finish (``finish.lua``); read by the coordinator into the health record's
    per-policy prediction error."""
    return f"{PREFIX}route-samples:{policy}"


def route_choices(policy: str) -> str:
    """hash ``<epoch minute>|<candidate>|<reason> -> count`` (HINCRBY), TTL ``ROUTE_SAMPLES_TTL_S``
    (renewed at each write): the routing choices of a policy per minute, written by web with
    each routed request; read by the coordinator into the health record (the last hour's), which
    deletes the fields older than ``ROUTE_SAMPLES_TTL_S``."""
    return f"{PREFIX}route-choices:{policy}"


def autosize_state() -> str:
    """hash, no TTL, owned by the coordinator: ``risky`` ("1" while autosize lifts the LLM pool
    above max_loaded_models with auto_evict off, so the warning fires once per entry) and
    ``config_version`` (the config semantics this data dir was last run with, for the one-time
    upgrade notice)."""
    return f"{PREFIX}autosize"


def model(name: str) -> str:
    """hash, no TTL. Residency of one model: ``state`` (see ``residency.states``), ``token`` (the
    load id that owns the state), ``host``, ``device``, ``pid``, ``last_used``, ``loaded_at``,
    ``load_seconds``, ``error``, ``parallel`` (its slots), ``reader`` (the connection id of its
    model process's queue reads, which the coordinator unblocks), ``yielding`` and
    ``yielding_since`` (the waiting model it gives its slot to; kept until its next load),
    ``load_user`` and ``load_key`` (whose request caused its current load: its load time is
    charged to them; set by ``start_load.lua``), ``footprint_bytes`` and ``estimate_bytes``
    (its memory measured after its load and the estimate for it, see ``residency.footprint``;
    absent when not measured), ``draining_since`` (the coordinator's clock) and ``drain_t``
    (Redis's) while it drains, ``unload_s`` (how long its last unload took, from its drain's
    start on Redis's clock: written by ``try_unload.lua``, kept across loads).
    ``state`` and ``token`` are written only through the compare-and-set scripts in
    ``residency.lua`` (by the coordinator, the agent and the model process); the coordinator's
    other writes to it are fenced by its lease."""
    return f"{PREFIX}model:{name}"


def footprint(name: str) -> str:
    """hash, no TTL: the last measured footprint of a model, kept across its unloads so that the
    next load can be counted for it: ``bytes``, ``estimate`` and ``spec`` (the
    ``footprint.spec_digest`` it was measured under; another digest invalidates it), written
    after each committed load that could be measured; and ``load_s`` (seconds from the
    coordinator starting its last load, process spawn included, to its commit) with
    ``load_spec`` (that load's digest: ``load_s`` holds for that spec only), written after every
    committed load. Written by the model process."""
    return f"{PREFIX}footprint:{name}"


def load_progress(name: str) -> str:
    """string, TTL ``LOAD_PROGRESS_TTL_S`` (renewed at each write): how far the current load of
    a model has come, JSON ``{"token": <the load's token>, "fraction": 0.0-1.0}``. Written by
    the model process while it loads (at most every ``workers.load_progress.PUBLISH_S``) and
    deleted when its load ends; read by web for the streaming requests that wait for that model
    (only while the model's state is loading under the same token, so a stale one never
    shows)."""
    return f"{PREFIX}load-progress:{name}"


#: How long a load's progress outlives its last write (a model process that died mid-load).
LOAD_PROGRESS_TTL_S = 60


def kvcache_epochs() -> str:
    """hash ``"*" | model name -> int`` (HINCRBY), no TTL: the clear epochs of the saved slot
    caches. Bumped by the admin API when a cache is emptied (``"*"``: every model's) and when a
    model is deleted or its spec replaced; a saved entry stamped with an older epoch is stale:
    never restored, deleted by the model process or the agent that finds it."""
    return f"{PREFIX}kvcache:epochs"


def kvcache(name: str) -> str:
    """hash, no TTL: a model's saved slot caches as its last process saw them: ``entries`` and
    ``bytes`` (set), ``hits`` (restores, HINCRBY). Written by the model process after its
    load's scan, each save and each restore; deleted with a clear of the model's cache; read
    into the health record."""
    return f"{PREFIX}kvcache:{name}"


def model_pattern() -> str:
    """SCAN pattern matching every ``model(name)`` key. Only for one-off sweeps (adopting the
    model hashes of a data dir written before ``models_with_state`` existed); the coordinator's
    pass reads ``models_with_state`` instead of scanning."""
    return f"{PREFIX}model:*"


def models_with_state() -> str:
    """set of model names that may have a ``model(name)`` hash, no TTL. Added to by
    ``start_load.lua`` (the only script that creates a model's state) in the same step; the
    coordinator reads it each pass (so a pass never scans the keyspace, yet sees residents of
    models deleted from the registry) and removes a name when it deletes that model's keys."""
    return f"{PREFIX}models"


def load_failures(name: str) -> str:
    """sorted set of one model's recent failed loads (a ready process that dies later is no
    failure of the model: see ``coordinator.failures``), member ``{"token", "error"}`` JSON
    (one per load token), score = time;
    TTL ``LOAD_FAILURE_WINDOW_S`` renewed on each failure, older members pruned on each write.
    Written only by the coordinator leader; deleted by an explicit admin load (which clears the
    backoff) and with a deleted model's keys."""
    return f"{PREFIX}load-failures:{name}"


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


def queue_tags(name: str) -> str:
    """sorted set of request JSON -> start tag (fair queueing), no TTL: one model's queued and
    in-flight requests, so the smallest tag is the model's virtual time. Added by the submit
    script; removed by the scripts that finish, withdraw, reject or fail a request; deleted with
    ``queue_finish`` whenever the model has nothing queued and nothing in flight (and with a
    forgotten model's keys)."""
    return f"{PREFIX}queue-tags:{name}"


def queue_finish(name: str) -> str:
    """hash of one model's users' turns and places, no TTL: ``f<user> -> finish tag`` of the
    last request each user queued (fair queueing) and ``o<request id> -> "<weight> <user>"``,
    the owner of each queued or in-flight request (the queue bound's shares between users, in
    every mode). Written by the submit script; an owner goes with its request's tag; deleted
    with ``queue_tags``."""
    return f"{PREFIX}queue-finish:{name}"


def reply(request_id: str) -> str:
    """stream of reply messages for one request, TTL ``REPLY_TTL_S``. Written by the model process
    (or by the coordinator for a rejection), read by the web thread that submitted it."""
    return f"{PREFIX}reply:{request_id}"


def cancel(request_id: str) -> str:
    """string flag, TTL ``REPLY_TTL_S``. Set by web when the client went away; the model process
    stops generating when it sees it."""
    return f"{PREFIX}cancel:{request_id}"


def progress(name: str) -> str:
    """string: the time (``time.time()``) a model's process last made progress while busy — it
    took a request or generated tokens — TTL ``PROGRESS_TTL_S``. Written by that model process
    (at most every ``workers.gate.PROGRESS_EVERY_S``); read by the agent's stall watchdog,
    which treats any change of the value as progress (its own clock measures how long it has
    not changed)."""
    return f"{PREFIX}progress:{name}"


def usage(day: str) -> str:
    """hash: what was used on one UTC day (``YYYY-MM-DD``), field ``subject|model|counter`` ->
    count, counters ``requests``, ``prompt_tokens``, ``completion_tokens`` (and
    ``load_seconds``). Counted by the model process that served each request, in the script
    that finishes it; the subject is the caller's (``user:<name>``, ``admin:<name>``, or
    ``ANONYMOUS`` for a request nobody was identified for). TTL ``USAGE_TTL_S``."""
    return f"{PREFIX}usage:{day}"


def usage_field(user: str, model: str, counter: str) -> str:
    return f"{user or ANONYMOUS}|{model}|{counter}"


def usage_totals() -> str:
    """hash: what was used since the box's data began, the fields and counters of ``usage(day)``
    (``requests``, ``prompt_tokens``, ``completion_tokens``), no TTL. Counted in the same step
    as the day's hash (``finish.lua``); ``/metrics`` exports it per user only with ``[metrics]
    per_user`` (monotonic counters, which summing the day hashes would not give cheaply)."""
    return f"{PREFIX}usage:all"


def quota_day(day: str) -> str:
    """hash: one UTC day's (``YYYY-MM-DD``) totals that daily quotas are checked against, field
    ``quota_field(counter, subject, name)``: ``tokens`` (prompt + completion, counted by
    ``finish.lua`` with the usage hash, ``charge.lua`` for a remote model), ``load_seconds``
    (charged by ``commit_load.lua`` to the user and key whose request caused the load) and
    ``reserved`` (the tokens reserved by that subject's requests in flight: added by
    ``admit.lua``, given back by ``release.lua``), for subject ``user`` and ``key``; and one
    field ``quota_hold_field(id)`` per admitted request holding a reservation. Read by
    ``admit.lua``; TTL ``QUOTA_DAY_TTL_S`` (a reservation whose web process died lapses with
    its day)."""
    return f"{PREFIX}quota-day:{day}"


def quota_field(counter: str, subject: str, name: str) -> str:
    """A field of ``quota_day``: ``counter`` (``tokens``, ``load_seconds``, ``reserved``) of one
    ``subject`` (``user``, ``key``) ``name``; the name goes last, so any name is read back
    whole."""
    return f"{counter}|{subject}|{name}"


def quota_hold_field(admission_id: str) -> str:
    """A field of ``quota_day``: the tokens one admitted request reserved (two parts, never
    taken for a ``quota_field``)."""
    return f"hold|{admission_id}"


def quota_rate(subject: str, name: str) -> str:
    """sorted set of the requests one user or key (``subject`` ``user`` / ``key``) was admitted
    in the last minute: member = an admission id, score = its time (Redis ``TIME``): the
    sliding window of ``requests_per_minute``. Written only by ``admit.lua`` (which prunes
    members older than a minute); TTL ``QUOTA_WINDOW_S`` + 1 from the last admission."""
    return f"{PREFIX}quota-rpm:{subject}:{name}"


def quota_concurrent(subject: str, name: str) -> str:
    """sorted set of the requests of one user or key in flight: member = an admission id, score
    = when its place expires (admission time + the request's deadline, or its timeout when it
    has none), so a web process that dies holding a place leaks it only until then. Added by
    ``admit.lua``, removed by the web process when it finishes the request (answered, failed or
    its client gone); expired members are pruned by the next admission. TTL: its last expiry."""
    return f"{PREFIX}quota-conc:{subject}:{name}"


def service(name: str) -> str:
    """string ``"<service s> [<first s> <bytes> <bytes^2> <bytes*first s>]"``, TTL
    ``SERVICE_TTL_S``: how long a request of this model holds its slot, in seconds, then how
    long one takes from being taken to its first token, its uncached prompt bytes
    (``residency.prompt_size``), their square and their product with those seconds (moving
    averages over recent requests, a line's fit: ``residency.route_wait.Service`` reads it).
    Written by its model process after each request; read by web to compute the
    ``Retry-After`` of a 429 (queue depth x the service time / slots) and the router's
    predicted waits. A key of its own, not a field of the model hash: a late write can never
    bring back the hash of a model that was forgotten."""
    return f"{PREFIX}service:{name}"


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


def agent_taken(host: str) -> str:
    """list of command JSON the agent on ``host`` took from ``agent_commands(host)`` (BLMOVE) and
    has not finished acting on: acknowledged (LREM) once done, moved back to the command list by
    the agent when it restarts, so a command is never lost to a crash in between."""
    return f"{PREFIX}agent:{host}:taken"


def standby(host: str, ident: str) -> str:
    """list holding at most one load command for the warm standby process ``ident`` of the agent
    on ``host`` (a process that has already started and imported llama.cpp, waiting for a
    model). Written by that agent, read and deleted by the standby process."""
    return f"{PREFIX}standby:{host}:{ident}"


def worker(host: str) -> str:
    """hash, TTL ``WORKER_TTL_S`` renewed by the agent's heartbeat: devices, memory, pid,
    last_heartbeat, ``children`` (JSON {model: load token} of the model processes it runs) and
    ``children_at`` (host time at which that list was read; the coordinator reaps a ready or
    draining model committed before it whose token is missing). Its absence means the host is
    gone."""
    return f"{PREFIX}worker:{host}"


def workers() -> str:
    """set of host names that registered, no TTL. Written by the agent (every heartbeat); the
    coordinator removes a host (with its command lists) once its record has expired, no model
    holds a slot on it and it has been gone ``worker.forget_after_s`` (``forget_host.lua``)."""
    return f"{PREFIX}workers"


def hosts_seen() -> str:
    """hash ``host -> time of its last heartbeat`` (the agent's clock), no TTL: outlives the
    worker record, so a gone host is listed with when it was last seen and forgotten once it has
    been gone ``worker.forget_after_s``. Written by the agent's heartbeat (in the MULTI that
    renews ``worker(host)``); the field is deleted with the host by ``forget_host.lua``."""
    return f"{PREFIX}hosts:seen"


def leader() -> str:
    """string lease ``token`` (a fresh one per leadership term), PX ``LEADER_TTL_MS``. Taken
    with ``acquire.lua`` (SET NX PX), renewed by the coordinator leader's lease thread
    (``lease.lua``). Every leader write's script compares it with the writer's token: the
    fencing check."""
    return f"{PREFIX}leader"


def leader_epoch() -> str:
    """string counter, no TTL: the number of the leadership term, INCR'd by ``acquire.lua`` in
    the step that takes the lease (shown in ``/health`` as ``leader.epoch``)."""
    return f"{PREFIX}leader:epoch"


def health() -> str:
    """hash ``generation``, ``record`` (JSON): the one published health record, no TTL. Written
    only by the coordinator leader, through a script that refuses an older generation and a
    caller that no longer holds the lease. Field ``route_room`` (JSON, the same pass's
    ``residency.pool.route_room.published``): what a load of each local policy candidate would
    take, read by the router (``route_view.lua``) without the whole record."""
    return f"{PREFIX}health"


def limits() -> str:
    """hash ``llm``, ``embedding``, ``rerank`` (effective limits, one per model type) and
    ``generation`` (the pass generation that last changed them), no TTL. Written by the
    coordinator leader together with the health record; a model process reads it when it
    commits a load, so a load decided under older limits triggers a full enforcement pass."""
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
    ``hold:<model>``, ``token_delay_s:<model>``, ``step_delay_s:<model>``, ``hang:<model>``,
    ``engine_crash:<model>``, ``script_text:<model>`` (a JSON list of texts), ``memory_pressure``).
    Written by ``POST /admin/faults`` only when ``[debug] fault_injection`` is on; read by
    model processes."""
    return f"{PREFIX}faults"


def users() -> str:
    """hash ``user name -> JSON {"name", "weight", "quotas", "created"}``, no TTL. The users API
    keys are issued for (``residency.users``). Written only by the admin API."""
    return f"{PREFIX}users"


def api_keys() -> str:
    """hash ``key id -> JSON record`` (user, sha256 of the secret, created, label, scopes,
    quotas; never the secret), no TTL. Written only by the admin API (issue, revoke, and the
    removal of a user, which revokes its keys in the same MULTI); read by web on every request
    that carries a user key (``principal.lua``), so a revoke is seen by the next request."""
    return f"{PREFIX}apikeys"


def admin_tokens() -> str:
    """hash ``token name -> JSON {"name", "hash", "created"}``, no TTL: the named admin tokens
    besides ``default`` (the admin key, which is never stored). Written only by the admin API."""
    return f"{PREFIX}admin-tokens"


def audit() -> str:
    """list of audit JSON (newest first), capped at ``AUDIT_MAX`` by LTRIM. Admin API writes."""
    return f"{PREFIX}audit"


def pull(pull_id: str) -> str:
    """hash, one pull of a model file (``residency pull``): ``id``, ``source``, ``host``,
    ``name``, ``dir``, the resolved ``file`` / ``url`` / ``size`` / ``sha256`` (and ``mmproj_*``
    for its projector), ``state`` (see ``residency.pulls.PullState``), ``bytes_done``,
    ``bytes_total``, ``error``, ``created``, ``finished``, ``cancel`` ("1": an admin asked to
    stop it). Created by the admin API (``POST /admin/pulls``); progress and state written by
    the agent of its host, state only through ``pull_store``'s compare-and-set script. TTL
    ``PULL_TTL_S`` once finished."""
    return f"{PREFIX}pull:{pull_id}"


def pulls() -> str:
    """sorted set of pull ids, score = creation time, no TTL: the pulls ``GET /admin/pulls`` and
    ``/health`` list. Added with each pull by the admin API; ids whose record expired are
    pruned when it is read, and it is capped at ``PULLS_KEPT`` (oldest finished first)."""
    return f"{PREFIX}pulls"


def pull_queue(host: str) -> str:
    """list of pull ids waiting for the agent on ``host``, no TTL, bounded (with
    ``pull_taken``) by ``pulls.max_queued`` in the enqueue script. Written by the admin API;
    the agent moves the head to ``pull_taken`` (BLMOVE) when it starts it."""
    return f"{PREFIX}pull-queue:{host}"


def pull_taken(host: str) -> str:
    """list holding the pull id the agent on ``host`` runs (one at a time), removed (LREM) when
    it finishes; moved back to the front of ``pull_queue`` by the agent when it restarts, so
    an interrupted pull resumes from its partial file."""
    return f"{PREFIX}pull-taken:{host}"


REPLY_TTL_S = 600
PROGRESS_TTL_S = 3600
SERVICE_TTL_S = 86400
USAGE_TTL_S = 400 * 86400
#: A day's quota totals are read only on that day (two days: a clock a little behind UTC).
QUOTA_DAY_TTL_S = 2 * 86400
#: The sliding window of ``requests_per_minute``.
QUOTA_WINDOW_S = 60
#: The subject usage is counted under for a request nobody was identified for (see
#: ``residency.auth.subject_of``: users are ``user:<name>``, admin tokens ``admin:<name>``).
ANONYMOUS = "anon"
WORKER_TTL_S = 10
LEADER_TTL_MS = 5000
AUDIT_MAX = 1000
#: A finished pull's record is kept this long, and at most this many pulls are listed.
PULL_TTL_S = 7 * 86400
PULLS_KEPT = 200
IDLE_WATCH_TTL_S = 30
CONVERSATION_TTL_S = 3600
#: Per policy: the route samples kept (the last hour's at most) and how long they outlive a write.
ROUTE_SAMPLES_MAX = 1000
ROUTE_SAMPLES_TTL_S = 2 * 3600
#: The crash-loop window: a model that failed this many times within it fails fast.
LOAD_FAILURE_WINDOW_S = 900
LOAD_FAILURE_LIMIT = 3
