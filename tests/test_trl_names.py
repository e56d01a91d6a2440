"""TRL users' names: TRL's field names where the concept is the same, a ConfigError naming the equivalent where not."""

from __future__ import annotations

import dataclasses

import pytest
from transformers import TrainingArguments

from pair_dpo_trainer import ConfigError, PairDPOConfig, PairDPOTrainer
from pair_dpo_trainer.config.trl_names import RENAMED_OPTIONS, TRAINER_KWARG_EQUIVALENTS, TRL_CONFIG_EQUIVALENTS
from tests.dpo_fixtures import cpu_config
from tests.models import tiny_llama, tiny_tokenizer

# TRL 1.16.0's DPOConfig fields beyond TrainingArguments' (trl/trainer/dpo_config.py and base_config.py), so the check
# runs without TRL installed; test_the_trl_field_list_is_trl_1_16s compares it with TRL when TRL is there.
TRL_1_16_DPO_FIELDS = {
    "model_init_kwargs", "trust_remote_code", "router_aux_loss_coef", "disable_dropout", "dataset_num_proc",
    "max_length", "truncation_mode", "padding_free", "pad_to_multiple_of", "precompute_ref_log_probs",
    "precompute_ref_batch_size", "loss_type", "loss_weights", "ld_alpha", "f_divergence_type",
    "f_alpha_divergence_coef", "label_smoothing", "beta", "use_weighting", "discopop_tau", "activation_offloading",
    "sync_ref_model", "ref_model_mixup_alpha", "ref_model_sync_steps", "pad_token",
}  # fmt: skip
# Implemented by the loss work under TRL's names: never in the "no twin" table.
LOSS_FIELDS = {
    "loss_weights", "ld_alpha", "f_divergence_type", "f_alpha_divergence_coef", "use_weighting", "discopop_tau",
    "sync_ref_model", "ref_model_mixup_alpha", "ref_model_sync_steps",
}  # fmt: skip
OURS = {f.name for f in dataclasses.fields(PairDPOConfig)}


def test_every_trl_dpo_field_is_ours_or_has_a_named_equivalent():
    for name in sorted(TRL_1_16_DPO_FIELDS):  # a loss field may already be ours once the loss work lands
        assert name in OURS or name in TRL_CONFIG_EQUIVALENTS or name in LOSS_FIELDS, name
    assert {"beta", "loss_type", "label_smoothing", "max_length", "precompute_ref_log_probs"} <= OURS
    assert not set(TRL_CONFIG_EQUIVALENTS) & LOSS_FIELDS
    assert not set(TRL_CONFIG_EQUIVALENTS) & OURS  # a table entry never shadows a real field


def test_the_trl_field_list_is_trl_1_16s():
    trl = pytest.importorskip("trl")
    if trl.__version__ != "1.16.0":
        pytest.skip(f"the list is TRL 1.16.0's; installed {trl.__version__}")
    base = {f.name for f in dataclasses.fields(TrainingArguments)}
    assert {f.name for f in dataclasses.fields(trl.DPOConfig)} - base == TRL_1_16_DPO_FIELDS


def test_precompute_ref_log_probs_has_trls_name():
    assert "precompute_ref_log_probs" in OURS and "precompute_ref_logps" not in OURS


@pytest.mark.parametrize(
    "name,value,equivalent",
    [
        ("rpo_alpha", 0.5, "nll_weight"),
        ("max_completion_length", 256, "max_prompt_length"),
        ("truncation_mode", "keep_end", "max_prompt_length"),
        ("padding_free", True, "padding-free"),
        ("pad_to_multiple_of", 8, "no padding"),
        ("precompute_ref_batch_size", 64, "per_device_eval_batch_size"),
        ("model_init_kwargs", {"dtype": "bfloat16"}, "from_pretrained"),
        ("precompute_ref_logps", True, "precompute_ref_log_probs"),
    ],
)
def test_a_trl_field_without_twin_raises_a_config_error_naming_the_equivalent(tmp_path, name, value, equivalent):
    with pytest.raises(ConfigError) as info:
        PairDPOConfig(output_dir=str(tmp_path), **{name: value})
    assert info.value.reason_code == "unsupported_option"
    assert name in str(info.value) and equivalent in str(info.value)


def test_every_unsupported_name_is_reported_at_once(tmp_path):
    with pytest.raises(ConfigError) as info:
        PairDPOConfig(output_dir=str(tmp_path), beta=0.2, rpo_alpha=1.0, padding_free=True)
    assert [text.split(":")[0] for _, text in info.value.problems] == ["rpo_alpha", "padding_free"]


def test_a_subclass_that_adds_a_listed_name_as_a_field_may_use_it(tmp_path):
    @dataclasses.dataclass
    class WithPaddingFree(PairDPOConfig):
        padding_free: bool = dataclasses.field(default=False, metadata={"help": "test"})

    assert WithPaddingFree(output_dir=str(tmp_path), padding_free=True, use_cpu=True).padding_free is True


@pytest.mark.parametrize("name", sorted(TRAINER_KWARG_EQUIVALENTS))
def test_trl_trainer_keywords_raise_a_config_error_naming_the_equivalent(tmp_path, name):
    with pytest.raises(ConfigError) as info:
        PairDPOTrainer(model=tiny_llama(0), args=cpu_config(tmp_path), **{name: object()})
    assert info.value.reason_code == "unsupported_option"
    assert name in str(info.value) and TRAINER_KWARG_EQUIVALENTS[name].split(":")[0] in str(info.value)


def test_tokenizer_keyword_names_processing_class(tmp_path):
    with pytest.raises(ConfigError, match="processing_class=tokenizer"):
        PairDPOTrainer(model=tiny_llama(0), args=cpu_config(tmp_path), tokenizer=tiny_tokenizer())


def test_trls_positional_order_is_named_in_the_bad_args_error(tmp_path):
    with pytest.raises(ConfigError) as info:
        PairDPOTrainer(tiny_llama(0), tiny_llama(1), cpu_config(tmp_path))  # TRL: (model, ref_model, args)
    assert info.value.reason_code == "bad_args" and "ref_model, args" in str(info.value)


def test_renamed_options_point_to_existing_fields():
    for old, new in RENAMED_OPTIONS.items():
        assert old not in OURS and new.split()[0] in OURS
