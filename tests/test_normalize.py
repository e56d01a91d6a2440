"""normalize_row: every accepted row shape, every row-level reason code, prompt hashing."""

from __future__ import annotations

import dataclasses
import doctest

import pytest

import pair_dpo_trainer.data.normalize as normalize_module
from pair_dpo_trainer.data.normalize import PreferencePair, normalize_row, prompt_hash
from pair_dpo_trainer.errors import PreferenceRowError


def _m(role: str, content: str) -> dict[str, str]:
    return {"role": role, "content": content}


USER = _m("user", "sort ascending: 3 1 2")
SYSTEM = _m("system", "be brief")
GOOD = _m("assistant", "1 2 3")
BAD = _m("assistant", "1 3 2")
SINGLE_TURN = PreferencePair((USER,), (GOOD,), (BAD,))

HH_CHOSEN = "\n\nHuman: count up: 1 to 3\n\nAssistant: 1 2\n\nHuman: more\n\nAssistant: 1 2 3"
HH_REJECTED = "\n\nHuman: count up: 1 to 3\n\nAssistant: 1 2\n\nHuman: more\n\nAssistant: 3 2 1"
HH_PAIR = PreferencePair(
    (_m("user", "count up: 1 to 3"), _m("assistant", "1 2"), _m("user", "more")),
    (_m("assistant", "1 2 3"),),
    (_m("assistant", "3 2 1"),),
)
"""The transcripts split into turns (with ``chat_strings``: plain strings rendered with the chat template)."""
HH_TEXT_PAIR = PreferencePair(
    (_m("user", "\n\nHuman: count up: 1 to 3\n\nAssistant: 1 2\n\nHuman: more\n\nAssistant:"),),
    (_m("assistant", " 1 2 3"),),
    (_m("assistant", " 3 2 1"),),
    plain_text=True,
)
"""The transcripts as TRL's ``extract_prompt`` splits them: the shared text before the differing answers."""


@pytest.mark.parametrize(
    "row,expected",
    [
        pytest.param({"prompt": USER["content"], "chosen": "1 2 3", "rejected": "1 3 2"}, SINGLE_TURN, id="1-strings"),
        pytest.param({"prompt": USER["content"], "chosen": [GOOD], "rejected": [BAD]}, SINGLE_TURN, id="2-str-prompt"),
        pytest.param({"prompt": [USER], "chosen": [GOOD], "rejected": [BAD]}, SINGLE_TURN, id="2-list-prompt"),
        pytest.param({"prompt": [USER], "chosen": "1 2 3", "rejected": "1 3 2"}, SINGLE_TURN, id="2-str-completions"),
        pytest.param(
            {"prompt": USER["content"], "chosen": [USER, GOOD], "rejected": [USER, BAD]},
            SINGLE_TURN,
            id="2-ultrafeedback",
        ),
        pytest.param(
            {"prompt": [USER], "chosen": [USER, GOOD], "rejected": [BAD]},
            SINGLE_TURN,
            id="2-full-and-assistant-only",
        ),
        pytest.param(
            {
                "prompt": [SYSTEM, USER, GOOD, USER],
                "chosen": [SYSTEM, USER, GOOD, USER, GOOD],
                "rejected": [BAD],
            },
            PreferencePair((SYSTEM, USER, GOOD, USER), (GOOD,), (BAD,)),
            id="2-multi-turn-full",
        ),
        pytest.param(
            {"prompt": [USER], "chosen": [GOOD, _m("user", "again"), GOOD], "rejected": [BAD]},
            PreferencePair((USER,), (GOOD, _m("user", "again"), GOOD), (BAD,)),
            id="2-multi-turn-completion",
        ),
        pytest.param(
            {
                "prompt": [{**USER, "name": "x"}],
                "chosen": [{**GOOD, "extra": None}],
                "rejected": [BAD],
                "id": 7,
            },
            SINGLE_TURN,
            id="2-extra-keys-dropped",
        ),
        pytest.param({"chosen": HH_CHOSEN, "rejected": HH_REJECTED}, HH_TEXT_PAIR, id="3-anthropic-hh"),
        pytest.param({"prompt": None, "chosen": HH_CHOSEN, "rejected": HH_REJECTED}, HH_TEXT_PAIR, id="3-null-prompt"),
        pytest.param({"chosen": [USER, GOOD], "rejected": [USER, BAD]}, SINGLE_TURN, id="3-implicit-messages"),
        pytest.param(
            {"chosen": [SYSTEM, USER, GOOD, USER, GOOD], "rejected": [SYSTEM, USER, GOOD, USER, BAD]},
            PreferencePair((SYSTEM, USER, GOOD, USER), (GOOD,), (BAD,)),
            id="3-implicit-multi-turn",
        ),
        pytest.param(
            {"chosen": "The sky is blue.", "rejected": "The sky is green."},
            PreferencePair(
                (_m("user", "The sky is"),), (_m("assistant", " blue."),), (_m("assistant", " green."),), True
            ),
            id="3-implicit-strings",
        ),
        pytest.param(
            {"chosen": "abc", "rejected": "abcd"},  # one a prefix of the other: TRL moves the last shared one out
            PreferencePair((_m("user", "ab"),), (_m("assistant", "c"),), (_m("assistant", "cd"),), True),
            id="3-implicit-prefix",
        ),
    ],
)
def test_accepted_shapes(row, expected):
    pair = normalize_row(row)
    assert pair == expected
    assert isinstance(pair.prompt_messages, tuple) and isinstance(pair.chosen_messages, tuple)
    assert normalize_row(pair.as_row()) == pair


