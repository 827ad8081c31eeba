"""The dashboard's files as web serves them (the browser test is tests/e2e/test_dashboard.py):
public, no secret in them however they are asked for, nothing else served from beside them, a
strict Content-Security-Policy that the page keeps (nothing inline, nothing from elsewhere), the
settings schema, and every element the script looks up by id present in the page. Each check
is also shown failing on a page that breaks it, so none passes by finding nothing."""

from __future__ import annotations

import json
import re
import shutil
from html.parser import HTMLParser
from pathlib import Path

import pytest
import redis
from flask.testing import FlaskClient

from residency.box import Box
from residency.settings import LIVE, key_meta
from web import create_app, ui
from web.ui import STATIC

ADMIN = "test-admin-key"
AUTH = {"Authorization": f"Bearer {ADMIN}"}


@pytest.fixture
def client(tmp_path: Path, redis_url: str, r: redis.Redis) -> FlaskClient:
    box = Box(
        data_dir=tmp_path,
        config_path=None,
        redis_url=redis_url,
        environ={"RESIDENCY_ADMIN_KEY": ADMIN},
    )
    return create_app(box).test_client()


@pytest.fixture
def secrets(client: FlaskClient) -> list[str]:
    """Every secret this box holds: its admin key, a named admin token and a user's API key
    (the last two exist only in the answers that created them; Redis has their hashes)."""
    token = client.post("/admin/tokens", json={"name": "ops"}, headers=AUTH).get_json()["token"]
    assert client.post("/admin/users", json={"name": "ann"}, headers=AUTH).status_code == 201
    key = client.post("/admin/users/ann/keys", json={}, headers=AUTH).get_json()["key"]
    return [ADMIN, token, key]


@pytest.mark.parametrize(
    ("path", "kind"),
    [
        ("/admin/ui", "text/html"),
        ("/admin/ui/", "text/html"),
        ("/admin/ui/app.js", "text/javascript"),
        ("/admin/ui/style.css", "text/css"),
    ],
)
def test_files_are_public_with_a_strict_policy(
    client: FlaskClient, secrets: list[str], path: str, kind: str
) -> None:
    # Asked for without a key and, as a signed-in browser would, with each of the secrets (a
    # page that echoed the caller's key or templated the box's own in would hand it to any
    # script that reads the page).
    for headers in ({}, *({"Authorization": f"Bearer {x}"} for x in secrets)):
        resp = client.get(path, headers=headers)
        assert resp.status_code == 200
        assert resp.mimetype == kind
        csp = resp.headers["Content-Security-Policy"]
        assert "default-src 'none'" in csp and "script-src 'self'" in csp
        assert resp.headers["X-Content-Type-Options"] == "nosniff"
        text = resp.get_data(as_text=True) + json.dumps(dict(resp.headers))
        for secret in secrets:
            assert secret not in text and secret.rsplit("_", 1)[-1] not in text
    schema = client.get("/admin/ui/settings.json", headers=AUTH).get_data(as_text=True)
    assert not any(secret.rsplit("_", 1)[-1] in schema for secret in secrets)


