"""``POST /admin/faults`` bodies for ``script_text`` (pure): what is stored, what is deleted,
and the 400 naming the bad part."""

from __future__ import annotations

import json
from typing import Any

import pytest

from residency.errors import ApiError
from web.faults import MAX_SCRIPT_BYTES, MAX_SCRIPT_TEXTS, parse_faults


def test_a_text_or_a_list_is_stored_as_a_json_list() -> None:
    put, drop = parse_faults({"script_text": {"a": "hi", "b": ["one", "two"]}})
    assert drop == []
    assert {k: json.loads(v) for k, v in put.items()} == {
        "script_text:a": ["hi"],
        "script_text:b": ["one", "two"],
    }


@pytest.mark.parametrize("off", [None, "", False, []])
def test_an_empty_value_deletes_the_script(off: Any) -> None:
    assert parse_faults({"script_text": {"a": off}}) == ({}, ["script_text:a"])


@pytest.mark.parametrize(
    ("value", "param"),
    [
        (3, "script_text.a"),
        (["ok", 3], "script_text.a"),
        (["ok", ""], "script_text.a[1]"),
        (["x"] * (MAX_SCRIPT_TEXTS + 1), "script_text.a"),
        ("x" * (MAX_SCRIPT_BYTES + 1), "script_text.a"),
    ],
)
def test_a_bad_script_is_a_400_naming_it(value: Any, param: str) -> None:
    with pytest.raises(ApiError) as e:
        parse_faults({"script_text": {"a": value}})
    assert e.value.status == 400 and e.value.param == param


def test_a_script_names_a_model() -> None:
    with pytest.raises(ApiError) as e:
        parse_faults({"script_text": "hi"})
    assert e.value.param == "script_text"
    with pytest.raises(ApiError) as e:
        parse_faults({"script_text": {"no/such name": "hi"}})
    assert e.value.status == 400
