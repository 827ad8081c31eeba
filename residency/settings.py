"""Typed settings, layered defaults < TOML file < environment < admin changes (in Redis).

Everything is validated when a process starts and again on every admin change: a bad value is
reported with its dotted key and the allowed range, and an admin change that has any bad key
changes nothing. Each key carries ``applies`` metadata (``live``, ``next-load`` or ``restart``)
that ``docs/configuration.md`` mirrors; a test keeps the two equal.
"""

from __future__ import annotations

import functools
import ipaddress
import json
import os
import re
import tomllib
from collections.abc import Mapping
from pathlib import Path
from typing import Any, Literal, get_args

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    ValidationError,
    ValidationInfo,
    field_validator,
    model_validator,
)

MODEL_NAME_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._:-]{0,127}$")
#: A name ``server.allowed_hosts`` may list: a DNS name, an IPv4 address or a bracketed IPv6 one.
HOST_NAME_RE = re.compile(r"^(\[[0-9A-Fa-f:.]+\]|[A-Za-z0-9_]([A-Za-z0-9_.-]{0,252}))$")
#: An origin ``server.cors_origins`` may list, as browsers send it in ``Origin``.
ORIGIN_RE = re.compile(r"^https?://(\[[0-9A-Fa-f:.]+\]|[A-Za-z0-9_.-]+)(:[0-9]{1,5})?$")

#: The only environment variables a remote model's ``api_key_env`` may name: the web process
#: holds other secrets (the admin key, the Redis URL) that must never be sent to a remote.
REMOTE_KEY_ENV_PREFIX = "RESIDENCY_REMOTE_"
#: Validation context for specs read back from Redis (see ``ModelSpec._key_prefix``).
STORED = "stored"

LIVE = "live"
NEXT_LOAD = "next-load"
RESTART = "restart"


def _key(default: Any, applies: str, doc: str, **kw: Any) -> Any:
    return Field(default, json_schema_extra={"applies": applies, "doc": doc}, **kw)


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", validate_assignment=True)


class ServerSettings(_Strict):
    host: str = _key("127.0.0.1", RESTART, "address the web front end binds")
    port: int = _key(8000, RESTART, "TCP port of the web front end", ge=1, le=65535)
    web_workers: int = _key(2, RESTART, "gunicorn worker processes", ge=1, le=64)
    web_worker_class: Literal["gevent", "gthread"] = _key(
        "gevent",
        RESTART,
        "gunicorn worker class: gevent (a waiting or streaming request costs a greenlet) or "
        "gthread (an OS thread each)",
    )
    web_connections: int = _key(
        4096,
        RESTART,
        "connections one gevent worker holds at once (waiting, streaming, admin, health)",
        ge=16,
        le=100_000,
    )
    web_threads: int = _key(
        16, RESTART, "threads per gunicorn worker (gthread only)", ge=1, le=1024
    )
    max_in_flight: int = _key(
        1000,
        LIVE,
        "API requests one web worker holds at once (waiting or streaming); more get 429 "
        "with a computed Retry-After",
        ge=1,
        le=100_000,
    )
    sse_keepalive_s: float = _key(
        15.0,
        LIVE,
        "a stream that has sent nothing for this long gets an SSE comment line (: keep-alive)",
        gt=0,
        le=3600,
    )
    max_request_bytes: int = _key(
        1_048_576, LIVE, "largest accepted request body; larger gets 413", ge=1024, le=1 << 30
    )
    request_timeout_s: float = _key(
        600.0, LIVE, "longest a request waits for its model and reply; then 503", gt=0, le=86400
    )
    request_deadline_s: float = _key(
        600.0,
        LIVE,
        "longest a request may take from submit to its last token; then 504 "
        "deadline_exceeded; 0 = none",
        ge=0,
        le=86400,
    )
    model_dirs: list[str] = _key(
        [],
        RESTART,
        "folders that admin-registered model paths must lie in (DATA_DIR/models always counts)",
    )
    allow_local_remotes: bool = _key(
        False,
        RESTART,
        "let remote models forward to loopback, link-local and unspecified addresses",
    )
    allow_private_remotes: bool = _key(
        False,
        RESTART,
        "let remote models forward to the private ranges (10/8, 172.16/12, 192.168/16, "
        "fc00::/7) and CGNAT (100.64/10)",
    )
    allowed_hosts: list[str] = _key(
        [],
        RESTART,
        "Host header names accepted besides the loopback names (localhost, 127.x, [::1]) and "
        "server.host, with or without a port; any other Host gets 421 misdirected_request "
        "(a DNS-rebinding page sends its own name)",
    )
    cors_origins: list[str] = _key(
        [],
        RESTART,
        "browser origins (scheme://host[:port]) allowed to call the box besides its own; a "
        "request with any other Origin header gets 403 origin_not_allowed",
    )
    redis_min_replicas: int = _key(
        1,
        LIVE,
        "with a Sentinel RESIDENCY_REDIS_URL: replicas that must hold an admin change before "
        "it is answered (else 503 not_replicated); 0 = answer without waiting",
        ge=0,
        le=16,
    )
    redis_wait_ms: int = _key(
        2000,
        LIVE,
        "longest an admin change waits for redis_min_replicas replicas to acknowledge it",
        ge=1,
        le=60_000,
    )

    @field_validator("allowed_hosts")
    @classmethod
    def _hosts(cls, v: list[str]) -> list[str]:
        return _lowered(
            v, HOST_NAME_RE, "a host name or address (no scheme, port or path; IPv6 in brackets)"
        )

    @field_validator("cors_origins")
    @classmethod
    def _origins(cls, v: list[str]) -> list[str]:
        return _lowered(v, ORIGIN_RE, "an origin: scheme://host[:port], without a path or '/'")


