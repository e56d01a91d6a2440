"""Normalise one preference row of any supported shape into a typed :class:`PreferencePair`.

Accepted row shapes (``None`` counts as a missing field: ``datasets`` fills absent keys with ``None``):

Details: data/README.md, "Module notes", ``normalize.py``.
"""

from __future__ import annotations

import hashlib
import json
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from pair_dpo_trainer.errors import PreferenceRowError

ROLES: tuple[str, ...] = ("system", "user", "assistant")

Message = dict[str, str]

# A turn marker of an Anthropic-HH transcript; the transcript is prefixed with "\n\n" before splitting.
_HH_TURN = re.compile(r"\n\n(Human|Assistant):")
_HH_ROLES = {"Human": "user", "Assistant": "assistant"}

# Any surrogate code point: a Python str holds a valid UTF-16 pair as one code point, so every match is lone.
_SURROGATE = re.compile("[\ud800-\udfff]")

MAX_ROW_DEPTH = 100
"""Most levels of nested lists / objects a row may have (a valid row has 3: row, message list, message)."""


@dataclass(frozen=True)
class UnreadableRow:
    """A row a reader could not decode (invalid UTF-8, JSON nested past the parser's limit), kept in its place.

    :func:`normalize_row` raises its ``reason_code`` and ``message``, so it is counted (``prepare-data``) or fails
    the run (trainer) like every other bad row.
    """

    reason_code: str
    message: str


@dataclass(frozen=True)
class PreferencePair:
    """One normalised preference pair.

    Attributes:
        prompt_messages: The shared prompt turns (at least one), each ``{"role": ..., "content": ...}``.
        chosen_messages: The preferred completion turns after the prompt; the last one is an assistant turn.
        rejected_messages: The dispreferred completion turns; the last one is an assistant turn.
        plain_text: The row gave ``prompt``, ``chosen`` and ``rejected`` as three plain strings (shape 1), or two
            strings whose shared prefix is the prompt: it is tokenised as raw text (TRL's way) unless the run asks
            for the chat template on strings; rows of the other shapes need a template. Not part of equality: it
            says how the row was written, not what the pair holds.

    Example:
        >>> pair = normalize_row({"prompt": "2+2?", "chosen": "4", "rejected": "5"})
        >>> pair.prompt_messages
        ({'role': 'user', 'content': '2+2?'},)
        >>> pair.chosen_messages
        ({'role': 'assistant', 'content': '4'},)
    """

    prompt_messages: tuple[Message, ...]
    chosen_messages: tuple[Message, ...]
    rejected_messages: tuple[Message, ...]
    plain_text: bool = field(default=False, compare=False)

    def as_row(self) -> dict[str, Any]:
        """Returns the pair as a row: three strings for a ``plain_text`` pair, else message lists (shape 2).

        ``normalize_row(pair.as_row()) == pair`` holds for every normalised pair, ``plain_text`` included.
        """
        if self.plain_text:
            return {
                "prompt": self.prompt_messages[0]["content"],
                "chosen": self.chosen_messages[0]["content"],
                "rejected": self.rejected_messages[0]["content"],
            }
        return {
            "prompt": [dict(m) for m in self.prompt_messages],
            "chosen": [dict(m) for m in self.chosen_messages],
            "rejected": [dict(m) for m in self.rejected_messages],
        }


def prompt_hash(pair: PreferencePair) -> str:
    """Returns the sha256 hex digest of a canonical JSON of the pair's normalised prompt messages.

    Two pairs get the same hash exactly when their prompt turns (roles and contents) are equal.

    Example:
        >>> a = normalize_row({"prompt": "hi", "chosen": "x", "rejected": "y"})
        >>> b = normalize_row({"prompt": [{"role": "user", "content": "hi"}], "chosen": "z", "rejected": "w"})
        >>> prompt_hash(a) == prompt_hash(b)
        True
    """
    canonical = json.dumps(
        [{"content": m["content"], "role": m["role"]} for m in pair.prompt_messages],
        ensure_ascii=False,
        sort_keys=True,
        separators=(",", ":"),
    )
    return hashlib.sha256(canonical.encode("utf-8")).hexdigest()


