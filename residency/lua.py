"""The Lua scripts that make each multi-key change atomic, with typed Python entry points.

Scripts live in ``residency/lua/*.lua``; state-changing ones get ``_prelude.lua`` (the
compare-and-set helper) prepended, those that add or remove requests ``_fair.lua`` (fair
queueing between users), and those that count a request's usage ``_usage.lua``. Keys always
come from ``residency.keys``; allowed source states always come from ``residency.states``.
"""

from __future__ import annotations

import json
import time
from collections.abc import Iterable
from functools import cache
from importlib.resources import files
from typing import Any

import redis

from residency import keys, metrics
from residency.auth import Quotas
from residency.route_wait import Service
from residency.settings import MODEL_TYPES
from residency.states import OCCUPYING, ModelState, sources_for

_WITH_PRELUDE = {"transition", "start_load", "commit_load", "begin_drain", "try_unload"}
_WITH_FAIR = {"submit", "finish", "withdraw", "reject_oldest", "hand_back", "push_out"}
_WITH_SHARES = {"submit"}
_WITH_USAGE = {"finish", "charge"}


@cache
def _source(name: str) -> str:
    base = files("residency").joinpath("lua")
    body = base.joinpath(f"{name}.lua").read_text()
    if name in _WITH_SHARES:
        body = base.joinpath("_shares.lua").read_text() + "\n" + body
    if name in _WITH_FAIR:
        body = base.joinpath("_fair.lua").read_text() + "\n" + body
    if name in _WITH_USAGE:
        body = base.joinpath("_usage.lua").read_text() + "\n" + body
    if name in _WITH_PRELUDE:
        body = base.joinpath("_prelude.lua").read_text() + "\n" + body
    return body


def _csv(dst: ModelState) -> str:
    return ",".join(sorted(s.value for s in sources_for(dst)))


def _s(value: Any) -> str:
    return value.decode() if isinstance(value, bytes) else str(value)


class NotLeader(Exception):
    """A fenced write was refused: the caller's token no longer holds the leader lease (it was
    paused or partitioned past the lease TTL and another coordinator leads now). Nothing of the
    refused write was applied."""


def _arg(v: Any) -> str:
    if isinstance(v, bytes):
        return v.decode()
    if isinstance(v, bool):
        raise TypeError("a fenced write takes no bool (Redis has none): pass a string")
    return str(v)


class Fenced:
    """A batch of coordinator-leader writes, applied by one script only while ``lease`` still
    holds the leader lease (``fenced.lua``); ``execute`` raises :class:`NotLeader` otherwise.

    Pipeline-shaped (the same method names and arguments as redis-py's, for the commands the
    leader needs), so helpers that queue on a pipeline — ``metrics.inc``, ``metrics.observe`` —
    queue on it too. Nothing is sent before ``execute``."""

    def __init__(self, scripts: Scripts, lease: str) -> None:
        self._scripts = scripts
        self._lease = lease
        self._keys: list[str] = []
        self._ops: list[list[Any]] = []

    def _op(self, command: str, key: str, *args: Any) -> Fenced:
        if key not in self._keys:
            self._keys.append(key)
        # Index into the script's KEYS (1-based, KEYS[1] is the lease).
        self._ops.append([command, self._keys.index(key) + 2, *(_arg(a) for a in args)])
        return self

    def hset(
        self,
        name: str,
        key: str | None = None,
        value: Any = None,
        mapping: dict[str, Any] | None = None,
    ) -> Fenced:
        pairs: list[Any] = [] if key is None else [key, value]
        for k, v in (mapping or {}).items():
            pairs += [k, v]
        return self._op("HSET", name, *pairs)

    def hdel(self, name: str, *fields: str) -> Fenced:
        return self._op("HDEL", name, *fields) if fields else self

    def hincrby(self, name: str, key: str, amount: int = 1) -> Fenced:
        return self._op("HINCRBY", name, key, amount)

    def hincrbyfloat(self, name: str, key: str, amount: float = 1.0) -> Fenced:
        return self._op("HINCRBYFLOAT", name, key, amount)

    def incr(self, name: str) -> Fenced:
        return self._op("INCR", name)

    def set(self, name: str, value: Any, ex: int | None = None) -> Fenced:
        return self._op("SET", name, value, *(["EX", ex] if ex is not None else []))

    def delete(self, *names: str) -> Fenced:
        for n in names:
            self._op("DEL", n)
        return self

    def rpush(self, name: str, *values: Any) -> Fenced:
        return self._op("RPUSH", name, *values)

    def lpop(self, name: str, count: int) -> Fenced:
        return self._op("LPOP", name, count)

    def lrem(self, name: str, count: int, value: Any) -> Fenced:
        return self._op("LREM", name, count, value)

    def sadd(self, name: str, *values: Any) -> Fenced:
        return self._op("SADD", name, *values)

    def srem(self, name: str, *values: Any) -> Fenced:
        return self._op("SREM", name, *values)

    def expire(self, name: str, seconds: int) -> Fenced:
        return self._op("EXPIRE", name, seconds)

    def execute(self) -> list[Any]:
        """Apply the batch (all or nothing); the replies in order. Raises NotLeader."""
        if not self._ops:
            return []
        ops, keys_ = self._ops, self._keys
        self._ops, self._keys = [], []
        res = self._scripts._run("fenced", [keys.leader(), *keys_], [self._lease, json.dumps(ops)])
        if res is None:
            raise NotLeader("the leader lease is not ours: batch refused")
        return list(res)


