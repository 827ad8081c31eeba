"""The `residency` command line (see CONTRACT.md): up, the single roles, status, config, usage,
users, keys, tokens and tiny-model. Roles are imported only by the command that runs them."""

from __future__ import annotations

import argparse
import json
import logging
import os
import shutil
import signal
import sys
import threading
from datetime import datetime
from pathlib import Path
from typing import Any

import requests

from residency.box import Box
from residency.settings import SettingsError


def _box(args: argparse.Namespace) -> Box:
    return Box.from_env(
        data_dir=getattr(args, "data_dir", None), config=getattr(args, "config", None)
    )


def _logging() -> None:
    logging.basicConfig(
        level=os.environ.get("RESIDENCY_LOG_LEVEL", "INFO"),
        format="%(asctime)s %(levelname)s %(name)s %(message)s",
    )


def _stop_on_signals() -> threading.Event:
    stop = threading.Event()

    def _set(signum: int, _frame: Any) -> None:
        stop.set()

    signal.signal(signal.SIGTERM, _set)
    signal.signal(signal.SIGINT, _set)
    return stop


def cmd_up(args: argparse.Namespace) -> int:
    from residency.supervisor import run_up

    _logging()
    return run_up(_box(args), host=args.host, port=args.port)


def cmd_coordinator(args: argparse.Namespace) -> int:
    from coordinator.loop import main

    _logging()
    box = _box(args)
    box.base_settings()
    main(box, _stop_on_signals())
    return 0


def cmd_worker(args: argparse.Namespace) -> int:
    from workers.agent import main

    _logging()
    box = _box(args)
    box.base_settings()
    main(box, _stop_on_signals())
    return 0


def cmd_web(args: argparse.Namespace) -> int:
    _logging()
    box = _box(args)
    s = box.base_settings()
    # prometheus-client reads this at import: set it before anything imports it.
    metrics_dir = box.metrics_dir
    shutil.rmtree(metrics_dir, ignore_errors=True)
    metrics_dir.mkdir(parents=True, exist_ok=True)
    os.environ["PROMETHEUS_MULTIPROC_DIR"] = str(metrics_dir)
    from residency.web_role import exec_web

    # A fresh interpreter serves: under gevent it patches before anything imports ssl.
    host, port = args.host or s.server.host, args.port or s.server.port
    exec_web(s.server.web_worker_class, host, port, box.data_dir, box.config_path)
    return 0


def _base_url(args: argparse.Namespace, box: Box) -> str:
    if args.url:
        return str(args.url).rstrip("/")
    s = box.base_settings()
    host = "127.0.0.1" if s.server.host in ("0.0.0.0", "::") else s.server.host
    return f"http://{host}:{s.server.port}"


def _admin(args: argparse.Namespace) -> tuple[str, dict[str, str]]:
    box = _box(args)
    return _base_url(args, box), {"Authorization": f"Bearer {box.admin_key()}"}


def _fmt_time(ts: Any) -> str:
    return datetime.fromtimestamp(float(ts)).strftime("%H:%M:%S") if ts else "-"


