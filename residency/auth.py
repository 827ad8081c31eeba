"""Who is asking: the identity a request carries through the box, and what it may do.

Pure types shared by the web tier (which authenticates a request and checks its scopes and
quotas), the stores that keep users, keys and admin tokens in Redis, and the model processes
(which count usage under the request's subject). A request's ``Principal`` is made once per request
by the web tier; nothing here talks to Redis.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

from residency import keys

Kind = Literal["anonymous", "user", "admin"]


@dataclass(frozen=True)
class Quotas:
    """Limits of one user or one key; None = no limit. A request must fit the quotas of both
    its user and its key."""

    requests_per_minute: int | None = None
    tokens_per_day: int | None = None
    concurrent: int | None = None
    load_seconds_per_day: float | None = None

    def any(self) -> bool:
        return any(
            v is not None
            for v in (
                self.requests_per_minute,
                self.tokens_per_day,
                self.concurrent,
                self.load_seconds_per_day,
            )
        )


@dataclass(frozen=True)
class Principal:
    """The caller of one request.

    ``name``: the user's name, an admin token's name, or "" for an anonymous caller (no key
    required and none given). ``models`` / ``policies``: the names it may ask for (None = all).
    ``may_load``: whether its request may cause a load of a model that is not resident (else
    409 ``model_not_resident``). ``route_trace``: whether it may ask for a router's trace.
    ``monitor``: whether a user key may read ``/health`` and ``/metrics`` (an admin token
    always may). ``weight``: its share in fair queueing (a user with weight 2 gets two turns
    to one)."""

    kind: Kind
    name: str = ""
    key_id: str | None = None
    models: frozenset[str] | None = None
    policies: frozenset[str] | None = None
    may_load: bool = True
    route_trace: bool = True
    monitor: bool = False
    weight: float = 1.0
    user_quotas: Quotas = field(default_factory=Quotas)
    key_quotas: Quotas = field(default_factory=Quotas)

    @property
    def subject(self) -> str:
        """What usage, quotas and fair queues count this caller under: ``user:<name>``,
        ``admin:<name>`` or ``anon``, so an admin token named like a user never spends that
        user's quota, and no user is the anonymous bucket."""
        return subject_of(self.kind, self.name)

    @property
    def user(self) -> str:
        """The same as ``subject`` (the name every counter of this caller is keyed by)."""
        return self.subject

    @property
    def may_monitor(self) -> bool:
        return self.kind == "admin" or self.monitor

    def may_use_model(self, name: str) -> bool:
        return self.models is None or name in self.models

    def may_use_policy(self, name: str) -> bool:
        return self.policies is None or name in self.policies


#: The subject of every caller without a key (one bucket, one user in fair queues).
ANONYMOUS_SUBJECT = keys.ANONYMOUS
#: How ``subject_label`` shows the anonymous subject (what ``/admin/usage?user=`` takes).
ANONYMOUS_LABEL = "-"
_PREFIXES: dict[str, str] = {"user": "user:", "admin": "admin:"}


def subject_of(kind: Kind, name: str) -> str:
    if kind == "anonymous":
        return ANONYMOUS_SUBJECT
    return _PREFIXES[kind] + name


def subject_label(subject: str) -> str:
    """A subject as reports show it: a user's plain name, ``admin:<name>`` for an admin token,
    ``-`` for anonymous callers. No label is ambiguous: user names hold no ':' and are never
    ``-``. Counters written before subjects were namespaced (a bare name, ``-``) show as they
    were."""
    if subject == ANONYMOUS_SUBJECT:
        return ANONYMOUS_LABEL
    return subject.removeprefix(_PREFIXES["user"])


#: A caller when no key is required and none was given: may do everything a request can.
ANONYMOUS = Principal(kind="anonymous")
