"""One bad row never crashes a run.

A lone surrogate (``"\\ud800"``, valid JSON) is ``bad_text``, not a tokenizer ``TypeError``; JSON nested past the
parser's limit is ``bad_json``, not a ``RecursionError``; the Arrow reader keeps the surrogate (a row is never accepted
altered). ``prepare-data`` counts such rows, the trainer fails closed with the code, and the
JSON-lines and Arrow / parquet paths give the same verdict. A property test feeds arbitrary JSON values and unicode
through normalise + tokenise: only ``PreferenceRowError`` may escape.
"""

from __future__ import annotations

import copy
import json
import string
from collections import Counter

import datasets
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from transformers import AutoTokenizer

from pair_dpo_trainer import PairDPOTrainer
from pair_dpo_trainer.cli import main as cli_main
from pair_dpo_trainer.data.normalize import MAX_ROW_DEPTH, ROLES, normalize_row
from pair_dpo_trainer.data.readers import _load_json_values, _load_with_datasets, load_rows
from pair_dpo_trainer.data.splits import load_train_eval
from pair_dpo_trainer.data.tokenize import tokenize_dataset, tokenize_pair
from pair_dpo_trainer.demo import bundled_model_dir
from pair_dpo_trainer.demo.pairs import generate_demo_pairs
from pair_dpo_trainer.errors import PreferenceRowError
from tests.dpo_fixtures import cpu_config
from tests.models import tiny_llama

GOOD = {"prompt": "sort ascending: 3 1 2", "chosen": "1 2 3", "rejected": "1 3 2"}
# JSON text of rows, written as they are to the files (json.dumps would escape the surrogate the same way)
SURROGATE_TOP = '{"prompt": "sort \\ud800 3 1 2", "chosen": "1 2 3", "rejected": "1 3 2"}'
SURROGATE_NESTED = '{"prompt": [{"role": "user", "content": "hi\\ud800"}], "chosen": "1 2 3", "rejected": "1 3 2"}'
SURROGATE_LOW = '{"prompt": "x", "chosen": "1 2 \\udc00", "rejected": "1 3 2"}'
VALID_PAIR = '{"prompt": "smile \\ud83d\\ude00", "chosen": "1 2 3", "rejected": "1 3 2"}'  # an escaped emoji: fine


def _nested(depth: int) -> str:
    return "[" * depth + "]" * depth


def _deep_row(depth: int, field: str = "chosen") -> str:
    row = {"prompt": "p", "chosen": " 1 2 3", "rejected": " 1 3 2"}  # raw text: "p" stays a token of its own
    text = json.dumps({**row, field: "@"})
    return text.replace('"@"', _nested(depth))


@pytest.fixture(scope="module")
def tok():
    return AutoTokenizer.from_pretrained(bundled_model_dir())


def _demo_lines(n: int, seed: int = 0) -> list[str]:
    return [json.dumps(r) for r in generate_demo_pairs(seed=seed, n=n)]


def _verdicts(rows, tok) -> list[str]:
    """``ok`` or the reason code of every row, in order."""
    out = []
    for row in rows:
        try:
            tokenize_pair(normalize_row(row), tok, max_length=256, max_prompt_length=128)
            out.append("ok")
        except PreferenceRowError as exc:
            out.append(exc.reason_code)
    return out


def test_a_lone_surrogate_fails_the_trainer_closed_with_bad_text(tmp_path, tok):
    rows = [*generate_demo_pairs(seed=1, n=3), json.loads(SURROGATE_TOP)]
    args = cpu_config(tmp_path, per_device_train_batch_size=2, gradient_accumulation_steps=1)
    with pytest.raises(PreferenceRowError) as info:
        PairDPOTrainer(model=tiny_llama(0), args=args, train_dataset=rows, processing_class=tok)
    assert info.value.reason_code == "bad_text"
    assert "train dataset row 3" in info.value.message and "'\\ud800'" in info.value.message


