"""Validation in one place: the config collects every config-only problem, the trainer's one runtime check
(``training.checks.run_problems``) every problem that needs the run, each raised once with ``.problems``."""

from __future__ import annotations

import pytest

from pair_dpo_trainer import PairDPOTrainer
from pair_dpo_trainer.errors import ConfigError
from pair_dpo_trainer.training.checks import check_config
from tests.dpo_fixtures import cpu_config, runtime_error, synthetic_pairs
from tests.models import tiny_llama, tiny_tokenizer


def test_the_reference_engine_options_report_every_problem_not_the_first(tmp_path) -> None:
    with pytest.raises(ConfigError) as info:
        cpu_config(tmp_path, ref_zero_stage=2, ref_fsdp_shard="yes")
    assert info.value.reason_code == "invalid_config"
    assert [code for code, _ in info.value.problems] == ["bad_ref_zero_stage", "bad_ref_fsdp_shard"]
    with pytest.raises(ConfigError) as info:
        check_config(cpu_config(tmp_path, zero3_leaf_modules="Llama Decoder", torch_compile_mode="max-autotune"))
    assert [code for code, _ in info.value.problems] == ["unsupported_combination", "bad_zero3_leaf_modules"]


def test_a_trainer_raises_every_runtime_problem_at_once(tmp_path) -> None:
    """Named leaves without ZeRO-3 and ref_offload_params without a sharded reference: both named, in one
    ConfigError."""
    args = cpu_config(tmp_path, zero3_leaf_modules="LlamaDecoderLayer", ref_offload_params=True)
    with pytest.raises(ConfigError) as info:
        PairDPOTrainer(tiny_llama(), args, train_dataset=synthetic_pairs(8), processing_class=tiny_tokenizer())
    assert info.value.reason_code == "invalid_config"
    assert [code for code, _ in info.value.problems] == ["unsupported_combination"] * 2
    assert "zero3_leaf_modules" in info.value.problems[0][1] and "ref_offload_params" in info.value.problems[1][1]


def test_one_runtime_problem_keeps_its_own_code_and_message(tmp_path) -> None:
    error = runtime_error(cpu_config(tmp_path, ref_offload_params=True))
    assert error.reason_code == "unsupported_combination" and error.problems == [(error.reason_code, error.message)]
    assert error.message.startswith("ref_offload_params=True offloads the parameters of a sharded reference")
    assert runtime_error(cpu_config(tmp_path)) is None
    assert runtime_error(cpu_config(tmp_path, reference_free=True), ref_model_given=True) is None  # ignored


def test_the_deepspeed_reference_stage_rules_are_collected(tmp_path) -> None:
    """ref_zero_stage=3 without a ZeRO-3 policy AND offloading a replicated reference: two problems."""
    args = cpu_config(tmp_path, ref_zero_stage=3, ref_offload_params=True)
    error = runtime_error(args, deepspeed_config={"zero_optimization": {"stage": 2}})
    assert [code for code, _ in error.problems] == ["unsupported_combination"] * 2
    assert "ref_zero_stage=3" in error.problems[0][1] and "ref_offload_params=True" in error.problems[1][1]


def test_compile_with_zero3_and_the_sdpa_kernel_is_refused_with_both_reasons(tmp_path) -> None:
    error = runtime_error(cpu_config(tmp_path, torch_compile=True), zero3=True, deepspeed_config={})
    assert [("ZeRO-3" in text, "sdpa_segments" in text) for _, text in error.problems] == [(True, False), (False, True)]