def _lowered(names: list[str], pattern: re.Pattern[str], what: str) -> list[str]:
    """``names`` lowercased (Host and Origin compare without case), each checked to be ``what``."""
    for name in names:
        if not pattern.match(name):
            raise ValueError(f"{name!r} is not {what}")
    return [name.lower() for name in names]


class PoolSettings(_Strict):
    max_loaded_models: int = _key(
        1, LIVE, "resident models per type in the standard pool; -1 = unlimited"
    )
    llm_pool_autosize: bool = _key(
        True, LIVE, "raise the LLM limit to the policies' local candidate floor"
    )
    auto_evict: bool = _key(False, LIVE, "memory-pressure backstop")
    auto_evict_threshold: float = _key(
        0.90, LIVE, "fraction of device memory above which auto_evict evicts", gt=0, le=1
    )
    max_queue_per_model: int = _key(
        64, LIVE, "requests waiting per model before 429 with Retry-After", ge=1, le=100_000
    )
    fair_queues: bool = _key(
        True,
        LIVE,
        "users take turns in a model's queue (weighted by their weight) instead of first "
        "come, first served",
    )
    load_timeout_s: float = _key(
        600.0, LIVE, "a load not ready by then is failed and its process stopped", gt=0, le=86400
    )
    max_busy_s: float = _key(
        30.0,
        LIVE,
        "a busy model that a waiting model needs the slot of becomes yielding after others "
        "waited this long: it admits nothing new, finishes what runs, and is evicted; 0 = never",
        ge=0,
        le=86400,
    )
    min_resident_s: float = _key(
        10.0,
        LIVE,
        "a model loaded less than this long ago is not made to yield, nor evicted for a "
        "waiting model while its last request ended under 0.5 s ago (two busy models take "
        "turns instead of thrashing); 0 = off",
        ge=0,
        le=86400,
    )
    preload_candidates: bool = _key(
        False,
        LIVE,
        "keep the router policies' local LLM candidates warm like preload models: each is "
        "loaded whenever the pool has a free slot (never evicting for it)",
    )

    @field_validator("max_loaded_models")
    @classmethod
    def _limit(cls, v: int) -> int:
        if v == 0 or v < -1:
            raise ValueError(f"must be -1 (unlimited) or >= 1, got {v}")
        return v