def test_deep_nesting_fails_the_trainer_closed_with_bad_json(tmp_path, tok):
    deep: list = []
    for _ in range(50_000):  # far past Python's recursion limit; checked without recursion
        deep = [deep]
    rows = [*generate_demo_pairs(seed=1, n=3), {**GOOD, "meta": deep}]
    args = cpu_config(tmp_path, per_device_train_batch_size=2, gradient_accumulation_steps=1)
    with pytest.raises(PreferenceRowError) as info:
        PairDPOTrainer(model=tiny_llama(0), args=args, train_dataset=rows, processing_class=tok)
    assert info.value.reason_code == "bad_json" and "train dataset row 3" in info.value.message


def test_prepare_data_counts_bad_rows_and_keeps_the_rest(tmp_path, tok, capsys):
    lines = [
        *_demo_lines(30),
        SURROGATE_TOP,
        SURROGATE_NESTED,
        SURROGATE_LOW,
        VALID_PAIR,
        _deep_row(5000),
        _deep_row(500, "meta"),
    ]
    source = tmp_path / "rows.jsonl"
    source.write_text("\n".join(lines) + "\n", encoding="utf-8")
    out = tmp_path / "out"
    argv = ["prepare-data", str(source), "--output", str(out), "--tokenizer", str(bundled_model_dir())]
    assert cli_main([*argv, "--train-size", "25", "--eval-size", "5", "--seed", "0", "--disable-tqdm"]) == 0
    manifest = json.loads((out / "manifest.json").read_text())
    assert manifest["accepted"] == 31 and manifest["rejections"] == {"bad_json": 2, "bad_text": 3}
    printed = capsys.readouterr().out
    assert "[bad_text] rows.jsonl row 31:" in printed and "[bad_json] rows.jsonl row 35:" in printed


def test_the_single_file_path_of_train_py_names_the_bad_row(tmp_path):
    source = tmp_path / "rows.jsonl"
    source.write_text("\n".join([*_demo_lines(5), SURROGATE_NESTED]) + "\n", encoding="utf-8")
    with pytest.raises(PreferenceRowError) as info:
        load_train_eval(source, eval_size=1, seed=0)
    assert info.value.reason_code == "bad_text" and info.value.message.startswith(f"{source} line 6: ")


@pytest.mark.parametrize("eval_size", ["auto", 0, 3])
def test_a_bad_row_is_named_by_its_file_line_whatever_the_split(tmp_path, tok, eval_size):
    """A duplicate pair (chosen == rejected) on file line 6, after a blank line: its index in the train or eval split
    (or, with no split, in the file's rows) is not 6; the message names line 6 either way."""
    lines = _demo_lines(8)
    same = json.loads(lines[4])
    lines[4] = json.dumps({**same, "rejected": same["chosen"]})
    source = tmp_path / "pairs.jsonl"
    source.write_text("\n".join([*lines[:3], "", *lines[3:]]) + "\n", encoding="utf-8")  # the duplicate: line 6
    split = load_train_eval(source, eval_size=eval_size, seed=0)
    args = cpu_config(tmp_path, per_device_train_batch_size=2, gradient_accumulation_steps=1)
    with pytest.raises(PreferenceRowError) as info:
        PairDPOTrainer(
            model=str(bundled_model_dir()),
            args=args,
            train_dataset=split.train,
            eval_dataset=split.eval or None,
            processing_class=tok,
        )
    assert info.value.reason_code == "identical_after_truncation"
    assert info.value.message.startswith(f"{source} line 6 (")


def test_a_schema_error_names_the_file_line(tmp_path):
    source = tmp_path / "no_rejected.jsonl"
    source.write_text("\n" + json.dumps({"prompt": "p", "chosen": "c"}) + "\n", encoding="utf-8")
    with pytest.raises(PreferenceRowError) as info:
        load_train_eval(source, eval_size=0, seed=0)
    assert info.value.reason_code == "schema" and info.value.message.startswith(f"{source} line 2: ")


