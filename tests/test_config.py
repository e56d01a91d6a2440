"""Option validation: every problem collected, one error, stable reason codes.

``PairDPOConfig`` refuses an option out of its own range when it is built; the checks that need a feature's
knowledge (objective names, attention kernels, compile modes, reference modes) are collected by
``training.checks.check_config``, which the trainer and ``train.py`` run before anything is loaded."""

from __future__ import annotations

import ast
import dataclasses
import math
import re
from pathlib import Path

import pytest
from transformers import TrainingArguments

from pair_dpo_trainer import PairDPOTrainer
from pair_dpo_trainer.config import PairDPOConfig, launch
from pair_dpo_trainer.errors import ConfigError
from pair_dpo_trainer.losses.registry import uses_reference
from pair_dpo_trainer.training.checks import check_config


def _config(tmp_path, **kwargs) -> PairDPOConfig:
    return PairDPOConfig(output_dir=str(tmp_path), report_to="none", **kwargs)


def _checked(tmp_path, **kwargs) -> PairDPOConfig:
    """A config that passed both its own checks and every feature's (what a trainer starts with)."""
    config = _config(tmp_path, **kwargs)
    check_config(config)
    return config


def test_defaults_are_valid_and_pair_friendly(tmp_path):
    config = _config(tmp_path)
    assert config.beta == 0.1 and config.loss_type == ["sigmoid"] and not config.reference_free  # TRL: a list
    assert config.remove_unused_columns is False
    assert config.logging_nan_inf_filter is False  # the HF filter syncs the host every micro-batch
    assert config.pairs_per_rank_per_step == config.per_device_train_batch_size * config.gradient_accumulation_steps


@pytest.mark.parametrize(
    "kwargs,code",
    [
        ({"beta": 0.0}, "bad_beta"),
        ({"beta": -1.0}, "bad_beta"),
        ({"beta": math.inf}, "bad_beta"),
        ({"beta": math.nan}, "bad_beta"),
        ({"label_smoothing": 0.5}, "bad_label_smoothing"),
        ({"label_smoothing": -0.1}, "bad_label_smoothing"),
        ({"loss_type": "ipo", "label_smoothing": 0.1}, "unsupported_combination"),
        ({"loss_type": "kto"}, "unknown_loss_type"),
        ({"max_prompt_length": 2048, "max_length": 1024}, "bad_length"),
        ({"attn_backend": "xformers"}, "bad_attn_backend"),
        ({"nll_weight": -1.0}, "bad_nll_weight"),
        ({"ref_zero_stage": 1}, "bad_ref_zero_stage"),
        ({"ref_zero_stage": 2}, "bad_ref_zero_stage"),
        ({"ref_zero_stage": True}, "bad_ref_zero_stage"),
        ({"ref_zero_stage": 0, "ref_offload_params": True}, "unsupported_combination"),
        ({"zero3_leaf_modules": "Llama Decoder"}, "bad_zero3_leaf_modules"),
        ({"zero3_leaf_modules": ""}, "bad_zero3_leaf_modules"),
        ({"zero3_leaf_modules": "LlamaDecoderLayer,"}, "bad_zero3_leaf_modules"),
        ({"loss_type": ["sigmoid", "sigmoid"]}, "duplicate_loss_type"),
        ({"loss_type": []}, "unknown_loss_type"),
        ({"loss_weights": [1.0, 2.0]}, "bad_loss_weights"),
        ({"loss_weights": [-1.0]}, "bad_loss_weights"),
        ({"loss_weights": [0.0]}, "bad_loss_weights"),
        ({"loss_weights": ["x"]}, "bad_loss_weights"),
        ({"loss_type": "exo_pair"}, "bad_label_smoothing"),
        ({"loss_type": ["sigmoid", "hinge"], "label_smoothing": 0.1}, "unsupported_combination"),
        ({"ld_alpha": 1.5}, "bad_loss_option"),
        ({"f_divergence_type": "kl"}, "bad_loss_option"),
        ({"f_alpha_divergence_coef": math.inf}, "bad_loss_option"),
        ({"discopop_tau": 0.0}, "bad_loss_option"),
        ({"simpo_gamma": math.nan}, "bad_loss_option"),
        ({"ref_model_mixup_alpha": 0.0}, "bad_loss_option"),
        ({"ref_model_sync_steps": 0}, "bad_loss_option"),
        ({"f_divergence_type": "forward_kl", "loss_type": "nca_pair"}, "unsupported_combination"),
        ({"use_weighting": True, "loss_type": "aot"}, "unsupported_combination"),
        ({"sync_ref_model": True, "loss_type": "simpo"}, "unsupported_combination"),
        ({"sync_ref_model": True, "precompute_ref_log_probs": True}, "unsupported_combination"),
        ({"loss_type": "ipo_norm"}, "unknown_loss_type"),
        ({"precompute_ref_log_probs": True, "loss_type": ["orpo", "sft"]}, "unsupported_combination"),
        ({"max_tokens_per_microbatch": 0}, "bad_length"),
        ({"max_tokens_per_microbatch": 4096, "gradient_accumulation_steps": 2}, "unsupported_combination"),
        ({"pad_to_budget": True}, "unsupported_combination"),
        ({"ddp_timeout": 0}, "bad_timeout"),
        ({"ddp_timeout": -1}, "bad_timeout"),
        ({"ddp_timeout": math.nan}, "bad_timeout"),
        ({"max_nonfinite_grad_skips": -1}, "bad_nonfinite_skips"),
        ({"max_nonfinite_grad_skips": 1.5}, "bad_nonfinite_skips"),
    ],
)
def test_invalid_values_raise_with_reason_code(tmp_path, kwargs, code):
    with pytest.raises(ConfigError) as info:
        _checked(tmp_path, **kwargs)
    assert info.value.reason_code == code
    field_name = next(iter(kwargs))
    assert field_name in str(info.value)


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
    """The message names the option as ``field=value``."""
    with pytest.raises(ConfigError) as info:
        _checked(tmp_path, **{field: value})
    assert info.value.reason_code == code
    assert f"{field}=" in str(info.value)


