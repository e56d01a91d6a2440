"""The tokenizer fingerprint: one sha256 that changes exactly when a tokenizer could tokenise a pair differently.

``pair-dpo prepare-data`` records it in its manifest; a run that uses the prepared directory with a tokenizer of
another fingerprint is refused (``tokenizer_mismatch``, see :mod:`pair_dpo_trainer.data.prepared`): its token ids
would mean other text to this model.

Details: data/README.md, "Module notes", ``fingerprint.py``.
"""

from __future__ import annotations

import hashlib
import json
from typing import Any

FINGERPRINT_FORMAT = 1

PROBE_TEXT = (
    "The quick brown fox jumps over the lazy dog.  Tabs\tand\nnewlines\r\n  trailing   spaces "
    '0123456789 3.14159 -42 1e-9 x**2 {"json": [1, 2]} <tag> </s> <|im_end|> [INST] '
    "Ünïcödé café naïve ß İ ﬁ 東京 日本語のテキスト 한국어 Русский العربية हिन्दी 🙂👍🏽 ✓ ∑ ∞"
)
"""Text tokenised into the fingerprint: ASCII, digits, whitespace runs, markup, special-token look-alikes, accents,
ligatures and several scripts and emoji, so that normalisation and merge rules show."""


def tokenizer_fingerprint(tokenizer: Any) -> str:
    """Returns the tokenizer's fingerprint (64 lowercase hex characters; definition in the module docstring).

    Args:
        tokenizer: A Hugging Face tokenizer (``get_vocab()``, ``__call__``).

    Example:
        >>> fp = tokenizer_fingerprint(tokenizer)  # doctest: +SKIP
        >>> len(fp), fp == tokenizer_fingerprint(copy.deepcopy(tokenizer))  # doctest: +SKIP
        (64, True)
    """
    vocab = sorted(([str(token), int(index)] for token, index in tokenizer.get_vocab().items()), key=_by_id)
    template = getattr(tokenizer, "chat_template", None) or None
    if template is not None and not isinstance(template, str):
        template = json.dumps(template, sort_keys=True, ensure_ascii=False)
    probe = tokenizer(PROBE_TEXT, add_special_tokens=True)["input_ids"]
    payload = {
        "format": FINGERPRINT_FORMAT,
        "vocab": vocab,
        "chat_template": template,
        "special": {"bos": _token_id(tokenizer, "bos_token_id"), "eos": _token_id(tokenizer, "eos_token_id")},
        "probe": [int(i) for i in (probe.tolist() if hasattr(probe, "tolist") else probe)],
    }
    text = json.dumps(payload, sort_keys=True, ensure_ascii=False, separators=(",", ":"))
    return hashlib.sha256(text.encode("utf-8")).hexdigest()


def _by_id(entry: list[Any]) -> tuple[int, str]:
    return entry[1], entry[0]


def _token_id(tokenizer: Any, name: str) -> int | None:
    value = getattr(tokenizer, name, None)
    return int(value) if isinstance(value, int) else None
