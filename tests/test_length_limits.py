"""The same length limits on every input path (raw rows, pre-tokenised rows, prepared directories).

The issue's scenario: with ``max_length=32, max_prompt_length=16`` no collated batch may hold a longer sequence or
prompt, whatever the input path; pre-tokenised and prepared rows are truncated by the raw rows' rule; a prepared
directory is refused with another tokenizer or looser limits.
"""

from __future__ import annotations

import copy
import json
import logging
import random
import shutil
import sys
from collections import Counter
from pathlib import Path

import datasets
import pytest
from transformers import AutoTokenizer

from pair_dpo_trainer import PairDPOTrainer
from pair_dpo_trainer.cli import main as cli_main
from pair_dpo_trainer.data.fingerprint import tokenizer_fingerprint
from pair_dpo_trainer.data.normalize import normalize_row
from pair_dpo_trainer.data.prepared import load_prepared
from pair_dpo_trainer.data.splits import load_train_eval
from pair_dpo_trainer.data.tokenize import FEATURE_COLUMNS, tokenize_pair
from pair_dpo_trainer.demo import bundled_model_dir
from pair_dpo_trainer.errors import ConfigError
from tests.dpo_fixtures import cpu_config
from tests.models import tiny_llama

MAX_LENGTH, MAX_PROMPT = 32, 16
# The fingerprint of the bundled tokenizer (definition: pair_dpo_trainer/data/fingerprint.py). It changes only if
# the definition or the bundled tokenizer changes: either is a format change for every prepared directory.
BUNDLED_FINGERPRINT = "fe9fdac3dc8c76ec67781d86f34feb7a83f220e90d0af98162271a04034086f0"


@pytest.fixture(scope="module")
def tok():
    return AutoTokenizer.from_pretrained(bundled_model_dir())


def long_rows(n: int, seed: int = 0) -> list[dict]:
    """Rows whose prompts (~60 tokens) and completions (~60 tokens) exceed 16 / 32 tokens; the completions differ in
    their first tokens, so they stay different after any cut."""
    rng = random.Random(seed)
    rows = []
    for _ in range(n):
        numbers = rng.sample(range(1, 99), 34)
        ordered = sorted(numbers)
        swapped = [ordered[1], ordered[0], *ordered[2:]]
        rows.append(
            {
                "prompt": "sort ascending: " + " ".join(map(str, numbers)),
                "chosen": " ".join(map(str, ordered)),
                "rejected": " ".join(map(str, swapped)),
            }
        )
    return rows


def _trainer(tmp_path, train, tokenizer, eval_=None, **overrides) -> PairDPOTrainer:
    args = cpu_config(tmp_path, max_length=MAX_LENGTH, max_prompt_length=MAX_PROMPT, **overrides)
    return PairDPOTrainer(
        model=tiny_llama(0, len(tokenizer)),
        args=args,
        train_dataset=train,
        eval_dataset=eval_,
        processing_class=tokenizer,
    )


def _sequence_lengths(batch) -> list[tuple[int, int]]:
    """``(sequence length, prompt length)`` of every sequence of a packed batch (the pad segment left out), in either
    layout: a sequence is its key segment (the rows ``kv_index`` gathers when prompts are shared)."""
    shared = batch.shares_prompt
    bounds = (batch.cu_seqlens_k if shared else batch.cu_seqlens).tolist()[: batch.num_sequences + 1]
    rows = batch.kv_index.tolist() if shared else list(range(batch.num_tokens))
    first_scored: dict[int, int] = {}
    for row, sequence in zip(batch.completion_positions.tolist(), batch.scored_sequences().tolist(), strict=True):
        first_scored.setdefault(sequence, row)
    out = []
    for sequence, (start, end) in enumerate(zip(bounds[:-1], bounds[1:], strict=True)):
        # labels are shifted: the last prompt position scores the first completion token
        out.append((end - start, rows[start:end].index(first_scored[sequence]) + 1))
    return out


def _assert_batches_within_limits(trainer: PairDPOTrainer) -> int:
    loaders = [trainer.get_train_dataloader()]
    if trainer.eval_dataset is not None:
        loaders.append(trainer.get_eval_dataloader())
    lengths = [pair for loader in loaders for batch in loader for pair in _sequence_lengths(batch)]
    assert lengths, "no batch was collated"
    assert max(length for length, _ in lengths) <= MAX_LENGTH
    assert max(prompt for _, prompt in lengths) <= MAX_PROMPT
    return len(lengths)


