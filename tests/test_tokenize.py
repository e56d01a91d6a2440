"""tokenize_pair / tokenize_dataset / pair_costs on the bundled tiny tokenizer: template, EOS, truncation."""

from __future__ import annotations

import copy
import dataclasses
import doctest
from collections import Counter

import datasets
import pytest
from transformers import AutoTokenizer, PreTrainedTokenizerBase

import pair_dpo_trainer.data.tokenize as tokenize_module
from pair_dpo_trainer.data.costs import pair_costs
from pair_dpo_trainer.data.normalize import normalize_row
from pair_dpo_trainer.data.tokenize import (
    TokenizedPair,
    _end_with_eos,
    _supports_sanitize,
    tokenize_dataset,
    tokenize_pair,
)
from pair_dpo_trainer.demo import bundled_model_dir
from pair_dpo_trainer.errors import ConfigError, PreferenceRowError

LONG_PROMPT = "sort ascending: " + " ".join(str(i) for i in range(40, 0, -1))
PROMPT = "sort ascending: 3 1 2"
ROW = {"prompt": [{"role": "user", "content": PROMPT}], "chosen": "1 2 3", "rejected": "1 3 2"}
"""A conversation (a list prompt): rendered with the chat template."""
STRINGS = {"prompt": PROMPT, "chosen": "1 2 3", "rejected": "1 3 2"}
"""Three plain strings: raw text, or the template with ``apply_chat_template_to_strings``."""

# Not prefix-consistent: the generation prompt is not the header that assistant turns are rendered with.
NON_PREFIX_TEMPLATE = (
    "{% for m in messages %}{{ '<|' + m['role'] + '|>' + m['content'] }}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|system|>' }}{% endif %}"
)
# Like Gemma's: refuses system turns.
NO_SYSTEM_TEMPLATE = (
    "{% if messages[0]['role'] == 'system' %}{{ raise_exception('System role not supported') }}{% endif %}"
)
# Ends assistant turns without EOS.
NO_EOS_TEMPLATE = (
    "{% for m in messages %}{{ '<|' + m['role'] + '|>' + m['content'] }}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|assistant|>' }}{% endif %}"
)


@pytest.fixture(scope="session")
def tok():
    return AutoTokenizer.from_pretrained(bundled_model_dir())


def _with_template(tok, template: str):
    other = copy.deepcopy(tok)
    other.chat_template = template
    return other


def _tokenize(row, tok, max_length=256, max_prompt_length=128, strings_templated=False, **kwargs) -> TokenizedPair:
    pair = normalize_row(row, chat_strings=strings_templated)
    limits = {"max_length": max_length, "max_prompt_length": max_prompt_length, **kwargs}
    return tokenize_pair(pair, tok, **limits, apply_chat_template_to_strings=strings_templated)


def test_ids_follow_the_chat_template(tok):
    tp = _tokenize(ROW, tok)
    prompt = [{"role": "user", "content": PROMPT}]
    assert list(tp.prompt_ids) == tok.apply_chat_template(prompt, add_generation_prompt=True, return_dict=False)
    for completion, ids in (("1 2 3", tp.chosen_ids), ("1 3 2", tp.rejected_ids)):
        full = tok.apply_chat_template(prompt + [{"role": "assistant", "content": completion}], return_dict=False)
        assert list(tp.prompt_ids + ids) == full
        assert ids[-1] == tok.eos_token_id
    assert tok.decode(tp.chosen_ids) == "1 2 3 </s>"
    assert tp.cost == 2 * len(tp.prompt_ids) + len(tp.chosen_ids) + len(tp.rejected_ids)
    assert tp.to_features() == {
        "prompt_input_ids": list(tp.prompt_ids),
        "chosen_input_ids": list(tp.chosen_ids),
        "rejected_input_ids": list(tp.rejected_ids),
    }
    with pytest.raises(dataclasses.FrozenInstanceError):
        tp.chosen_ids = ()  # type: ignore[misc]


def test_every_shape_gives_the_same_ids(tok):
    user = {"role": "user", "content": PROMPT}
    conversations = [
        ROW,
        {"prompt": [user], "chosen": [{"role": "assistant", "content": "1 2 3"}], "rejected": "1 3 2"},
        {"prompt": PROMPT, "chosen": [user, {"role": "assistant", "content": "1 2 3"}], "rejected": "1 3 2"},
        {
            "chosen": [user, {"role": "assistant", "content": "1 2 3"}],
            "rejected": [user, {"role": "assistant", "content": "1 3 2"}],
        },
    ]
    strings = [  # the same turns with the chat template on plain strings
        STRINGS,
        {
            "chosen": "\n\nHuman: sort ascending: 3 1 2\n\nAssistant: 1 2 3",
            "rejected": "Human: sort ascending: 3 1 2\n\nAssistant: 1 3 2",
        },
    ]
    tokenized = {_tokenize(row, tok) for row in conversations}
    tokenized |= {_tokenize(row, tok, strings_templated=True) for row in strings}
    assert len(tokenized) == 1
    assert {_tokenize(row, tok).rendering for row in conversations} == {"conversations"}


