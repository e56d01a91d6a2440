"""Tokenise normalised preference pairs: conversations with the tokenizer's chat template, plain strings as raw text.

A row of plain strings is tokenised as TRL 1.16 does, by concatenation (``tokenizer(prompt)`` and
``tokenizer(prompt + completion)``, the shared token prefix being the prompt) and never through the chat template,
even when the tokenizer has one; ``apply_chat_template_to_strings=True`` renders it as one user turn and one assistant
turn with the template instead. For a conversation (or strings rendered with the template), ``prompt_ids`` is the
template applied to the prompt turns with the generation prompt (the assistant header); each completion is the rest
of the template applied to prompt + completion turns, after checking that this rendering starts with ``prompt_ids``
(else ``template_not_prefix``). A completion ends with ``eos_token_id``: if the template closes the turn with EOS
followed only by whitespace tokens (e.g. ``<|im_end|>\n``) that whitespace is dropped; if it does not emit EOS at
all, EOS is appended.

Details: data/README.md, "Module notes", ``tokenize.py``.
"""

from __future__ import annotations

import functools
import inspect
import sys
from collections import Counter
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field, replace
from typing import Any

from jinja2.exceptions import TemplateError

from pair_dpo_trainer.data.normalize import PreferencePair, normalize_row
from pair_dpo_trainer.data.readers import iter_rows
from pair_dpo_trainer.data.rownames import RowNames, row_name
from pair_dpo_trainer.errors import ConfigError, PreferenceRowError

FEATURE_COLUMNS: tuple[str, str, str] = ("prompt_input_ids", "chosen_input_ids", "rejected_input_ids")

# Below this many rows, tokenize_dataset(progress=None) shows no progress bar.
PROGRESS_MIN_ROWS = 1000

# One input row -> (its normalised pair or None, its features, whether it was truncated, its rendering or None).
RowConverter = Callable[[Any], "tuple[PreferencePair | None, dict[str, Any], bool, str | None]"]

RENDERINGS: tuple[str, ...] = ("strings_raw", "strings_templated", "conversations")
"""How a row became tokens: plain strings as raw text (TRL's way), plain strings through the chat template
(``apply_chat_template_to_strings=True``), a conversation through the chat template."""


def rendering_of(pair: PreferencePair, *, apply_chat_template_to_strings: bool) -> str:
    """The :data:`RENDERINGS` entry :func:`tokenize_pair` uses for ``pair``."""
    if not pair.plain_text:
        return "conversations"
    return "strings_templated" if apply_chat_template_to_strings else "strings_raw"


@dataclass(frozen=True)
class TokenizedPair:
    """Token ids of one pair.

    Attributes:
        prompt_ids: Chat-template tokens of the prompt, ending with the generation prompt (assistant header).
        chosen_ids: Tokens of the chosen completion; they end with EOS unless the completion was truncated.
        rejected_ids: Tokens of the rejected completion; same rule.
        truncated: :func:`truncate_pair` cut the prompt or a completion (not part of equality).
        rendering: How the pair was rendered (:data:`RENDERINGS`), None for pre-tokenised ids (not part of
            equality).

    Example:
        >>> tp = TokenizedPair(prompt_ids=(5, 6, 7), chosen_ids=(8, 2), rejected_ids=(9, 9, 2))
        >>> tp.cost
        11
        >>> tp.to_features()["chosen_input_ids"]
        [8, 2]
    """

    prompt_ids: tuple[int, ...]
    chosen_ids: tuple[int, ...]
    rejected_ids: tuple[int, ...]
    truncated: bool = field(default=False, compare=False)
    rendering: str | None = field(default=None, compare=False)

    @property
    def cost(self) -> int:
        """Tokens of both sequences of the pair: ``2 * len(prompt) + len(chosen) + len(rejected)``."""
        return 2 * len(self.prompt_ids) + len(self.chosen_ids) + len(self.rejected_ids)

    def packed_cost(self, *, share_prompt: bool) -> int:
        """Tokens the pair takes in a packed row: :attr:`cost`, less one prompt in the shared-prompt layout."""
        return self.cost - (len(self.prompt_ids) if share_prompt else 0)

    def to_features(self) -> dict[str, list[int]]:
        """Returns the columns ``prompt_input_ids``, ``chosen_input_ids`` and ``rejected_input_ids``."""
        return {
            "prompt_input_ids": list(self.prompt_ids),
            "chosen_input_ids": list(self.chosen_ids),
            "rejected_input_ids": list(self.rejected_ids),
        }


