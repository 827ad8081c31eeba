"""Stop strings and UTF-8 at token boundaries (``workers.textout``), and which slot a prompt
goes to (``workers.slots``): pure functions, no model."""

from __future__ import annotations

import pytest

from residency.settings import CACHE_SCOPES
from workers.slots import (
    TRANSITIONS,
    Asker,
    Cached,
    Choice,
    SlotState,
    check_transition,
    choose,
    common_prefix,
)
from workers.textout import TextOut


def feed(out: TextOut, pieces: list[bytes]) -> list[str]:
    seen = []
    for p in pieces:
        stopped = out.add(p)
        seen.append(out.take())
        if stopped:
            break
    return seen


def test_a_stop_string_split_over_tokens_is_never_handed_out() -> None:
    out = TextOut(["END"])
    seen = feed(out, [b"abc E", b"N", b"D more"])
    assert out.stopped
    assert "".join(seen) + out.take(final=True) == "abc "
    assert seen == ["abc ", "", ""]  # "E" and "EN" were held: they could start "END"


def test_a_held_tail_that_turns_out_not_to_be_a_stop_string_is_released() -> None:
    out = TextOut(["END"])
    assert feed(out, [b"x E", b"Nx"]) == ["x ", "ENx"]
    assert not out.stopped


def test_the_earliest_of_several_stop_strings_wins() -> None:
    out = TextOut(["bb", "a"])
    out.add(b"xxbba")
    assert out.text == "xx"


def test_a_character_split_over_tokens_is_held_until_complete() -> None:
    euro = "€".encode()  # three bytes
    out = TextOut()
    assert feed(out, [b"1 ", euro[:1], euro[1:2], euro[2:] + b"!"]) == ["1 ", "", "", "€!"]


def test_the_end_hands_out_what_was_held() -> None:
    out = TextOut(["STOP"])
    out.add(b"go ST")
    assert out.take() == "go "
    assert out.take(final=True) == "ST"


def test_invalid_bytes_are_not_held_forever() -> None:
    out = TextOut()
    out.add(b"\x80a")  # a lone continuation byte can never complete
    assert out.take() == "a"


def test_nothing_is_added_after_a_stop() -> None:
    out = TextOut(["x"])
    assert out.add(b"ax")
    with pytest.raises(RuntimeError):
        out.add(b"b")


def test_the_slot_sharing_the_longest_prefix_is_chosen() -> None:
    free = [Cached(0, [1, 2], 5.0), Cached(1, [1, 2, 3, 4], 1.0), Cached(2, [], 0.0)]
    assert choose(free, [1, 2, 3, 9]) == Choice(1, 3)


def test_with_no_shared_prefix_the_least_recently_used_slot_is_chosen() -> None:
    free = [Cached(0, [7], 5.0), Cached(1, [8], 1.0), Cached(2, [9], 3.0)]
    assert choose(free, [1, 2]) == Choice(1, 0)


def test_a_prompt_entirely_cached_still_leaves_one_token_to_decode() -> None:
    assert choose([Cached(0, [1, 2, 3, 4])], [1, 2, 3]) == Choice(0, 2)
    assert choose([Cached(0, [])], [5]) == Choice(0, 0)


# A slot filled by user "a" whose first 3 tokens (its system part) it marked shareable.
A_SLOT = Cached(0, [1, 2, 3, 4, 5, 6], 0.0, owner="a", shareable=3)
PROMPT = [1, 2, 3, 4, 5, 9]


def test_the_same_user_reuses_its_whole_prefix_under_every_scope() -> None:
    for scope in CACHE_SCOPES:
        assert choose([A_SLOT], PROMPT, Asker("a", 3, scope)) == Choice(0, 5)


def test_another_user_reuses_nothing_under_user_scope() -> None:
    assert choose([A_SLOT], PROMPT, Asker("b", 3, "user")) == Choice(0, 0)
    assert choose([A_SLOT], PROMPT) == Choice(0, 0)  # the default asker is nobody's


def test_shared_system_caps_reuse_across_users_at_both_shareable_parts() -> None:
    assert choose([A_SLOT], PROMPT, Asker("b", 3, "shared_system")) == Choice(0, 3)
    assert choose([A_SLOT], PROMPT, Asker("b", 2, "shared_system")) == Choice(0, 2)
    assert choose([A_SLOT], PROMPT, Asker("b", 9, "shared_system")) == Choice(0, 3)
    # What is shared is still only a common prefix.
    assert choose([A_SLOT], [1, 7], Asker("b", 2, "shared_system")) == Choice(0, 1)


def test_global_reuses_across_users() -> None:
    assert choose([A_SLOT], PROMPT, Asker("b", 0, "global")) == Choice(0, 5)


def test_another_users_match_does_not_steer_the_choice_under_user_scope() -> None:
    # b's prompt matches a's slot 1 but b may not reuse it: the least recently used slot is
    # taken, as with no match at all (the choice reveals nothing of a's prompt either).
    free = [Cached(0, [7], 1.0, owner="c"), Cached(1, PROMPT, 5.0, owner="a")]
    assert choose(free, PROMPT, Asker("b", 0, "user")) == Choice(0, 0)
    assert choose(free, PROMPT, Asker("a", 0, "user")) == Choice(1, 5)


def test_choose_needs_a_free_slot() -> None:
    with pytest.raises(ValueError):
        choose([], [1])


def test_common_prefix() -> None:
    assert common_prefix([1, 2, 3], [1, 2, 4]) == 2
    assert common_prefix([], [1]) == 0


def test_slot_transitions_follow_the_table() -> None:
    for old, allowed in TRANSITIONS.items():
        for new in SlotState:
            if new in allowed:
                check_transition(old, new)
            else:
                with pytest.raises(RuntimeError):
                    check_transition(old, new)
