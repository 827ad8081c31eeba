"""Where a box lives and how every role reaches its settings and its Redis.

``Box`` is what each process builds first: data dir, config file, Redis URL, admin key. The
effective settings are computed from the config file, the environment and the admin layer in
Redis (``load_settings``), and admin changes are written through ``ConfigStore`` only.
"""

from __future__ import annotations

import json
import os
import secrets
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, cast

import redis

from residency import keys, settings
from residency.messages import Event, EventType
from residency.redis_conn import RedisUrlError, parse
from residency.redis_conn import connect as connect  # re-exported: every role imports it here
from residency.redis_conn import probe as probe


def default_data_dir() -> Path:
    base = os.environ.get("XDG_DATA_HOME") or str(Path.home() / ".local" / "share")
    return Path(base) / "residency"


@dataclass
class Box:
    data_dir: Path
    config_path: Path | None
    redis_url: str | None
    environ: Mapping[str, str] = field(default_factory=lambda: dict(os.environ))

    @classmethod
    def from_env(
        cls,
        *,
        data_dir: str | None = None,
        config: str | None = None,
        environ: Mapping[str, str] | None = None,
    ) -> Box:
        env = dict(os.environ if environ is None else environ)
        dd = Path(data_dir or env.get("RESIDENCY_DATA_DIR") or default_data_dir()).resolve()
        cfg = config or env.get("RESIDENCY_CONFIG") or None
        return cls(
            data_dir=dd,
            config_path=Path(cfg).resolve() if cfg else None,
            redis_url=env.get("RESIDENCY_REDIS_URL") or None,
            environ=env,
        )

    @property
    def models_dir(self) -> Path:
        return self.data_dir / "models"

    @property
    def admin_key_path(self) -> Path:
        return self.data_dir / "admin.key"

    @property
    def redis_dir(self) -> Path:
        return self.data_dir / "redis"

    @property
    def metrics_dir(self) -> Path:
        return self.data_dir / "prometheus"

    def slot_cache_dir(self, s: settings.Settings) -> Path:
        """Where this host keeps its saved slot caches (``[cache] dir``, else under the data
        dir)."""
        if s.cache.dir:
            return Path(s.cache.dir).expanduser().resolve()
        return self.data_dir / "slot-cache"

    def child_environ(self) -> dict[str, str]:
        """What a process this box starts must be told to read the same settings: the config
        file, the data dir and the settings given as ``RESIDENCY_*`` variables (never the admin
        key: a model process has no use for it)."""
        out = {
            k: v
            for k, v in self.environ.items()
            if k.startswith("RESIDENCY_") and k != "RESIDENCY_ADMIN_KEY"
        }
        out["RESIDENCY_DATA_DIR"] = str(self.data_dir)
        if self.config_path is not None:
            out["RESIDENCY_CONFIG"] = str(self.config_path)
        return out

    def file_layer(self) -> dict[str, Any]:
        return settings.read_file(self.config_path) if self.config_path else {}

    def base_settings(self) -> settings.Settings:
        """File and environment only: what a process validates before it touches Redis (the
        Redis URL too: a malformed one stops the process at start, naming the bad part)."""
        self.check_redis_url()
        return settings.build(
            self.file_layer(), settings.env_layer(self.environ), origin=str(self.config_path or "")
        )

    def check_redis_url(self) -> None:
        if not self.redis_url:
            return
        try:
            parse(self.redis_url)
        except RedisUrlError as e:
            raise settings.SettingsError({"RESIDENCY_REDIS_URL": str(e)}, "environment") from None

    def redis(self, max_connections: int | None = None) -> redis.Redis:
        if not self.redis_url:
            raise RuntimeError("no Redis URL: set RESIDENCY_REDIS_URL or use `residency up`")
        return connect(self.redis_url, max_connections)

    def admin_key(self, *, create: bool = False) -> str:
        """RESIDENCY_ADMIN_KEY, else the key file (created mode 0600 on first start)."""
        env_key = self.environ.get("RESIDENCY_ADMIN_KEY")
        if env_key:
            return env_key
        p = self.admin_key_path
        if p.exists():
            return p.read_text().strip()
        if not create:
            raise RuntimeError(f"no admin key: {p} does not exist and RESIDENCY_ADMIN_KEY is unset")
        p.parent.mkdir(parents=True, exist_ok=True)
        key = "rsd-" + secrets.token_urlsafe(32)
        fd = os.open(p, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        with os.fdopen(fd, "w") as fh:
            fh.write(key + "\n")
        return key


class ConfigStore:
    """The admin layer of settings in Redis, and the generation counter."""

    def __init__(self, box: Box, r: redis.Redis) -> None:
        self.box = box
        self.r = r

    def admin_layer(self) -> dict[str, dict[str, Any]]:
        """Admin overrides of live and next-load keys. A value stored for a restart-only key (the
        API refuses them; an older version accepted ``server.model_dirs`` and
        ``debug.fault_injection``) is ignored, so Redis access cannot widen the model
        directories or switch fault injection on."""
        raw = cast(dict[str, str], self.r.hgetall(keys.config_admin()))
        flat = {k: json.loads(v) for k, v in raw.items() if not settings.is_restart_only(k)}
        return settings.unflatten(flat)

    def load(self) -> tuple[settings.Settings, dict[str, str]]:
        """Effective settings and each key's source. Admin values that no longer validate (the
        file changed under them) are reported, never silently applied."""
        file_layer = self.box.file_layer()
        env = settings.env_layer(self.box.environ)
        admin = self.admin_layer()
        s = settings.build(file_layer, env, admin, origin="file+env+admin")
        return s, settings.sources(file_layer, env, admin)

    def generation(self) -> int:
        return int(self.r.get(keys.generation()) or 0)

    def config_generation(self) -> int:
        return int(self.r.get(keys.config_generation()) or 0)

    def apply_patch(self, flat: Mapping[str, Any], actor: str) -> int:
        """Persist validated changes (see ``commit_change``)."""
        mapping = {k: json.dumps(v) for k, v in flat.items()}
        return commit_change(
            self.r,
            actor,
            "config.patch",
            dict(flat),
            lambda p: p.hset(keys.config_admin(), mapping=mapping),
        )


class NameTaken(ValueError):
    """The name is already used by the other kind of entry (a model vs a policy)."""


def commit_change(
    r: redis.Redis,
    actor: str,
    action: str,
    detail: dict[str, Any],
    op: Callable[[Any], Any],
    *,
    absent: tuple[str, str] | None = None,
    read: tuple[str, Callable[[Any], None]] | None = None,
) -> int:
    """Every admin change: apply ``op``, bump the generation and the config generation, write
    the audit record and tell the coordinator — one MULTI, so a change and its event are never
    seen apart. Returns the new (pass) generation. ``absent = (hash key, field)`` must not exist
    when the change commits (checked under WATCH, so two writers racing for one name cannot
    both win). ``read = (key, check)``: a change made from what is stored (read-modify-write):
    ``check(pipe)`` reads under WATCH of ``key`` (and may raise to refuse the change) before
    ``op`` is queued, and a write to ``key`` in between makes it read again."""
    with r.pipeline(transaction=True) as pipe:
        while True:
            try:
                if absent is not None:
                    pipe.watch(absent[0])
                    if pipe.hexists(*absent):
                        raise NameTaken(absent[1])
                if read is not None:
                    pipe.watch(read[0])
                    read[1](pipe)
                pipe.multi()
                # The generation first: its reply's place does not depend on how many
                # commands ``op`` queues (all of it is one MULTI: no reader sees them apart).
                pipe.incr(keys.generation())
                pipe.incr(keys.config_generation())
                op(pipe)
                audit(pipe, actor, action, detail)
                pipe.rpush(keys.events(), json.dumps(Event(EventType.CONFIG).to_dict()))
                return int(pipe.execute()[0])
            except redis.WatchError:
                continue  # the watched hash changed meanwhile: check again


def audit(pipe: Any, actor: str, action: str, detail: dict[str, Any]) -> None:
    """Queue an audit record on a pipeline (so it commits with the change it describes)."""
    rec = {"at": time.time(), "actor": actor, "action": action, "detail": detail}
    pipe.lpush(keys.audit(), json.dumps(rec))
    pipe.ltrim(keys.audit(), 0, keys.AUDIT_MAX - 1)