@dataclass(frozen=True)
class TokenizationResult:
    """What :func:`tokenize_dataset` (or :func:`truncate_dataset`) accepted and rejected.

    Attributes:
        features: One dict of the three ``*_input_ids`` columns per accepted row, in input order
            (:func:`truncate_dataset`: the row itself, its id columns replaced when it was truncated).
        row_indices: The input index of each accepted row (aligned with ``features``).
        rejections: Number of rejected rows per reason code.
        examples: The first rejection message per reason code (it names the row).
        num_rows: Rows read.
        pairs: The normalised pair of each accepted row when ``keep_pairs=True``, else ``None``.
        num_truncated: Accepted pairs whose prompt or a completion was cut to the length limits.
        first_rejection: ``"[code] message"`` of the first rejected row in input order, else ``None``.
        first_error: ``(reason_code, message)`` of that row, else ``None`` (what a strict run raises).
        renderings: Accepted rows per rendering (:data:`RENDERINGS`; empty for pre-tokenised rows).
    """

    features: list[dict[str, Any]]
    row_indices: list[int]
    rejections: Counter[str]
    examples: dict[str, str]
    num_rows: int
    pairs: list[PreferencePair] | None = field(default=None)
    num_truncated: int = 0
    first_rejection: str | None = None
    first_error: tuple[str, str] | None = None
    renderings: Counter[str] = field(default_factory=Counter)

    @property
    def num_accepted(self) -> int:
        """Number of accepted rows."""
        return len(self.features)


def tokenize_pair(
    pair: PreferencePair,
    tokenizer: Any,
    *,
    max_length: int,
    max_prompt_length: int | None,
    max_tokens_per_microbatch: int | None = None,
    share_prompt: bool = False,
    apply_chat_template_to_strings: bool = False,
) -> TokenizedPair:
    """Tokenises and truncates one normalised pair (raw text or the chat template: module docstring).

    Args:
        pair: The normalised pair (see :func:`~pair_dpo_trainer.data.normalize.normalize_row`).
        tokenizer: A Hugging Face tokenizer with an ``eos_token_id`` (and a chat template for message rows).
        max_length: Maximum tokens of one sequence (prompt + one completion).
        max_prompt_length: Maximum prompt tokens (left truncation), or ``None`` for no prompt-specific limit.
        max_tokens_per_microbatch: If given, a pair whose packed cost exceeds it raises ``pair_too_long`` (the
            budget of one packed micro-batch).
        share_prompt: The run packs the shared-prompt layout: a pair's packed cost counts its prompt once
            (:meth:`TokenizedPair.packed_cost`), else twice.
        apply_chat_template_to_strings: Render a plain-string pair with the chat template (one user turn, one
            assistant turn) instead of as raw text.

    Returns:
        The pair's token ids, with the rendering used.

    Raises:
        PreferenceRowError: ``template_not_prefix``, ``template_error``, ``empty_completion``,
            ``identical_after_truncation``, ``pair_too_long``, ``empty_prompt`` (raw text); without a chat template
            ``no_chat_template`` (a conversation, or strings with ``apply_chat_template_to_strings``).
        ConfigError: ``bad_length`` for a non-positive length, or a tokenizer without ``eos_token_id``.

    Example:
        >>> pair = normalize_row({"prompt": "Hi", "chosen": "Hello!", "rejected": "Go away."})
        >>> # with a template rendering ``<|user|>{content}\\n`` and ``<|assistant|>{content}</s>``:
        >>> tp = tokenize_pair(pair, tokenizer, max_length=512, max_prompt_length=256)  # doctest: +SKIP
        >>> tokenizer.decode(tp.prompt_ids), tokenizer.decode(tp.chosen_ids)  # doctest: +SKIP
        ('<|user|>Hi\\n<|assistant|>', 'Hello!</s>')
    """
    _checked_limits(max_length, max_prompt_length, max_tokens_per_microbatch, share_prompt)
    eos = _eos_token_id(tokenizer)
    rendering = rendering_of(pair, apply_chat_template_to_strings=apply_chat_template_to_strings)
    if rendering == "strings_raw":
        prompt_ids, chosen, rejected = _concatenated_ids(tokenizer, pair, eos)
    else:
        _require_chat_template(tokenizer, rendering)
        prompt_ids = _encode(tokenizer, pair.prompt_messages, add_generation_prompt=True, what="the prompt")
        chosen = _completion_ids(tokenizer, pair.prompt_messages, pair.chosen_messages, prompt_ids, eos, "chosen")
        rejected = _completion_ids(tokenizer, pair.prompt_messages, pair.rejected_messages, prompt_ids, eos, "rejected")
    truncated = truncate_pair(
        prompt_ids,
        chosen,
        rejected,
        max_length=max_length,
        max_prompt_length=max_prompt_length,
        max_tokens_per_microbatch=max_tokens_per_microbatch,
        share_prompt=share_prompt,
    )
    return replace(truncated, rendering=rendering)


