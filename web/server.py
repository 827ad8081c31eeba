"""Running the web role under gunicorn, started from Python (``residency web`` / ``up``).

The caller sets ``PROMETHEUS_MULTIPROC_DIR`` (to an emptied ``box.metrics_dir``) before
prometheus_client is first imported, so every worker writes its metrics where ``/metrics`` of any
worker aggregates them.
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
from typing import Any

from gunicorn.app.base import BaseApplication

from residency.box import Box

GRACEFUL_TIMEOUT_S = 10


def _child_exit(_server: Any, worker: Any) -> None:
    """Runs in the master: drop the dead worker's live gauges from the aggregate."""
    if os.environ.get("PROMETHEUS_MULTIPROC_DIR"):
        from prometheus_client import multiprocess

        multiprocess.mark_process_dead(worker.pid)


def _post_worker_init(worker: Any) -> None:
    """Runs in each worker once its signal handlers are installed: on SIGTERM, tell the
    request threads first (web.bus.SHUTTING_DOWN), so requests still waiting for a model are
    answered at once rather than cut at the end of the graceful timeout."""
    import signal

    from web import bus

    graceful = worker.handle_exit

    def on_term(signum: int, frame: Any) -> None:
        bus.SHUTTING_DOWN.set()
        graceful(signum, frame)

    signal.signal(signal.SIGTERM, on_term)
    # signal.signal makes the signal interrupt system calls again; gunicorn had turned that off
    # so a SIGTERM does not disturb active requests.
    signal.siginterrupt(signal.SIGTERM, False)


class WebServer(BaseApplication):
    def __init__(self, box: Box, options: dict[str, Any]) -> None:
        self.box = box
        self.options = options
        super().__init__()

    def load_config(self) -> None:
        for key, value in self.options.items():
            self.cfg.set(key, value)

    def load(self) -> Any:
        # Called in each worker after fork (preload_app is off), so Redis clients, threads and
        # metric files belong to the worker that uses them.
        from web.app import create_app

        return create_app(self.box)


def _raise_fd_limit() -> None:
    """A gevent worker holds a socket per client and, while a request waits, a Redis
    connection for it: lift the soft limit on open files to the hard one (often 1024 against
    hundreds of thousands), so a thousand waiting clients do not run a worker out of them."""
    import resource

    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if hard == resource.RLIM_INFINITY or soft < hard:
        with contextlib.suppress(ValueError, OSError):
            resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))


def options(
    host: str,
    port: int,
    workers: int,
    *,
    worker_class: str = "gevent",
    threads: int = 16,
    connections: int = 4096,
    access_log: bool = False,
) -> dict[str, Any]:
    _raise_fd_limit()
    return {
        "bind": [f"[{host}]:{port}" if ":" in host else f"{host}:{port}"],
        "workers": workers,
        "worker_class": worker_class,
        # gthread: the requests one worker serves at once; gevent: its greenlets.
        "threads": threads,
        "worker_connections": connections,
        "preload_app": False,
        # gunicorn >= 25 opens a control socket under $XDG_RUNTIME_DIR or $HOME by default.
        "control_socket_disable": True,
        "graceful_timeout": GRACEFUL_TIMEOUT_S,
        "accesslog": "-" if access_log else None,
        "child_exit": _child_exit,
        "post_worker_init": _post_worker_init,
        "proc_name": "residency-web",
        # Streams hold a greenlet (gthread: a thread) for as long as they run; the worker's
        # heartbeat does not depend on request length, so the worker timeout stays gunicorn's
        # default.
        "keepalive": 5,
    }


def run(box: Box, host: str, port: int, *, access_log: bool = False) -> None:
    """Serve until SIGTERM/SIGINT (blocks)."""
    # The workers' settings name the address actually bound (``--host`` may differ from the
    # config): ``[auth] required = null`` requires keys whenever it is not a loopback one.
    box = dataclasses.replace(box, environ={**box.environ, "RESIDENCY_SERVER_HOST": host})
    srv = box.base_settings().server
    opts = options(
        host,
        port,
        srv.web_workers,
        worker_class=srv.web_worker_class,
        threads=srv.web_threads,
        connections=srv.web_connections,
        access_log=access_log,
    )
    WebServer(box, opts).run()
