"""The Lua scripts that make each multi-key change atomic, with typed Python entry points.

Scripts live in ``residency/lua/*.lua``; state-changing ones get ``_prelude.lua`` (the
compare-and-set helper) prepended. Keys always come from ``residency.keys``; allowed source
states always come from ``residency.states``.
"""

from __future__ import annotations

import json
from functools import cache
from importlib.resources import files
from typing import Any

import redis

from residency import keys
from residency.states import ModelState, sources_for

_WITH_PRELUDE = {"transition", "start_load", "commit_load", "begin_drain", "try_unload"}


@cache
def _source(name: str) -> str:
    base = files("residency").joinpath("lua")
    body = base.joinpath(f"{name}.lua").read_text()
    if name in _WITH_PRELUDE:
        return base.joinpath("_prelude.lua").read_text() + "\n" + body
    return body


def _csv(dst: ModelState) -> str:
    return ",".join(sorted(s.value for s in sources_for(dst)))


def _s(value: Any) -> str:
    return value.decode() if isinstance(value, bytes) else str(value)


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
                "begin_drain",
                "try_unload",
                "hand_back",
                "reject_oldest",
                "publish_health",
                "publish_limits",
                "lease",
            )
        }

    def _run(self, name: str, keys_: list[str], args: list[Any]) -> Any:
        return self._scripts[name](keys=keys_, args=args)

    def transition(
        self,
        model: str,
        dst: ModelState,
        *,
        token: str = "",
        fields: dict[str, Any] | None = None,
    ) -> tuple[bool, ModelState]:
        """Compare-and-set ``model`` to ``dst``; returns (changed, previous-or-current state)."""
        args: list[Any] = [dst.value, _csv(dst), token]
        for k, v in (fields or {}).items():
            args += [k, "" if v is None else v]
        ok, state = self._run("transition", [keys.model(model)], args)
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
            [keys.model(model), keys.agent_commands(host), keys.leader()],
            [_csv(ModelState.LOADING), token, host, device, now, json.dumps(command), lease, pool],
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
    ) -> tuple[bool, str]:
        """loading -> ready for ``token``, re-checked against the limits in force now: (True,
        'ok'), (True, 'recheck') when the limits changed since the load was decided (a full
        enforcement pass is asked for), or (False, the state that refused the commit)."""
        recheck = {**ready_event, "data": {**ready_event.get("data", {}), "recheck": True}}
        args: list[Any] = [
            _csv(ModelState.READY),
            token,
            limits_generation,
            json.dumps(ready_event),
            json.dumps(recheck),
        ]
        for k, v in fields.items():
            args += [k, "" if v is None else v]
        ok, res = self._run("commit_load", [keys.model(model), keys.limits(), keys.events()], args)
        return bool(ok), _s(res)

    def submit(
        self, model: str, item: str, *, bound: int, demand_event: dict[str, Any]
    ) -> tuple[bool, int]:
        ok, depth = self._run(
            "submit",
            [keys.queue(model), keys.model(model), keys.events()],
            [item, bound, json.dumps(demand_event)],
        )
        return bool(ok), int(depth)

    def finish(
        self,
        model: str,
        item: str,
        *,
        now: float,
        idle_event: dict[str, Any],
        request_id: str,
        last: tuple[str, dict[str, Any]] | None = None,
    ) -> bool:
        """Take a finished request off the processing list, writing its last reply message
        (``last``: reply type and data; none for a cancelled request) in the same step.
        Returns True when this finish sent the idle event (the model went idle while the
        coordinator was waiting for that)."""
        kind, data = last if last is not None else ("", {})
        went_idle = self._run(
            "finish",
            [
                keys.processing(model),
                keys.queue(model),
                keys.model(model),
                keys.events(),
                keys.idle_watch(),
                keys.reply(request_id),
            ],
            [
                item,
                now,
                json.dumps(idle_event),
                kind,
                json.dumps(data, separators=(",", ":")),
                keys.REPLY_TTL_S,
            ],
        )
        return bool(went_idle)

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
                [keys.model(model), keys.queue(model), keys.processing(model), keys.events()],
                [
                    token,
                    _csv(ModelState.UNLOADED),
                    _csv(ModelState.READY),
                    json.dumps(unloaded_event),
                    json.dumps(rescued_event),
                ],
            )
        )

    def hand_back(self, model: str, request_id: str, item: str, error: dict[str, Any]) -> str:
        """'requeued', 'failed' (answered with ``error``) or 'gone'."""
        return _s(
            self._run(
                "hand_back",
                [keys.processing(model), keys.queue(model), keys.reply(request_id)],
                [item, json.dumps(error), keys.REPLY_TTL_S],
            )
        )

    def reject_oldest(self, model: str, request_id: str, item: str, error: dict[str, Any]) -> bool:
        """Pop ``item`` (the oldest queued request) and answer it with ``error``, atomically."""
        return bool(
            self._run(
                "reject_oldest",
                [keys.queue(model), keys.reply(request_id)],
                [item, json.dumps(error), keys.REPLY_TTL_S],
            )
        )

    def publish_health(self, generation: int, record: dict[str, Any], *, lease: str) -> str:
        """Publish one pass's record: 'ok', 'stale' (a newer pass published) or 'not_leader'
        (``lease`` is no longer ours)."""
        return _s(
            self._run(
                "publish_health",
                [keys.health(), keys.leader()],
                [generation, json.dumps(record), lease],
            )
        )

    def publish_limits(self, generation: int, limits: dict[str, int], *, lease: str) -> str:
        """Record the effective limits of the pass ``generation`` if they changed; returns the
        generation of the limits in force, or 'not_leader' / 'stale'."""
        return _s(
            self._run(
                "publish_limits",
                [keys.limits(), keys.leader()],
                [generation, lease, limits.get("llm", 1), limits.get("embedding", 1)],
            )
        )

    def lease(self, token: str, op: str, ttl_ms: int = keys.LEADER_TTL_MS) -> bool:
        """Renew (``op='renew'``) or release the leader lease if ``token`` still holds it."""
        return bool(self._run("lease", [keys.leader()], [token, op, ttl_ms]))