def test_pair_is_frozen_and_hash_depends_on_prompt_only():
    with pytest.raises(dataclasses.FrozenInstanceError):
        SINGLE_TURN.prompt_messages = ()  # type: ignore[misc]
    same_prompt = normalize_row({"prompt": [USER], "chosen": "9", "rejected": "8"})
    other_prompt = normalize_row({"prompt": [SYSTEM, USER], "chosen": "1 2 3", "rejected": "1 3 2"})
    assert prompt_hash(SINGLE_TURN) == prompt_hash(same_prompt)
    assert prompt_hash(SINGLE_TURN) != prompt_hash(other_prompt)
    assert len(prompt_hash(SINGLE_TURN)) == 64


@pytest.mark.parametrize(
    "row,code,names",
    [
        pytest.param(["a", "b", "c"], "schema", "object", id="schema-not-object"),
        pytest.param({"prompt": "p", "rejected": "r"}, "schema", "chosen", id="schema-missing-chosen"),
        pytest.param({"prompt": "p", "chosen": "c", "rejected": None}, "schema", "rejected", id="schema-null"),
        pytest.param({"prompt": "p", "chosen": 3, "rejected": "r"}, "schema", "chosen", id="schema-int-completion"),
        pytest.param({"prompt": 5, "chosen": "c", "rejected": "r"}, "schema", "prompt", id="schema-int-prompt"),
        pytest.param({"prompt": [], "chosen": "c", "rejected": "r"}, "schema", "prompt", id="schema-empty-prompt"),
        pytest.param({"chosen": [GOOD], "rejected": [BAD]}, "prefix_mismatch", "messages", id="no-shared-messages"),
        pytest.param(
            {"chosen": "just text", "rejected": "other"}, "prefix_mismatch", "characters", id="no-shared-text"
        ),
        pytest.param({"chosen": [USER, GOOD], "rejected": "1 3 2"}, "schema", "both as strings", id="implicit-mixed"),
        pytest.param({"messages": [USER, GOOD]}, "schema", "'messages'", id="messages-row"),
        pytest.param({"prompt": ["hi"], "chosen": "c", "rejected": "r"}, "schema", "prompt[0]", id="schema-msg-str"),
        pytest.param({"prompt": [_m("human", "x")], "chosen": "c", "rejected": "r"}, "role", "prompt[0]", id="role"),
        pytest.param(
            {"prompt": "p", "chosen": [{"content": "c"}], "rejected": "r"},
            "role",
            "chosen[0]",
            id="role-missing",
        ),
        pytest.param(
            {"prompt": "p", "chosen": [_m("tool", "c")], "rejected": "r"}, "role", "chosen[0]", id="role-tool"
        ),
        pytest.param(
            {"prompt": "p", "chosen": "c", "rejected": [{"role": "assistant", "content": None}]},
            "content_type",
            "rejected[0]",
            id="content-null",
        ),
        pytest.param(
            {
                "prompt": [{"role": "user", "content": [{"type": "text", "text": "x"}]}],
                "chosen": "c",
                "rejected": "r",
            },
            "content_type",
            "prompt[0]",
            id="content-parts",
        ),
        pytest.param(
            {"prompt": "3 1 2", "chosen": [_m("user", "2 1 3"), GOOD], "rejected": [USER, BAD]},
            "prefix_mismatch",
            "chosen",
            id="prefix-ultrafeedback-other-prompt",
        ),
        pytest.param(
            {"prompt": [USER], "chosen": [GOOD], "rejected": [SYSTEM, USER, BAD]},
            "prefix_mismatch",
            "rejected",
            id="prefix-extra-system",
        ),
        pytest.param(
            {"prompt": [USER], "chosen": [USER, _m("user", "more"), GOOD], "rejected": [BAD]},
            "prefix_mismatch",
            "chosen",
            id="prefix-continues-with-user",
        ),
        pytest.param(
            {"prompt": "p", "chosen": [GOOD, _m("user", "thanks")], "rejected": [BAD]},
            "not_assistant_last",
            "chosen",
            id="not-assistant-last",
        ),
        pytest.param({"prompt": "p", "chosen": "", "rejected": "r"}, "empty_completion", "chosen", id="empty-string"),
        pytest.param({"prompt": "p", "chosen": "c", "rejected": " \n"}, "empty_completion", "rejected", id="empty-ws"),
        pytest.param({"prompt": "p", "chosen": [], "rejected": "r"}, "empty_completion", "chosen", id="empty-list"),
        pytest.param(
            {"prompt": [USER], "chosen": [USER], "rejected": [BAD]},
            "empty_completion",
            "chosen",
            id="only-prompt",
        ),
        pytest.param(
            {"chosen": HH_CHOSEN, "rejected": HH_REJECTED.replace("3 2 1", "")},
            "empty_completion",
            "rejected",
            id="empty-hh",
        ),
    ],
)
def test_malformed_rows(row, code, names):
    with pytest.raises(PreferenceRowError) as info:
        normalize_row(row)
    assert info.value.reason_code == code
    assert names in info.value.message
    assert str(info.value).startswith(f"[{code}] ")