def test_plain_strings_are_raw_text_even_with_a_chat_template(tok):
    """TRL's non-conversational path: ``tokenizer(prompt)`` / ``tokenizer(prompt + completion)`` + EOS, no template."""
    spaced = {**STRINGS, "chosen": " 1 2 3", "rejected": " 1 3 2"}  # the prompt's last token stays whole
    tp = _tokenize(spaced, tok)
    assert tp.rendering == "strings_raw"
    assert list(tp.prompt_ids) == tok(PROMPT)["input_ids"]
    assert list(tp.prompt_ids + tp.chosen_ids) == tok(PROMPT + " 1 2 3")["input_ids"] + [tok.eos_token_id]
    templated = _tokenize(STRINGS, tok, strings_templated=True)
    assert templated.rendering == "strings_templated" and templated == _tokenize(ROW, tok)
    assert templated != _tokenize(STRINGS, tok)


def test_multi_turn_completion_and_system_prompt(tok):
    row = {
        "prompt": [{"role": "system", "content": "sort"}, {"role": "user", "content": "3 1 2"}],
        "chosen": [
            {"role": "assistant", "content": "1 2"},
            {"role": "user", "content": "up"},
            {"role": "assistant", "content": "1 2 3"},
        ],
        "rejected": "3 2 1",
    }
    tp = _tokenize(row, tok)
    assert tok.decode(tp.chosen_ids) == "1 2 </s> <|user|> up <|assistant|> 1 2 3 </s>"
    assert tok.decode(tp.prompt_ids).endswith("<|assistant|>")


def test_prompt_is_truncated_from_the_left(tok):
    row = {**ROW, "prompt": [{"role": "user", "content": LONG_PROMPT}]}
    full = _tokenize(row, tok, max_length=256, max_prompt_length=200)
    cut = _tokenize(row, tok, max_length=256, max_prompt_length=10)
    assert len(full.prompt_ids) > 10
    assert cut.prompt_ids == full.prompt_ids[-10:]
    assert tok.decode(cut.prompt_ids).endswith("3 2 1 <|assistant|>")
    assert cut.chosen_ids == full.chosen_ids and cut.chosen_ids[-1] == tok.eos_token_id


def test_completions_are_truncated_from_the_right_and_lose_eos(tok):
    row = {**ROW, "chosen": "1 2 3 4 5 6 7 8", "rejected": "8 7 6"}
    whole = _tokenize(row, tok)
    room = 5
    cut = _tokenize(row, tok, max_length=len(whole.prompt_ids) + room)
    assert cut.chosen_ids == whole.chosen_ids[:room]  # 8 words + EOS -> first 5 words, no EOS
    assert tok.eos_token_id not in cut.chosen_ids
    assert cut.rejected_ids == whole.rejected_ids and cut.rejected_ids[-1] == tok.eos_token_id  # fits: keeps EOS
    exact = _tokenize(row, tok, max_length=len(whole.prompt_ids) + len(whole.chosen_ids))
    assert exact.chosen_ids == whole.chosen_ids  # fits exactly: untouched, EOS kept
    assert len(exact.prompt_ids) + len(exact.chosen_ids) == len(whole.prompt_ids) + len(whole.chosen_ids)


def test_eos_is_appended_when_the_template_omits_it(tok):
    tp = _tokenize(ROW, _with_template(tok, NO_EOS_TEMPLATE))
    assert tok.decode(tp.chosen_ids) == "1 2 3 </s>"


def test_whitespace_after_eos_is_dropped():
    class Decoder:
        pieces = {1: "a", 2: "</s>", 3: "\n", 4: "b"}

        def decode(self, ids):
            return "".join(self.pieces[i] for i in ids)

    assert _end_with_eos([1, 2, 3], 2, Decoder()) == [1, 2]  # "<|im_end|>\n" style
    assert _end_with_eos([1, 2], 2, Decoder()) == [1, 2]
    assert _end_with_eos([1, 2, 4], 2, Decoder()) == [1, 2, 4, 2]
    assert _end_with_eos([1, 4], 2, Decoder()) == [1, 4, 2]


def test_dict_return_of_apply_chat_template_is_handled(tok):
    class DictTokenizer:
        eos_token_id = tok.eos_token_id

        def apply_chat_template(self, messages, **kwargs):
            kwargs.pop("return_dict", None)
            kwargs.pop("sanitize_control_tokens", None)
            return tok.apply_chat_template(messages, return_dict=True, **kwargs)

    assert _tokenize(ROW, DictTokenizer()) == _tokenize(ROW, tok)


@pytest.mark.skipif(not _supports_sanitize(PreTrainedTokenizerBase), reason="needs transformers sanitize support")
def test_control_tokens_in_content_are_text(tok):
    tp = _tokenize({**ROW, "chosen": "1 </s> 2"}, tok)
    assert tp.chosen_ids.count(tok.eos_token_id) == 1 and tp.chosen_ids[-1] == tok.eos_token_id