class WorkerSettings(_Strict):
    standby_process: bool = _key(
        True,
        RESTART,
        "keep one started model process per device waiting for the next load (saves the "
        "process start and llama.cpp import, ~0.3 s a load; ~60 MB each)",
    )
    stall_s: float = _key(
        60.0,
        LIVE,
        "a busy model process with no progress this long is killed; 0 = never",
        ge=0,
        le=86400,
    )
    grammar_budget_s: float = _key(
        10.0,
        NEXT_LOAD,
        "seconds of sampling work a request's grammar (JSON schema, forced tool call) may take "
        "on its model's engine thread; past it that request alone ends with 400 "
        "grammar_budget_exceeded; 0 = unbounded",
        ge=0,
        le=3600,
    )
    slot_share_grace_s: float = _key(
        0.25,
        NEXT_LOAD,
        "slot shares between a model's users: a user may take a free slot of a model process "
        "only below its share (slots x weight / the weights of its active users) while another "
        "active user is below its own; a user stays active this long after its last request "
        "there ended (the gap before its next one arrives); 0 = off: any request takes a free "
        "slot",
        ge=0,
        le=60,
    )
    forget_after_s: float = _key(
        600.0,
        LIVE,
        "a host whose agent stopped heartbeating stays listed (as gone, with when it was last "
        "seen) this long, then is forgotten; 0 = as soon as no model holds a slot on it",
        ge=0,
        le=30 * 86400,
    )
    device_budget_mb: int = _key(
        0,
        RESTART,
        "bytes each device of this agent may hold in loaded models, in MiB; 0 = the device's "
        "total memory less memory_reserve_mb (CPU devices of one host split what is left)",
        ge=0,
        le=1 << 24,
    )
    memory_reserve_mb: int = _key(
        1024,
        RESTART,
        "memory left out of each device's default budget for everything else (the OS, Redis, "
        "the web tier; a GPU's driver); unused when device_budget_mb is set",
        ge=0,
        le=1 << 24,
    )


class DebugSettings(_Strict):
    fault_injection: bool = _key(
        False, RESTART, "enables POST /admin/faults (drills and tests only)"
    )


class AuthSettings(_Strict):
    required: bool = _key(
        True,
        RESTART,
        "API keys required on /v1, /health and /metrics, whatever address web binds (a "
        "loopback bind is reachable from every web page the operator's browser opens)",
    )
    public_health: bool = _key(
        False, RESTART, "/health and /metrics answer without a key even when keys are required"
    )


class MetricsSettings(_Strict):
    per_user: bool = _key(
        False,
        LIVE,
        "/metrics exports per-user series (residency_user_requests_total, "
        "residency_user_tokens_total): one series per user and model",
    )


#: Who may reuse a slot's cached prompt prefix (``[cache] scope``): its own user only; also
#: everyone for the part its system message(s) cover; everyone for all of it.
CacheScope = Literal["user", "shared_system", "global"]
CACHE_SCOPES: tuple[str, ...] = get_args(CacheScope)


#: The folder of a host's slot caches, as its agent hands it to the model processes it starts.
CACHE_DIR_ENV = "RESIDENCY_SLOT_CACHE_DIR"


class CacheSettings(_Strict):
    scope: CacheScope = _key(
        "user",
        LIVE,
        "who may reuse a slot's cached prompt prefix (and see it in cached_tokens): user = the "
        "same user only; shared_system = also everyone, for the part the system message(s) "
        "cover; global = everyone (an oracle of other users' prompts: benchmarks only)",
    )
    dir: str = _key(
        "",
        RESTART,
        "folder of the slot caches a model saves when it is unloaded (each host its own); "
        "empty = slot-cache under the data dir",
    )
    disk_mb: int = _key(
        4096,
        LIVE,
        "disk the saved slot caches of a host may use, in MiB; the least recently used entry "
        "of the user holding the most goes first; a save that does not fit is skipped; 0 = no "
        "slot is saved or restored",
        ge=0,
        le=1 << 24,
    )
    save_timeout_s: float = _key(
        5.0,
        LIVE,
        "longest a draining or stopping model spends saving its slots before it unloads "
        "(what is not written by then is skipped); 0 = no slot is saved",
        ge=0,
        le=600,
    )


class PullSettings(_Strict):
    """Model files pulled onto a host by the admin (``residency pull``, ``POST /admin/pulls``)."""

    max_queued: int = _key(
        4,
        LIVE,
        "pulls one host holds at once, the running one included; another is refused (429)",
        ge=1,
        le=100,
    )
    disk_reserve_mb: int = _key(
        1024,
        LIVE,
        "disk a pull must leave free on its model folder, in MiB, beside the file's size; a "
        "pull that would not is refused before it starts",
        ge=0,
        le=1 << 24,
    )


