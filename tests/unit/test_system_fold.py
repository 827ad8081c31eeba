"""System messages folded where a chat handler cannot render them (``workers.system_fold``):
pure, on message lists."""

from __future__ import annotations

from typing import Any

import pytest

from residency.errors import ApiError
from workers.system_fold import ALL, SystemRoles, fold, shared_head

#: gemma: no system role at all.
NONE = SystemRoles(leading=False, several=False, later=False)
#: chatml, llama-2, zephyr...: only the first system message, at the start.
FIRST_ONLY = SystemRoles(leading=True, several=False, later=False)
#: open-orca: not even a user turn's text (a fold cannot carry it).
BROKEN = SystemRoles(leading=False, several=False, later=False, folds=False)


def sys(text: str, role: str = "system") -> dict[str, Any]:
    return {"role": role, "content": text}


def user(text: Any) -> dict[str, Any]:
    return {"role": "user", "content": text}


def bot(text: str) -> dict[str, Any]:
    return {"role": "assistant", "content": text}


def test_a_handler_that_renders_every_system_message_gets_the_messages_unchanged() -> None:
    msgs = [sys("S"), sys("T"), user("u"), bot("a"), sys("M"), user("v")]
    assert fold(msgs, ALL) == msgs


def test_without_a_system_role_the_leading_text_heads_the_first_user_turn() -> None:
    # Gemma's own GGUF template: the system text and a blank line before the user's.
    assert fold([sys("Be brief."), user("Hi")], NONE) == [user("Be brief.\n\nHi")]
    assert fold([sys("A"), sys("B", "developer"), user("Hi")], NONE) == [user("A\n\nB\n\nHi")]


def test_a_leading_text_with_no_user_turn_after_it_is_a_user_turn() -> None:
    assert fold([sys("S")], NONE) == [user("S")]
    assert fold([sys("S"), bot("a"), user("u")], NONE) == [user("S"), bot("a"), user("u")]


def test_a_user_turn_of_parts_gets_a_text_part_first() -> None:
    parts = [{"type": "image_url", "image_url": {"url": "x"}}, {"type": "text", "text": "what"}]
    out = fold([sys("S"), user(parts)], NONE)
    assert out == [user([{"type": "text", "text": "S\n\n"}, *parts])]


def test_several_leading_messages_become_one_where_only_the_first_is_rendered() -> None:
    assert fold([sys("A"), sys("B"), user("u")], FIRST_ONLY) == [sys("A\n\nB"), user("u")]
    # One alone stays as it is.
    assert fold([sys("A"), user("u")], FIRST_ONLY) == [sys("A"), user("u")]


def test_a_later_system_message_joins_the_next_user_turn_and_the_prefix_is_unchanged() -> None:
    msgs = [sys("S"), user("u"), bot("a"), sys("M", "developer"), user("v")]
    out = fold(msgs, FIRST_ONLY)
    assert out == [sys("S"), user("u"), bot("a"), user("M\n\nv")]
    # The turns before it are untouched: a slot's cached prefix of them still matches.
    assert out[:3] == msgs[:3]
    assert fold(msgs, NONE) == [user("S\n\nu"), bot("a"), user("M\n\nv")]


def test_a_later_system_message_with_no_user_turn_after_it() -> None:
    # Last, after a user turn: appended to it.
    assert fold([user("u"), sys("M")], NONE) == [user("u\n\nM")]
    # After an assistant turn: a user turn of its own, where it was sent.
    assert fold([user("u"), bot("a"), sys("M")], NONE) == [user("u"), bot("a"), user("M")]
    assert fold([user("u"), bot("a"), sys("M"), bot("b")], NONE) == [
        user("u"),
        bot("a"),
        user("M"),
        bot("b"),
    ]


def test_empty_system_texts_are_nothing_to_fold() -> None:
    assert fold([sys(""), user("u"), bot("a"), sys(""), user("v")], NONE) == [
        user("u"),
        bot("a"),
        user("v"),
    ]


@pytest.mark.parametrize(
    ("msgs", "param"),
    [
        ([sys("S"), user("u")], "messages[0].role"),
        ([user("u"), bot("a"), sys("M"), user("v")], "messages[2].role"),
    ],
)
def test_a_system_message_that_cannot_be_rendered_nor_folded_is_refused(
    msgs: list[dict[str, Any]], param: str
) -> None:
    with pytest.raises(ApiError) as e:
        fold(msgs, BROKEN)
    assert e.value.status == 400 and e.value.param == param
    assert e.value.code == "invalid_messages"
    # Without a system message there is nothing to refuse.
    assert fold([user("u")], BROKEN) == [user("u")]


def test_the_shared_head_is_the_system_text_as_the_prompt_begins_with_it() -> None:
    msgs = [sys("A"), sys("B"), user("secret")]
    assert shared_head(msgs, ALL) == [sys("A"), sys("B")]
    assert shared_head(msgs, FIRST_ONLY) == [sys("A\n\nB")]
    # Folded: a user turn holding only the system text, never the user's own.
    assert shared_head(msgs, NONE) == [user("A\n\nB\n\n")]
    assert shared_head([user("secret")], NONE) == []
    assert shared_head(msgs, BROKEN) == []