def _untruncated_lengths(rows, tok) -> tuple[int, int]:
    pairs = [tokenize_pair(normalize_row(r), tok, max_length=4096, max_prompt_length=2048) for r in rows]
    return max(len(p.prompt_ids) + len(p.chosen_ids) for p in pairs), max(len(p.prompt_ids) for p in pairs)


def _expected_features(rows, tok) -> list[dict]:
    """The raw rows' truncation, computed independently of the trainer."""
    return [
        tokenize_pair(normalize_row(r), tok, max_length=MAX_LENGTH, max_prompt_length=MAX_PROMPT).to_features()
        for r in rows
    ]


def test_the_rows_of_these_tests_exceed_the_limits(tok):
    longest, longest_prompt = _untruncated_lengths(long_rows(16), tok)
    assert longest > 2 * MAX_LENGTH and longest_prompt > 2 * MAX_PROMPT


def test_raw_rows_are_truncated_in_every_batch(tmp_path, tok):
    trainer = _trainer(tmp_path, long_rows(16), tok, eval_=long_rows(8, seed=1))
    assert _assert_batches_within_limits(trainer) == 2 * (16 + 8)


@pytest.mark.parametrize("container", ["list", "datasets"])
def test_pre_tokenised_rows_are_truncated_by_the_raw_rule(tmp_path, tok, container):
    rows = long_rows(16)
    untruncated = [tokenize_pair(normalize_row(r), tok, max_length=4096, max_prompt_length=2048) for r in rows]
    features = [{**p.to_features(), "note": i} for i, p in enumerate(untruncated)]
    dataset = datasets.Dataset.from_list(features) if container == "datasets" else features
    trainer = _trainer(tmp_path, dataset, tok, eval_=dataset)
    _assert_batches_within_limits(trainer)
    expected = _expected_features(rows, tok)
    for got, want, i in zip(trainer.train_dataset, expected, range(len(rows)), strict=True):
        assert {k: got[k] for k in want} == want  # prompt keeps its end, completions their start, cut: no EOS
        assert got["note"] == i  # other columns are kept
    assert all(f["chosen_input_ids"][-1] != tok.eos_token_id for f in expected)  # every completion here was cut


def test_pre_tokenised_rows_within_the_limits_are_passed_through(tmp_path, tok):
    short = [tokenize_pair(normalize_row(r), tok, max_length=32, max_prompt_length=16) for r in long_rows(16)]
    dataset = datasets.Dataset.from_list([p.to_features() for p in short])
    trainer = _trainer(tmp_path, dataset, tok)
    assert trainer.train_dataset is dataset  # nothing to cut: the Arrow dataset itself, not a copy


def test_named_eval_datasets_get_the_limits_too(tmp_path, tok):
    pre_tokenised = [
        tokenize_pair(normalize_row(r), tok, max_length=4096, max_prompt_length=2048).to_features()
        for r in long_rows(8, seed=2)
    ]
    trainer = _trainer(tmp_path, long_rows(16), tok, eval_={"raw": long_rows(8, seed=1), "ids": pre_tokenised})
    for name in ("raw", "ids"):
        lengths = [pair for batch in trainer.get_eval_dataloader(name) for pair in _sequence_lengths(batch)]
        assert len(lengths) >= 16 and max(length for length, _ in lengths) <= MAX_LENGTH
        assert max(prompt for _, prompt in lengths) <= MAX_PROMPT


def test_truncation_is_logged_once_per_dataset(tmp_path, tok, caplog):
    features = [
        tokenize_pair(normalize_row(r), tok, max_length=4096, max_prompt_length=2048).to_features()
        for r in long_rows(16)
    ]
    with caplog.at_level(logging.INFO, logger="pair_dpo_trainer.data.dataset"):
        _trainer(tmp_path, features, tok, eval_=long_rows(8, seed=1))
    messages = [r.getMessage() for r in caplog.records if "truncated" in r.getMessage()]
    assert messages == [
        "train dataset: truncated 16 of 16 pairs to max_length=32 / max_prompt_length=16 (prompts keep their end, "
        "completions their start; a cut completion has no EOS).",
        "eval dataset: truncated 8 of 8 pairs to max_length=32 / max_prompt_length=16 (prompts keep their end, "
        "completions their start; a cut completion has no EOS).",
    ]