def render_status(h: dict[str, Any]) -> str:
    cols = ["model", "pool", "state", "busy", "queued", "host/device", "pid", "last used"]
    rows = [
        [
            m["name"],
            f"{m['type']}/{m['pool']}",
            m["state"] + ("*" if m.get("pinned") else ""),
            str(m["in_flight"]),
            str(m["queued"]),
            f"{m['host'] or '-'}/{m['device'] or '-'}",
            str(m["pid"] or "-"),
            _fmt_time(m.get("last_used")),
        ]
        for m in h.get("models", [])
    ]
    widths = [
        max(len(c), *(len(r[i]) for r in rows)) if rows else len(c) for i, c in enumerate(cols)
    ]
    lines = ["  ".join(c.ljust(w) for c, w in zip(cols, widths, strict=True))]
    lines += ["  ".join(v.ljust(w) for v, w in zip(r, widths, strict=True)) for r in rows]
    limits = ", ".join(
        f"{t}: {v['effective']} (configured {v['configured']})" for t, v in h["max_models"].items()
    )
    lines.append(f"\nlimits  {limits}   generation {h.get('generation')}   (* = pinned)")
    for typ, over in sorted(((h.get("enforcement") or {}).get("blocked") or {}).items()):
        lines.append(
            f"shrink  {typ} pool {over} over its limit: deferred until a busy model goes idle"
        )
    for w in h.get("workers", []):
        state = "alive" if w["alive"] else "GONE"
        if not w["alive"] and w.get("last_seen") is not None:
            seen = datetime.fromtimestamp(float(w["last_seen"])).strftime("%H:%M:%S")
            state += f" (last seen {seen})"
        lines.append(f"worker  {w['host']} {','.join(w['devices'])} {state}")
    for d in h.get("devices", []):
        budget = d.get("budget_bytes")
        of = "no budget" if budget is None else f"of {budget >> 20} MiB"
        held = ", ".join(f"{m} {n >> 20}" for m, n in sorted(d.get("models", {}).items()))
        lines.append(
            f"memory  {d['host']}/{d['device']} {d['used_bytes'] >> 20} MiB {of}"
            + (f" ({held})" if held else "")
        )
    for w in h.get("workers", []):
        c = w.get("slot_cache")
        if c:
            saved = ", ".join(
                f"{m['name']} {m['cache']['entries']}"
                for m in h.get("models", [])
                if (m.get("cache") or {}).get("entries") and m.get("host") in (None, w["host"])
            )
            lines.append(
                f"cache   {w['host']} {_mib(c['bytes'])} MiB in {c['entries']} saved slot(s) "
                f"at {c['dir']}" + (f" ({saved})" if saved else "")
            )
    return "\n".join(lines)


def _mib(n: int) -> str:
    return f"{n / (1 << 20):.1f}"


def cmd_status(args: argparse.Namespace) -> int:
    box = _box(args)
    url = _base_url(args, box)
    try:  # /health needs a key on a box that requires keys: the admin key is one
        headers = {"Authorization": f"Bearer {box.admin_key()}"}
    except RuntimeError:
        headers = {}
    resp = requests.get(url + "/health", headers=headers, timeout=10)
    if resp.status_code != 200:
        print(
            f"residency status: {url}/health answered {resp.status_code}: {resp.text}",
            file=sys.stderr,
        )
        return 1
    h = resp.json()
    print(json.dumps(h, indent=2) if args.json else render_status(h))
    return 0


def _parse_assignment(text: str) -> tuple[str, str, Any]:
    key, sep, raw = text.partition("=")
    section, dot, name = key.strip().partition(".")
    if not sep or not dot or not name:
        raise SystemExit(f"residency config set: expected SECTION.KEY=VALUE, got {text!r}")
    try:
        value: Any = json.loads(raw)
    except ValueError:
        value = raw
    return section, name, value


def cmd_config(args: argparse.Namespace) -> int:
    url, headers = _admin(args)
    if args.action == "get":
        resp = requests.get(url + "/admin/config", headers=headers, timeout=10)
        if resp.status_code != 200:
            print(resp.text, file=sys.stderr)
            return 1
        body = resp.json()
        if args.key:
            section, _, name = args.key.partition(".")
            try:
                value = body["config"][section][name] if name else body["config"][section]
            except KeyError:
                print(f"residency config get: unknown key {args.key}", file=sys.stderr)
                return 1
            print(json.dumps(value))
        else:
            print(json.dumps(body, indent=2))
        return 0
    patch: dict[str, dict[str, Any]] = {}
    for a in args.assignments:
        section, name, value = _parse_assignment(a)
        patch.setdefault(section, {})[name] = value
    resp = requests.patch(url + "/admin/config", headers=headers, json=patch, timeout=10)
    print(json.dumps(resp.json(), indent=2))
    return 0 if resp.status_code == 200 else 1


def cmd_usage(args: argparse.Namespace) -> int:
    from residency.usage import render

    url, headers = _admin(args)
    params = {
        k: v
        for k, v in (
            ("from", args.from_day),
            ("to", args.to_day),
            ("user", args.user),
            ("model", args.model),
        )
        if v
    }
    resp = requests.get(url + "/admin/usage", headers=headers, params=params, timeout=30)
    if resp.status_code != 200:
        print(f"residency usage: {resp.status_code}: {resp.text}", file=sys.stderr)
        return 1
    rep = resp.json()
    print(json.dumps(rep, indent=2) if args.json else render(rep))
    return 0