def test_all_problems_are_reported_at_once(tmp_path):
    with pytest.raises(ConfigError) as info:  # the options' own ranges: when the config is built
        _config(tmp_path, beta=-1.0, label_smoothing=0.7, max_length=1)
    assert info.value.reason_code == "invalid_config"
    assert [code for code, _ in info.value.problems] == ["bad_beta", "bad_label_smoothing", "bad_length", "bad_length"]
    for name in ("beta", "label_smoothing", "max_length"):
        assert f"{name}=" in str(info.value)
    with pytest.raises(ConfigError) as info:  # the features' checks: all of them, at once
        _checked(tmp_path, attn_backend="nope", loss_type="kto", zero3_leaf_modules="", ref_model_revision="main")
    codes = [code for code, _ in info.value.problems]
    assert codes == ["unknown_loss_type", "revision_not_pinned", "bad_attn_backend", "bad_zero3_leaf_modules"]


def test_a_trainer_checks_every_feature_option_before_it_loads_anything(tmp_path):
    """An unknown loss name is named before the policy path is even looked at (it does not exist here)."""
    config = _config(tmp_path, loss_type="kto", use_cpu=True)
    with pytest.raises(ConfigError) as info:
        PairDPOTrainer(model=str(tmp_path / "no-such-model"), args=config, train_dataset=[])
    assert info.value.reason_code == "unknown_loss_type"


def test_config_is_a_value_error_for_argument_parsers(tmp_path):
    with pytest.raises(ValueError):
        _config(tmp_path, beta=0)


@pytest.mark.parametrize("stage", [None, 0, 3])
def test_ref_zero_stage_accepts_none_0_and_3(tmp_path, stage):
    assert _config(tmp_path, ref_zero_stage=stage).ref_zero_stage == stage
    assert _config(tmp_path, ref_zero_stage=stage, ref_offload_params=False).ref_offload_params is False
    if stage != 0:
        assert _config(tmp_path, ref_zero_stage=stage, ref_offload_params=True).ref_offload_params is True