def normalize_row(row: Mapping[str, Any], *, chat_strings: bool = False) -> PreferencePair:
    """Validates one row of any supported shape and returns its :class:`PreferencePair`.

    Args:
        row: A mapping with ``chosen``, ``rejected`` and usually ``prompt``; without ``prompt`` the prompt is the
            shared prefix of ``chosen`` and ``rejected`` (TRL 1.16's ``extract_prompt``: :func:`implicit_prompt`).
        chat_strings: The run renders plain strings with the chat template
            (``apply_chat_template_to_strings``): an Anthropic-HH transcript pair is then split into its turns
            instead of at the shared character prefix.

    Returns:
        The normalised pair; the completions hold only the turns after the prompt.

    Raises:
        PreferenceRowError: ``schema``, ``role``, ``content_type``, ``prefix_mismatch``,
            ``not_assistant_last``, ``empty_completion``, ``bad_text`` or ``bad_json`` (also for an
            :class:`UnreadableRow`, with the reader's code).

    Example:
        >>> row = {
        ...     "prompt": "Capital of France?",
        ...     "chosen": [{"role": "user", "content": "Capital of France?"},
        ...                {"role": "assistant", "content": "Paris."}],
        ...     "rejected": [{"role": "user", "content": "Capital of France?"},
        ...                  {"role": "assistant", "content": "Lyon."}],
        ... }
        >>> normalize_row(row).rejected_messages
        ({'role': 'assistant', 'content': 'Lyon.'},)
        >>> hh = normalize_row({"chosen": "\\n\\nHuman: Hi\\n\\nAssistant: Hello!",
        ...                     "rejected": "\\n\\nHuman: Hi\\n\\nAssistant: Go away."})
        >>> hh.prompt_messages[0]["content"], hh.chosen_messages[0]["content"], hh.plain_text
        ('\\n\\nHuman: Hi\\n\\nAssistant:', ' Hello!', True)
    """
    if isinstance(row, UnreadableRow):
        raise PreferenceRowError(row.reason_code, row.message)
    _check_depth(row)
    if not isinstance(row, Mapping):
        raise PreferenceRowError(
            "schema",
            f"the row is a {type(row).__name__}, not an object; give each row as a JSON object "
            "with 'prompt', 'chosen' and 'rejected'.",
        )
    if "messages" in row and row.get("chosen") is None and row.get("rejected") is None:
        raise PreferenceRowError(
            "schema",
            "the row has 'messages' but no 'chosen' / 'rejected': a conversation is SFT data, not a preference "
            "pair (TRL's DPOTrainer refuses it too); give 'chosen' and 'rejected' (and optionally 'prompt').",
        )
    chosen = _required_text_or_list(row, "chosen")
    rejected = _required_text_or_list(row, "rejected")
    prompt = row.get("prompt")
    if prompt is None:
        return implicit_prompt(chosen, rejected, chat_strings=chat_strings)
    prompt_messages = _prompt_messages(prompt)
    chosen_messages = _completion_messages(chosen, "chosen", prompt_messages)
    rejected_messages = _completion_messages(rejected, "rejected", prompt_messages)
    plain = isinstance(prompt, str) and isinstance(chosen, str) and isinstance(rejected, str)
    return PreferencePair(prompt_messages, chosen_messages, rejected_messages, plain_text=plain)


def shared_prefix_length(chosen: Sequence[Any], rejected: Sequence[Any]) -> int:
    """Where TRL 1.16's ``extract_prompt`` (``trl/data_utils.py``) cuts the prompt off ``chosen`` and ``rejected``.

    The first index at which they differ (for strings one step earlier when the character before it is a space, so
    the completions keep their leading space); when one is a prefix of the other (or they are equal) the last shared
    element is moved into both completions (``min(len) - 1``). 0 means there is no shared prompt.

    Example:
        >>> shared_prefix_length("The sky is blue.", "The sky is green."), shared_prefix_length("abc", "abcd")
        (10, 2)
    """
    length = min(len(chosen), len(rejected))
    for index in range(length):
        if chosen[index] != rejected[index]:
            return index - 1 if index > 0 and chosen[index - 1] == " " else index
    return max(length - 1, 0)