def _quotas(assignments: list[str] | None) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for a in assignments or []:
        name, sep, raw = a.partition("=")
        if not sep:
            raise SystemExit(f"residency: expected --quota NAME=VALUE, got {a!r}")
        try:
            out[name.strip()] = json.loads(raw)
        except ValueError:
            out[name.strip()] = raw  # the admin API names the bad value
    return out


def _names(csv: str | None) -> list[str] | None:
    return None if csv is None else [n for n in csv.split(",") if n]


def _call(args: argparse.Namespace, method: str, path: str, body: Any = None) -> int:
    """One admin API call; prints its JSON answer (an error to stderr)."""
    url, headers = _admin(args)
    params = {"user": args.user} if getattr(args, "user", None) else None
    resp = requests.request(
        method, url + path, headers=headers, json=body, params=params, timeout=10
    )
    ok = resp.status_code in (200, 201)
    print(json.dumps(resp.json(), indent=2), file=sys.stdout if ok else sys.stderr)
    return 0 if ok else 1


def cmd_users(args: argparse.Namespace) -> int:
    if args.action == "ls":
        return _call(args, "GET", "/admin/users")
    if args.action == "rm":
        return _call(args, "DELETE", f"/admin/users/{args.name}")
    body: dict[str, Any] = {"name": args.name}
    if args.weight is not None:
        body["weight"] = args.weight
    if args.quota:
        body["quotas"] = _quotas(args.quota)
    return _call(args, "POST", "/admin/users", body)


def cmd_keys(args: argparse.Namespace) -> int:
    if args.action == "ls":
        return _call(args, "GET", "/admin/keys")
    if args.action == "revoke":
        return _call(args, "DELETE", f"/admin/keys/{args.id}")
    body: dict[str, Any] = {
        "label": args.label or "",
        "models": _names(args.models),
        "policies": _names(args.policies),
        "may_load": not args.no_load,
        "route_trace": args.route_trace,
        "monitor": args.monitor,
    }
    if args.quota:
        body["quotas"] = _quotas(args.quota)
    # The answer holds the key: the only time it is shown.
    return _call(args, "POST", f"/admin/users/{args.owner}/keys", body)


def cmd_tokens(args: argparse.Namespace) -> int:
    if args.action == "ls":
        return _call(args, "GET", "/admin/tokens")
    if args.action == "rm":
        return _call(args, "DELETE", f"/admin/tokens/{args.name}")
    return _call(args, "POST", "/admin/tokens", {"name": args.name})


PULL_POLL_S = 0.5
PULL_BAR = 30


