"""Progress bars for the long silent steps (tokenising raw rows in the trainer, ``evaluate()``,
``prepare-data``), on rank 0 only and silent with ``disable_tqdm``; tqdm writes to stderr, captured here."""

from __future__ import annotations

import json
import re

import pytest
from transformers import AutoTokenizer

from pair_dpo_trainer import PairDPOTrainer
from pair_dpo_trainer.cli import main as cli_main
from pair_dpo_trainer.demo import bundled_model_dir
from pair_dpo_trainer.demo.pairs import generate_demo_pairs
from tests.dpo_fixtures import cpu_config, synthetic_pairs
from tests.launch import ranks
from tests.models import tiny_llama, tiny_tokenizer


def _bar(text: str, desc: str, total: int) -> bool:
    """True when ``text`` holds a finished tqdm bar ``desc: 100%|...| total/total``."""
    return re.search(rf"{re.escape(desc)}100%\|[^|]*\| {total}/{total} ", text) is not None


@pytest.mark.parametrize("disable_tqdm", [False, True])
def test_tokenising_raw_rows_in_the_trainer_shows_a_bar(tmp_path, capsys, disable_tqdm):
    capsys.readouterr()
    PairDPOTrainer(
        model=tiny_llama(0, len(AutoTokenizer.from_pretrained(bundled_model_dir()))),
        args=cpu_config(tmp_path, disable_tqdm=disable_tqdm),
        train_dataset=generate_demo_pairs(seed=0, n=12),
        eval_dataset=generate_demo_pairs(seed=1, n=5),
        processing_class=AutoTokenizer.from_pretrained(bundled_model_dir()),
    )
    err = capsys.readouterr().err
    assert _bar(err, "train dataset: ", 12) is not disable_tqdm
    assert _bar(err, "eval dataset: ", 5) is not disable_tqdm
    if disable_tqdm:
        assert "%|" not in err


@pytest.mark.parametrize("disable_tqdm", [False, True])
def test_evaluate_shows_a_bar(tmp_path, capsys, disable_tqdm):
    trainer = PairDPOTrainer(
        model=tiny_llama(0),
        args=cpu_config(tmp_path, disable_tqdm=disable_tqdm, per_device_eval_batch_size=4),
        train_dataset=synthetic_pairs(16),
        eval_dataset=synthetic_pairs(12, seed=1),
        processing_class=tiny_tokenizer(),
    )
    batches = len(trainer.get_eval_dataloader())
    assert batches == 3
    capsys.readouterr()
    trainer.evaluate()
    err = capsys.readouterr().err
    assert _bar(err, "", batches) is not disable_tqdm
    if disable_tqdm:
        assert "%|" not in err


@pytest.mark.parametrize("flag", [(), ("--disable-tqdm",)])
def test_prepare_data_shows_a_bar_per_input(tmp_path, capsys, flag):
    source = tmp_path / "rows.jsonl"
    source.write_text("".join(json.dumps(r) + "\n" for r in generate_demo_pairs(seed=0, n=30)))
    argv = ["prepare-data", str(source), "--output", str(tmp_path / "out"), "--tokenizer", str(bundled_model_dir())]
    assert cli_main([*argv, "--train-size", "20", "--eval-size", "5", "--seed", "0", *flag]) == 0
    captured = capsys.readouterr()
    assert _bar(captured.err, "rows.jsonl: ", 30) is not bool(flag)
    assert "%|" not in captured.out  # the summary on stdout stays clean
    if flag:
        assert captured.err == ""
    else:  # the phases' seconds, on the last line
        assert re.search(r"tokenised 30 rows in [0-9.]+ s .* split in [0-9.]+ s; wrote the splits in", captured.err)


@pytest.mark.slow
@pytest.mark.distributed
def test_bars_show_on_rank_0_only(tmp_path):
    ranks("progress_worker.py", tmp_path, timeout=300)
    rank0, rank1 = ((tmp_path / f"stderr.{r}").read_text() for r in (0, 1))
    assert _bar(rank0, "train dataset: ", 16) and _bar(rank0, "eval dataset: ", 16)
    assert _bar(rank0, "", 2)  # evaluate(): 16 pairs over 2 ranks, 4 per micro-batch: 2 micro-batches per rank
    ours = [line for line in re.split(r"[\r\n]", rank1) if "%|" in line and not line.startswith("Loading weights")]
    assert ours == []  # transformers' own weight-loading bar shows on every rank; ours do not
    assert any(line.startswith("Loading weights") for line in re.split(r"[\r\n]", rank1))  # stderr was captured