def test_loss_type_lists_parse_as_trl_does_from_flags_yaml_and_strings(tmp_path):
    """TRL 1.16: ``loss_type`` is a list (one string is one objective), ``loss_weights`` a list of floats; flags take
    several values, YAML a list; a comma-separated string is a list too."""
    from transformers import HfArgumentParser

    parser = HfArgumentParser(PairDPOConfig)
    base = ["--output_dir", str(tmp_path), "--use_cpu", "--report_to", "none"]
    (flags,) = parser.parse_args_into_dataclasses(
        [*base, "--loss_type", "sigmoid", "bco_pair", "sft", "--loss_weights", "0.8", "0.2", "1.0"]
    )
    yaml_file = tmp_path / "c.yaml"
    yaml_file.write_text(
        f"output_dir: {tmp_path}\nuse_cpu: true\nreport_to: none\nloss_type: [sigmoid, bco_pair, sft]\n"
        "loss_weights: [0.8, 0.2, 1.0]\n"
    )
    (from_yaml,) = parser.parse_yaml_file(str(yaml_file))
    from_string = _config(tmp_path, loss_type="sigmoid, bco_pair,sft", loss_weights="0.8,0.2,1")
    for config in (flags, from_yaml, from_string):
        assert config.loss_type == ["sigmoid", "bco_pair", "sft"]
        assert config.loss_weights == [0.8, 0.2, 1.0]
    assert _config(tmp_path, loss_type="ipo").loss_type == ["ipo"]
    (comma,) = parser.parse_args_into_dataclasses([*base, "--loss_type", "sigmoid,sft"])  # argparse: ['sigmoid,sft']
    assert comma.loss_type == ["sigmoid", "sft"]
    check_config(comma)


def test_our_earlier_objective_name_is_refused_with_trls_name(tmp_path):
    with pytest.raises(ConfigError) as info:
        _checked(tmp_path, loss_type="ipo_norm")
    assert info.value.reason_code == "unknown_loss_type"
    assert "'ipo'" in info.value.message and "'ipo_sum'" in info.value.message


def test_a_reference_free_run_ignores_the_reference_settings(tmp_path):
    """Switching to a reference-free run is one option: the reference settings left set are ignored (the run
    summary names them), never refused."""
    from pair_dpo_trainer.reference.checks import ignored_reference_settings
    from pair_dpo_trainer.training.options import reference_options

    revision = "a" * 40
    for options in ({"reference_free": True}, {"loss_type": "simpo"}, {"loss_type": ["orpo", "sft"]}):
        config = _checked(tmp_path, ref_model_revision=revision, ref_model_name_or_path="/models/ref", **options)
        ignored = ignored_reference_settings(reference_options(config))
        assert ignored == ["ref_model_name_or_path", "ref_model_revision"]
    assert ignored_reference_settings(reference_options(_checked(tmp_path, ref_model_revision=revision))) == []


@pytest.mark.parametrize(
    "options,env,fails",
    [
        ({"bf16": False}, {"ACCELERATE_MIXED_PRECISION": "bf16"}, True),
        ({"fp16": True}, {"ACCELERATE_MIXED_PRECISION": "bf16"}, True),
        ({"bf16": True}, {"ACCELERATE_MIXED_PRECISION": "fp16"}, True),
        ({}, {"ACCELERATE_MIXED_PRECISION": "bf16"}, False),
        ({"bf16": False}, {"ACCELERATE_MIXED_PRECISION": "no"}, False),
    ],
)
def test_a_precision_that_contradicts_the_launcher_is_refused_before_anything_loads(
    tmp_path, monkeypatch, options, env, fails
):
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    if not fails:
        assert launch.precision_problem(options.get("bf16"), fp16=options.get("fp16", False), env=env) is None
        return
    with pytest.raises(ConfigError) as info:
        PairDPOConfig(output_dir=str(tmp_path), use_cpu=True, report_to="none", **options)
    assert info.value.reason_code == "precision_mismatch" and "mixed_precision" in info.value.message


def test_reference_free_objectives_use_no_reference():
    assert not uses_reference(["simpo"])
    assert not uses_reference(["orpo", "sft"])
    assert uses_reference(["sigmoid", "sft"])
    assert not uses_reference(["sigmoid"], reference_free=True)


# ------------------------------------------------------------------ DPO defaults


def _documented_defaults(doc: str) -> dict[str, tuple[object, object]]:
    """The defaults table of docs/guide(.zh).md: field -> (TrainingArguments default, PairDPOConfig default)."""
    text = (Path(__file__).resolve().parents[1] / doc).read_text(encoding="utf-8")
    heading = (
        "### Defaults that differ from `TrainingArguments`"
        if doc.endswith("guide.md")
        else "### 与 `TrainingArguments` 不同的默认值"
    )
    table = text.split(heading, 1)[1].split("\n\n")[2]
    rows = {}
    for line in table.splitlines()[2:]:
        cells = [cell.strip() for cell in line.strip("|").split("|")]
        values = [re.search(r"`([^`]*)`", cell) for cell in cells[1:3]]
        parsed = tuple(ast.literal_eval(v.group(1)) if v else None for v in values)
        rows[re.search(r"`([^`]*)`", cells[0]).group(1)] = parsed
    return rows