def truncate_pair(
    prompt_ids: Sequence[int],
    chosen: Sequence[int],
    rejected: Sequence[int],
    *,
    max_length: int,
    max_prompt_length: int | None,
    max_tokens_per_microbatch: int | None = None,
    share_prompt: bool = False,
) -> TokenizedPair:
    """Left-truncates the prompt, right-truncates the completions, then checks the pair: the one truncation rule of
    every input path (raw rows, pre-tokenised rows, prepared directories).

    Args:
        prompt_ids / chosen / rejected: Token ids; completions end with EOS unless already cut.
        max_length / max_prompt_length / max_tokens_per_microbatch / share_prompt: See :func:`tokenize_pair`.

    Returns:
        The pair, ``truncated=True`` when something was cut (a cut completion loses its EOS with its tail).

    Raises:
        PreferenceRowError: ``empty_completion`` (the prompt leaves no room), ``identical_after_truncation``,
            ``pair_too_long``.

    Example:
        >>> tp = truncate_pair([1, 2, 3, 4], [5, 6, 2], [7, 2], max_length=5, max_prompt_length=3)
        >>> tp.prompt_ids, tp.chosen_ids, tp.rejected_ids, tp.truncated
        ((2, 3, 4), (5, 6), (7, 2), True)
    """
    prompt_ids, chosen, rejected = list(prompt_ids), list(chosen), list(rejected)
    full_prompt = len(prompt_ids)
    if max_prompt_length is not None and len(prompt_ids) > max_prompt_length:
        prompt_ids = prompt_ids[-max_prompt_length:]
    room = max_length - len(prompt_ids)
    if room <= 0:
        raise PreferenceRowError(
            "empty_completion",
            f"the prompt takes {len(prompt_ids)} tokens and leaves no room for completion tokens "
            f"within max_length={max_length}; set max_prompt_length below max_length.",
        )
    cut = len(prompt_ids) < full_prompt or len(chosen) > room or len(rejected) > room
    truncated = TokenizedPair(tuple(prompt_ids), tuple(chosen[:room]), tuple(rejected[:room]), truncated=cut)
    if truncated.chosen_ids == truncated.rejected_ids:
        detail = "are identical" if chosen == rejected else f"are identical after truncation to {room} tokens"
        raise PreferenceRowError(
            "identical_after_truncation",
            f"the chosen and rejected completions {detail}; the pair carries no preference signal "
            "(drop it, or raise max_length / lower max_prompt_length if they differ later).",
        )
    cost = truncated.packed_cost(share_prompt=share_prompt)
    if max_tokens_per_microbatch is not None and cost > max_tokens_per_microbatch:
        layout = "prompt + chosen + rejected, shared prompt" if share_prompt else "2 x prompt + chosen + rejected"
        raise PreferenceRowError(
            "pair_too_long",
            f"the pair costs {cost} tokens ({layout}), more than max_tokens_per_microbatch="
            f"{max_tokens_per_microbatch}; lower max_length / max_prompt_length or raise the micro-batch token budget.",
        )
    return truncated