MIXED_TYPES = [  # 'chosen' is a message list in one row and a string in the others
    json.dumps({"prompt": "2+2?", "chosen": [{"role": "assistant", "content": "4"}], "rejected": "5"}),
    json.dumps({"prompt": "2+2?", "chosen": "4", "rejected": "5"}),
    json.dumps({"prompt": "what is void?", "chosen": "null", "rejected": "1 2"}),
    json.dumps({"prompt": [{"role": "user", "content": "list?"}], "chosen": "[1, 2]", "rejected": "[2, 1]"}),
]


@pytest.mark.parametrize(
    "lines,expected,arrow_alters",
    [
        pytest.param([SURROGATE_NESTED, VALID_PAIR], ["bad_text", "ok"], True, id="text-nested"),
        pytest.param([SURROGATE_TOP, SURROGATE_LOW, VALID_PAIR], ["bad_text"] * 2 + ["ok"], False, id="text-top"),
        pytest.param(
            [_deep_row(60, "meta"), _deep_row(500), _deep_row(990, "meta"), _deep_row(1000), _deep_row(1100)],
            ["ok"] + ["bad_json"] * 4,
            False,
            id="nesting",
        ),
        pytest.param(MIXED_TYPES, ["ok"] * 4, True, id="mixed-types"),
    ],
)
def test_jsonl_and_arrow_readers_give_the_same_verdict(tmp_path, tok, lines, expected, arrow_alters):
    source = tmp_path / "rows.jsonl"
    source.write_text("\n".join([*_demo_lines(3), *lines]) + "\n", encoding="utf-8")
    expected = ["ok"] * 3 + expected
    assert _verdicts(load_rows(str(source), str(tmp_path / "cache")), tok) == expected
    assert _verdicts(_load_json_values(str(source)), tok) == expected  # the exact reader
    try:
        arrow = _load_with_datasets(str(source), "json", str(tmp_path / "arrow-cache"))
    except Exception:  # Arrow cannot read every file: load_rows then reads it as JSON lines
        assert not arrow_alters
        return
    # what load_rows avoids where Arrow alters rows: the surrogate inside a message deleted (the row then passes),
    # "4" / "null" / "[1, 2]" of a mixed-type field turned into a number / None / a list (the rows then fail)
    assert (_verdicts(arrow, tok) != expected) is arrow_alters


def test_a_parquet_row_that_does_not_decode_is_bad_text(tmp_path, tok):
    texts = [b"sort ascending: 2 1", b"sort ascending: 3 \xed\xa0\x80 1", b"sort ascending: 5 4"]
    valid = pa.array(texts, type=pa.binary())
    prompts = pa.Array.from_buffers(pa.string(), len(texts), valid.buffers())  # invalid UTF-8 in row 2
    table = pa.table({"prompt": prompts, "chosen": ["1 2", "1 3", "4 5"], "rejected": ["2 1", "3 1", "5 4"]})
    path = tmp_path / "rows.parquet"
    pq.write_table(table, path)
    rows = load_rows(str(path), str(tmp_path / "cache"))
    assert isinstance(rows, datasets.Dataset)
    result = tokenize_dataset(rows, tok, max_length=64, max_prompt_length=32, desc="rows.parquet", first_row=1)
    assert result.row_indices == [0, 2] and result.rejections == Counter(bad_text=1)
    assert result.first_rejection.startswith("[bad_text] rows.parquet row 2: its text is not valid UTF-8")
    args = cpu_config(tmp_path, per_device_train_batch_size=1, gradient_accumulation_steps=1)
    with pytest.raises(PreferenceRowError) as info:
        PairDPOTrainer(model=tiny_llama(0), args=args, train_dataset=rows, processing_class=tok)
    assert info.value.reason_code == "bad_text"


