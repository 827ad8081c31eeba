"""The web role's process: ``residency web`` (and so ``up``) reads its settings, then replaces
itself with this module (``exec``), which runs gunicorn.

Why a fresh interpreter: gunicorn's gevent worker patches the standard library when it starts,
after the fork, by which time the master has imported redis and requests, whose modules keep
direct references to ``ssl.SSLContext`` that no patch can reach (gevent warns at every start
that this may lead to errors). Here, under the gevent worker class, the patch comes first, before
anything imports ssl: the master and every worker it forks run patched from their first import.
The worker's own patch then finds everything patched already. ``exec`` keeps the process id, so
the supervisor's signals and its parent-death signal still reach the gunicorn master.
"""

import sys

# The first argument says which worker class gunicorn runs; it is read before any import that
# could bring ssl in (which is every other one in this module).
if __name__ == "__main__" and sys.argv[1:2] == ["gevent"]:
    from gevent import monkey

    monkey.patch_all()

import argparse
import os
from pathlib import Path


def command(
    worker_class: str, host: str, port: int, data_dir: Path, config: Path | None
) -> list[str]:
    """The command line that runs the web role in this module."""
    argv = [
        sys.executable,
        "-m",
        "residency.web_role",
        worker_class,
        host,
        str(port),
        "--data-dir",
        str(data_dir),
    ]
    return argv + (["--config", str(config)] if config is not None else [])


def exec_web(worker_class: str, host: str, port: int, data_dir: Path, config: Path | None) -> None:
    """Replace this process with the web role (never returns)."""
    argv = command(worker_class, host, port, data_dir, config)
    sys.stdout.flush()
    sys.stderr.flush()
    os.execv(argv[0], argv)


def main(argv: list[str]) -> int:
    p = argparse.ArgumentParser(prog="residency.web_role")
    p.add_argument("worker_class", choices=["gevent", "gthread"])
    p.add_argument("host")
    p.add_argument("port", type=int)
    p.add_argument("--data-dir", required=True)
    p.add_argument("--config")
    args = p.parse_args(argv)
    from residency.box import Box
    from residency.cli import _logging
    from web.server import run

    _logging()
    box = Box.from_env(data_dir=args.data_dir, config=args.config)
    run(box, host=args.host, port=args.port)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
