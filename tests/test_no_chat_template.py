"""Plain strings are raw text; a tokenizer without a chat template (a base model) refuses only conversations.

Plain ``prompt`` / ``chosen`` / ``rejected`` strings are tokenised by concatenation, as TRL 1.16's non-conversational
path does, with or without a chat template; message rows without a template get ``no_chat_template`` naming the fix,
in the trainer and in ``prepare-data``.
"""

from __future__ import annotations

import copy
import json
import types

import datasets
import pytest
from transformers import AutoTokenizer

from pair_dpo_trainer import PairDPOTrainer
from pair_dpo_trainer.cli import main as cli_main
from pair_dpo_trainer.data.normalize import normalize_row
from pair_dpo_trainer.data.tokenize import tokenize_dataset, tokenize_pair
from pair_dpo_trainer.demo import bundled_model_dir
from pair_dpo_trainer.demo.pairs import generate_demo_pairs
from pair_dpo_trainer.errors import PreferenceRowError
from tests.dpo_fixtures import cpu_config

MESSAGE_ROW = {
    "prompt": [{"role": "user", "content": "sort ascending: 3 1 2"}],
    "chosen": [{"role": "assistant", "content": "1 2 3"}],
    "rejected": [{"role": "assistant", "content": "1 3 2"}],
}
HH_ROW = {"chosen": "\n\nHuman: 3 1 2\n\nAssistant: 1 2 3", "rejected": "\n\nHuman: 3 1 2\n\nAssistant: 1 3 2"}


@pytest.fixture(scope="module")
def base_tok():
    tok = AutoTokenizer.from_pretrained(bundled_model_dir())
    tok.chat_template = None
    return tok


def plain_rows(n: int, seed: int = 0, sep: str = "") -> list[dict]:
    return [
        {
            "prompt": r["prompt"][0]["content"] + sep,
            "chosen": r["chosen"][0]["content"],
            "rejected": r["rejected"][0]["content"],
        }
        for r in generate_demo_pairs(seed=seed, n=n)
    ]


TEMPLATED = {"apply_chat_template_to_strings": True}


def _tokenize(row, tok):
    return tokenize_pair(normalize_row(row), tok, max_length=1024, max_prompt_length=512)


def test_plain_rows_are_tokenised_by_concatenation(base_tok):
    row = {"prompt": "sort ascending: 3 1 2 ", "chosen": "1 2 3", "rejected": "1 3 2"}
    tp = _tokenize(row, base_tok)
    prompt_ids = base_tok(row["prompt"])["input_ids"]
    assert list(tp.prompt_ids) == prompt_ids  # the boundary here is a token boundary
    for completion, ids in ((row["chosen"], tp.chosen_ids), (row["rejected"], tp.rejected_ids)):
        full = base_tok(row["prompt"] + completion)["input_ids"]
        assert list(tp.prompt_ids) + list(ids) == full + [base_tok.eos_token_id]


def test_tokens_merging_across_the_boundary_start_the_completion(base_tok):
    row = {"prompt": "sort ascending: 3 1 2 11", "chosen": "1 2 3", "rejected": "1 3 2"}  # "11" + "1..." merge
    tp = _tokenize(row, base_tok)
    prompt_ids = base_tok(row["prompt"])["input_ids"]
    assert len(tp.prompt_ids) < len(prompt_ids) and list(tp.prompt_ids) == prompt_ids[: len(tp.prompt_ids)]
    full = base_tok(row["prompt"] + row["chosen"])["input_ids"]
    assert list(tp.prompt_ids) + list(tp.chosen_ids) == full + [base_tok.eos_token_id]  # the sequence is the text's


def test_special_token_strings_inside_the_text_stay_text(base_tok):
    tp = _tokenize({"prompt": "sort: 2 1 ", "chosen": "1 </s> 2", "rejected": "2 1"}, base_tok)
    assert tp.chosen_ids.count(base_tok.eos_token_id) == 1 and tp.chosen_ids[-1] == base_tok.eos_token_id


def test_truncation_follows_the_same_rule(base_tok):
    row = plain_rows(1)[0]
    full = _tokenize(row, base_tok)
    cut = tokenize_pair(normalize_row(row), base_tok, max_length=12, max_prompt_length=6)
    assert cut.prompt_ids == full.prompt_ids[-6:]
    assert cut.chosen_ids == full.chosen_ids[:6] and cut.chosen_ids[-1] != base_tok.eos_token_id


@pytest.mark.parametrize("row", [MESSAGE_ROW, {**MESSAGE_ROW, "chosen": "1 2 3", "rejected": "1 3 2"}])
def test_message_rows_need_a_template(base_tok, row):
    with pytest.raises(PreferenceRowError) as info:
        _tokenize(row, base_tok)
    assert info.value.reason_code == "no_chat_template"
    assert "chat_template" in info.value.message and "plain strings" in info.value.message