class ImageSettings(_Strict):
    """What web takes of a chat request's images for a local model (a remote model's request
    is forwarded whole: its upstream fetches and judges them)."""

    max_per_request: int = _key(
        8,
        LIVE,
        "image parts one request may hold, all its messages together; more is 400",
        ge=1,
        le=256,
    )
    max_bytes: int = _key(
        10 << 20,
        LIVE,
        "largest image in bytes, fetched from a URL or sent in a data: URL; larger is 400",
        ge=1024,
        le=1 << 28,
    )
    max_request_bytes: int = _key(
        10 << 20,
        LIVE,
        "the bytes of all one request's fetched images together (they are queued with it, in "
        "Redis, as data: URLs); more is 400",
        ge=1024,
        le=1 << 30,
    )
    fetch_timeout_s: float = _key(
        20.0,
        LIVE,
        "longest web spends fetching one request's http(s) image URLs, all of them, from the "
        "first connection to the last byte; then 400",
        gt=0,
        le=600,
    )
    allow_local_urls: bool = _key(
        False,
        LIVE,
        "let image URLs be fetched from loopback, link-local and unspecified addresses (this "
        "host and its link)",
    )
    allow_private_urls: bool = _key(
        False,
        LIVE,
        "let image URLs be fetched from the private ranges (10/8, 172.16/12, 192.168/16, "
        "fc00::/7) and CGNAT (100.64/10)",
    )


def is_loopback(host: str) -> bool:
    """Whether ``host`` (a name or an address, an IPv6 one bracketed or not) is reachable from
    this machine only: ``localhost`` or a loopback address (127.0.0.0/8, ::1). Any other name
    counts as not (it may resolve to anything)."""
    if host.lower() in ("localhost", "localhost."):
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False


#: What a local model serves; each type is its own pool with its own count limit
#: (``pool.max_loaded_models``). "rerank": a GGUF reranker, loaded with llama.cpp's rank pooling
#: (POST /v1/rerank).
ModelType = Literal["llm", "embedding", "rerank"]
FlashAttn = Literal["auto", "on", "off"]
MODEL_TYPES: tuple[str, ...] = get_args(ModelType)


#: ``[models.X] tool_format``: how a model writes a tool call in its text. "hermes":
#: ``<tool_call>{json}</tool_call>`` (Hermes, Qwen 2.5/3); "llama3": ``<|python_tag|>`` or a
#: whole-JSON answer (Llama 3.1+); "mistral": ``[TOOL_CALLS]`` (Mistral, Magistral, Devstral);
#: "qwen3_coder": ``<function=…><parameter=…>`` XML (Qwen3-Coder); "harmony": gpt-oss's
#: ``to=functions.…`` channel messages.
ToolFormat = Literal["auto", "hermes", "llama3", "mistral", "qwen3_coder", "harmony"]
TOOL_FORMATS: tuple[str, ...] = get_args(ToolFormat)


def reasoning_markers(value: str) -> tuple[str, str] | None:
    """``[models.X] reasoning`` as an (opening, closing) marker pair; None for "auto" and
    "none" (the caller decides those). The closer of ``<tag>`` is ``</tag>``, of ``[TAG]``
    ``[/TAG]``; anything else is refused."""
    if value in ("auto", "none"):
        return None
    m = re.fullmatch(r"<([^<>/\s][^<>\s]*)>|\[([^\[\]/\s][^\[\]\s]*)\]", value)
    if m is None:
        raise ValueError(
            f'\'reasoning\' must be "auto", "none" or an opening marker such as "<think>" or '
            f'"[THINK]" (its closer is derived); got {value!r}'
        )
    if m.group(1) is not None:
        return value, f"</{m.group(1)}>"
    return value, f"[/{m.group(2)}]"


