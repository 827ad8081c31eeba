"""The admin API for pulls: fetch a model file onto a host and register it (``residency pull``).

``POST /admin/pulls`` resolves the source (asking the hub which file, its size and sha256),
picks the host and queues the pull there; the host's agent downloads it (``workers.pull``).
Each host runs one pull at a time and holds at most ``pulls.max_queued`` (429 beyond). A pull's
source is the admin's choice: any http(s) address is allowed, private and loopback ones too.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, cast

from flask import Blueprint, Response, jsonify

from residency import errors, keys, pull_store, registry
from residency.box import audit
from residency.errors import ApiError
from residency.pull_source import HubUnreachable, resolve
from residency.pulls import FINISHED, SourceError, default_model_name, parse_source
from residency.settings import check_model_name
from web import admin_api
from web.body import read_json
from web.responses import error_response
from web.state import state

bp = Blueprint("admin_pulls", __name__, url_prefix="/admin")
bp.before_request(admin_api._auth)

_FIELDS = {"source", "name", "host", "mmproj", "dir"}


def _live_hosts() -> list[str]:
    r = state().r
    hosts = sorted(cast(set[str], r.smembers(keys.workers())))
    pipe = r.pipeline(transaction=False)
    for h in hosts:
        pipe.exists(keys.worker(h))
    return [h for h, alive in zip(hosts, pipe.execute(), strict=True) if alive]


def _host(given: Any) -> str:
    live = _live_hosts()
    if given is not None:
        if not isinstance(given, str) or given not in live:
            shown = ", ".join(live) or "none"
            raise errors.bad_request(f"no live host {given!r} (live: {shown})", "host")
        return given
    if len(live) == 1:
        return live[0]
    if not live:
        raise errors.not_ready("no live worker agent to pull onto")
    raise errors.bad_request(
        f"{len(live)} hosts are live ({', '.join(live)}): name one in 'host'", "host"
    )


def _folder(given: Any) -> Path:
    st = state()
    if given is None:
        return st.box.models_dir
    dirs = [Path(d).resolve() for d in st.refresh().settings.server.model_dirs]
    if not isinstance(given, str) or Path(given).resolve() not in dirs:
        shown = ", ".join(str(d) for d in dirs) or "none"
        raise errors.bad_request(f"'dir' must be one of server.model_dirs ({shown})", "dir")
    return Path(given).resolve()


def _name_taken(name: str, what: str = "model or policy") -> ApiError:
    return ApiError(
        409,
        f"'{name}' is already the name of a {what}: pick another with 'name'",
        type="conflict_error",
        param="name",
        code="name_taken",
    )


@bp.post("/pulls")
def create_pull() -> Any:
    body = read_json()
    unknown = sorted(set(body) - _FIELDS)
    if unknown:
        raise errors.bad_request(f"unknown field(s): {', '.join(unknown)}", unknown[0])
    mmproj = body.get("mmproj", False)
    if not isinstance(mmproj, bool):
        raise errors.bad_request("'mmproj' must be a boolean", "mmproj")
    try:
        record = start_pull(
            body.get("source"), body.get("name"), body.get("host"), body.get("dir"), mmproj
        )
    except SourceError as e:
        return error_response(
            errors.bad_request(str(e), "source", "invalid_source"), {"choices": e.choices}
        )
    resp = jsonify(_pull(record["id"]))
    resp.status_code = 202
    return resp


def start_pull(
    source: Any, name: Any, host: Any, folder: Any, mmproj: bool, via: str = "admin"
) -> dict[str, Any]:
    """Resolve ``source``, pick the host and queue the pull there: its record (raises the
    client's error, or ``SourceError`` for a source that names no single file). The admin API's
    and the Ollama API's ``/api/pull`` (``via``, in the audit log) both start pulls here."""
    st = state()
    if name is not None:
        try:
            check_model_name(name)
        except (ValueError, TypeError) as e:
            raise errors.bad_request(str(e), "name", "invalid_model_name") from None
    on = _host(host)
    where = _folder(folder)
    try:
        resolved = resolve(parse_source(source), mmproj)
    except HubUnreachable as e:
        raise ApiError(502, str(e), type="server_error", code="hub_unreachable") from None
    name = name or default_model_name(resolved["file"])
    if registry.get(st.r, name) is not None or st.r.hexists(keys.policies(), name):
        raise _name_taken(name)
    if any(
        p["name"] == name and p["state"] not in {s.value for s in FINISHED}
        for p in pull_store.listing(st.r)
    ):
        raise _name_taken(name, "pull under way")
    record = {
        **resolved,
        "id": pull_store.new_id(),
        "source": source,
        "host": on,
        "name": name,
        "dir": str(where),
        "actor": admin_api._actor(),
        "bytes_total": resolved.get("size"),
    }
    if resolved.get("mmproj_size") is not None and resolved.get("size") is not None:
        record["bytes_total"] = int(resolved["size"]) + int(resolved["mmproj_size"])
    limit = st.refresh().settings.pulls.max_queued
    if not pull_store.enqueue(st.r, record, limit):
        raise ApiError(
            429,
            f"host {on} already holds {limit} pulls (pulls.max_queued): wait for one to finish",
            type="rate_limit_error",
            code="pull_queue_full",
            retry_after=5,
        )
    pipe = st.r.pipeline(transaction=False)
    audit(
        pipe,
        admin_api._actor(),
        "pull.create",
        {"id": record["id"], "source": source, "via": via},
    )
    pipe.execute()
    return record


def _pull(pull_id: str) -> dict[str, Any]:
    raw = pull_store.get(state().r, pull_id)
    if raw is None:
        raise ApiError(404, f"no pull '{pull_id}'", param="id", code="pull_not_found")
    return pull_store.public(raw)


@bp.get("/pulls")
def list_pulls() -> Any:
    return jsonify({"pulls": pull_store.listing(state().r)})


@bp.get("/pulls/<pull_id>")
def get_pull(pull_id: str) -> Any:
    return jsonify(_pull(pull_id))


@bp.delete("/pulls/<pull_id>")
def cancel_pull(pull_id: str) -> Response:
    st = state()
    rec = _pull(pull_id)
    if rec["state"] in {s.value for s in FINISHED}:
        raise ApiError(
            409,
            f"pull '{pull_id}' already finished ({rec['state']})",
            type="conflict_error",
            param="id",
            code="pull_finished",
        )
    now = pull_store.cancel(st.r, pull_id, str(rec["host"]))
    pipe = st.r.pipeline(transaction=False)
    audit(pipe, admin_api._actor(), "pull.cancel", {"id": pull_id})
    pipe.execute()
    resp = jsonify({**_pull(pull_id), "state": now or rec["state"]})
    resp.status_code = 202
    return resp