def tokenize_dataset(
    dataset_or_rows: Iterable[Mapping[str, Any]],
    tokenizer: Any,
    *,
    max_length: int,
    max_prompt_length: int | None,
    max_tokens_per_microbatch: int | None = None,
    share_prompt: bool = False,
    strict: bool = False,
    keep_pairs: bool = False,
    progress: bool | None = None,
    desc: str = "dataset",
    first_row: int = 0,
    apply_chat_template_to_strings: bool = False,
    row_names: RowNames | None = None,
) -> TokenizationResult:
    """Normalises and tokenises every row, counting rejected rows per reason code and accepted rows per rendering.

    Args:
        dataset_or_rows: A ``datasets.Dataset`` or any iterable of row mappings (any supported shape).
        tokenizer: A Hugging Face tokenizer (with a chat template for message rows).
        max_length: See :func:`tokenize_pair`.
        max_prompt_length: See :func:`tokenize_pair`.
        max_tokens_per_microbatch / share_prompt: See :func:`tokenize_pair`.
        strict: Raise the first :class:`PreferenceRowError` (its message names the row) instead of
            counting it.
        keep_pairs: Also return the normalised pair of every accepted row.
        progress: Show a tqdm bar on stderr; ``None``: only on a terminal and for at least 1000 rows.
        desc: Label of the progress bar and prefix of the row names in messages (e.g. an input file name).
        first_row: Number of the first row in messages: 0 for an index into an in-memory dataset, 1 for the
            rows of a file (``prepare-data``).
        apply_chat_template_to_strings: See :func:`tokenize_pair`.
        row_names: Names the rows by their file and line instead (``data.rownames``; ``first_row`` is their index).

    Returns:
        A :class:`TokenizationResult`.

    Example:
        >>> rows = [{"prompt": "Hi", "chosen": "Hello!", "rejected": "Go away."}, {"prompt": "Hi"}]
        >>> result = tokenize_dataset(rows, tok, max_length=512, max_prompt_length=256)  # doctest: +SKIP
        >>> result.num_accepted, dict(result.rejections)  # doctest: +SKIP
        (1, {'schema': 1})
    """
    limits = _checked_limits(max_length, max_prompt_length, max_tokens_per_microbatch, share_prompt)

    def convert(row: Any) -> tuple[PreferencePair, dict[str, Any], bool, str | None]:
        pair = normalize_row(row, chat_strings=apply_chat_template_to_strings)
        tokenized = tokenize_pair(
            pair, tokenizer, **limits, apply_chat_template_to_strings=apply_chat_template_to_strings
        )
        return pair, tokenized.to_features(), tokenized.truncated, tokenized.rendering

    rows = _progress(dataset_or_rows, progress, desc)
    return _convert_rows(
        rows, convert, strict=strict, keep_pairs=keep_pairs, desc=desc, first_row=first_row, row_names=row_names
    )


def truncate_dataset(
    rows: Iterable[Mapping[str, Any]],
    *,
    max_length: int,
    max_prompt_length: int | None,
    max_tokens_per_microbatch: int | None = None,
    share_prompt: bool = False,
    strict: bool = True,
    progress: bool | None = None,
    desc: str = "dataset",
    first_row: int = 0,
    row_names: RowNames | None = None,
) -> TokenizationResult:
    """Applies :func:`truncate_pair` (the raw rows' truncation and checks) to already tokenised rows.

    Args:
        rows: A ``datasets.Dataset`` or iterable of mappings with the three ``*_input_ids`` columns.
        max_length / max_prompt_length / max_tokens_per_microbatch / share_prompt: See :func:`tokenize_pair`.
        strict / progress / desc / first_row / row_names: See :func:`tokenize_dataset`.

    Returns:
        A :class:`TokenizationResult` whose ``features`` are the rows themselves, a truncated row as a copy with
        its id columns replaced (other columns kept).

    Example:
        >>> row = {"prompt_input_ids": [1, 2, 3], "chosen_input_ids": [4, 5, 2], "rejected_input_ids": [6, 2]}
        >>> result = truncate_dataset([row], max_length=4, max_prompt_length=2)
        >>> result.features[0]["prompt_input_ids"], result.features[0]["chosen_input_ids"], result.num_truncated
        ([2, 3], [4, 5], 1)
    """
    limits = _checked_limits(max_length, max_prompt_length, max_tokens_per_microbatch, share_prompt)

    def convert(row: Any) -> tuple[None, dict[str, Any], bool, str | None]:
        tokenized = truncate_pair(*(row[column] for column in FEATURE_COLUMNS), **limits)
        return None, ({**row, **tokenized.to_features()} if tokenized.truncated else row), tokenized.truncated, None

    return _convert_rows(
        _progress(rows, progress, desc),
        convert,
        strict=strict,
        keep_pairs=False,
        desc=desc,
        first_row=first_row,
        row_names=row_names,
    )