def test_other_paths_are_not_served(
    client: FlaskClient, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Served from a copy of the folder beside files that exist, so each refusal below is the
    # blueprint's (a path naming no file would be 404 whatever it served).
    root = tmp_path / "web"
    shutil.copytree(STATIC, root / "static" / "ui")
    (root / "static" / "ui" / "notes.txt").write_text("not one of the dashboard's files")
    (root / "ui.py").write_text("SOURCE")
    (root / "static" / "secret.txt").write_text("SECRET")
    monkeypatch.setattr(ui, "STATIC", root / "static" / "ui")
    assert client.get("/admin/ui/app.js").get_data(as_text=True) == (STATIC / "app.js").read_text()
    for path in (
        "/admin/ui/notes.txt",
        "/admin/ui/../../ui.py",
        "/admin/ui/..%2f..%2fui.py",
        "/admin/ui/../secret.txt",
        "/admin/ui/%2e%2e/secret.txt",
        "/admin/ui/app.js/../../secret.txt",
    ):
        resp = client.get(path)
        assert resp.status_code == 404, path
        assert (
            b"SOURCE" not in resp.data
            and b"SECRET" not in resp.data
            and b"not one" not in (resp.data)
        )
    # The data stays behind the admin API's key.
    assert client.get("/admin/config").status_code == 401


def test_settings_schema_lists_the_live_keys(client: FlaskClient) -> None:
    keys = client.get("/admin/ui/settings.json").get_json()["keys"]
    assert keys == {k: {**m} for k, m in key_meta().items()}
    assert keys["pool.max_loaded_models"]["applies"] == LIVE


class _Page(HTMLParser):
    """The page's tags as parsed (not searched for as text): ids, and every attribute."""

    def __init__(self) -> None:
        super().__init__()
        self.ids: set[str] = set()
        self.tags: list[tuple[str, dict[str, str | None]]] = []
        self.script_text = ""
        self._in_script = False

    def handle_starttag(self, tag: str, attrs: list[tuple[str, str | None]]) -> None:
        a = dict(attrs)
        self.tags.append((tag, a))
        if a.get("id"):
            self.ids.add(str(a["id"]))
        self._in_script = tag == "script"

    def handle_endtag(self, tag: str) -> None:
        self._in_script = False

    def handle_data(self, data: str) -> None:
        if self._in_script:
            self.script_text += data.strip()


def parse(page: str) -> _Page:
    p = _Page()
    p.feed(page)
    return p


def ids_looked_up(script: str) -> set[str]:
    """Every id the script looks up with ``$()``: literal ones, and those it loops over
    (``for (const id of ["a", "b"]) $(id)``). Ids it builds from a key (``$(`setting-${key}`)``)
    are those of rows it creates itself (``id: `setting-${key}```)."""
    found = set(re.findall(r"\$\(\s*[\"']([^\"']+)[\"']\s*\)", script))
    for names, var in re.findall(r"for \(const \w+ of \[([^\]]*)\]\) \$\((\w+)\)", script):
        assert var, names
        found |= set(re.findall(r"[\"']([^\"']+)[\"']", names))
    return found


def built_ids_are_created(script: str) -> list[str]:
    """The templates of ids looked up by key (``$(`x-${key}`)``) that no element the script
    creates carries (``id: `x-${key}```)."""
    looked = set(re.findall(r"\$\(`([^`]+)`\)", script))
    created = set(re.findall(r"id: `([^`]+)`", script))
    assert looked, "the script looks up no built id: the check below would check nothing"
    return sorted(looked - created)


def page_problems(page: str) -> list[str]:
    """What the policy would block or what would load from elsewhere."""
    p = parse(page)
    out = []
    if p.script_text:
        out.append("inline script")
    for tag, attrs in p.tags:
        for name, value in attrs.items():
            if name == "style" or name.startswith("on"):
                out.append(f"<{tag} {name}=…>")
            link = name in ("src", "href", "action") and value is not None
            if link and not str(value).startswith("/admin/ui/"):
                out.append(f"<{tag} {name}={value!r}>")
        if tag == "script" and not attrs.get("src"):
            out.append("a script without src")
        if tag == "style":
            out.append("a style element")
    return out


def test_every_id_the_script_uses_is_in_the_page() -> None:
    page = (STATIC / "index.html").read_text()
    script = (STATIC / "app.js").read_text()
    ids = parse(page).ids
    used = ids_looked_up(script)
    assert len(used) >= 10 and used <= ids, used - ids
    assert built_ids_are_created(script) == []
    # The checks above fail on a page or script that breaks them (they can fail at all).
    assert (
        "usage-chart" in used
        and "usage-chart" not in parse(page.replace('id="usage-chart"', 'id="usage-bars"')).ids
    )
    assert built_ids_are_created(script.replace("id: `source-${key}`", "id: `src-${key}`"))
    loop = 'for (const id of ["settings", "audit", "usage-chart"])'
    assert loop in script
    assert "nope" in ids_looked_up(script.replace(loop, loop.replace('"audit"', '"nope"')))


def test_the_page_runs_nothing_inline_and_loads_nothing_from_elsewhere() -> None:
    page = (STATIC / "index.html").read_text()
    assert page_problems(page) == []
    head = "<head>"
    for bad in (
        "<script>alert(1)</script>",
        '<script type="module">alert(1)</script>',
        "<script src='https://cdn.example/x.js'></script>",
        "<script src=//cdn.example/x.js></script>",
        '<link rel="stylesheet" href="https://cdn.example/x.css">',
        "<style>body{}</style>",
        '<p style="color:red">x</p>',
        '<button onclick="go()">x</button>',
        '<a href="javascript:go()">x</a>',
    ):
        assert page_problems(page.replace(head, head + bad)), bad