# ------------------------------------------------------------------------------------------------ prepared directories


@pytest.fixture(scope="module")
def prepared(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("prepared")
    source = root / "rows.jsonl"
    source.write_text("".join(json.dumps(r) + "\n" for r in long_rows(30, seed=5)), encoding="utf-8")
    out = root / "out"
    argv = ["prepare-data", str(source), "--output", str(out), "--tokenizer", str(bundled_model_dir())]
    argv += ["--train-size", "20", "--eval-size", "8", "--seed", "0", "--max-length", "128"]
    assert cli_main([*argv, "--max-prompt-length", "64", "--disable-tqdm"]) == 0
    return out


def test_manifest_records_the_tokenizer_fingerprint_and_limits(prepared, tok):
    manifest = json.loads((prepared / "manifest.json").read_text())
    assert manifest["format"] == "pair_dpo_trainer.prepare-data/5"
    assert manifest["tokenizer"]["fingerprint"] == tokenizer_fingerprint(tok)
    assert (manifest["max_length"], manifest["max_prompt_length"]) == (128, 64)


def test_prepared_dir_is_truncated_to_tighter_limits(tmp_path, tok, prepared):
    split = load_train_eval(prepared, eval_size=0, seed=0)
    train, eval_ = split.train, split.eval
    assert max(len(r["prompt_input_ids"]) for r in train) > MAX_PROMPT  # prepared at 128 / 64: longer than the run's
    trainer = _trainer(tmp_path, train, tok, eval_=eval_)
    _assert_batches_within_limits(trainer)
    # the same rows as a preparation with the run's limits would hold
    got = [{column: f[column] for column in FEATURE_COLUMNS} for f in trainer.train_dataset]
    assert got == _expected_features(train, tok)


@pytest.mark.parametrize(
    "max_length,max_prompt_length,named",
    [
        (256, 64, "max_length=256 > 128"),
        (128, 100, "max_prompt_length=100 > 64"),
        (120, 32, "completion room max_length - max_prompt_length = 88 > 64"),
    ],
)
def test_prepared_dir_with_looser_limits_is_refused(tmp_path, tok, prepared, max_length, max_prompt_length, named):
    train = load_prepared(prepared, "train")
    with pytest.raises(ConfigError) as info:
        PairDPOTrainer(
            model=tiny_llama(0),
            args=cpu_config(tmp_path, max_length=max_length, max_prompt_length=max_prompt_length),
            train_dataset=train,
            processing_class=tok,
        )
    assert info.value.reason_code == "limits_looser_than_prepared"
    message = info.value.message
    assert named in message and "re-run `pair-dpo prepare-data" in message.lower()
    assert f"--max-length {max_length} --max-prompt-length {max_prompt_length}" in message


def test_prepared_dir_with_another_tokenizer_is_refused(tmp_path, tok, prepared):
    other = copy.deepcopy(tok)
    other.chat_template = tok.chat_template.replace("<|assistant|>", "<|bot|>")
    with pytest.raises(ConfigError) as info:
        _trainer(tmp_path, load_prepared(prepared, "train"), other)
    assert info.value.reason_code == "tokenizer_mismatch"
    assert str(prepared) in info.value.message and "--tokenizer" in info.value.message


def test_train_script_refuses_looser_limits_than_the_preparation(tmp_path, prepared):
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    import train  # the repository's train.py

    argv = ["--dataset", str(prepared), "--output_dir", str(tmp_path / "run"), "--use_cpu", "true"]
    argv += ["--model_name_or_path", str(bundled_model_dir())]  # a real run names both (else incomplete_arguments)
    with pytest.raises(ConfigError) as info:
        train.main([*argv, "--max_length", "512", "--max_prompt_length", "64", "--max_steps", "1"])
    assert info.value.reason_code == "limits_looser_than_prepared"


def test_a_prepared_dir_gives_its_limits_to_a_run_that_sets_none(tmp_path, tok, prepared):
    """Default limits (neither max_length nor max_prompt_length given) take the manifest's, so nothing is refused;
    a limit the user set is checked as before."""
    args = cpu_config(tmp_path)  # no limits given: 1024 / 512 by default, looser than the preparation's 128 / 64
    assert (args.max_length, args.max_prompt_length) == (1024, 512) and not args.limits_given()
    trainer = PairDPOTrainer(
        model=tiny_llama(0, len(tok)), args=args, train_dataset=load_prepared(prepared, "train"), processing_class=tok
    )
    assert (trainer.args.max_length, trainer.args.max_prompt_length) == (128, 64)


@pytest.mark.integration
def test_train_script_trains_on_a_prepared_dir_with_its_limits(tmp_path, prepared):
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    import train  # the repository's train.py

    argv = ["--dataset", str(prepared), "--output_dir", str(tmp_path / "run"), "--use_cpu", "true"]
    argv += ["--model_name_or_path", str(bundled_model_dir()), "--max_steps", "1", "--report_to", "none"]
    argv += ["--per_device_train_batch_size", "4", "--save_strategy", "no", "--disable_tqdm", "true"]
    metrics = train.main(argv)
    assert "eval_loss" in metrics
    state = json.loads((tmp_path / "run" / "trainer_state.json").read_text())
    assert state["global_step"] == 1


@pytest.mark.parametrize("damage", ["no-manifest", "old-format", "no-fingerprint"])
def test_a_directory_without_a_valid_manifest_is_refused(tmp_path, prepared, damage):
    copy_dir = tmp_path / "copy"
    shutil.copytree(prepared, copy_dir)
    manifest = json.loads((copy_dir / "manifest.json").read_text())
    if damage == "no-manifest":
        (copy_dir / "manifest.json").unlink()
    elif damage == "old-format":
        manifest["format"] = "pair_dpo_trainer.prepare-data/1"
        (copy_dir / "manifest.json").write_text(json.dumps(manifest))
    else:
        del manifest["tokenizer"]["fingerprint"]
        (copy_dir / "manifest.json").write_text(json.dumps(manifest))
    with pytest.raises(ConfigError) as info:
        load_train_eval(copy_dir, eval_size=0, seed=0)
    assert info.value.reason_code == "bad_manifest" and "prepare-data" in info.value.message


# ------------------------------------------------------------------------------------------------ fingerprint


def test_fingerprint_is_stable_and_tracks_what_tokenises(tmp_path, tok):
    fingerprint = tokenizer_fingerprint(tok)
    assert len(fingerprint) == 64 and int(fingerprint, 16) >= 0
    copied = tmp_path / "copy"
    shutil.copytree(bundled_model_dir(), copied)
    assert tokenizer_fingerprint(AutoTokenizer.from_pretrained(copied)) == fingerprint  # another path, same files
    padded = copy.deepcopy(tok)
    padded.pad_token = padded.eos_token  # padding does not change any token id of a pair
    padded.padding_side = "left"
    assert tokenizer_fingerprint(padded) == fingerprint
    no_template = copy.deepcopy(tok)
    no_template.chat_template = None
    other_eos = copy.deepcopy(tok)
    other_eos.eos_token = "<s>"
    added = copy.deepcopy(tok)
    added.add_tokens(["<extra>"])
    variants = [tokenizer_fingerprint(t) for t in (no_template, other_eos, added)]
    assert len({fingerprint, *variants}) == 4


def test_fingerprint_of_the_bundled_tokenizer_is_pinned(tok):
    assert tokenizer_fingerprint(tok) == BUNDLED_FINGERPRINT


def test_the_length_helper_reads_back_what_was_packed(tmp_path, tok):
    features = [
        tokenize_pair(normalize_row(r), tok, max_length=4096, max_prompt_length=2048).to_features()
        for r in long_rows(8)
    ]
    args = cpu_config(tmp_path, max_length=4096, max_prompt_length=2048)
    trainer = PairDPOTrainer(model=tiny_llama(0, len(tok)), args=args, train_dataset=features, processing_class=tok)
    got = Counter(pair for batch in trainer.get_train_dataloader() for pair in _sequence_lengths(batch))
    want = Counter(
        (len(f["prompt_input_ids"]) + len(f[key]), len(f["prompt_input_ids"]))
        for f in features
        for key in ("chosen_input_ids", "rejected_input_ids")
    )
    assert got == want and max(length for length, _ in got) > MAX_LENGTH