def test_transcripts_are_plain_strings_and_the_template_option_needs_a_template(base_tok):
    tp = _tokenize(HH_ROW, base_tok)  # TRL's extract_prompt: the shared text is the prompt, raw text
    assert normalize_row(HH_ROW).prompt_messages[0]["content"] == "\n\nHuman: 3 1 2\n\nAssistant: 1"
    assert tp.rendering == "strings_raw" and base_tok.decode(tp.chosen_ids) == "2 3 </s>"
    with pytest.raises(PreferenceRowError) as info:
        tokenize_pair(normalize_row(HH_ROW), base_tok, max_length=64, max_prompt_length=32, **TEMPLATED)
    assert info.value.reason_code == "no_chat_template" and "apply_chat_template_to_strings" in info.value.message


def test_the_trainer_fails_closed_on_a_message_row_and_trains_on_plain_rows(tmp_path, base_tok):
    model_dir = str(bundled_model_dir())
    args = cpu_config(tmp_path, max_steps=1, per_device_train_batch_size=2, gradient_accumulation_steps=1)
    with pytest.raises(PreferenceRowError) as info:
        PairDPOTrainer(
            model=model_dir, args=args, train_dataset=[*plain_rows(3), MESSAGE_ROW], processing_class=base_tok
        )
    assert info.value.reason_code == "no_chat_template" and "train dataset row 3" in info.value.message
    trainer = PairDPOTrainer(model=model_dir, args=args, train_dataset=plain_rows(8), processing_class=base_tok)
    assert trainer.train().global_step == 1


def test_prepare_data_counts_message_rows_and_keeps_plain_rows(tmp_path, base_tok, capsys):
    tokenizer_dir = tmp_path / "base-tokenizer"
    base_tok.save_pretrained(tokenizer_dir)
    assert not (tokenizer_dir / "chat_template.jinja").exists()
    source = tmp_path / "rows.jsonl"
    rows = [*plain_rows(20), MESSAGE_ROW, HH_ROW]
    source.write_text("".join(json.dumps(r) + "\n" for r in rows))
    out = tmp_path / "out"
    argv = ["prepare-data", str(source), "--output", str(out), "--tokenizer", str(tokenizer_dir), "--disable-tqdm"]
    assert cli_main([*argv, "--train-size", "15", "--eval-size", "5", "--seed", "0"]) == 0
    manifest = json.loads((out / "manifest.json").read_text())
    assert manifest["rejections"] == {"no_chat_template": 1}  # the message row; the transcripts are text
    assert manifest["renderings"] == {"strings_raw": 21} and manifest["apply_chat_template_to_strings"] is False
    assert manifest["tokenizer"]["chat_template_sha256"] is None
    written = [json.loads(line) for line in (out / "train.jsonl").read_text().splitlines()]
    for row in written:
        assert isinstance(row["prompt"], str)  # plain rows stay plain strings
        tokens = _tokenize(row, base_tok)
        assert tokens.to_features() == {k: row[k] for k in tokens.to_features()}
    assert "[no_chat_template] rows.jsonl row 21:" in capsys.readouterr().out


@pytest.mark.parametrize("template", [False, True])
@pytest.mark.parametrize("sep", ["", " "])
def test_same_ids_as_trl(base_tok, sep, template):
    """TRL never applies the chat template to plain strings; neither do we, with or without one."""
    trl = pytest.importorskip("trl")
    if template:
        base_tok = AutoTokenizer.from_pretrained(bundled_model_dir())
        assert base_tok.chat_template
    rows = plain_rows(12, seed=3, sep=sep)
    config = trl.DPOConfig(output_dir="unused", max_length=None, report_to="none", use_cpu=True, bf16=False)
    fake_trainer = types.SimpleNamespace(_tokenizer=base_tok)  # all that _prepare_dataset reads from self
    datasets.disable_progress_bars()
    try:
        prepared = trl.DPOTrainer._prepare_dataset(
            fake_trainer, datasets.Dataset.from_list(rows), base_tok, config, "train"
        )
    finally:
        datasets.enable_progress_bars()
    ours = tokenize_dataset(rows, base_tok, max_length=4096, max_prompt_length=2048, strict=True)
    assert ours.num_accepted == len(rows)
    for theirs, mine in zip(prepared, ours.features, strict=True):
        assert mine == {
            "prompt_input_ids": theirs["prompt_ids"],
            "chosen_input_ids": theirs["chosen_ids"],
            "rejected_input_ids": theirs["rejected_ids"],
        }


def test_the_template_renders_plain_rows_only_when_asked(base_tok):
    templated = AutoTokenizer.from_pretrained(bundled_model_dir())
    row = plain_rows(1)[0]
    assert _tokenize(row, templated) == _tokenize(row, copy.deepcopy(base_tok))  # raw text either way
    with_template = tokenize_pair(normalize_row(row), templated, max_length=1024, max_prompt_length=512, **TEMPLATED)
    messages = normalize_row(row).prompt_messages
    expected = templated.apply_chat_template([dict(m) for m in messages], add_generation_prompt=True, return_dict=False)
    assert list(with_template.prompt_ids) == expected and with_template.rendering == "strings_templated"