class ModelSpec(_Strict):
    """One registered model: a local GGUF (``path``; its parameters take effect at its next
    load) or a remote OpenAI-compatible endpoint (``base_url``; forwarded, never loaded here,
    counted in no pool)."""

    path: str | None = Field(None, min_length=1)
    base_url: str | None = Field(None, pattern=r"^https?://\S+$")
    api_key_env: str | None = Field(None, pattern=r"^[A-Za-z_][A-Za-z0-9_]*$")
    remote_model: str | None = Field(None, min_length=1)
    type: ModelType = "llm"
    n_ctx: int = Field(4096, ge=16, le=1 << 20)
    n_gpu_layers: int = Field(-1, ge=-1)
    n_threads: int | None = Field(None, ge=1, le=1024)
    n_threads_batch: int | None = Field(None, ge=1, le=1024)
    n_batch: int = Field(512, ge=1, le=1 << 16)
    # Flash attention: "auto" lets llama.cpp enable it where the device supports it (as
    # llama-server does by default: on a CPU it decoded Gemma 3 270M 1.4x as fast), "on"
    # requires it, "off" never uses it.
    flash_attn: FlashAttn = "auto"
    # The most tokens one request may generate (None: n_ctx). Web applies it to each request it
    # submits, so it takes effect at once, not at the next load.
    max_tokens: int | None = Field(None, ge=1, le=1 << 20)
    chat_format: str | None = None
    # A vision projector GGUF (libmtmd) loaded beside the model: the model then reads images.
    # Same path rules as ``path``; takes effect at the next load.
    mmproj: str | None = Field(None, min_length=1)
    # How the model's reasoning is told apart from its answer: "auto" (the markers its chat
    # template uses: <think>, [THINK], gpt-oss's channels), "none" (all of it is the answer),
    # or an opening marker ("<think>", "[THINK]") whose closer is derived ("</think>").
    reasoning: str = Field("auto", min_length=1, max_length=64)
    # The text format of the model's tool calls: "auto" (from its chat template), or one of
    # TOOL_FORMATS.
    tool_format: ToolFormat = "auto"
    # Requests decoded together (continuous batching), each in its own slot with n_ctx tokens
    # of context: the context allocated is n_ctx x parallel. None: the device kind's default
    # (workers.devices.default_parallel). Embedding and rerank models serve one request at a
    # time.
    parallel: int | None = Field(None, ge=1, le=256)
    pinned: bool = False
    # Read by the coordinator on every pass (live). ttl_s: a ready, idle, unpinned resident
    # unused this long is evicted (None or 0: never). preload: loaded whenever its pool has a
    # free slot, never evicting anything for it. The two are exclusive: a model kept warm never
    # expires.
    ttl_s: float | None = Field(None, ge=0, le=31_536_000)
    preload: bool = False
    # Read by web for each request (live): a chat stream that waits for this model's load is
    # shown its progress as reasoning ("loading NAME 40%"), which chat UIs display; every
    # stream gets it as SSE comments whatever this says.
    show_loading: bool = False

    @field_validator("api_key_env")
    @classmethod
    def _key_prefix(cls, v: str | None, info: ValidationInfo) -> str | None:
        # Entries already stored in Redis are read with ``STORED``: one written before the prefix
        # rule must not make the whole registry unreadable; the forwarder refuses it instead.
        if v is not None and not (info.context or {}).get(STORED):
            check_remote_key_env(v)
        return v

    @field_validator("reasoning")
    @classmethod
    def _reasoning(cls, v: str) -> str:
        reasoning_markers(v)  # raises on a marker whose closer cannot be derived
        return v

    @model_validator(mode="after")
    def _local_or_remote(self) -> ModelSpec:
        if (self.path is None) == (self.base_url is None):
            raise ValueError("give exactly one of 'path' (a local GGUF) or 'base_url' (remote)")
        if self.base_url is None and (self.api_key_env or self.remote_model):
            raise ValueError("'api_key_env' and 'remote_model' apply to remote models only")
        if self.base_url is not None and self.max_tokens is not None:
            raise ValueError("'max_tokens' applies to local models only")
        if self.base_url is not None and self.parallel is not None:
            raise ValueError("'parallel' applies to local models only")
        if self.base_url is not None and self.mmproj is not None:
            raise ValueError("'mmproj' applies to local models only (a remote one sees for itself)")
        if self.mmproj is not None and self.type != "llm":
            raise ValueError("'mmproj' applies to llm models only")
        if self.base_url is not None and (self.ttl_s or self.preload):
            raise ValueError("'ttl_s' and 'preload' apply to local models only")
        if self.ttl_s and self.preload:
            raise ValueError(
                "'ttl_s' and 'preload' are exclusive: a preload model is kept warm, so it never "
                "expires (set ttl_s = 0 or preload = false)"
            )
        return self

    @property
    def remote(self) -> bool:
        return self.base_url is not None

    @property
    def token_cap(self) -> int:
        """The most tokens one request to this model may generate."""
        return self.max_tokens or self.n_ctx


