"""The fields a request sent that changed nothing, as the ``x-residency-ignored`` header names
them (``web.pipeline.ignore``): in the body's order, each once, odd names hidden, at most 16."""

from __future__ import annotations

from flask import Flask, Response, g

from web import pipeline


def header_for(*batches: list[str]) -> str | None:
    app = Flask("t")
    with app.test_request_context():
        for names in batches:
            pipeline.ignore(names)
        resp = pipeline.ignored_header(Response())
        # Found by name in O(1): a body may name 100,000 fields, each looked up once.
        assert g.get("ignored_fields") is None or isinstance(g.ignored_fields, dict)
        return resp.headers.get(pipeline.IGNORED_HEADER)


def test_names_once_in_order() -> None:
    assert header_for(["store", "user"], ["user", "tools[2] (web_search)"]) == (
        "store, user, tools[2] (web_search)"
    )
    assert header_for([]) is None


def test_odd_names_are_hidden_and_a_long_list_is_cut() -> None:
    assert header_for(["a\r\nSet-Cookie: x", "ok", "é"]) == "(a field with an odd name), ok"
    many = [f"f{i}" for i in range(50_000)]
    listed = header_for(many)
    assert listed == ", ".join(many[:16]) + ", and 49984 more"