def test_invalid_utf8_in_a_jsonl_file_is_one_file_level_message_from_both_readers(tmp_path):
    source = tmp_path / "rows.jsonl"
    data = ("\n".join(_demo_lines(3)) + "\n").encode()
    nested = json.dumps({"prompt": [{"role": "user", "content": "@"}], "chosen": "1", "rejected": "2"}).encode()
    source.write_bytes(data + nested.replace(b"@", b"caf\xe9") + b"\n")
    from pair_dpo_trainer.data.readers import InputError

    with pytest.raises(InputError) as info:
        load_rows(str(source), str(tmp_path / "cache"))  # Arrow would read it and fail later, at that row
    assert "line 4 is not UTF-8" in str(info.value)


# ------------------------------------------------------------------------------------------------ property test

ANY_TEXT = st.text(st.characters(), max_size=24)  # every code point, lone surrogates included
TEXT = st.one_of(
    ANY_TEXT,
    st.sampled_from(["", " ", "</s>", "<|assistant|>", "\n\nHuman: hi", "\n\nAssistant:", "\ud800", "1 2 3"]),
    st.text(string.digits + " ", max_size=16),
)
SCALARS = st.one_of(st.none(), st.booleans(), st.integers(), st.floats(allow_nan=True), TEXT)
JSON_VALUES = st.recursive(
    SCALARS, lambda inner: st.lists(inner, max_size=4) | st.dictionaries(TEXT, inner, max_size=4)
)
MESSAGE = st.fixed_dictionaries(
    {"role": st.one_of(st.sampled_from(ROLES), TEXT, JSON_VALUES), "content": st.one_of(TEXT, JSON_VALUES)}
)
FIELD = st.one_of(TEXT, st.lists(MESSAGE, max_size=3), JSON_VALUES)
ROW = st.one_of(
    JSON_VALUES,
    st.fixed_dictionaries({"prompt": FIELD, "chosen": FIELD, "rejected": FIELD}, optional={"extra": JSON_VALUES}),
    st.fixed_dictionaries({"chosen": TEXT.map(lambda t: f"\n\nHuman: {t}\n\nAssistant: a"), "rejected": TEXT}),
    st.integers(MAX_ROW_DEPTH - 2, 3 * MAX_ROW_DEPTH).map(lambda d: {**GOOD, "extra": json.loads(_nested(d))}),
)
LIMITS = st.integers(2, 96).flatmap(lambda length: st.tuples(st.just(length), st.integers(1, length - 1)))


@pytest.fixture(scope="module")
def tokenizers(tok):
    base = copy.deepcopy(tok)
    base.chat_template = None
    return {"template": tok, "no-template": base}


@pytest.mark.integration
@settings(max_examples=400, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(row=ROW, limits=LIMITS, which=st.sampled_from(["template", "no-template"]))
def test_only_preference_row_errors_escape_normalise_and_tokenise(tokenizers, row, limits, which):
    max_length, max_prompt_length = limits
    try:
        pair = normalize_row(row)
        tp = tokenize_pair(pair, tokenizers[which], max_length=max_length, max_prompt_length=max_prompt_length)
    except PreferenceRowError as exc:
        assert exc.reason_code and str(exc).startswith(f"[{exc.reason_code}] ")
        return
    assert len(tp.prompt_ids) <= max_prompt_length
    assert len(tp.prompt_ids) + max(len(tp.chosen_ids), len(tp.rejected_ids)) <= max_length
    assert tp.chosen_ids != tp.rejected_ids and tp.chosen_ids and tp.rejected_ids


@pytest.mark.integration
@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(rows=st.lists(ROW, max_size=6))
def test_tokenize_dataset_counts_every_arbitrary_row(tokenizers, rows):
    result = tokenize_dataset(rows, tokenizers["template"], max_length=64, max_prompt_length=32)
    assert result.num_rows == len(rows) == result.num_accepted + sum(result.rejections.values())


def test_the_property_test_reaches_both_outcomes(tokenizers):
    """Guards the strategies: accepted rows and each new code do occur."""
    assert _verdicts([GOOD], tokenizers["template"]) == ["ok"]
    assert _verdicts([json.loads(SURROGATE_TOP), {**GOOD, "x": json.loads(_nested(200))}], tokenizers["template"]) == [
        "bad_text",
        "bad_json",
    ]
