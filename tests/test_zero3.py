"""ZeRO-3 leaf modules (``pair_dpo_trainer.parallel.zero3``): which modules are flagged, and the refusals.

What the flags do to a real DeepSpeed engine (no hooks inside a leaf; the same losses and parameters as per-submodule
hooks) is tested with 2 ranks in tests/test_deepspeed.py.
"""

from __future__ import annotations

import pytest
import torch
from transformers import GPT2Config, GPT2LMHeadModel

from pair_dpo_trainer import PairDPOTrainer
from pair_dpo_trainer.errors import ConfigError
from pair_dpo_trainer.modeling.layers import find_decoder_layers
from pair_dpo_trainer.parallel.zero3 import mark_zero3_leaf_modules, zero3_leaf_modules_problem, zero3_leaf_setup
from tests.dpo_fixtures import cpu_config, synthetic_pairs
from tests.models import tiny_llama, tiny_tokenizer

pytest.importorskip("deepspeed")


def _flagged(model: torch.nn.Module) -> list[str]:
    return [name for name, module in model.named_modules() if getattr(module, "_z3_leaf", False)]


def test_auto_flags_exactly_the_decoder_layers() -> None:
    model = tiny_llama()
    assert mark_zero3_leaf_modules(model, "auto") == ("LlamaDecoderLayer",)
    assert _flagged(model) == ["model.layers.0", "model.layers.1"]


def test_auto_finds_the_blocks_of_a_model_without_get_decoder_layers() -> None:
    """GPT-2's blocks are ``transformer.h`` (found through ``_no_split_modules``)."""
    model = GPT2LMHeadModel(GPT2Config(n_embd=16, n_layer=3, n_head=2, vocab_size=64, n_positions=32))
    assert [type(m).__name__ for m in find_decoder_layers(model)] == ["GPT2Block"] * 3
    assert mark_zero3_leaf_modules(model, "auto") == ("GPT2Block",)
    assert _flagged(model) == ["transformer.h.0", "transformer.h.1", "transformer.h.2"]


@pytest.mark.parametrize(
    "names, suffixes",
    [
        ("LlamaMLP", ["mlp"]),
        (
            "transformers.models.llama.modeling_llama.LlamaMLP, LlamaRMSNorm",
            ["mlp", "input_layernorm", "post_attention_layernorm"],
        ),
    ],
)
def test_class_names_short_or_fully_qualified_flag_those_modules(names: str, suffixes: list[str]) -> None:
    model = tiny_llama()
    mark_zero3_leaf_modules(model, names)
    expected = {f"model.layers.{i}.{suffix}" for i in (0, 1) for suffix in suffixes}
    if "LlamaRMSNorm" in names:
        expected.add("model.norm")
    assert set(_flagged(model)) == expected


def test_none_flags_nothing_and_unknown_names_or_no_blocks_fail_closed() -> None:
    model = tiny_llama()
    assert mark_zero3_leaf_modules(model, "none") == () and _flagged(model) == []
    with pytest.raises(ConfigError) as info:
        mark_zero3_leaf_modules(model, "MistralDecoderLayer")
    assert info.value.reason_code == "zero3_leaf_modules_not_found" and "MistralDecoderLayer" in str(info.value)
    with pytest.raises(ConfigError) as info:
        mark_zero3_leaf_modules(torch.nn.Sequential(torch.nn.Linear(2, 2)), "auto")
    assert info.value.reason_code == "zero3_leaf_modules_not_found" and "zero3_leaf_modules='none'" in str(info.value)


def test_without_zero3_only_auto_and_none_are_accepted_and_nothing_is_flagged(tmp_path) -> None:
    model = tiny_llama()
    assert zero3_leaf_setup(model, "auto", zero3=False) == () and _flagged(model) == []
    with pytest.raises(ConfigError) as info:
        PairDPOTrainer(
            model,
            cpu_config(tmp_path, zero3_leaf_modules="LlamaDecoderLayer"),
            train_dataset=synthetic_pairs(8),
            processing_class=tiny_tokenizer(),
        )
    assert info.value.reason_code == "unsupported_combination" and "zero3_leaf_modules" in str(info.value)


def test_a_peft_policy_gets_no_leaves_and_named_leaves_are_refused_for_it() -> None:
    """DeepSpeed would reduce a leaf's gradients before the LoRA weight gradients exist (see zero3_leaf_setup)."""
    model = tiny_llama()
    assert zero3_leaf_setup(model, "auto", zero3=True, peft=True) == () and _flagged(model) == []
    from pair_dpo_trainer.training.checks import zero3_leaf_problems

    assert [code for code, _ in zero3_leaf_problems("LlamaDecoderLayer", zero3=True, peft=True)] == [
        "unsupported_combination"
    ]
    assert "PEFT" in zero3_leaf_problems("LlamaDecoderLayer", zero3=True, peft=True)[0][1]
    assert zero3_leaf_setup(model, "auto", zero3=True) == ("LlamaDecoderLayer",)


@pytest.mark.parametrize("value", ["auto", "none", "LlamaDecoderLayer", "a.b.C, D"])
def test_valid_settings(value: str) -> None:
    assert zero3_leaf_modules_problem(value) is None
