"""Every error class a user can trigger carries a reason code and names what to change (the option, file or row)."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from transformers import AutoTokenizer

from pair_dpo_trainer import PairDPOConfig, PairDPOTrainer
from pair_dpo_trainer.cli import main as cli_main
from pair_dpo_trainer.demo import DEMO_REVISION, bundled_model_dir, generate_demo_pairs
from pair_dpo_trainer.errors import ConfigError, PreferenceRowError, ScheduleError
from pair_dpo_trainer.modeling import attention
from tests.dpo_fixtures import cpu_config, synthetic_pairs, tiny_llama, tiny_tokenizer


def _config(tmp_path: Path, **kwargs) -> PairDPOConfig:
    return cpu_config(tmp_path, **kwargs)


# ------------------------------------------------------------------------------------------------ configuration


@pytest.mark.parametrize(
    "field,value,code",
    [
        ("beta", 0.0, "bad_beta"),
        ("loss_type", "dpo", "unknown_loss_type"),
        ("label_smoothing", 0.7, "bad_label_smoothing"),
        ("max_prompt_length", 4096, "bad_length"),
        ("attn_backend", "xformers", "bad_attn_backend"),
        ("ref_model_revision", "main", "revision_not_pinned"),
    ],
)
def test_bad_config_value_names_the_field(tmp_path, field, value, code):
    with pytest.raises(ConfigError) as info:
        PairDPOConfig(output_dir=str(tmp_path), report_to="none", **{field: value})
    assert info.value.reason_code == code
    assert f"{field}=" in str(info.value)


def test_several_bad_config_values_are_reported_together(tmp_path):
    with pytest.raises(ConfigError) as info:
        PairDPOConfig(output_dir=str(tmp_path), report_to="none", beta=-1.0, loss_type="kto")
    assert info.value.reason_code == "invalid_config"
    assert "beta=" in str(info.value) and "loss_type=" in str(info.value)
    assert [code for code, _ in info.value.problems] == ["bad_beta", "unknown_loss_type"]


# ------------------------------------------------------------------------------------------------ data files


def _bad_inputs(tmp_path: Path) -> dict[str, tuple[Path, str]]:
    """name -> (file, text the error must contain besides the path)."""
    broken = tmp_path / "broken.jsonl"
    broken.write_text('{"prompt": "a", "chosen": "b", "rejected": "c"}\n{"prompt": "a", "chosen": \n')
    parquet = tmp_path / "corrupt.parquet"
    parquet.write_bytes(b"PAR1 not really parquet")
    latin = tmp_path / "latin1.jsonl"
    latin.write_bytes(b'\xff{"prompt": "caf\xe9"}\n')
    return {
        "missing": (tmp_path / "missing.jsonl", "no such file"),
        "broken": (broken, "line 2"),
        "parquet": (parquet, "parquet"),
        "encoding": (latin, "UTF-8"),
    }


@pytest.mark.parametrize("name", ["missing", "broken", "parquet", "encoding"])
def test_prepare_data_on_an_unreadable_file_exits_2_naming_the_file(tmp_path, capsys, name):
    path, detail = _bad_inputs(tmp_path)[name]
    output = tmp_path / "prepared"
    args = ["prepare-data", str(path), "--output", str(output), "--tokenizer", str(bundled_model_dir())]
    code = cli_main([*args, "--train-size", "1", "--eval-size", "0", "--seed", "0"])
    err = capsys.readouterr().err
    assert code == 2
    assert str(path) in err and detail in err
    assert not output.exists()  # no partial output


# ------------------------------------------------------------------------------------------------ snapshots


def _verify(path: Path, revision: str = DEMO_REVISION) -> subprocess.CompletedProcess:
    command = [sys.executable, "-m", "pair_dpo_trainer.cli", "verify-snapshot", str(path), "--revision", revision]
    return subprocess.run(command, capture_output=True, text=True, timeout=120)


def test_verify_snapshot_rejects_a_tampered_copy_with_code_and_path(tmp_path):
    snapshot = tmp_path / "tiny-llama"
    shutil.copytree(bundled_model_dir(), snapshot)
    assert _verify(snapshot).returncode == 0  # the untouched copy verifies

    config = snapshot / "config.json"
    config.write_text(config.read_text().replace('"num_hidden_layers": 4', '"num_hidden_layers": 3'))
    done = _verify(snapshot)
    assert done.returncode == 1
    assert "[hash_mismatch]" in done.stdout and "config.json" in done.stdout

    (snapshot / "extra.safetensors").write_bytes(b"not from the commit")
    done = _verify(snapshot)
    assert done.returncode == 1
    assert "[metadata_missing]" in done.stdout and "extra.safetensors" in done.stdout


def test_verify_snapshot_refuses_a_branch_name(tmp_path):
    done = _verify(bundled_model_dir(), revision="main")
    assert done.returncode == 1
    assert "[revision_not_pinned]" in done.stdout and "'main'" in done.stdout


# ------------------------------------------------------------------------------------------------ optional dependencies


def test_flash_attn_backend_without_cuda_is_a_config_error_naming_the_way_out(tmp_path):
    with pytest.raises(ConfigError) as info:
        PairDPOTrainer(
            model=tiny_llama(0),
            args=_config(tmp_path, attn_backend="flash_attn"),
            train_dataset=synthetic_pairs(8),
            processing_class=tiny_tokenizer(),
        )
    assert info.value.reason_code == "attn_backend_unavailable"
    assert "flash_attn" in str(info.value) and "'auto'" in str(info.value)


def _flash_attn_not_installed_error(monkeypatch) -> ConfigError:
    """The error of ``attn_backend='flash_attn'`` on a CUDA device when the flash_attn package does not import."""
    monkeypatch.setattr(attention, "_flash_attn_varlen_func", lambda: None)
    with pytest.raises(ConfigError) as info:
        attention.select_attn_backend("flash_attn", device="cuda", dtype=torch.bfloat16)
    return info.value


def test_flash_attn_not_installed_is_a_config_error(monkeypatch):
    error = _flash_attn_not_installed_error(monkeypatch)
    assert error.reason_code == "attn_backend_unavailable"
    assert "flash_attn" in str(error) and "'auto'" in str(error)


def test_flash_attn_not_installed_names_the_option_and_the_install(monkeypatch):
    message = str(_flash_attn_not_installed_error(monkeypatch))
    assert "attn_backend" in message and "pip install" in message


# ------------------------------------------------------------------------------------------------ dataset rows


@pytest.mark.parametrize(
    "bad_row,code,names",
    [
        ({"prompt": "2+2?", "chosen": "4"}, "schema", "'rejected'"),
        ({"prompt": [{"role": "human", "content": "hi"}], "chosen": "a", "rejected": "b"}, "role", "prompt[0].role"),
        ({"prompt": "2+2?", "chosen": "4", "rejected": "4"}, "identical_after_truncation", "identical"),
    ],
)
def test_malformed_row_in_the_trainer_dataset_names_the_row(tmp_path, bad_row, code, names):
    rows = [*generate_demo_pairs(seed=1, n=3), bad_row, *generate_demo_pairs(seed=2, n=2)]
    with pytest.raises(PreferenceRowError) as info:
        PairDPOTrainer(
            model=tiny_llama(0),
            args=_config(tmp_path),
            train_dataset=rows,
            processing_class=AutoTokenizer.from_pretrained(bundled_model_dir()),
        )
    assert info.value.reason_code == code
    assert "row 3" in str(info.value) and names in str(info.value)


# ------------------------------------------------------------------------------------------------ schedule


def test_too_few_pairs_for_one_step_names_the_batch_options(tmp_path):
    trainer = PairDPOTrainer(
        model=tiny_llama(0),
        args=_config(tmp_path, per_device_train_batch_size=4, gradient_accumulation_steps=2, max_steps=1),
        train_dataset=synthetic_pairs(5),
        processing_class=tiny_tokenizer(),
    )
    with pytest.raises(ScheduleError) as info:
        trainer.train()
    assert info.value.reason_code == "too_few_pairs"
    assert "per_device_train_batch_size" in str(info.value) and "gradient_accumulation_steps" in str(info.value)