def test_with_chat_strings_transcripts_are_split_into_turns():
    """For the chat template on plain strings an Anthropic-HH pair becomes its turns, so the template renders them."""
    assert normalize_row({"chosen": HH_CHOSEN, "rejected": HH_REJECTED}, chat_strings=True) == HH_PAIR
    loose = {"chosen": "Human: 3 1 2\n\nAssistant: 1 2 3", "rejected": "\n\nHuman: 3 1 2\n\nAssistant:  1 3 2 "}
    assert normalize_row(loose, chat_strings=True) == PreferencePair((_m("user", "3 1 2"),), (GOOD,), (BAD,))
    text = normalize_row({"chosen": "The sky is blue.", "rejected": "The sky is green."}, chat_strings=True)
    assert text.prompt_messages == (_m("user", "The sky is"),) and text.plain_text  # not a transcript


@pytest.mark.parametrize(
    "row,code,names",
    [
        pytest.param(
            {"chosen": HH_CHOSEN, "rejected": HH_REJECTED.replace("more", "less")},
            "prefix_mismatch",
            "transcripts",
            id="prefix-hh",
        ),
        pytest.param(
            {"chosen": HH_CHOSEN + "\n\nHuman: thanks", "rejected": HH_REJECTED},
            "not_assistant_last",
            "chosen",
            id="not-assistant-last-hh",
        ),
        pytest.param(
            {"chosen": "\n\nHuman: hi", "rejected": "\n\nHuman: hi"},
            "not_assistant_last",
            "chosen",
            id="hh-no-assistant",
        ),
    ],
)
def test_malformed_transcripts_with_chat_strings(row, code, names):
    with pytest.raises(PreferenceRowError) as info:
        normalize_row(row, chat_strings=True)
    assert info.value.reason_code == code and names in info.value.message


def test_implicit_prompts_are_trls_extract_prompt():
    """The same prompt / completions as TRL 1.16's own ``extract_prompt`` (TRL only in tests)."""
    data_utils = pytest.importorskip("trl.data_utils")
    rows = [
        {"chosen": HH_CHOSEN, "rejected": HH_REJECTED},
        {"chosen": "The sky is blue.", "rejected": "The sky is green."},
        {"chosen": "abc", "rejected": "abcd"},
        {"chosen": [USER, GOOD], "rejected": [USER, BAD]},
        {"chosen": [SYSTEM, USER, GOOD, USER, GOOD], "rejected": [SYSTEM, USER, GOOD, USER, BAD]},
    ]
    for row in rows:
        theirs = data_utils.extract_prompt(row)
        ours = normalize_row(row).as_row()
        if isinstance(row["chosen"], str):
            assert ours == theirs, row
        else:
            assert (ours["prompt"], ours["chosen"], ours["rejected"]) == (
                theirs["prompt"],
                theirs["chosen"],
                theirs["rejected"],
            ), row


def test_docstring_examples():
    assert doctest.testmod(normalize_module).failed == 0
