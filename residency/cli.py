"""The `residency` command line (see CONTRACT.md): up, the single roles, status, config, and
tiny-model. Roles are imported only by the command that runs them."""

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
    from web.server import run

    run(box, host=args.host or s.server.host, port=args.port or s.server.port)
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
        lines.append(f"worker  {w['host']} {','.join(w['devices'])} {state}")
    return "\n".join(lines)


def cmd_status(args: argparse.Namespace) -> int:
    url = _base_url(args, _box(args))
    resp = requests.get(url + "/health", timeout=10)
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


def cmd_tiny_model(args: argparse.Namespace) -> int:
    from residency.tinymodel import write_tiny_model

    p = write_tiny_model(args.out, seed=args.seed, dtype=args.dtype, embedding=args.embedding)
    print(p)
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

    tm = sub.add_parser("tiny-model", help="write a tiny seeded-random llama GGUF")
    tm.add_argument("out", type=Path)
    tm.add_argument("--seed", type=int, default=0)
    tm.add_argument("--dtype", choices=["f32", "q8_0"], default="f32")
    tm.add_argument("--embedding", action="store_true")
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
