"""Stop strings and UTF-8 at token boundaries (``workers.textout``), and which slot a prompt
goes to (``workers.slots``): pure functions, no model."""

from __future__ import annotations

import pytest

from workers.slots import TRANSITIONS, Choice, SlotState, check_transition, choose, common_prefix
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
    free = [(0, [1, 2], 5.0), (1, [1, 2, 3, 4], 1.0), (2, [], 0.0)]
    assert choose(free, [1, 2, 3, 9]) == Choice(1, 3)


def test_with_no_shared_prefix_the_least_recently_used_slot_is_chosen() -> None:
    free = [(0, [7], 5.0), (1, [8], 1.0), (2, [9], 3.0)]
    assert choose(free, [1, 2]) == Choice(1, 0)


def test_a_prompt_entirely_cached_still_leaves_one_token_to_decode() -> None:
    assert choose([(0, [1, 2, 3, 4], 0.0)], [1, 2, 3]) == Choice(0, 2)
    assert choose([(0, [], 0.0)], [5]) == Choice(0, 0)


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