def render_pull_bar(p: dict[str, Any]) -> str:
    """One line of a pull's progress: a bar (when its size is known), bytes and state."""
    done, total = int(p.get("bytes_done") or 0), p.get("bytes_total")
    if total:
        filled = min(PULL_BAR, PULL_BAR * done // int(total))
        bar = "[" + "#" * filled + "-" * (PULL_BAR - filled) + f"] {100 * done // int(total):3d}%"
        size = f"{_mib(done)}/{_mib(int(total))} MiB"
    else:
        bar, size = "[" + "?" * PULL_BAR + "]", f"{_mib(done)} MiB"
    return f"{p.get('file') or p.get('source')}: {bar} {size} {p.get('state')}"


def cmd_pull(args: argparse.Namespace) -> int:
    import time

    url, headers = _admin(args)
    body: dict[str, Any] = {"source": args.source, "mmproj": args.mmproj}
    for k in ("name", "host", "dir"):
        if getattr(args, k):
            body[k] = getattr(args, k)
    resp = requests.post(url + "/admin/pulls", headers=headers, json=body, timeout=60)
    if resp.status_code != 202:
        print(f"residency pull: {resp.status_code}: {resp.text}", file=sys.stderr)
        return 1
    p = resp.json()
    if args.no_wait:
        print(json.dumps(p, indent=2))
        return 0
    tty = sys.stderr.isatty()
    shown = None
    while True:
        # A terminal gets one line redrawn; a log gets a line per state change only.
        if tty:
            print("\r" + render_pull_bar(p), end="", file=sys.stderr, flush=True)
        elif p["state"] != shown:
            print(render_pull_bar(p), file=sys.stderr, flush=True)
            shown = p["state"]
        if p["state"] in ("done", "failed", "cancelled"):
            break
        time.sleep(PULL_POLL_S)
        got = requests.get(f"{url}/admin/pulls/{p['id']}", headers=headers, timeout=30)
        if got.status_code != 200:
            print(f"\nresidency pull: {got.status_code}: {got.text}", file=sys.stderr)
            return 1
        p = got.json()
    if tty:
        print(file=sys.stderr)
    print(json.dumps(p, indent=2))
    if p["state"] != "done":
        print(f"residency pull: {p['state']}: {p.get('error') or ''}", file=sys.stderr)
        return 1
    return 0


def cmd_tiny_model(args: argparse.Namespace) -> int:
    import dataclasses

    from residency.tinymodel import TINY, write_tiny_model

    sizes = {f.name: getattr(args, f.name) for f in dataclasses.fields(TINY)}
    try:
        shape = dataclasses.replace(TINY, **{k: v for k, v in sizes.items() if v is not None})
        p = write_tiny_model(
            args.out,
            seed=args.seed,
            dtype=args.dtype,
            embedding=args.embedding,
            rerank=args.rerank,
            shape=shape,
        )
        proj = None
        if args.mmproj is not None:
            from residency.tinyprojector import write_tiny_projector

            if args.embedding or args.rerank:
                raise ValueError("--mmproj is for a chat model, not an embedding model or reranker")
            proj = write_tiny_projector(args.mmproj, n_embd_text=shape.n_embd, seed=args.seed)
    except ValueError as e:
        print(f"tiny-model: {e}", file=sys.stderr)
        return 2
    print(p)
    if proj is not None:
        print(proj)
    return 0


def parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="residency", description=__doc__)
    sub = ap.add_subparsers(dest="command", required=True)

    def common(p: argparse.ArgumentParser) -> argparse.ArgumentParser:
        p.add_argument("--config", help="TOML config file (default: $RESIDENCY_CONFIG)")
        p.add_argument("--data-dir", help="data dir (default: $RESIDENCY_DATA_DIR)")
        return p

    up = common(sub.add_parser("up", help="the whole box on this machine"))
    up.add_argument("--host")
    up.add_argument("--port", type=int)
    up.set_defaults(func=cmd_up)
    for role, func in (("coordinator", cmd_coordinator), ("worker", cmd_worker)):
        common(sub.add_parser(role, help=f"run the {role} role alone")).set_defaults(func=func)
    web = common(sub.add_parser("web", help="run the web front end alone"))
    web.add_argument("--host")
    web.add_argument("--port", type=int)
    web.set_defaults(func=cmd_web)

    st = common(sub.add_parser("status", help="the pool as a table"))
    st.add_argument("--url", help="base URL of the box (default: from the config)")
    st.add_argument("--json", action="store_true", help="print the raw /health record")
    st.set_defaults(func=cmd_status)

    cfg = common(sub.add_parser("config", help="read or change settings through the admin API"))
    cfg.add_argument("--url", help="base URL of the box (default: from the config)")
    csub = cfg.add_subparsers(dest="action", required=True)
    g = csub.add_parser("get")
    g.add_argument("key", nargs="?")
    s = csub.add_parser("set")
    s.add_argument("assignments", nargs="+", metavar="SECTION.KEY=VALUE")
    cfg.set_defaults(func=cmd_config)

    us = common(sub.add_parser("usage", help="what each user used, per model and day (table)"))
    us.add_argument("--url", help="base URL of the box (default: from the config)")
    us.add_argument("--from", dest="from_day", metavar="YYYY-MM-DD", help="first day (UTC)")
    us.add_argument("--to", dest="to_day", metavar="YYYY-MM-DD", help="last day (default today)")
    us.add_argument("--user", help="only this user ('-': anonymous callers)")
    us.add_argument("--model", help="only this model")
    us.add_argument("--json", action="store_true", help="print the raw /admin/usage answer")
    us.set_defaults(func=cmd_usage)

    quota_help = "NAME=VALUE: requests_per_minute, tokens_per_day, concurrent, ..."
    users_p = common(sub.add_parser("users", help="add, list or remove users"))
    users_p.add_argument("--url", help="base URL of the box (default: from the config)")
    usub = users_p.add_subparsers(dest="action", required=True)
    ua = usub.add_parser("add")
    ua.add_argument("name")
    ua.add_argument("--weight", type=float, help="share in fair queueing (default 1)")
    ua.add_argument("--quota", action="append", metavar="NAME=VALUE", help=quota_help)
    usub.add_parser("ls")
    usub.add_parser("rm").add_argument("name")
    users_p.set_defaults(func=cmd_users)

    keys_p = common(sub.add_parser("keys", help="issue, list or revoke API keys"))
    keys_p.add_argument("--url", help="base URL of the box (default: from the config)")
    ksub = keys_p.add_subparsers(dest="action", required=True)
    ki = ksub.add_parser("issue", help="a new key for a user (printed once)")
    ki.add_argument("owner", metavar="USER")
    ki.add_argument("--label", help="what the key is for")
    ki.add_argument("--models", metavar="A,B", help="only these models (default: all)")
    ki.add_argument("--policies", metavar="P,Q", help="only these policies (default: all)")
    ki.add_argument("--no-load", action="store_true", help="may not cause a model load")
    ki.add_argument("--route-trace", action="store_true", help="may ask for route_trace")
    ki.add_argument(
        "--monitor", action="store_true", help="may read /health and /metrics (a scrape key)"
    )
    ki.add_argument("--quota", action="append", metavar="NAME=VALUE", help=quota_help)
    ksub.add_parser("ls").add_argument("--user", help="only this user's keys")
    ksub.add_parser("revoke").add_argument("id")
    keys_p.set_defaults(func=cmd_keys)

    tok = common(sub.add_parser("tokens", help="add, list or remove named admin tokens"))
    tok.add_argument("--url", help="base URL of the box (default: from the config)")
    tsub = tok.add_subparsers(dest="action", required=True)
    tsub.add_parser("add", help="a new admin token (printed once)").add_argument("name")
    tsub.add_parser("ls")
    tsub.add_parser("rm").add_argument("name")
    tok.set_defaults(func=cmd_tokens)

    pl = common(sub.add_parser("pull", help="download a model onto a host and register it"))
    pl.add_argument("source", help="hf:ORG/REPO[:QUANT or FILE], or an http(s) URL of a .gguf")
    pl.add_argument("--url", help="base URL of the box (default: from the config)")
    pl.add_argument("--name", help="the model's name (default: the file's stem)")
    pl.add_argument("--host", help="the host to pull onto (default: the only one)")
    pl.add_argument("--dir", help="one of server.model_dirs (default: the data dir's models/)")
    pl.add_argument("--mmproj", action="store_true", help="also the repo's vision projector")
    pl.add_argument("--no-wait", action="store_true", help="print the pull and return at once")
    pl.set_defaults(func=cmd_pull)

    tm = sub.add_parser("tiny-model", help="write a tiny seeded-random llama GGUF")
    tm.add_argument("out", type=Path)
    tm.add_argument("--seed", type=int, default=0)
    tm.add_argument("--dtype", choices=["f32", "f16", "q8_0"], default="f32")
    # Larger shapes are for benchmarks (bench/gpu.sh: Llama 3.2 1B's shape, random weights).
    for size, what in (
        ("n-layer", "layers (2)"),
        ("n-embd", "embedding width (64)"),
        ("n-head", "attention heads (4)"),
        ("n-head-kv", "KV heads (2)"),
        ("n-ff", "feed-forward width (128)"),
        ("n-vocab", "vocabulary, padded up to this many tokens (natural: ~400)"),
    ):
        tm.add_argument(f"--{size}", type=int, help=what)
    kind = tm.add_mutually_exclusive_group()
    kind.add_argument("--embedding", action="store_true")
    kind.add_argument("--rerank", action="store_true", help="a reranker (rank pooling)")
    tm.add_argument(
        "--mmproj",
        type=Path,
        metavar="PROJ.gguf",
        help="also write a tiny vision projector for it (serve it with [models.X] mmproj)",
    )
    tm.set_defaults(func=cmd_tiny_model)
    return ap


def main(argv: list[str] | None = None) -> int:
    args = parser().parse_args(argv)
    try:
        return int(args.func(args))
    except SettingsError as e:
        print(f"residency: {e}", file=sys.stderr)
        return 2
    except requests.ConnectionError as e:
        print(f"residency: cannot reach the box: {e}", file=sys.stderr)
        return 1
    except RuntimeError as e:
        print(f"residency: {e}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    raise SystemExit(main())