def implicit_prompt(
    chosen: str | Sequence[Any], rejected: str | Sequence[Any], *, chat_strings: bool = False
) -> PreferencePair:
    """The pair of a row without ``prompt``: the prompt is the shared prefix of ``chosen`` and ``rejected`` (whole
    messages for conversations, characters for strings: :func:`shared_prefix_length`), the completions the rest.

    Raises:
        PreferenceRowError: ``prefix_mismatch`` when they share no prefix; ``schema`` for a string next to a list;
            the completion checks of :func:`normalize_row`.
    """
    if isinstance(chosen, str) != isinstance(rejected, str):
        raise PreferenceRowError(
            "schema",
            "the row has no 'prompt' and one of 'chosen' / 'rejected' is a string, the other a list of messages: "
            "give both as strings or both as conversations (the shared prefix becomes the prompt), or add 'prompt'.",
        )
    for field_name, value in (("chosen", chosen), ("rejected", rejected)):
        if not value:
            raise PreferenceRowError("empty_completion", f"'{field_name}' is empty; give the response.")
    if isinstance(chosen, str) and isinstance(rejected, str):
        _check_text(chosen, "'chosen'")
        _check_text(rejected, "'rejected'")
        if chat_strings and _is_transcript(chosen) and _is_transcript(rejected):
            return _from_transcripts(chosen, rejected)
    cut = shared_prefix_length(chosen, rejected)
    if cut == 0:
        what = "characters" if isinstance(chosen, str) else "messages"
        raise PreferenceRowError(
            "prefix_mismatch",
            f"the row has no 'prompt' and 'chosen' / 'rejected' share no leading {what} to take as the prompt: add "
            "a 'prompt' field, or repeat the prompt at the start of both.",
        )
    if isinstance(chosen, str) and isinstance(rejected, str):
        prompt_messages: tuple[Message, ...] = ({"role": "user", "content": chosen[:cut]},)
        chosen_messages = _completion_messages(chosen[cut:], "chosen", prompt_messages)
        rejected_messages = _completion_messages(rejected[cut:], "rejected", prompt_messages)
        return PreferencePair(prompt_messages, chosen_messages, rejected_messages, plain_text=True)
    prompt_messages = _messages(chosen[:cut], "chosen")
    chosen_messages = _completion_turns(_messages(chosen[cut:], "chosen"), "chosen")
    rejected_messages = _completion_turns(_messages(rejected[cut:], "rejected"), "rejected")
    return PreferencePair(prompt_messages, chosen_messages, rejected_messages)


def _completion_turns(turns: tuple[Message, ...], field: str) -> tuple[Message, ...]:
    _check_completion(turns, field)
    return turns


def _check_depth(row: Any) -> None:
    """Raises ``bad_json`` when ``row`` nests more than :data:`MAX_ROW_DEPTH` lists / objects (no recursion)."""
    stack = [(row, 1)]
    while stack:
        value, depth = stack.pop()
        if isinstance(value, Mapping):
            children: Any = value.values()
        elif isinstance(value, (list, tuple)):
            children = value
        else:
            continue
        if depth > MAX_ROW_DEPTH:
            raise PreferenceRowError(
                "bad_json",
                f"the row nests more than {MAX_ROW_DEPTH} levels of lists / objects; a preference row needs 3 "
                "(row, message list, message): drop the row or flatten the field.",
            )
        stack.extend((child, depth + 1) for child in children)


def _check_text(text: str, where: str) -> str:
    """Returns ``text``; raises ``bad_text`` when it holds a lone surrogate (not encodable as UTF-8)."""
    match = _SURROGATE.search(text)
    if match is not None:
        raise PreferenceRowError(
            "bad_text",
            f"{where} holds the lone surrogate {match.group()!r} at character {match.start() + 1} (a JSON escape "
            "such as \\ud800 without its pair): it is not text any tokenizer can encode; fix the escape or drop "
            "the row.",
        )
    return text


def _required_text_or_list(row: Mapping[str, Any], field: str) -> str | Sequence[Any]:
    value = row.get(field)
    if value is None:
        raise PreferenceRowError(
            "schema",
            f"the row has no '{field}' field (or it is null); add it as a string or a list of messages.",
        )
    if not isinstance(value, (str, list, tuple)):
        raise PreferenceRowError(
            "schema",
            f"'{field}' is a {type(value).__name__}; give a string or a list of {{role, content}} messages.",
        )
    return value


def _prompt_messages(prompt: Any) -> tuple[Message, ...]:
    if isinstance(prompt, str):
        return ({"role": "user", "content": _check_text(prompt, "'prompt'")},)
    if not isinstance(prompt, (list, tuple)):
        raise PreferenceRowError(
            "schema",
            f"'prompt' is a {type(prompt).__name__}; give a string or a list of {{role, content}} messages.",
        )
    if not prompt:
        raise PreferenceRowError("schema", "'prompt' is an empty list; give at least one message.")
    return _messages(prompt, "prompt")


def _messages(values: Sequence[Any], field: str) -> tuple[Message, ...]:
    return tuple(_message(value, f"{field}[{i}]") for i, value in enumerate(values))


def _message(value: Any, where: str) -> Message:
    if not isinstance(value, Mapping):
        raise PreferenceRowError(
            "schema",
            f"{where} is a {type(value).__name__}; each message must be an object with 'role' and 'content'.",
        )
    role = value.get("role")
    if not isinstance(role, str) or role not in ROLES:
        raise PreferenceRowError(
            "role",
            f"{where}.role is {role!r}; use one of {', '.join(ROLES)} (map e.g. 'human' to 'user', 'gpt' to "
            "'assistant'; tool turns are not supported).",
        )
    content = value.get("content")
    if not isinstance(content, str):
        raise PreferenceRowError(
            "content_type",
            f"{where}.content is {type(content).__name__}, not a string; flatten list/multimodal "
            "content to text and replace null content.",
        )
    return {"role": role, "content": _check_text(content, f"{where}.content")}


