"""Quotas and the usage report against real parts: a real Redis, the quota script called as the
web tier calls it, and — for the HTTP behaviour — the coordinator, agent and real model
processes (llama.cpp, tiny GGUF) behind Flask apps, two of them standing for two web processes.

Over HTTP the callers are real users and API keys, made through the admin API and sent as
``Authorization: Bearer``, so quotas are exercised through authentication as clients meet
them; the quotas that must hold under concurrency are hit by many requests at once.
Assertions are on statuses, error codes, counts and stored totals, never on how long something
took.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import pytest
import redis
from flask import Flask
from flask.testing import FlaskClient

from residency import keys
from residency.auth import Principal, Quotas
from residency.box import connect
from residency.errors import ApiError
from residency.lua import Scripts
from tests.conftest import Pool
from tests.integration.test_bounded_work import configure, faults
from tests.integration.test_pool import _APP_LOCK, ADMIN, in_thread
from web import quota
from web.app import create_app

MESSAGES = [{"role": "user", "content": "hi"}]


def user(
    name: str, key: str | None = None, key_quotas: Quotas | None = None, **q: Any
) -> Principal:
    return Principal(
        kind="user",
        name=name,
        key_id=key,
        user_quotas=Quotas(**q),
        key_quotas=key_quotas or Quotas(),
    )


def app_for(pool: Pool) -> Flask:
    """The web app of one web process."""
    with _APP_LOCK:
        return create_app(pool.box)


@dataclass
class Caller:
    """A real user and one of its API keys (``key_id``), as a client holds them."""

    user: str
    key_id: str
    headers: dict[str, str]


def caller(
    c: FlaskClient, name: str, key_quotas: dict[str, Any] | None = None, **user_quotas: Any
) -> Caller:
    """A new API key of user ``name`` (made, with ``user_quotas``, when it does not exist), the
    key with quotas of its own ``key_quotas``."""
    if c.get(f"/admin/users/{name}", headers=ADMIN).status_code == 404:
        resp = c.post("/admin/users", json={"name": name, "quotas": user_quotas}, headers=ADMIN)
        assert resp.status_code == 201, resp.get_json()
    resp = c.post(f"/admin/users/{name}/keys", json={"quotas": key_quotas or {}}, headers=ADMIN)
    assert resp.status_code == 201, resp.get_json()
    out = resp.get_json()
    return Caller(name, str(out["api_key"]["id"]), {"Authorization": f"Bearer {out['key']}"})


def ask(c: FlaskClient, who: Caller | None, model: str = "a", **kw: Any) -> Any:
    body = {"model": model, "messages": MESSAGES, "max_tokens": 4, **kw}
    return c.post("/v1/chat/completions", json=body, headers=who.headers if who else {})


def at_once(n: int, fn: Callable[[int], Any]) -> list[Any]:
    """``fn(i)`` for i < n, in n threads let go together; their results."""
    go = threading.Barrier(n)
    results: list[Any] = []
    lock = threading.Lock()

    def one(i: int) -> None:
        go.wait()
        out = fn(i)
        with lock:
            results.append(out)

    threads = [threading.Thread(target=one, args=(i,), daemon=True) for i in range(n)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    assert len(results) == n
    return results


def refused(resp: Any, quota_name: str) -> str:
    """The refusal's message, after checking its envelope and Retry-After."""
    assert resp.status_code == 429, resp.get_data(as_text=True)
    err = resp.get_json()["error"]
    assert err["type"] == "rate_limit_error" and err["code"] == "quota_exceeded"
    assert err["param"] is None
    assert int(resp.headers["Retry-After"]) >= 1
    assert quota_name in err["message"]
    return str(err["message"])


def today() -> str:
    return time.strftime("%Y-%m-%d", time.gmtime())


# --- the quota script, as web calls it ---------------------------------------------------------


