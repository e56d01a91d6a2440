"""PEFT / LoRA policies: the reference is the policy with its adapters disabled, never a second copy of the weights."""

from __future__ import annotations

import copy
import math

import pytest
import torch

from pair_dpo_trainer import PairDPOTrainer
from pair_dpo_trainer.collators.packed import PackedPairCollator
from pair_dpo_trainer.modeling.attention import enable_pair_varlen
from pair_dpo_trainer.modeling.logprobs import packed_sequence_logps
from pair_dpo_trainer.reference import FrozenReference
from pair_dpo_trainer.reference.peft import AdapterDisabledReference, is_peft_model
from tests.dpo_fixtures import cpu_config, synthetic_pairs
from tests.models import tiny_llama, tiny_tokenizer

peft = pytest.importorskip("peft")

# Standard DPO with an in-memory policy needs this opt-in where the config has it (pinned references otherwise).


def _lora(model: torch.nn.Module, *, init_lora_weights: bool = True) -> torch.nn.Module:
    """Wraps ``model`` in LoRA on every attention and MLP projection (dropout on, to test the eval switch)."""
    config = peft.LoraConfig(
        r=4,
        lora_alpha=8,
        lora_dropout=0.1,
        target_modules=["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"],
        init_lora_weights=init_lora_weights,
    )
    return peft.get_peft_model(model, config)


def _trainer(tmp_path, policy: torch.nn.Module, pairs: list[dict], **kwargs) -> PairDPOTrainer:
    config = cpu_config(tmp_path, learning_rate=1e-2, **kwargs)
    return PairDPOTrainer(
        model=policy, args=config, train_dataset=pairs, eval_dataset=pairs, processing_class=tiny_tokenizer()
    )


def test_is_peft_model():
    base = tiny_llama(0)
    assert not is_peft_model(base)
    assert not is_peft_model("a path")
    policy = _lora(base)
    assert is_peft_model(policy)
    wrapper = torch.nn.Module()
    wrapper.module = policy  # what DDP / a DeepSpeed engine look like
    assert is_peft_model(wrapper)
    with pytest.raises(TypeError, match="PeftModel"):
        AdapterDisabledReference(tiny_llama(0))


def test_adapter_disabled_logps_equal_a_frozen_copy_of_the_base_model():
    base = tiny_llama(0)
    frozen = FrozenReference(copy.deepcopy(base), chunk_size=16)  # the copy a non-PEFT run would build
    enable_pair_varlen(frozen.model, "sdpa_segments")
    policy = _lora(base, init_lora_weights=False)  # non-zero adapters: policy != base
    enable_pair_varlen(policy, "sdpa_segments")
    batch = PackedPairCollator()(synthetic_pairs(6, seed=4))

    policy.train()
    policy.base_model.model.model.layers[1].eval()  # a mixed pattern of modes, restored exactly
    modes = [module.training for module in policy.modules()]
    reference = AdapterDisabledReference(policy, chunk_size=16)
    ref_logps = reference.sequence_logps(batch)

    expected = frozen.sequence_logps(batch)
    assert ref_logps.dtype == torch.float32 and not ref_logps.requires_grad
    assert (ref_logps - expected).abs().max().item() < 1e-5
    assert [module.training for module in policy.modules()] == modes
    policy.eval()
    with torch.no_grad():
        adapted = packed_sequence_logps(policy, batch, chunk_size=16)
    assert (adapted - expected).abs().max().item() > 1e-3  # the adapters are active again after the pass


def test_trainer_with_lora_policy_shares_weights_starts_at_ln2_and_trains_only_lora(tmp_path):
    policy = _lora(tiny_llama(0))  # default init: LoRA B = 0, so policy == reference at step 0
    trainer = _trainer(tmp_path, policy, synthetic_pairs(32, seed=1), max_steps=3)

    reference = trainer.reference
    assert isinstance(reference, AdapterDisabledReference)
    assert reference.model is None and reference.policy is trainer.model  # no model of its own: no copy
    policy_tensors = {p.data_ptr() for p in trainer.model.parameters()}
    assert all(p.data_ptr() in policy_tensors for _, p in reference.identity_parameters())
    assert not any("lora_" in name for name, _ in reference.identity_parameters())

    assert trainer.evaluate()["eval_loss"] == pytest.approx(math.log(2), abs=1e-6)
    before = {name: p.detach().clone() for name, p in trainer.model.named_parameters()}
    trainer.train()
    changed = {name for name, p in trainer.model.named_parameters() if not torch.equal(p, before[name])}
    assert changed and all("lora_" in name for name in changed)
    assert any("lora_B" in name for name in changed)
    assert trainer.evaluate()["eval_loss"] < math.log(2)


def test_explicit_reference_directory_wins_over_the_adapter_reference(tmp_path):
    base = tiny_llama(0)
    base.save_pretrained(tmp_path / "ref")
    trainer = _trainer(tmp_path, _lora(base), synthetic_pairs(16), ref_model_name_or_path=str(tmp_path / "ref"))
    assert isinstance(trainer.reference, FrozenReference)


@pytest.mark.parametrize("option", [{"ref_zero_stage": 0}, {"ref_offload_params": True}])
def test_reference_engine_options_are_refused_for_an_adapter_disabled_reference(tmp_path, option):
    """Under DeepSpeed these options would be silently ignored for a PEFT policy's reference: refuse them."""
    from tests.dpo_fixtures import runtime_error

    error = runtime_error(cpu_config(tmp_path, **option), peft_policy=True, deepspeed_config={"train_batch_size": 1})
    assert error.reason_code == "unsupported_combination" and next(iter(option)) in str(error)


def test_a_lora_policy_with_precomputed_reference_log_probs_trains_from_ln2(tmp_path):
    """docs/guide.md section 6: LoRA with ``precompute_ref_log_probs=True`` works (one pass of the adapter-disabled
    policy before training, no reference during it)."""
    policy = _lora(tiny_llama(0))
    pairs = synthetic_pairs(16, seed=1)
    trainer = _trainer(tmp_path, policy, pairs, max_steps=2, precompute_ref_log_probs=True)
    trainer.train()
    losses = [entry["loss"] for entry in trainer.state.log_history if "loss" in entry]
    assert losses[0] == pytest.approx(math.log(2), abs=1e-4) and len(losses) == 2
    changed = [name for name, p in trainer.model.named_parameters() if p.requires_grad]
    assert changed and all("lora_" in name for name in changed)
