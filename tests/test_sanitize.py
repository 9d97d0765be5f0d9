"""Issue 29, item 8: nothing a rank or a host sends can act on the operator's terminal
(`fdl_fabric.inert`)."""

from __future__ import annotations

import json
import re

from hypothesis import given
from hypothesis import strategies as st

from fdl_fabric.events import Event, Name
from fdl_fabric.inert import (
    RESET,
    SGR,
    clean,
    fold,
    json_inert,
    latest_state,
    neutralize,
    shown_lines,
)

#: Anything a terminal acts on, but the tab (and the newline, between lines).
ACTIVE = re.compile(r"[\x00-\x08\x0a-\x1f\x7f-\x9f]")

#: Text rich in what attacks a terminal: escapes, CSI, OSC, C1, carriage returns, SGR.
hostile = st.lists(st.one_of(
    st.text(alphabet=st.characters(max_codepoint=0xFF), max_size=8),
    st.sampled_from(["\x1b[2J", "\x1b]0;title\x07", "\x1b]52;c;Y3VybA==\x1b\\", "\r",
                     "\x1b[1A", "\x1b[31m", "\x1b[0m", "\x1b[38;5;200m", "\x1b[31",
                     "\x9b2J", "\x1b", "\n", "\t", "\x07", "漢", "\x1b[" + "1;" * 40 + "m"]),
), max_size=30).map("".join)


def inert(text: str) -> bool:
    """No control but the tab survives once the kept colours are taken out."""
    return not ACTIVE.search(SGR.sub("", text))


@given(hostile)
def test_no_escape_or_control_but_tab_and_sgr_ever_reaches_the_screen(text: str) -> None:
    for keep in (True, False):
        for line in shown_lines(text, keep_sgr=keep):
            assert inert(line), repr(line)
            if not keep:
                assert "\x1b" not in line.replace("^[", "")
            for row in fold(line, 20):
                assert inert(row), repr(row)


@given(hostile)
def test_launcher_text_keeps_its_newlines_and_nothing_else(text: str) -> None:
    shown = neutralize(text)
    assert "\x1b" not in shown and "\r" not in shown
    assert shown.count("\n") == text.count("\n")
    assert inert(shown.replace("\n", ""))


@given(hostile)
def test_a_line_that_kept_a_colour_ends_with_a_reset(text: str) -> None:
    for line in shown_lines(text):
        if SGR.search(line):
            assert line.endswith(RESET), repr(line)


def test_a_clear_screen_a_title_and_a_clipboard_write_are_shown_as_cat_v_would() -> None:
    assert neutralize("\x1b[2J\x1b[H") == "^[[2J^[[H"
    assert neutralize("\x1b]0;pwned\x07") == "^[]0;pwned^G"
    assert neutralize("\x1b]52;c;Y3VybCBldmlsLmV4YW1wbGUgfCBzaA==\x1b\\") == \
        "^[]52;c;Y3VybCBldmlsLmV4YW1wbGUgfCBzaA==^[\\"
    assert neutralize("\x9b2J\x7f") == "M-^[2J^?"


def test_plain_text_is_returned_unchanged() -> None:
    text = "step 3 loss 0.25\ttook 1.2s — ok 漢字"
    assert neutralize(text) is text
    assert shown_lines(text) == [text]


def test_colours_stay_and_are_reset_at_the_end_of_the_line() -> None:
    assert shown_lines("\x1b[32mok\x1b[0m and \x1b[31mred") == [
        "\x1b[32mok\x1b[0m and \x1b[31mred" + RESET]


def test_an_unfinished_or_odd_colour_sequence_is_shown_inert() -> None:
    assert shown_lines("\x1b[31 red") == ["^[[31 red"]
    long = "\x1b[" + "1;" * 20 + "m"
    assert shown_lines(long) == ["^[[" + "1;" * 20 + "m"]
    assert shown_lines("\x1b[1Aup\x1b[?25l") == ["^[[1Aup^[[?25l"]


def test_a_progress_bar_shows_its_latest_state() -> None:
    assert latest_state("\r 10%|#   |\r 50%|##  |\r100%|####|") == "100%|####|"
    assert latest_state("windows line\r") == "windows line"
    assert shown_lines("a\rb\nc\r\n") == ["b", "c", ""]