@pytest.mark.parametrize(
    "row,template,kwargs,code",
    [
        pytest.param(ROW, NON_PREFIX_TEMPLATE, {}, "template_not_prefix", id="template_not_prefix"),
        pytest.param(
            {
                "prompt": [{"role": "system", "content": "sort"}, {"role": "user", "content": "3 1 2"}],
                "chosen": "1 2 3",
                "rejected": "1 3 2",
            },
            "no-system",
            {},
            "template_error",
            id="template_error",
        ),
        pytest.param(
            {**STRINGS, "prompt": LONG_PROMPT},
            None,
            {"max_length": 12, "max_prompt_length": 12},
            "empty_completion",
            id="empty_completion-no-room",
        ),
        pytest.param({**ROW, "rejected": "1 2 3"}, None, {}, "identical_after_truncation", id="identical"),
        pytest.param(
            {**ROW, "chosen": "1 2 3 4", "rejected": "1 2 3 5"},
            None,
            {"max_length": 12, "max_prompt_length": 9},
            "identical_after_truncation",
            id="identical_after_truncation",
        ),
        pytest.param(
            {**STRINGS, "prompt": LONG_PROMPT}, None, {"max_tokens_per_microbatch": 60}, "pair_too_long", id="too-long"
        ),
    ],
)
def test_tokenization_reason_codes(tok, row, template, kwargs, code):
    if template == "no-system":
        template = NO_SYSTEM_TEMPLATE + tok.chat_template
    tokenizer = tok if template is None else _with_template(tok, template)
    with pytest.raises(PreferenceRowError) as info:
        _tokenize(row, tokenizer, **kwargs)
    assert info.value.reason_code == code


def test_pair_too_long_boundary(tok):
    cost = _tokenize(ROW, tok).cost
    assert _tokenize(ROW, tok, max_tokens_per_microbatch=cost).cost == cost
    with pytest.raises(PreferenceRowError, match="pair_too_long"):
        _tokenize(ROW, tok, max_tokens_per_microbatch=cost - 1)


@pytest.mark.parametrize("kwargs", [{"max_length": 0}, {"max_prompt_length": -1}, {"max_tokens_per_microbatch": 0}])
def test_bad_lengths(tok, kwargs):
    with pytest.raises(ConfigError) as info:
        _tokenize(ROW, tok, **kwargs)
    assert info.value.reason_code == "bad_length"


def test_tokenizer_without_eos(tok):
    class NoEos:
        eos_token_id = None

    with pytest.raises(ConfigError) as info:
        _tokenize(ROW, NoEos())
    assert info.value.reason_code == "bad_tokenizer"


def test_tokenize_dataset_counts_rejections(tok):
    rows = [
        ROW,
        {"prompt": "p"},
        {**ROW, "rejected": "1 2 3"},
        {**ROW, "chosen": [{"role": "gpt", "content": "x"}]},
        {**STRINGS, "prompt": LONG_PROMPT * 3},
        {"prompt": "p", "chosen": ""},
    ]
    result = tokenize_dataset(
        rows, tok, max_length=256, max_prompt_length=128, max_tokens_per_microbatch=80, keep_pairs=True
    )
    assert result.num_rows == 6 and result.num_accepted == 1 and result.row_indices == [0]
    assert result.features == [_tokenize(ROW, tok).to_features()]
    assert result.pairs == [normalize_row(ROW)] and result.renderings == Counter(conversations=1)
    assert result.rejections == Counter(schema=2, identical_after_truncation=1, role=1, pair_too_long=1)
    assert result.examples["schema"].startswith("dataset row 1: ")
    with pytest.raises(PreferenceRowError) as info:
        tokenize_dataset(rows, tok, max_length=256, max_prompt_length=128, strict=True, desc="x.jsonl")
    assert info.value.reason_code == "schema" and info.value.message.startswith("x.jsonl row 1: ")


def test_tokenize_dataset_accepts_a_datasets_dataset(tok):
    rows = [ROW, {**ROW, "chosen": "3 2 1"}]
    result = tokenize_dataset(datasets.Dataset.from_list(rows), tok, max_length=64, max_prompt_length=32)
    assert result.num_accepted == 2 and not result.rejections and result.pairs is None


def test_pair_costs(tok):
    pairs = [_tokenize({**ROW, "chosen": " ".join(str(i) for i in range(n))}, tok) for n in (1, 5, 9)]
    features = [p.to_features() for p in pairs]
    expected = [p.cost for p in pairs]
    assert pair_costs(features) == expected
    dataset = datasets.Dataset.from_list(features)
    assert pair_costs(dataset) == expected
    assert pair_costs(dataset.select([2, 0])) == [expected[2], expected[0]]
    with pytest.raises(KeyError):
        pair_costs(dataset.remove_columns("chosen_input_ids"))


def test_docstring_examples():
    assert doctest.testmod(tokenize_module).failed == 0