def admit_many(
    redis_url: str, p: Principal, n_procs: int, n_threads: int, **kw: Any
) -> tuple[list[quota.Ticket], list[ApiError]]:
    """``n_threads`` admissions at once, spread over ``n_procs`` clients (web processes)."""
    clients = [connect(redis_url) for _ in range(n_procs)]
    scripts = [Scripts(c) for c in clients]
    admitted: list[quota.Ticket] = []
    errors: list[ApiError] = []
    lock = threading.Lock()
    go = threading.Barrier(n_threads)

    def one(i: int) -> None:
        go.wait()
        try:
            t = quota.admit(clients[i % n_procs], scripts[i % n_procs], p, "a", hold_s=60, **kw)
            with lock:
                admitted.append(t)  # type: ignore[arg-type]
        except ApiError as e:
            with lock:
                errors.append(e)

    threads = [threading.Thread(target=one, args=(i,)) for i in range(n_threads)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    for c in clients:
        c.close()
    return admitted, errors


def test_requests_per_minute_admits_exactly_the_quota_across_processes(
    r: redis.Redis, redis_url: str
) -> None:
    ann = user("ann", requests_per_minute=7)
    admitted, errors = admit_many(redis_url, ann, n_procs=2, n_threads=20)
    assert len(admitted) == 7 and len(errors) == 13
    for e in errors:
        assert e.status == 429 and e.code == "quota_exceeded"
        assert e.message.startswith("user 'ann' reached its quota of 7 requests per minute;")
        assert e.retry_after is not None and 1 <= e.retry_after <= 60
    assert r.zcard(keys.quota_rate("user", "user:ann")) == 7
    # Another user has a window of its own.
    assert quota.admit(r, Scripts(r), user("bob", requests_per_minute=7), "a", hold_s=60)


def test_a_request_must_fit_both_its_user_and_its_key_and_a_refusal_takes_nothing(
    r: redis.Redis,
) -> None:
    s = Scripts(r)
    p = user("ann", key="k1", key_quotas=Quotas(concurrent=1), requests_per_minute=10)
    first = quota.admit(r, s, p, "a", hold_s=60)
    assert first is not None
    with pytest.raises(ApiError) as e:
        quota.admit(r, s, p, "a", hold_s=60)
    assert e.value.message.startswith("API key 'k1' of user 'ann' reached its quota of 1 ")
    # The refused request took no place in its user's window.
    assert r.zcard(keys.quota_rate("user", "user:ann")) == 1
    first.release(s)
    assert r.zcard(keys.quota_concurrent("key", "k1")) == 0
    assert quota.admit(r, s, p, "a", hold_s=60) is not None
    assert r.zcard(keys.quota_rate("user", "user:ann")) == 2


def test_an_expired_place_in_flight_is_taken_back(r: redis.Redis) -> None:
    """A web process that died holding a place leaks it only until its request's deadline."""
    s = Scripts(r)
    p = user("ann", concurrent=1)
    r.zadd(keys.quota_concurrent("user", "user:ann"), {"dead-process": 1.0})  # expired long ago
    ticket = quota.admit(r, s, p, "a", hold_s=60)
    assert ticket is not None
    assert r.zrange(keys.quota_concurrent("user", "user:ann"), 0, -1) == [ticket.id]


def test_a_concurrent_refusal_says_to_retry_after_one_service_time(r: redis.Redis) -> None:
    """The hint is the model's service time, the first field of its pace record (the router's
    fields follow it)."""
    s = Scripts(r)
    p = user("ann", concurrent=1)
    assert quota.admit(r, s, p, "a", hold_s=60) is not None
    r.set(keys.service("a"), "7.5 0.1 100 10000 10")
    with pytest.raises(ApiError) as e:
        quota.admit(r, s, p, "a", hold_s=60)
    assert e.value.retry_after == 8


def test_no_quotas_cost_nothing(r: redis.Redis) -> None:
    from residency.auth import ANONYMOUS

    s = Scripts(r)
    assert quota.admit(r, s, ANONYMOUS, "a", hold_s=60) is None
    assert quota.admit(r, s, user("ann"), "a", hold_s=60) is None
    assert r.dbsize() == 0


def test_daily_quotas_read_the_days_totals(r: redis.Redis) -> None:
    s = Scripts(r)
    day = keys.quota_day(today())
    p = user("ann", key="k1", key_quotas=Quotas(tokens_per_day=100), load_seconds_per_day=2.0)
    r.hset(day, keys.quota_field("tokens", "key", "k1"), 100)
    with pytest.raises(ApiError) as e:
        quota.admit(r, s, p, "a", hold_s=60)
    assert "API key 'k1' of user 'ann' reached its quota of 100 tokens per day (100 used" in (
        e.value.message
    )
    assert "resets at 00:00 UTC" in e.value.message
    assert e.value.retry_after is not None and 1 <= e.value.retry_after <= 86400
    r.hset(day, keys.quota_field("tokens", "key", "k1"), 99)
    r.hset(day, keys.quota_field("load_seconds", "user", "user:ann"), 2.5)
    # Over its load-seconds: refused for a model that is not loaded (the request would load
    # it), admitted for one that is ready or loading (someone else's load).
    with pytest.raises(ApiError) as e:
        quota.admit(r, s, p, "a", hold_s=60)
    assert "user 'ann' reached its quota of 2 load-seconds per day (2.5 used today)" in (
        e.value.message
    )
    assert "model 'a' is not loaded (it is unloaded)" in e.value.message
    for state in ("ready", "loading"):
        r.hset(keys.model("a"), "state", state)
        assert quota.admit(r, s, p, "a", hold_s=60) is not None
    # A remote model is never loaded: that quota does not apply.
    r.hset(keys.model("a"), "state", "unloaded")
    assert quota.admit(r, s, p, "a", hold_s=60, may_load=False) is not None


def test_a_reservation_holds_until_released_once_and_lapses_with_its_day(r: redis.Redis) -> None:
    s = Scripts(r)
    day = keys.quota_day(today())
    p = user("ann", key="k1", key_quotas=Quotas(tokens_per_day=500), tokens_per_day=100)
    first = quota.admit(r, s, p, "a", hold_s=60, reserve=60)
    assert first is not None
    for subject, name in (("user", "user:ann"), ("key", "k1")):
        assert int(r.hget(day, keys.quota_field("reserved", subject, name))) == 60
    second = quota.admit(r, s, p, "a", hold_s=60, reserve=60)  # 60 < 100: admitted
    assert second is not None
    # 120 reserved, nothing charged: refused until one of them ends, not until the day does.
    with pytest.raises(ApiError) as e:
        quota.admit(r, s, p, "a", hold_s=60, reserve=60)
    assert "quota of 100 tokens per day with its requests in flight" in e.value.message
    assert "(0 used today, 120 reserved by them)" in e.value.message
    assert e.value.retry_after is not None and e.value.retry_after <= quota.MAX_RETRY_S
    first.release(s)
    first.release(s)  # given back once
    assert int(r.hget(day, keys.quota_field("reserved", "user", "user:ann"))) == 60
    assert quota.admit(r, s, p, "a", hold_s=60, reserve=1) is not None
    # What a web process that died still holds lapses with the day's hash.
    assert 0 < r.ttl(day) <= keys.QUOTA_DAY_TTL_S


# --- through the web tier: real keys over HTTP, with real model processes ---------------------


def test_two_web_processes_admit_exactly_the_requests_per_minute(
    start_pool: Callable[..., Pool],
) -> None:
    pool = start_pool()
    apps = [app_for(pool), app_for(pool)]
    ann = caller(apps[0].test_client(), "ann", requests_per_minute=7)
    results = at_once(20, lambda i: ask(apps[i % 2].test_client(), ann))
    codes = sorted(x.status_code for x in results)
    assert codes == [200] * 7 + [429] * 13
    for resp in results:
        if resp.status_code == 429:
            msg = refused(resp, "7 requests per minute")
            assert msg.startswith("user 'ann' reached its quota of 7 requests per minute; ")
            assert "it resets in " in msg
    assert usage_of_float(pool.r, "user:ann", "a", "requests") == 7


def test_concurrent_quota_with_held_requests(start_pool: Callable[..., Pool]) -> None:
    pool = start_pool(debug={"fault_injection": True}, models=None)
    app = app_for(pool)
    c = app.test_client()
    ann, bob = caller(c, "ann", concurrent=2), caller(c, "bob")
    assert ask(c, bob).status_code == 200  # a is loaded
    faults(c, hold={"a": True})
    conc = keys.quota_concurrent("user", "user:ann")
    held = [in_thread(lambda: ask(app.test_client(), ann)) for _ in range(2)]
    pool.wait_for(lambda: pool.r.zcard(conc) == 2, what="two of ann's requests in flight")
    # Many at once beside them: every one refused, none takes a place.
    for resp in at_once(8, lambda i: ask(app.test_client(), ann)):
        msg = refused(resp, "2 concurrent requests")
        assert msg.startswith("user 'ann' reached its quota of 2 concurrent requests; retry in ")
    assert pool.r.zcard(conc) == 2
    faults(c, hold={"a": False})
    for t, out in held:
        t.join(60)
        assert out[0].status_code == 200
    assert pool.r.zcard(conc) == 0
    # A stream answers once its first keep-alive goes out (its model is held).
    configure(c, "server", sse_keepalive_s=0.05)
    faults(c, hold={"a": True})
    stream = c.post(
        "/v1/chat/completions",
        json={"model": "a", "messages": MESSAGES, "max_tokens": 4, "stream": True},
        headers=ann.headers,
        buffered=False,
    )
    assert pool.r.zcard(conc) == 1
    other = in_thread(lambda: ask(app.test_client(), ann))
    pool.wait_for(lambda: pool.r.zcard(conc) == 2, what="a stream and a request in flight")
    refused(ask(c, ann), "concurrent")
    stream.close()  # the client leaves: its stream gives its place back
    assert pool.r.zcard(conc) == 1
    faults(c, hold={"a": False})
    other[0].join(60)
    assert other[1][0].status_code == 200
    assert ask(c, ann).status_code == 200
    assert pool.r.zcard(conc) == 0


def test_twenty_requests_at_once_spend_at_most_one_request_over_the_tokens_per_day(
    start_pool: Callable[..., Pool],
) -> None:
    """Admissions reserve what they may use: 20 at once against a quota of 100 tokens (each
    may use its prompt and 8 tokens) cannot all pass while none has finished, and the day ends
    at most one request's reservation over the quota. The model is held while they arrive, so
    no request finishes (and charges) before every one of them was admitted or refused."""
    limit, max_tokens = 100, 8
    pool = start_pool(debug={"fault_injection": True}, models=None)
    apps = [app_for(pool), app_for(pool)]
    c = apps[0].test_client()
    ann = caller(c, "ann", tokens_per_day=limit)
    assert ask(c, caller(c, "bob"), max_tokens=1).status_code == 200  # a is loaded
    faults(c, hold={"a": True})
    one_max = quota.reservation({"messages": MESSAGES}, max_tokens)
    answers: list[Any] = []

    def in_flight() -> int:
        return int(pool.r.llen(keys.queue("a")) + pool.r.llen(keys.processing("a")))

    def one(i: int) -> Any:
        resp = ask(apps[i % 2].test_client(), ann, max_tokens=max_tokens)
        answers.append(resp)
        return resp

    burst = in_thread(lambda: at_once(20, one))
    pool.wait_for(
        lambda: len(answers) + in_flight() == 20, what="every request admitted or refused"
    )
    admitted = in_flight()
    # Admitted while the charged tokens and the reservations were below the quota.
    assert admitted == -(-limit // one_max), (admitted, one_max)
    for resp in answers:
        msg = refused(resp, "tokens per day")
        assert "reserved by them" in msg and "retry in" in msg, msg
    faults(c, hold={"a": False})
    burst[0].join(120)
    results = burst[1][0]
    served = [x.get_json()["usage"]["total_tokens"] for x in results if x.status_code == 200]
    assert len(served) == admitted
    # Then one at a time until the quota refuses for the day.
    while True:
        resp = ask(c, ann, max_tokens=max_tokens)
        if resp.status_code != 200:
            break
        served.append(resp.get_json()["usage"]["total_tokens"])
    assert "resets at 00:00 UTC" in refused(resp, "tokens per day")
    day = keys.quota_day(today())
    charged = int(pool.r.hget(day, keys.quota_field("tokens", "user", "user:ann")))
    assert charged == sum(served)
    assert limit <= charged <= limit + one_max
    # Every reservation was given back.
    assert pool.r.hget(day, keys.quota_field("reserved", "user", "user:ann")) is None
    assert not [f for f in pool.r.hkeys(day) if f.startswith("hold|")]


def test_tokens_per_day_refuses_once_the_days_tokens_are_used(
    start_pool: Callable[..., Pool],
) -> None:
    pool = start_pool()
    c = app_for(pool).test_client()
    ann = caller(c, "ann", tokens_per_day=30)
    ann_k = caller(c, "ann", key_quotas={"tokens_per_day": 1000})
    used = 0
    while used < 30:
        resp = ask(c, ann, max_tokens=8)
        assert resp.status_code == 200, resp.get_json()
        used += resp.get_json()["usage"]["total_tokens"]
    msg = refused(ask(c, ann), "tokens per day")
    assert msg.startswith(f"user 'ann' reached its quota of 30 tokens per day ({used} used today)")
    assert int(
        pool.r.hget(keys.quota_day(today()), keys.quota_field("tokens", "user", "user:ann"))
    ) == (used)
    # Through a key with a quota of its own (unused), the user's quota still applies.
    msg = refused(ask(c, ann_k), "tokens per day")
    assert msg.startswith("user 'ann' reached its quota of 30 tokens per day")


def test_key_tokens_are_counted_per_key(start_pool: Callable[..., Pool]) -> None:
    pool = start_pool()
    c = app_for(pool).test_client()
    k = caller(c, "cy", key_quotas={"tokens_per_day": 5})
    resp = ask(c, k, max_tokens=8)
    assert resp.status_code == 200
    spent = resp.get_json()["usage"]["total_tokens"]
    assert spent >= 5
    day = keys.quota_day(today())
    assert int(pool.r.hget(day, keys.quota_field("tokens", "key", k.key_id))) == spent
    assert int(pool.r.hget(day, keys.quota_field("tokens", "user", "user:cy"))) == spent
    msg = refused(ask(c, k), "tokens per day")
    assert msg.startswith(f"API key '{k.key_id}' of user 'cy' reached its quota of 5 tokens")
    # Another key of the same user has a day of its own.
    assert ask(c, caller(c, "cy"), max_tokens=2).status_code == 200


def test_load_seconds_are_charged_to_the_causing_user_and_refuse_only_loads(
    start_pool: Callable[..., Pool],
) -> None:
    pool = start_pool(pool={"max_loaded_models": 1})
    c = app_for(pool).test_client()
    ann, bob = caller(c, "ann", load_seconds_per_day=0.0001), caller(c, "bob")
    assert ask(c, ann, "a").status_code == 200  # within its quota (nothing used): loads a
    day = keys.quota_day(today())
    charged = float(pool.r.hget(day, keys.quota_field("load_seconds", "user", "user:ann")) or 0)
    load_a = float(pool.r.hget(keys.model("a"), "load_seconds") or 0)
    assert charged > 0 and charged == pytest.approx(load_a, abs=1e-3)
    assert usage_of_float(pool.r, "user:ann", "a", "load_seconds") == pytest.approx(
        charged, abs=1e-9
    )
    # Loaded: ann's requests for it pass; a cold one would load: refused, and nothing queued.
    assert ask(c, ann, "a").status_code == 200
    msg = refused(ask(c, ann, "b"), "load-seconds per day")
    assert "model 'b' is not loaded (it is unloaded)" in msg
    assert pool.r.llen(keys.queue("b")) == 0 and pool.state("b") == "unloaded"
    # Bob's request loads b: charged to bob, not ann; then ann may use b.
    assert ask(c, bob, "b").status_code == 200
    assert float(pool.r.hget(day, keys.quota_field("load_seconds", "user", "user:bob")) or 0) > 0
    assert float(pool.r.hget(day, keys.quota_field("load_seconds", "user", "user:ann"))) == charged
    assert ask(c, ann, "b").status_code == 200


def usage_of_float(r: redis.Redis, user_: str, model: str, counter: str) -> float:
    return float(r.hget(keys.usage(today()), keys.usage_field(user_, model, counter)) or 0)


# --- the usage report and per-user metrics -----------------------------------------------------


def test_admin_usage_totals_equal_the_responses_usage(start_pool: Callable[..., Pool]) -> None:
    pool = start_pool()
    c = app_for(pool).test_client()
    who = {"ann": caller(c, "ann"), "bob": caller(c, "bob")}
    sums: dict[tuple[str, str], list[int]] = {}
    for name, model, n in (("ann", "a", 3), ("ann", "a", 6), ("bob", "a", 5), ("ann", "b", 4)):
        resp = ask(c, who[name], model, max_tokens=n)
        assert resp.status_code == 200
        u = resp.get_json()["usage"]
        s = sums.setdefault((name, model), [0, 0, 0])
        s[0] += 1
        s[1] += u["prompt_tokens"]
        s[2] += u["completion_tokens"]
    resp = c.get("/admin/usage", headers=ADMIN)
    assert resp.status_code == 200
    rep = resp.get_json()
    assert rep["from"] == rep["to"] == today()

    def totals(items: list[list[int]]) -> dict[str, int]:
        return {
            "requests": sum(x[0] for x in items),
            "prompt_tokens": sum(x[1] for x in items),
            "completion_tokens": sum(x[2] for x in items),
        }

    def counts(row: dict[str, Any]) -> dict[str, int]:
        return {k: row[k] for k in ("requests", "prompt_tokens", "completion_tokens")}

    assert counts(rep["total"]) == totals(list(sums.values()))
    assert rep["total"]["total_tokens"] == (
        rep["total"]["prompt_tokens"] + rep["total"]["completion_tokens"]
    )
    assert counts(rep["users"]["ann"]) == totals([v for k, v in sums.items() if k[0] == "ann"])
    assert counts(rep["models"]["a"]) == totals([v for k, v in sums.items() if k[1] == "a"])
    assert counts(rep["days"][today()]) == totals(list(sums.values()))
    # Loads were caused by ann (a, then b): their seconds are hers.
    assert rep["users"]["ann"]["load_seconds"] > 0 and rep["users"]["bob"]["load_seconds"] == 0
    one = c.get(f"/admin/usage?from={today()}&to={today()}&user=ann&model=a", headers=ADMIN)
    assert counts(one.get_json()["total"]) == totals([sums[("ann", "a")]])
    assert [(x["user"], x["model"]) for x in one.get_json()["rows"]] == [("ann", "a")]
    # Bad queries name their parameter; the report is the admin's.
    bad = c.get("/admin/usage?from=2024-02-30", headers=ADMIN)
    assert bad.status_code == 400 and bad.get_json()["error"]["param"] == "from"
    bad = c.get("/admin/usage?from=2024-03-02&to=2024-03-01", headers=ADMIN)
    assert bad.status_code == 400 and bad.get_json()["error"]["param"] == "from"
    assert c.get("/admin/usage").status_code == 401


def test_per_user_metrics_only_when_configured(start_pool: Callable[..., Pool]) -> None:
    pool = start_pool()
    c = app_for(pool).test_client()
    resp = ask(c, caller(c, "ann"), max_tokens=3)
    assert resp.status_code == 200
    u = resp.get_json()["usage"]
    text = c.get("/metrics").get_data(as_text=True)
    assert "residency_user_" not in text and 'user="ann"' not in text
    configure(c, "metrics", per_user=True)
    text = c.get("/metrics").get_data(as_text=True)
    assert 'residency_user_requests_total{model="a",user="ann"} 1.0' in text
    for kind in ("prompt", "completion"):
        line = f'residency_user_tokens_total{{kind="{kind}",model="a",user="ann"}} '
        assert line + str(float(u[f"{kind}_tokens"])) in text


def test_usage_command_prints_the_report_as_a_table(
    start_pool: Callable[..., Pool],
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    from residency import cli
    from tests.integration.test_bounded_work import http_server

    pool = start_pool()
    c = app_for(pool).test_client()
    resp = ask(c, caller(c, "ann"), max_tokens=5)
    assert resp.status_code == 200
    u = resp.get_json()["usage"]
    monkeypatch.setenv("RESIDENCY_ADMIN_KEY", "test-admin-key")
    args = ["--config", str(pool.box.config_path), "--data-dir", str(pool.box.data_dir)]
    with http_server(pool) as port:
        url = f"http://127.0.0.1:{port}"
        assert cli.main(["usage", "--url", url, "--user", "ann", *args]) == 0
        lines = capsys.readouterr().out.splitlines()
        assert lines[0].split()[:4] == ["day", "user", "model", "requests"]
        row = [today(), "ann", "a", "1", str(u["prompt_tokens"]), str(u["completion_tokens"])]
        assert lines[1].split()[:6] == row
        assert lines[-1].split()[:4] == [
            "total",
            "1",
            str(u["prompt_tokens"]),
            str(u["completion_tokens"]),
        ]
        assert cli.main(["usage", "--url", url, "--from", "someday", *args]) == 1
        assert "'from' must be a date" in capsys.readouterr().err


# --- routing helpers run for admitted requests only, as their caller's --------------------------


def test_a_router_generates_only_for_an_admitted_caller_and_is_charged_to_it(
    start_pool: Callable[..., Pool],
) -> None:
    """A policy with an LLM router: the router's generation is part of the request, so a caller
    refused 429 makes it generate nothing (however many retries at once), and what it
    generates counts under the caller's user and key."""
    pool = start_pool()
    c = app_for(pool).test_client()
    router = {"type": "llm", "model": "c", "prompt": "Pick a model.", "max_tokens": 8}
    spec = {"candidates": ["a", "b"], "default": "a", "router": router}
    assert c.put("/admin/policies/judge", json=spec, headers=ADMIN).status_code == 201
    ann = caller(c, "ann", requests_per_minute=2)
    for _ in range(2):
        resp = ask(c, ann, "judge")
        assert resp.status_code == 200, resp.get_json()
        assert resp.headers["x-residency-route"] == "judge:default:a"

    def helper_requests() -> int:
        day = pool.r.hgetall(keys.usage(today()))
        return sum(int(v) for f, v in day.items() if f.endswith("|c|requests"))

    assert helper_requests() == 2 and usage_of_float(pool.r, "user:ann", "c", "requests") == 2
    for resp in at_once(6, lambda i: ask(app_for(pool).test_client(), ann, "judge")):
        refused(resp, "2 requests per minute")
    assert helper_requests() == 2  # no router generation for a refused caller
    # The router's tokens are the caller's: its user's and its key's.
    spent = sum(
        usage_of_float(pool.r, "user:ann", m, k)
        for m in ("a", "c")
        for k in ("prompt_tokens", "completion_tokens")
    )
    assert usage_of_float(pool.r, "user:ann", "c", "prompt_tokens") > 0
    day = keys.quota_day(today())
    assert int(pool.r.hget(day, keys.quota_field("tokens", "key", ann.key_id)) or 0) == spent


def test_counting_a_prompts_tokens_reserves_no_tokens_to_generate(
    start_pool: Callable[..., Pool],
) -> None:
    """count_tokens generates nothing: while one is in flight it holds its prompt's
    reservation only, not the model's token cap (512 here, what a chat without max_tokens
    reserves), so its user's chat is admitted beside it under a 200-token quota."""
    pool = start_pool(debug={"fault_injection": True})
    c = app_for(pool).test_client()
    ann = caller(c, "ann", tokens_per_day=200)
    bob = caller(c, "bob")
    assert ask(c, bob, max_tokens=1).status_code == 200  # a is loaded
    faults(c, hold={"a": True})
    held = in_thread(lambda: ask(app_for(pool).test_client(), bob, max_tokens=1))
    pool.wait_for(lambda: pool.r.llen(keys.processing("a")) == 1, what="bob's chat held")
    body = {"model": "a", "messages": MESSAGES}
    count = in_thread(
        lambda: (
            app_for(pool)
            .test_client()
            .post("/v1/messages/count_tokens", json=body, headers=ann.headers)
        )
    )
    pool.wait_for(lambda: pool.r.llen(keys.queue("a")) == 1, what="ann's count queued")
    chat = in_thread(lambda: ask(app_for(pool).test_client(), ann, max_tokens=2))
    pool.wait_for(
        lambda: pool.r.llen(keys.queue("a")) == 2 or not chat[0].is_alive(),
        what="ann's chat queued (or refused)",
    )
    faults(c, hold={"a": False})
    for t, _ in (held, count, chat):
        t.join(120)
    assert count[1][0].status_code == 200, count[1][0].get_json()
    assert chat[1][0].status_code == 200, chat[1][0].get_json()