def _default(cls: type, name: str) -> object:
    field_ = {f.name: f for f in dataclasses.fields(cls)}[name]
    return field_.default if field_.default is not dataclasses.MISSING else field_.default_factory()


@pytest.mark.parametrize("doc", ["docs/guide.md", "docs/guide.zh.md"])
def test_every_default_that_differs_from_training_arguments_is_in_the_one_table(doc):
    differing = {
        f.name
        for f in dataclasses.fields(TrainingArguments)
        if _default(PairDPOConfig, f.name) != _default(TrainingArguments, f.name)
    }
    assert {"learning_rate", "logging_steps", "bf16"} <= differing
    table = _documented_defaults(doc)
    assert differing <= set(table), differing - set(table)
    for name, (theirs, ours) in table.items():
        if name in differing:
            assert (theirs, ours) == (_default(TrainingArguments, name), _default(PairDPOConfig, name)), name
        else:  # a row that only documents a difference from TRL: not overridden here
            assert name not in vars(PairDPOConfig).get("__annotations__", {}), name


def test_dpo_defaults(tmp_path):
    config = PairDPOConfig(output_dir=str(tmp_path))
    assert config.learning_rate == 1e-6 and config.logging_steps == 10
    assert config.max_prompt_length == 512  # prepare-data's default
    assert PairDPOConfig(output_dir=str(tmp_path), max_length=4096).max_prompt_length == 512
    assert PairDPOConfig(output_dir=str(tmp_path), max_length=128).max_prompt_length == 64  # TRL users set max_length


@pytest.mark.parametrize(
    "bf16,fp16,use_cpu,env,gpu_bf16,expected",
    [
        (None, False, False, {}, True, True),  # a bf16 GPU: on
        (None, False, False, {}, False, False),  # CPU / no bf16 support: float32
        (None, False, True, {}, True, False),  # use_cpu
        (None, True, False, {}, True, False),  # fp16 asked for
        (None, False, False, {"ACCELERATE_MIXED_PRECISION": "fp16"}, True, False),  # accelerate config says fp16
        (None, False, False, {"ACCELERATE_MIXED_PRECISION": "bf16"}, True, True),
        (None, False, True, {"ACCELERATE_MIXED_PRECISION": "bf16"}, False, True),  # the launcher's bf16, on CPU too
        (None, False, False, {"ACCELERATE_MIXED_PRECISION": "no"}, True, True),  # accelerate's default, not a choice
        (False, False, False, {}, True, False),  # explicit values win
        (True, False, True, {}, False, True),
    ],
)
def test_bf16_default_follows_the_hardware_and_never_overrides_a_choice(
    monkeypatch, bf16, fp16, use_cpu, env, gpu_bf16, expected
):
    monkeypatch.setattr(launch, "is_torch_bf16_gpu_available", lambda: gpu_bf16)
    assert launch.resolve_bf16(bf16, fp16=fp16, use_cpu=use_cpu, env=env) is expected


def test_cpu_runs_stay_float32_by_default(tmp_path):
    config = PairDPOConfig(output_dir=str(tmp_path))
    assert config.bf16 is False and config.mixed_precision == "no"
    assert PairDPOConfig(output_dir=str(tmp_path), use_cpu=True, bf16=True).mixed_precision == "bf16"


def test_token_budget_needs_one_accumulation_step_and_names_the_pairs_per_step(tmp_path):
    config = _config(tmp_path, max_tokens_per_microbatch=16384, per_device_train_batch_size=32, pad_to_budget=True)
    assert config.pairs_per_rank_per_step == 32 and config.gradient_accumulation_steps == 1
    with pytest.raises(ConfigError) as info:
        _config(tmp_path, max_tokens_per_microbatch=16384, per_device_train_batch_size=8, gradient_accumulation_steps=4)
    assert "gradient_accumulation_steps=1" in str(info.value) and "(here 32)" in str(info.value)