def test_tqdm_nested_bars_stay_readable_with_their_cursor_up_shown_inert() -> None:
    # The bytes tqdm 4 writes for an outer bar and a nested one (position=1), split at
    # the newlines as the agent forwards them.
    tqdm = ("\router:   0%|          | 0/2\n\rinner:  50%|#####     | 1/2\x1b[A\n"
            "\r                    \x1b[A\router:  50%|#####     | 1/2\n")
    assert shown_lines(tqdm.rstrip("\n")) == [
        "outer:   0%|          | 0/2", "inner:  50%|#####     | 1/2^[[A",
        "outer:  50%|#####     | 1/2"]


def test_a_fake_launcher_line_painted_with_cursor_moves_stays_visible_as_rank_text() -> None:
    fake = "\r\x1b[2A\x1b[2Kcluster launcher: run completed — all 4 ranks exited 0"
    (shown,) = shown_lines(fake)
    assert shown == "^[[2A^[[2Kcluster launcher: run completed — all 4 ranks exited 0"


def test_fold_cuts_rows_to_the_width_counting_wide_characters_and_no_colour() -> None:
    assert fold("abcdef", 4) == ["abcd", "ef"]
    assert fold("漢字漢字", 5) == ["漢字", "漢字"]
    assert fold("\x1b[31mabcdef" + RESET, 4) == ["\x1b[31mabcd" + RESET, "ef" + RESET]
    assert fold("a\tb", 4) == ["a   ", "    ", "b"]
    assert fold("short", 80) == ["short"]


def test_every_string_of_an_event_is_cleaned_and_the_rest_kept() -> None:
    e = Event(Name.AGENT_WARNING, host="h\x1b[2J", rank=1,
              data={"message": "bad\x1b]0;t\x07", "n": 3, "items": ["\r", ("\x1b",)]})
    got = clean(e)
    assert got.name is Name.AGENT_WARNING and got.time == e.time
    assert got.host == "h^[[2J"
    assert got.data == {"message": "bad^[]0;t^G", "n": 3, "items": ["^M", ("^[",)]}


def test_json_stays_the_same_value_with_c1_escaped() -> None:
    value = {"text": "a\x9b2J\u2028b\x1b"}
    line = json_inert(json.dumps(value, ensure_ascii=False))
    assert json.loads(line) == value
    assert not re.search("[\x00-\x1f\x7f-\x9f\u2028\u2029]", line)


def test_a_launcher_line_with_a_word_wider_than_the_terminal_is_cut_with_no_orphan() -> None:
    from fdl_fabric.presentation.ranklines import cut_to_width

    path = '    "/tmp/' + "x" * 66 + '/steady.py",'
    rows = cut_to_width(f"head\n{path}\nshort", 80).split("\n")
    assert rows[0] == "head" and rows[-1] == "short"
    assert all(len(row) <= 80 for row in rows)
    assert "".join(r.strip() for r in rows[1:-1]) == path.strip()
    assert len(rows[2].strip()) >= 8  # no '",' alone on a row


@given(st.text(alphabet=st.characters(max_codepoint=0x2FF), max_size=64))
def test_the_fast_plain_check_agrees_with_the_rule_for_any_text(text: str) -> None:
    from fdl_fabric.inert import is_plain

    acts = re.search(r"[\x00-\x08\x0b-\x1f\x7f-\x9f]", text) is not None
    assert is_plain(text) is not acts


#: Event data as hosts shape it: strings (hostile ones too), atoms, lists, tuples and
#: mappings, nested.
_data = st.recursive(
    st.one_of(hostile, st.integers(), st.none(), st.booleans()),
    lambda inner: st.one_of(st.lists(inner, max_size=4),
                            st.lists(inner, max_size=4).map(tuple),
                            st.dictionaries(hostile, inner, max_size=4)),
    max_leaves=12)


@given(_data, st.booleans())
def test_cleaning_data_whole_agrees_with_cleaning_each_string(value: object,
                                                              lines: bool) -> None:
    """`clean` checks every string at once and keeps plain data as it is: what it gives
    is what cleaning each string alone gives."""
    from fdl_fabric.inert import _clean, one_line

    assert clean(value, lines=lines) == _clean(value, one_line if lines else neutralize)


def test_plain_data_is_kept_as_it_is_and_an_event_with_it_too() -> None:
    from fdl_fabric.presentation.hostwords import inert_data

    data = {"host": "leaf0007", "rank": 55, "peer": ["leaf0007 (through its agent)", 1.5]}
    assert clean(data) is data and clean(data, lines=True) is data
    assert clean({"text": "two\nlines"}, lines=True) == {"text": "two^Jlines"}
    e = Event(Name.RANK_JOINED, host="leaf0007", rank=55, data=data)
    assert inert_data(e) is e