class Settings(_Strict):
    server: ServerSettings = ServerSettings()
    pool: PoolSettings = PoolSettings()
    worker: WorkerSettings = WorkerSettings()
    debug: DebugSettings = DebugSettings()
    auth: AuthSettings = AuthSettings()
    metrics: MetricsSettings = MetricsSettings()
    cache: CacheSettings = CacheSettings()
    images: ImageSettings = ImageSettings()
    pulls: PullSettings = PullSettings()
    models: dict[str, ModelSpec] = {}
    # Router policies, as written; checked against ``models`` by ``_policies`` below and kept
    # raw because the registry (not this file) is what they are finally resolved against.
    policies: dict[str, dict[str, Any]] = {}

    @model_validator(mode="after")
    def _policies(self) -> Settings:
        from residency import policies as pol  # policies imports settings' name rule

        infos = {n: pol.ModelInfo(s.type, s.remote) for n, s in self.models.items()}
        problems: dict[str, str] = {}
        for name, data in self.policies.items():
            try:
                pol.parse_policy(name, data, infos)
            except pol.PolicyError as e:
                problems.update({f"policies.{name}.{k}": v for k, v in e.problems.items()})
        if problems:
            raise ValueError("; ".join(f"{k}: {v}" for k, v in problems.items()))
        return self

    @field_validator("models")
    @classmethod
    def _names(cls, v: dict[str, ModelSpec]) -> dict[str, ModelSpec]:
        for name in v:
            check_model_name(name)
        return v


#: Sections whose keys are plain settings (env-overridable and admin-patchable).
SECTIONS: dict[str, type[_Strict]] = {
    "server": ServerSettings,
    "pool": PoolSettings,
    "worker": WorkerSettings,
    "debug": DebugSettings,
    "auth": AuthSettings,
    "metrics": MetricsSettings,
    "cache": CacheSettings,
    "images": ImageSettings,
    "pulls": PullSettings,
}


class SettingsError(ValueError):
    """Bad settings; ``problems`` maps each dotted key to what is wrong with it."""

    def __init__(self, problems: dict[str, str], origin: str = "") -> None:
        self.problems = problems
        self.origin = origin
        where = f" ({origin})" if origin else ""
        lines = "; ".join(f"{k}: {v}" for k, v in problems.items())
        super().__init__(f"invalid settings{where}: {lines}")


def check_model_name(name: str) -> str:
    if not MODEL_NAME_RE.match(name):
        raise ValueError(
            f"model name {name!r} must match {MODEL_NAME_RE.pattern} "
            "(letters, digits, '.', '_', ':', '-'; at most 128)"
        )
    return name


def check_remote_key_env(name: str) -> str:
    if not name.startswith(REMOTE_KEY_ENV_PREFIX) or name == REMOTE_KEY_ENV_PREFIX:
        raise ValueError(
            f"must start with {REMOTE_KEY_ENV_PREFIX} (got {name!r}): only variables with this "
            "prefix may be sent to a remote"
        )
    return name


def is_restart_only(dotted: str) -> bool:
    """``section.key`` is a plain key read only at process start (never an admin override)."""
    return dotted in _restart_keys()


@functools.cache
def _restart_keys() -> frozenset[str]:
    return frozenset(k for k, m in key_meta().items() if m["applies"] == RESTART)


def key_meta() -> dict[str, dict[str, Any]]:
    """Every plain key ``section.key`` with default, applies and doc (for docs and the API)."""
    out: dict[str, dict[str, Any]] = {}
    for section, model in SECTIONS.items():
        for name, field in model.model_fields.items():
            extra = field.json_schema_extra
            assert isinstance(extra, dict)
            out[f"{section}.{name}"] = {
                "default": field.default,
                "applies": extra["applies"],
                "doc": extra["doc"],
            }
    return out


def _problems(err: ValidationError, prefix: str = "") -> dict[str, str]:
    out: dict[str, str] = {}
    for e in err.errors():
        loc = ".".join(str(p) for p in e["loc"]) or "(root)"
        msg = e["msg"]
        if e["type"] == "extra_forbidden":
            msg = "unknown key"
        msg = msg.removeprefix("Value error, ")
        if "input" in e and e["type"] != "extra_forbidden" and not isinstance(e["input"], dict):
            msg += f" (got {e['input']!r})"
        out[prefix + loc] = msg
    return out


def read_file(path: str | os.PathLike[str]) -> dict[str, Any]:
    p = Path(path)
    try:
        with p.open("rb") as fh:
            return tomllib.load(fh)
    except FileNotFoundError:
        raise SettingsError({"config": f"file not found: {p}"}, str(p)) from None
    except tomllib.TOMLDecodeError as e:
        raise SettingsError({"config": f"not valid TOML: {e}"}, str(p)) from None