def _convert_rows(
    rows: Iterable[Any],
    convert: RowConverter,
    *,
    strict: bool,
    keep_pairs: bool,
    desc: str,
    first_row: int,
    row_names: RowNames | None = None,
) -> TokenizationResult:
    features: list[dict[str, Any]] = []
    row_indices: list[int] = []
    pairs: list[PreferencePair] = []
    rejections: Counter[str] = Counter()
    renderings: Counter[str] = Counter()
    examples: dict[str, str] = {}
    first_error: tuple[str, str] | None = None
    num_truncated = 0
    for index, row in enumerate(iter_rows(rows)):
        try:
            pair, row_features, truncated, rendering = convert(row)
        except PreferenceRowError as exc:
            message = f"{row_name(desc, index + first_row, row_names)}: {exc.message}"
            if strict:
                raise PreferenceRowError(exc.reason_code, message) from exc
            rejections[exc.reason_code] += 1
            examples.setdefault(exc.reason_code, message)
            first_error = first_error or (exc.reason_code, message)
            continue
        features.append(row_features)
        row_indices.append(index)
        num_truncated += truncated
        if rendering is not None:
            renderings[rendering] += 1
        if keep_pairs and pair is not None:
            pairs.append(pair)
    num_rows = len(features) + sum(rejections.values())
    return TokenizationResult(
        features,
        row_indices,
        rejections,
        examples,
        num_rows,
        pairs if keep_pairs else None,
        num_truncated=num_truncated,
        first_rejection=None if first_error is None else f"[{first_error[0]}] {first_error[1]}",
        first_error=first_error,
        renderings=renderings,
    )


def _checked_limits(
    max_length: int, max_prompt_length: int | None, max_tokens_per_microbatch: int | None, share_prompt: bool
) -> dict[str, Any]:
    """The three length limits and the layout the budget counts as the keyword arguments of :func:`tokenize_pair` /
    :func:`truncate_pair`.

    Raises:
        ConfigError: ``bad_length`` for a limit that is not a positive integer.
    """
    for name, value, optional in (
        ("max_length", max_length, False),
        ("max_prompt_length", max_prompt_length, True),
        ("max_tokens_per_microbatch", max_tokens_per_microbatch, True),
    ):
        if value is None and optional:
            continue
        if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
            raise ConfigError("bad_length", f"{name}={value!r}: set a positive integer.")
    return {
        "max_length": max_length,
        "max_prompt_length": max_prompt_length,
        "max_tokens_per_microbatch": max_tokens_per_microbatch,
        "share_prompt": bool(share_prompt),
    }


def _eos_token_id(tokenizer: Any) -> int:
    eos = getattr(tokenizer, "eos_token_id", None)
    if not isinstance(eos, int):
        raise ConfigError(
            "bad_tokenizer", "the tokenizer has no eos_token_id; set eos_token in its tokenizer_config.json."
        )
    return eos


@functools.lru_cache(maxsize=32)
def _supports_sanitize(tokenizer_type: type) -> bool:
    method = getattr(tokenizer_type, "apply_chat_template", None)
    try:
        return method is not None and "sanitize_control_tokens" in inspect.signature(method).parameters
    except (TypeError, ValueError):
        return False


def _encode(
    tokenizer: Any, messages: Sequence[Mapping[str, str]], *, add_generation_prompt: bool, what: str
) -> list[int]:
    kwargs: dict[str, Any] = {
        "add_generation_prompt": add_generation_prompt,
        "tokenize": True,
        "return_dict": False,
    }
    if _supports_sanitize(type(tokenizer)):  # type: ignore[arg-type]  # a class is hashable
        kwargs["sanitize_control_tokens"] = True
    try:
        out = tokenizer.apply_chat_template([dict(m) for m in messages], **kwargs)
    except TemplateError as exc:
        raise PreferenceRowError(
            "template_error",
            f"the chat template refused {what}: {exc}; fix the turns (e.g. roles must alternate, "
            "or no system turn) to suit this model's template.",
        ) from exc
    if isinstance(out, Mapping):
        out = out["input_ids"]
    if hasattr(out, "tolist"):
        out = out.tolist()
    if out and isinstance(out[0], (list, tuple)):
        out = out[0]
    return [int(i) for i in out]


def _completion_ids(
    tokenizer: Any,
    prompt: tuple[Mapping[str, str], ...],
    completion: tuple[Mapping[str, str], ...],
    prompt_ids: list[int],
    eos: int,
    field_name: str,
) -> list[int]:
    full = _encode(tokenizer, prompt + completion, add_generation_prompt=False, what=f"prompt + {field_name}")
    if full[: len(prompt_ids)] != prompt_ids:
        raise PreferenceRowError(
            "template_not_prefix",
            f"the chat template renders prompt + {field_name} so that it does not start with "
            "the rendered prompt (+ generation prompt): the template is not prefix-consistent for this row. "
            "Use a template whose rendering of a conversation extends the rendering of its prefix.",
        )
    ids = full[len(prompt_ids) :]
    if not ids:
        raise PreferenceRowError(
            "empty_completion",
            f"'{field_name}' renders to no tokens after the prompt; give a non-empty assistant response.",
        )
    return _end_with_eos(ids, eos, tokenizer)