def _type_limits(limits: dict[str, int]) -> list[Any]:
    """``type, limit`` pairs of every model type, in a fixed order (a type a pass left out
    counts 1, the smallest limit)."""
    return [x for t in MODEL_TYPES for x in (t, limits.get(t, 1))]


class Scripts:
    """One instance per Redis client; scripts are sent by SHA and reloaded if Redis lost them."""

    def __init__(self, r: redis.Redis) -> None:
        self.r = r
        self._scripts = {
            name: r.register_script(_source(name))
            for name in (
                "transition",
                "start_load",
                "commit_load",
                "submit",
                "finish",
                "flush",
                "begin_drain",
                "try_unload",
                "hand_back",
                "reject_oldest",
                "publish_health",
                "publish_limits",
                "lease",
                "acquire",
                "fenced",
                "withdraw",
                "push_out",
                "record_failure",
                "forget_host",
                "forget_model",
                "admit",
                "release",
                "charge",
                "principal",
                "take_share",
                "pop_script",
                "route_view",
            )
        }

    def _run(self, name: str, keys_: list[str], args: list[Any]) -> Any:
        return self._scripts[name](keys=keys_, args=args)

    def route_view(
        self, models: list[str], *, user: str, fair: bool, prefix_key: str
    ) -> tuple[str | None, str | None, list[list[str]]]:
        """(the published route room JSON, the caller's route-prefix JSON, per model its state,
        parallel, loading_since, loaded_at, last_used, queued, in flight, service and the
        queued requests ahead of ``user``'s next one): one read of the router's inputs."""
        ks = [keys.health(), prefix_key]
        for m in models:
            ks += [
                keys.model(m),
                keys.queue(m),
                keys.processing(m),
                keys.service(m),
                keys.queue_tags(m),
                keys.queue_finish(m),
            ]
        out = self._run("route_view", ks, [user, "1" if fair else "0"])
        room = _s(out[0]) if out[0] else None
        prefix = _s(out[1]) if out[1] else None
        rows = [[_s(x) for x in out[2 + 9 * i : 11 + 9 * i]] for i in range(len(models))]
        return room, prefix, rows

    def principal(self, key_id: str) -> tuple[str, str | None] | None:
        """(key record, its user's record or None) of a user key, or None when there is no
        such key: one round trip for web's per-request authentication."""
        out = self._run("principal", [keys.api_keys(), keys.users()], [key_id])
        if not out:
            return None
        rec, user = out
        return _s(rec), (_s(user) if user else None)

    def transition(
        self,
        model: str,
        dst: ModelState,
        *,
        token: str = "",
        fields: dict[str, Any] | None = None,
        lease: str | None = None,
    ) -> tuple[bool, ModelState]:
        """Compare-and-set ``model`` to ``dst``; returns (changed, previous-or-current state).
        With ``lease`` (the coordinator's), fenced: raises NotLeader if it is not the lease."""
        args: list[Any] = [dst.value, _csv(dst), token, lease or ""]
        for k, v in (fields or {}).items():
            args += [k, "" if v is None else v]
        ok, state = self._run("transition", [keys.model(model), keys.leader()], args)
        if _s(state) == "not_leader":
            raise NotLeader(f"transition of {model} to {dst.value} refused")
        return bool(ok), ModelState(_s(state))

    def start_load(
        self,
        model: str,
        *,
        token: str,
        host: str,
        device: str,
        now: float,
        command: dict[str, Any],
        lease: str,
        pool: str = "standard",
    ) -> tuple[bool, str]:
        """(started, previous state — or 'not_leader' when ``lease`` is no longer ours)."""
        ok, state = self._run(
            "start_load",
            [
                keys.model(model),
                keys.agent_commands(host),
                keys.leader(),
                keys.models_with_state(),
                keys.queue(model),
            ],
            [
                _csv(ModelState.LOADING),
                token,
                host,
                device,
                now,
                json.dumps(command),
                lease,
                pool,
                model,
            ],
        )
        return bool(ok), _s(state)

    def commit_load(
        self,
        model: str,
        *,
        token: str,
        limits_generation: int,
        ready_event: dict[str, Any],
        fields: dict[str, Any],
        load_seconds: float = 0.0,
        charge_user: str = "",
        charge_key: str = "",
        now: float | None = None,
    ) -> tuple[bool, str]:
        """loading -> ready for ``token``, re-checked against the limits in force now: (True,
        'ok'), (True, 'recheck') when the limits changed since the load was decided (a full
        enforcement pass is asked for), or (False, the state that refused the commit). In the
        same step, ``load_seconds`` are charged to ``charge_user`` (its usage, counter
        ``load_seconds``, and its day's quota total) and ``charge_key`` (its day's quota
        total): the user and key whose request caused the load (none: nobody's)."""
        recheck = {**ready_event, "data": {**ready_event.get("data", {}), "recheck": True}}
        day = time.strftime("%Y-%m-%d", time.gmtime(time.time() if now is None else now))
        args: list[Any] = [
            _csv(ModelState.READY),
            token,
            limits_generation,
            json.dumps(ready_event),
            json.dumps(recheck),
            f"{load_seconds:.4f}",
            keys.usage_field(charge_user, model, "load_seconds") if charge_user else "",
            keys.quota_field("load_seconds", "user", charge_user) if charge_user else "",
            keys.quota_field("load_seconds", "key", charge_key) if charge_key else "",
            keys.USAGE_TTL_S,
            keys.QUOTA_DAY_TTL_S,
        ]
        for k, v in fields.items():
            args += [k, "" if v is None else v]
        ok, res = self._run(
            "commit_load",
            [
                keys.model(model),
                keys.limits(),
                keys.events(),
                keys.usage(day),
                keys.quota_day(day),
                keys.usage_totals(),
            ],
            args,
        )
        return bool(ok), _s(res)

    def submit(
        self,
        model: str,
        item: str,
        *,
        bound: int,
        demand_event: dict[str, Any],
        may_load: bool = True,
        user: str = "",
        weight: float = 1.0,
        fair: bool = True,
        request_id: str = "",
        push_out: tuple[str, dict[str, Any]] | None = None,
    ) -> tuple[int, int | str]:
        """(1, depth) when queued; (0, depth) when the queue is full; (2, state) when the
        model is not resident and ``may_load`` is false (nothing was queued); (3, id) when the
        queue is full but ``user`` is within its share of it (see ``_shares.lua``) and queued
        request ``id`` is the one to make room: call again with ``push_out`` = (that id, its
        error reply) to push it out and queue this one in one step (or get 3 with the one to
        go now). With ``fair``, queued in its place among the model's users (start-time fair
        queueing, ``user``'s share ``weight``, see ``_fair.lua``); without, at the end of the
        line. ``request_id``: ``item``'s id (read from it when not given)."""
        if not weight > 0:
            raise ValueError(f"weight must be > 0, got {weight}")
        rid = request_id or str(json.loads(item)["id"])
        victim, error = push_out if push_out is not None else ("", {})
        res = self._run(
            "submit",
            [
                keys.queue(model),
                keys.model(model),
                keys.events(),
                keys.queue_tags(model),
                keys.queue_finish(model),
                keys.processing(model),
                *([keys.reply(victim)] if victim else []),
            ],
            [
                item,
                bound,
                json.dumps(demand_event),
                "1" if may_load else "0",
                "1" if fair else "0",
                user,
                repr(1.0 / weight),
                repr(float(weight)),
                rid,
                victim,
                json.dumps(error),
                keys.REPLY_TTL_S,
            ],
        )
        code = int(res[0])
        if code == 2:
            return code, _s(res[1])
        if code == 3:
            return code, _s(res[2])
        return code, int(res[1])

    def flush(self, request_id: str, chunks: list[dict[str, Any]], *, renew: bool) -> bool:
        """Write one chunk message of a stream (``chunks``), renewing the stream's TTL when
        ``renew`` (a new stream always gets it) — unless the request was cancelled: then
        nothing is written (its client's web thread deleted the stream) and True returned."""
        data = json.dumps({"chunks": chunks}, separators=(",", ":"))
        res = self._run(
            "flush",
            [keys.reply(request_id), keys.cancel(request_id)],
            [data, keys.REPLY_TTL_S, "1" if renew else "0"],
        )
        return bool(res)

    def finish(
        self,
        model: str,
        item: str,
        *,
        now: float,
        idle_event: dict[str, Any],
        request_id: str,
        last: tuple[str, dict[str, Any]] | None = None,
        chunks: list[dict[str, Any]] | None = None,
        service: Service | None = None,
        user: str = "",
        usage: tuple[int, int] | None = None,
        key: str = "",
        route_sample: tuple[str, str, float] | None = None,
    ) -> bool:
        """Take a finished request off the processing list, writing its last reply message
        (``last``: reply type and data; none for a cancelled request) in the same step —
        after a chunk message of ``chunks`` (a stream's last ones), if any — and the model's
        pace ``service``, if given; counts the request, and its ``usage`` (prompt and
        completion tokens) when known, for ``user`` on today's usage hash (UTC), and its tokens
        on the day's quota totals of ``user`` and of ``key`` (its API key's id). A routed
        request's ``route_sample`` (policy, sample JSON, seconds its wait was mispredicted by)
        goes on the policy's samples and its error on ``ROUTE_WAIT_ERROR``, once, in the same
        step. Returns True when this finish sent the idle event (the model went idle while the
        coordinator was waiting for that)."""
        kind, data = last if last is not None else ("", {})
        compact = (",", ":")
        day = time.strftime("%Y-%m-%d", time.gmtime(now))
        sample_keys: list[str] = []
        sample_args: list[Any] = ["", "", "", "", "", ""]
        if route_sample is not None:
            policy, sample, error_s = route_sample
            hist, bucket, total = metrics.histogram_fields(
                metrics.ROUTE_WAIT_ERROR, {"policy": policy}, error_s
            )
            sample_keys = [keys.route_samples(policy), hist]
            sample_args = [
                sample,
                keys.ROUTE_SAMPLES_MAX,
                keys.ROUTE_SAMPLES_TTL_S,
                bucket,
                total,
                f"{error_s:.6g}",
            ]
        went_idle = self._run(
            "finish",
            [
                keys.processing(model),
                keys.queue(model),
                keys.model(model),
                keys.events(),
                keys.idle_watch(),
                keys.reply(request_id),
                keys.service(model),
                keys.usage(day),
                keys.queue_tags(model),
                keys.queue_finish(model),
                keys.quota_day(day),
                keys.usage_totals(),
                *sample_keys,
            ],
            [
                item,
                now,
                json.dumps(idle_event),
                kind,
                json.dumps(data, separators=compact),
                keys.REPLY_TTL_S,
                json.dumps({"chunks": chunks}, separators=compact) if chunks else "",
                "" if service is None else service.dumps(),
                keys.SERVICE_TTL_S,
                keys.usage_field(user, model, ""),
                "" if usage is None else usage[0],
                "" if usage is None else usage[1],
                keys.USAGE_TTL_S,
                keys.quota_field("tokens", "user", user) if user else "",
                keys.quota_field("tokens", "key", key) if key else "",
                keys.QUOTA_DAY_TTL_S,
                *sample_args,
            ],
        )
        return bool(went_idle)

    def admit(
        self,
        model: str,
        admission_id: str,
        *,
        day: str,
        hold_s: float,
        may_load: bool,
        subjects: list[tuple[str, str, Quotas]],
        reserve: int = 0,
    ) -> list[str]:
        """Admit one request for ``model`` against the quotas of ``subjects`` ((``user`` or
        ``key``, name, quotas) each): [] when admitted (its places taken, and ``reserve``
        tokens reserved on the day's totals of each subject with a tokens-per-day quota), else
        the refusal whose wait is the longest: [subject index (0-based), quota, limit, used,
        retry seconds ('' for a daily quota), the model's state, tokens reserved by requests in
        flight]. ``day``: today (UTC), whose totals the daily quotas are checked against;
        ``hold_s``: how long an in-flight place is held at most; ``may_load``: the model is
        local (its load-seconds quota applies while it is neither ready nor loading)."""
        keys_ = [keys.quota_day(day), keys.model(model), keys.service(model)]
        args: list[Any] = [
            admission_id,
            hold_s,
            keys.QUOTA_WINDOW_S,
            "1" if may_load else "0",
            max(0, int(reserve)),
            keys.quota_hold_field(admission_id),
            keys.QUOTA_DAY_TTL_S,
        ]
        for subject, name, q in subjects:
            keys_ += [keys.quota_rate(subject, name), keys.quota_concurrent(subject, name)]
            args += [
                "" if q.requests_per_minute is None else q.requests_per_minute,
                "" if q.concurrent is None else q.concurrent,
                "" if q.tokens_per_day is None else q.tokens_per_day,
                "" if q.load_seconds_per_day is None else q.load_seconds_per_day,
                keys.quota_field("tokens", subject, name),
                keys.quota_field("load_seconds", subject, name),
                keys.quota_field("reserved", subject, name),
            ]
        res = self._run("admit", keys_, args)
        if int(res[0]) == 1:
            return []
        return [str(int(res[1]) - 1), *(_s(v) for v in res[2:])]

    def release(self, admission_id: str, *, day: str, held: list[str], reserved: list[str]) -> bool:
        """Give back what admission ``admission_id`` (of ``day``) held: its places in the
        in-flight sets ``held`` and its reservation on the ``reserved`` fields (the
        reserved-tokens fields of its subjects). True when a reservation was given back (once:
        a second release gives back nothing)."""
        return bool(
            self._run(
                "release",
                [keys.quota_day(day), *held],
                [admission_id, keys.quota_hold_field(admission_id), *reserved],
            )
        )

    def pop_script(self, field: str) -> str | None:
        """The first text of the fault script in ``keys.faults()`` field ``field``, taken off
        it (None: none left)."""
        raw = self._run("pop_script", [keys.faults()], [field])
        return None if raw is None else _s(raw)

    def charge(
        self, model: str, *, user: str, key: str, usage: tuple[int, int], now: float
    ) -> None:
        """Count one request ``user`` sent (with API key id ``key``, '' for none) to the remote
        model ``model`` and its ``usage`` (prompt, completion tokens) as ``finish`` counts a
        local one's: on the day's usage hash, the all-time totals and the day's quota totals."""
        day = time.strftime("%Y-%m-%d", time.gmtime(now))
        self._run(
            "charge",
            [keys.usage(day), keys.usage_totals(), keys.quota_day(day)],
            [
                keys.usage_field(user, model, ""),
                max(0, int(usage[0])),
                max(0, int(usage[1])),
                keys.USAGE_TTL_S,
                keys.quota_field("tokens", "user", user) if user else "",
                keys.quota_field("tokens", "key", key) if key else "",
                keys.QUOTA_DAY_TTL_S,
            ],
        )

    def begin_drain(
        self, model: str, *, token: str, control: dict[str, Any], now: float, lease: str
    ) -> str:
        """'ok' when the model is now draining; 'busy', 'not_leader' or its state if refused."""
        return _s(
            self._run(
                "begin_drain",
                [
                    keys.model(model),
                    keys.queue(model),
                    keys.processing(model),
                    keys.control(model),
                    keys.leader(),
                ],
                [_csv(ModelState.DRAINING), token, json.dumps(control), now, lease],
            )
        )

    def try_unload(
        self,
        model: str,
        *,
        token: str,
        unloaded_event: dict[str, Any],
        rescued_event: dict[str, Any],
    ) -> str:
        """'unloaded', 'rescued', or the state that refused the change."""
        return _s(
            self._run(
                "try_unload",
                [
                    keys.model(model),
                    keys.queue(model),
                    keys.processing(model),
                    keys.events(),
                    keys.queue_tags(model),
                    keys.queue_finish(model),
                ],
                [
                    token,
                    _csv(ModelState.UNLOADED),
                    _csv(ModelState.READY),
                    json.dumps(unloaded_event),
                    json.dumps(rescued_event),
                ],
            )
        )

    def hand_back(
        self,
        model: str,
        request_id: str,
        item: str,
        error: dict[str, Any],
        *,
        requeue: str | None = None,
        refusal: dict[str, Any] | None = None,
        lease: str | None = None,
    ) -> str:
        """'requeued' (as ``requeue``, the item itself by default), 'refused' (no output yet but
        ``requeue`` is '': answered with ``refusal``), 'failed' (partial output: answered with
        ``error``) or 'gone'. With ``lease`` (the coordinator's), fenced: raises NotLeader if it
        is not the lease."""
        fence = [keys.leader()] if lease else []
        res = _s(
            self._run(
                "hand_back",
                [
                    keys.processing(model),
                    keys.queue(model),
                    keys.reply(request_id),
                    keys.queue_tags(model),
                    keys.queue_finish(model),
                    *fence,
                ],
                [
                    item,
                    json.dumps(error),
                    keys.REPLY_TTL_S,
                    item if requeue is None else requeue,
                    json.dumps(refusal or error),
                    lease or "",
                ],
            )
        )
        if res == "not_leader":
            raise NotLeader(f"hand-back of a request of {model} refused")
        return res

    def reject_oldest(
        self,
        model: str,
        request_id: str,
        item: str,
        error: dict[str, Any],
        *,
        lease: str | None = None,
    ) -> bool:
        """Pop ``item`` (the oldest queued request) and answer it with ``error``, atomically.
        With ``lease`` (the coordinator's), fenced: raises NotLeader if it is not the lease."""
        fence = [keys.leader()] if lease else []
        res = self._run(
            "reject_oldest",
            [
                keys.queue(model),
                keys.reply(request_id),
                keys.queue_tags(model),
                keys.queue_finish(model),
                keys.processing(model),
                *fence,
            ],
            [item, json.dumps(error), keys.REPLY_TTL_S, lease or ""],
        )
        if _s(res) == "not_leader":
            raise NotLeader(f"rejecting a request of {model} refused")
        return bool(res)

    def take_share(self, model: str, capped: Iterable[str], depth: int) -> str | None:
        """Move the first of ``model``'s queued requests (in service order, at most ``depth``
        deep) whose user is not in ``capped`` into processing and return it; None when none of
        them may take a slot (slot shares, see workers/slot_shares.py)."""
        res = self._run(
            "take_share",
            [keys.queue(model), keys.processing(model), keys.queue_finish(model)],
            [depth, *sorted(capped)],
        )
        return _s(res) if res else None

    def withdraw(self, model: str, request_id: str, item: str, *, cancel: bool) -> bool:
        """Take ``item`` out of ``model``'s queue if no model process took it yet (True);
        otherwise, with ``cancel``, set its cancel flag so the process that took it stops."""
        res = self._run(
            "withdraw",
            [
                keys.queue(model),
                keys.cancel(request_id),
                keys.reply(request_id),
                keys.queue_tags(model),
                keys.queue_finish(model),
                keys.processing(model),
            ],
            [item, "1" if cancel else "0", keys.REPLY_TTL_S],
        )
        return bool(res)

    def push_out(self, model: str, request_id: str, item: str, error: dict[str, Any]) -> bool:
        """Take ``item`` out of ``model``'s queue with ``error`` as its reply, if no model
        process took it yet (True); False when it is no longer queued."""
        res = self._run(
            "push_out",
            [
                keys.queue(model),
                keys.reply(request_id),
                keys.queue_tags(model),
                keys.queue_finish(model),
                keys.processing(model),
            ],
            [item, json.dumps(error), keys.REPLY_TTL_S],
        )
        return bool(res)

    def publish_health(
        self,
        generation: int,
        record: dict[str, Any],
        *,
        lease: str,
        route_room: dict[str, Any] | None = None,
    ) -> str:
        """Publish one pass's record, and with it its ``route_room`` when given (in the same
        step): 'ok', 'stale' (a newer pass published) or 'not_leader' (``lease`` is no longer
        ours)."""
        args: list[Any] = [generation, json.dumps(record), lease]
        if route_room is not None:
            args.append(json.dumps(route_room, sort_keys=True))
        return _s(self._run("publish_health", [keys.health(), keys.leader()], args))

    def publish_limits(self, generation: int, limits: dict[str, int], *, lease: str) -> str:
        """Record the effective limits of the pass ``generation`` if they changed; returns the
        generation of the limits in force, or 'not_leader' / 'stale'."""
        return _s(
            self._run(
                "publish_limits",
                [keys.limits(), keys.leader()],
                [generation, lease, *_type_limits(limits)],
            )
        )

    def lease(self, token: str, op: str, ttl_ms: int = keys.LEADER_TTL_MS) -> bool:
        """Renew (``op='renew'``) or release the leader lease if ``token`` still holds it."""
        return bool(self._run("lease", [keys.leader()], [token, op, ttl_ms]))

    def acquire(self, token: str, ttl_ms: int = keys.LEADER_TTL_MS) -> int:
        """Take the leader lease for a new term with ``token`` if nobody holds it: the term's
        epoch, or 0 when the lease is held."""
        return int(self._run("acquire", [keys.leader(), keys.leader_epoch()], [token, ttl_ms]))

    def fenced(self, lease: str) -> Fenced:
        """A batch of leader writes that applies only while ``lease`` holds the lease."""
        return Fenced(self, lease)

    def record_failure(
        self, model: str, *, token: str, member: str, now: float, window: float, lease: str
    ) -> str:
        """Add ``member`` to the model's failure window: 'ok' or 'duplicate' (this load token's
        failure is already counted). Fenced: raises NotLeader if ``lease`` is not the lease."""
        res = _s(
            self._run(
                "record_failure",
                [keys.load_failures(model), keys.leader(), keys.model(model)],
                [lease, token, member, now, window],
            )
        )
        if res == "not_leader":
            raise NotLeader(f"failure of {model} not recorded")
        return res

    def forget_host(self, host: str, *, lease: str, seen_before: float | None = None) -> bool:
        """Delete a gone host's keys (True), unless it came back meanwhile or its last heartbeat
        is after ``seen_before`` (None: whenever it was) (False). Fenced: raises NotLeader if
        ``lease`` is not the lease."""
        res = _s(
            self._run(
                "forget_host",
                [
                    keys.workers(),
                    keys.worker(host),
                    keys.leader(),
                    keys.hosts_seen(),
                    keys.agent_commands(host),
                    keys.agent_taken(host),
                ],
                [lease, host, "" if seen_before is None else repr(float(seen_before))],
            )
        )
        if res == "not_leader":
            raise NotLeader(f"host {host} not forgotten")
        return res == "ok"

    def forget_model(self, model: str, *, lease: str) -> bool:
        """Delete the keys of a model deleted from the registry (True), unless it was registered
        again, holds a slot or has work meanwhile (False). Fenced: raises NotLeader if ``lease``
        is not the lease."""
        res = _s(
            self._run(
                "forget_model",
                [
                    keys.model(model),
                    keys.queue(model),
                    keys.processing(model),
                    keys.control(model),
                    keys.load_failures(model),
                    keys.models_with_state(),
                    keys.registry(),
                    keys.leader(),
                    keys.progress(model),
                    keys.service(model),
                    keys.queue_tags(model),
                    keys.queue_finish(model),
                    keys.footprint(model),
                ],
                [lease, model, ",".join(sorted(s.value for s in OCCUPYING))],
            )
        )
        if res == "not_leader":
            raise NotLeader(f"keys of {model} not deleted")
        return res == "ok"