def _completion_messages(value: str | Sequence[Any], field: str, prompt: tuple[Message, ...]) -> tuple[Message, ...]:
    if isinstance(value, str):
        turns: tuple[Message, ...] = ({"role": "assistant", "content": _check_text(value, f"'{field}'")},)
    else:
        if not value:
            raise PreferenceRowError(
                "empty_completion", f"'{field}' is an empty list; give at least one assistant message."
            )
        turns = _strip_prompt(_messages(value, field), field, prompt)
    _check_completion(turns, field)
    return turns


def _strip_prompt(turns: tuple[Message, ...], field: str, prompt: tuple[Message, ...]) -> tuple[Message, ...]:
    """Returns the completion turns of a message list: all of it, or what follows the repeated prompt."""
    if turns[0]["role"] == "assistant":
        return turns
    n = len(prompt)
    if turns[:n] != prompt:
        raise PreferenceRowError(
            "prefix_mismatch",
            f"'{field}' is a full conversation but its first {n} turn(s) differ from 'prompt'; "
            "a conversation must repeat the prompt turns exactly (same roles, same text) or hold only the "
            "turns after it, starting with an assistant turn.",
        )
    if len(turns) > n and turns[n]["role"] != "assistant":
        raise PreferenceRowError(
            "prefix_mismatch",
            f"'{field}' repeats 'prompt' and then continues with a {turns[n]['role']!r} turn; "
            "the turns before the response must equal 'prompt' exactly (move them into 'prompt').",
        )
    if len(turns) == n:
        raise PreferenceRowError(
            "empty_completion",
            f"'{field}' only repeats the prompt turns; add the assistant response after them.",
        )
    return turns[n:]


def _check_completion(turns: tuple[Message, ...], field: str) -> None:
    last = turns[-1]
    if last["role"] != "assistant":
        raise PreferenceRowError(
            "not_assistant_last",
            f"'{field}' ends with a {last['role']!r} turn; a completion must end with an "
            "assistant turn (drop the trailing turns).",
        )
    if not last["content"].strip():
        raise PreferenceRowError(
            "empty_completion",
            f"the final assistant turn of '{field}' is empty; drop the row or fill in the response.",
        )


@dataclass(frozen=True)
class _Transcript:
    """An Anthropic-HH transcript split at its last ``Assistant:`` turn."""

    prompt: tuple[Message, ...]
    completion: tuple[Message, ...]


def _is_transcript(text: str) -> bool:
    """True for an Anthropic-HH transcript (``"\\n\\nHuman: ..."``)."""
    return text.lstrip().startswith("Human:")


def _from_transcripts(chosen: str, rejected: str) -> PreferencePair:
    chosen_split = _split_transcript(chosen, "chosen")
    rejected_split = _split_transcript(rejected, "rejected")
    if chosen_split.prompt != rejected_split.prompt:
        raise PreferenceRowError(
            "prefix_mismatch",
            "the 'chosen' and 'rejected' transcripts differ before their last 'Assistant:' turn; "
            "both must share exactly the same prompt turns.",
        )
    return PreferencePair(chosen_split.prompt, chosen_split.completion, rejected_split.completion)


def _split_transcript(text: str, field: str) -> _Transcript:
    """Splits an Anthropic-HH transcript into its prompt turns and its completion turns."""
    parts = _HH_TURN.split("\n\n" + text.lstrip())
    if len(parts) == 1 or parts[0].strip():
        raise PreferenceRowError(
            "schema",
            f"'{field}' is a string but not an Anthropic-HH transcript (it must start with "
            "'\\n\\nHuman:'); without a 'prompt' field, give both completions as "
            "'\\n\\nHuman: ...\\n\\nAssistant: ...' transcripts, or add a 'prompt' field.",
        )
    turns = tuple(
        {"role": _HH_ROLES[marker], "content": content.strip()}
        for marker, content in zip(parts[1::2], parts[2::2], strict=True)
    )
    last_assistant = max((i for i, turn in enumerate(turns) if turn["role"] == "assistant"), default=None)
    if last_assistant is None:
        raise PreferenceRowError(
            "not_assistant_last",
            f"the '{field}' transcript has no 'Assistant:' turn; end it with the response.",
        )
    if last_assistant == 0:
        raise PreferenceRowError(
            "schema",
            f"the '{field}' transcript has no turn before its last 'Assistant:' turn; start it with a "
            "'\\n\\nHuman:' turn that holds the prompt.",
        )
    completion = turns[last_assistant:]
    _check_completion(completion, field)
    return _Transcript(prompt=turns[:last_assistant], completion=completion)