def _parse_env_value(raw: str) -> Any:
    """Env values are strings; JSON literals (numbers, booleans, lists) are read as such."""
    try:
        return json.loads(raw)
    except ValueError:
        low = raw.strip().lower()
        if low in ("true", "yes", "on"):
            return True
        if low in ("false", "no", "off"):
            return False
        return raw


def env_layer(environ: Mapping[str, str]) -> dict[str, dict[str, Any]]:
    """``RESIDENCY_<SECTION>_<KEY>`` for the plain sections; unknown keys are errors, not
    silently ignored, so a typo in a deployment's environment is caught at start."""
    out: dict[str, dict[str, Any]] = {}
    problems: dict[str, str] = {}
    for var, raw in environ.items():
        for section, model in SECTIONS.items():
            pre = f"RESIDENCY_{section.upper()}_"
            if not var.startswith(pre):
                continue
            key = var[len(pre) :].lower()
            if key not in model.model_fields:
                problems[var] = f"unknown key {section}.{key}"
                continue
            out.setdefault(section, {})[key] = _parse_env_value(raw)
    if problems:
        raise SettingsError(problems, "environment")
    return out


def flatten(layer: Mapping[str, Any]) -> dict[str, Any]:
    """``{"pool": {"a": 1}}`` -> ``{"pool.a": 1}`` for the plain sections."""
    out: dict[str, Any] = {}
    for section, values in layer.items():
        if section in SECTIONS and isinstance(values, dict):
            for k, v in values.items():
                out[f"{section}.{k}"] = v
    return out


def unflatten(flat: Mapping[str, Any]) -> dict[str, dict[str, Any]]:
    out: dict[str, dict[str, Any]] = {}
    for dotted, v in flat.items():
        section, _, key = dotted.partition(".")
        out.setdefault(section, {})[key] = v
    return out


def merge(*layers: Mapping[str, Any]) -> dict[str, Any]:
    """Later layers win, key by key inside each section (models replace by name)."""
    out: dict[str, Any] = {}
    for layer in layers:
        for section, values in layer.items():
            if isinstance(values, dict) and isinstance(out.get(section), dict):
                out[section] = {**out[section], **values}
            else:
                out[section] = values
    return out


def build(*layers: Mapping[str, Any], origin: str = "") -> Settings:
    try:
        return Settings.model_validate(merge(*layers))
    except ValidationError as e:
        raise SettingsError(_problems(e), origin) from None


def sources(
    file_layer: Mapping[str, Any], env: Mapping[str, Any], admin: Mapping[str, Any]
) -> dict[str, str]:
    """Which layer each plain key's effective value came from."""
    out = {k: "default" for k in key_meta()}
    for name, layer in (("file", file_layer), ("env", env), ("admin", admin)):
        for k in flatten(layer):
            if k in out:
                out[k] = name
    return out


def validate_patch(current: Settings, patch: Mapping[str, Any]) -> dict[str, Any]:
    """Check an admin PATCH body against the current settings. Returns the flat changes; raises
    SettingsError naming every bad key (unknown, restart-only, or out of range) so that either
    all keys apply or none does."""
    problems: dict[str, str] = {}
    flat: dict[str, Any] = {}
    if not isinstance(patch, Mapping) or not patch:
        raise SettingsError({"(body)": "expected a non-empty object of sections"})
    meta = key_meta()
    for section, values in patch.items():
        if section not in SECTIONS:
            problems[section] = "unknown section (models have their own API)"
            continue
        if not isinstance(values, Mapping):
            problems[section] = "expected an object of keys"
            continue
        for k, v in values.items():
            dotted = f"{section}.{k}"
            if dotted not in meta:
                problems[dotted] = "unknown key"
            elif meta[dotted]["applies"] == RESTART:
                problems[dotted] = (
                    "restart-only: set it in the config file or the environment and restart"
                )
            else:
                flat[dotted] = v
    # Values of the known keys are checked even when other keys are bad, so one answer names
    # every problem.
    try:
        build(current.model_dump(), unflatten(flat))
    except SettingsError as e:
        problems.update(e.problems)
    if problems:
        raise SettingsError(problems, "admin")
    return flat