def _end_with_eos(ids: list[int], eos: int, tokenizer: Any) -> list[int]:
    """Makes ``ids`` end with EOS: drop whitespace-only tokens after the last EOS, else append EOS."""
    if ids[-1] == eos:
        return ids
    if eos in ids:
        last = len(ids) - 1 - ids[::-1].index(eos)
        if not tokenizer.decode(ids[last + 1 :]).strip():
            return ids[: last + 1]
    return [*ids, eos]


def _require_chat_template(tokenizer: Any, rendering: str) -> None:
    """Raises ``no_chat_template`` when a rendering that needs the chat template meets a tokenizer without one."""
    if has_chat_template(tokenizer):
        return
    if rendering == "strings_templated":
        raise PreferenceRowError(
            "no_chat_template",
            "apply_chat_template_to_strings=True renders plain-string rows with the chat template, but the tokenizer "
            "has none: give it a chat template, or set apply_chat_template_to_strings=False (raw text, TRL's way).",
        )
    raise PreferenceRowError(
        "no_chat_template",
        "the tokenizer has no chat template, and this row holds chat turns (message lists) that only a template can "
        "render: give the tokenizer a chat template (a chat_template.jinja file in its directory, or "
        "tokenizer.chat_template = ...), or write the row as three plain strings 'prompt' / 'chosen' / 'rejected', "
        "which are tokenised as raw text.",
    )


def has_chat_template(tokenizer: Any) -> bool:
    """True when ``tokenizer`` has a chat template (conversations need one; plain strings are raw text).

    A Hugging Face tokenizer says so with ``chat_template``; an object without that attribute counts as templated
    when it has ``apply_chat_template``.
    """
    if hasattr(tokenizer, "chat_template"):
        return bool(tokenizer.chat_template)
    return hasattr(tokenizer, "apply_chat_template")


def _concatenated_ids(tokenizer: Any, pair: PreferencePair, eos: int) -> tuple[list[int], list[int], list[int]]:
    """TRL's non-conversational tokenisation of a plain-string pair (see the module docstring), template or not."""
    prompt = pair.prompt_messages[0]["content"]
    prompt_ids = _encode_text(tokenizer, prompt)
    fulls = [_encode_text(tokenizer, prompt + c[0]["content"]) for c in (pair.chosen_messages, pair.rejected_messages)]
    shared = min(_common_prefix_length(prompt_ids, full) for full in fulls)
    if shared == 0:
        raise PreferenceRowError(
            "empty_prompt",
            "the prompt tokenises to no tokens ahead of the completion (raw text, and the tokenizer adds no BOS): the "
            "first completion token would have no context; give a non-empty prompt.",
        )
    completions = []
    for name, full in zip(("chosen", "rejected"), fulls, strict=True):
        if len(full) == shared:
            raise PreferenceRowError(
                "empty_completion", f"'{name}' tokenises to no tokens after the prompt; give a non-empty response."
            )
        completions.append(_end_with_eos(full[shared:], eos, tokenizer))
    return prompt_ids[:shared], completions[0], completions[1]


def _encode_text(tokenizer: Any, text: str) -> list[int]:
    out = tokenizer(text, add_special_tokens=True, split_special_tokens=True)["input_ids"]
    return [int(i) for i in (out.tolist() if hasattr(out, "tolist") else out)]


def _common_prefix_length(a: Sequence[int], b: Sequence[int]) -> int:
    n = 0
    for x, y in zip(a, b, strict=False):
        if x != y:
            break
        n += 1
    return n


def _progress(rows: Any, enabled: bool | None, desc: str) -> Any:
    """``rows`` wrapped in a tqdm bar on stderr when ``enabled`` (``None``: a terminal and >= 1000 rows)."""
    total = len(rows) if hasattr(rows, "__len__") else None
    if enabled is None:
        enabled = total is not None and total >= PROGRESS_MIN_ROWS and sys.stderr.isatty()
    if not enabled:
        return rows
    from tqdm.auto import tqdm

    return tqdm(iter_rows(rows), total=total, desc=desc, unit="row", file=sys.stderr)
