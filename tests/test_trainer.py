"""PairDPOTrainer in one process: step-0 loss, reference modes, packed = padded, fail-closed, resume = uninterrupted."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

from pair_dpo_trainer import PairDPOConfig, PairDPOTrainer
from pair_dpo_trainer.collators.padded import PaddedPairCollator
from pair_dpo_trainer.logprobs import padded_sequence_logps
from pair_dpo_trainer.reference import FrozenReference, NoReference
from pair_dpo_trainer.summary import run_summary
from tests.dpo_fixtures import cpu_config, synthetic_pairs, tiny_llama, tiny_tokenizer


def _config(tmp_path, **kwargs) -> PairDPOConfig:
    return cpu_config(tmp_path, **kwargs)


def _trainer(tmp_path, pairs, ref_model=None, **kwargs) -> PairDPOTrainer:
    return PairDPOTrainer(
        model=tiny_llama(0),
        args=_config(tmp_path, **kwargs),
        train_dataset=pairs,
        eval_dataset=pairs,
        processing_class=tiny_tokenizer(),
        ref_model=ref_model,
    )


def _padded_logps(model, pairs) -> tuple[torch.Tensor, torch.Tensor]:
    """Independent per-pair computation: right-padded rows, full logits, sdpa with an attention mask."""
    model = model.eval()
    model.set_attn_implementation("sdpa")
    with torch.no_grad():
        seq = padded_sequence_logps(model, PaddedPairCollator()(pairs))
    return seq[0::2].double(), seq[1::2].double()


def test_step0_loss_is_ln2_when_reference_equals_policy(tmp_path):
    trainer = _trainer(tmp_path, synthetic_pairs(20))
    assert isinstance(trainer.reference, FrozenReference)
    assert all(not p.requires_grad for p in trainer.reference.model.parameters())
    metrics = trainer.evaluate()
    assert metrics["eval_loss"] == pytest.approx(math.log(2), abs=1e-6)
    assert metrics["eval_rewards/margins"] == pytest.approx(0.0, abs=1e-6)
    for key in (
        "rewards/chosen",
        "rewards/rejected",
        "rewards/accuracies",
        "logps/chosen",
        "logps/rejected",
        "tokens_per_second",
        "pairs_per_second",
    ):
        assert f"eval_{key}" in metrics


def test_reference_free_builds_no_reference_and_matches_padded_formula(tmp_path):
    pairs = synthetic_pairs(20, seed=3)
    trainer = _trainer(tmp_path, pairs, reference_free=True, beta=0.5)
    assert isinstance(trainer.reference, NoReference)
    metrics = trainer.evaluate()
    chosen, rejected = _padded_logps(tiny_llama(0), pairs)
    expected = -F.logsigmoid(0.5 * (chosen - rejected))
    assert metrics["eval_loss"] == pytest.approx(float(expected.mean()), rel=1e-5)
    assert metrics["eval_logps/chosen"] == pytest.approx(float(chosen.mean()), rel=1e-5)
    accuracy = float((chosen > rejected).double().mean())
    assert metrics["eval_rewards/accuracies"] == pytest.approx(accuracy)


@pytest.mark.parametrize("loss_type", ["sigmoid", "ipo", "hinge", "robust", "sigmoid_nll"])
def test_packed_eval_loss_equals_padded_computation_with_distinct_reference(tmp_path, loss_type):
    pairs = synthetic_pairs(12, seed=5)
    smoothing = 0.1 if loss_type == "robust" else 0.0
    trainer = _trainer(tmp_path, pairs, ref_model=tiny_llama(1), loss_type=loss_type, label_smoothing=smoothing)
    metrics = trainer.evaluate()
    pc, pr = _padded_logps(tiny_llama(0), pairs)
    rc, rr = _padded_logps(tiny_llama(1), pairs)
    h = (pc - rc) - (pr - rr)
    beta = 0.1
    formulas = {
        "sigmoid": -F.logsigmoid(beta * h),
        "ipo": (h - 1 / (2 * beta)) ** 2,
        "hinge": torch.relu(1 - beta * h),
        "robust": (-(1 - smoothing) * F.logsigmoid(beta * h) + smoothing * F.logsigmoid(-beta * h))
        / (1 - 2 * smoothing),
        "sigmoid_nll": -F.logsigmoid(beta * h) - pc / torch.tensor([len(p["chosen_input_ids"]) for p in pairs]),
    }
    assert metrics["eval_loss"] == pytest.approx(float(formulas[loss_type].mean()), rel=1e-4, abs=1e-5)
    assert metrics["eval_rewards/margins"] == pytest.approx(float((beta * h).mean()), rel=1e-4, abs=1e-6)


def test_non_finite_logps_fail_closed_with_a_clear_message(tmp_path):
    trainer = _trainer(tmp_path, synthetic_pairs(8))
    with torch.no_grad():
        trainer.model.model.norm.weight.fill_(float("nan"))
    with pytest.raises(RuntimeError, match="non_finite"):
        trainer.evaluate()


def test_training_improves_margins_and_logs_pair_metrics(tmp_path):
    pairs = synthetic_pairs(32, seed=1)
    trainer = _trainer(tmp_path, pairs, max_steps=8, learning_rate=5e-3)
    trainer.train()
    logged = [entry for entry in trainer.state.log_history if "loss" in entry]
    assert len(logged) == 8
    assert logged[0]["loss"] == pytest.approx(math.log(2), abs=1e-5)
    assert all("rewards/accuracies" in entry and "tokens_per_second" in entry for entry in logged)
    assert trainer.evaluate()["eval_rewards/margins"] > 0.05


def test_resume_from_checkpoint_equals_uninterrupted_run(tmp_path):
    pairs = synthetic_pairs(48, seed=2)
    straight = _trainer(tmp_path / "a", pairs, max_steps=6, save_strategy="no")
    straight.train()
    first = _trainer(tmp_path / "b", pairs, max_steps=6, save_strategy="steps", save_steps=3)
    first.train()
    resumed = _trainer(tmp_path / "b", pairs, max_steps=6, save_strategy="no")
    resumed.train(resume_from_checkpoint=str(tmp_path / "b" / "out" / "checkpoint-3"))

    def losses(trainer):
        return [entry["loss"] for entry in trainer.state.log_history if "loss" in entry and entry["step"] > 3]

    assert losses(resumed) == pytest.approx(losses(straight), abs=1e-6)
    resumed_params = dict(resumed.model.named_parameters())
    for name, p_straight in straight.model.named_parameters():
        torch.testing.assert_close(resumed_params[name], p_straight, atol=1e-6, rtol=0, msg=name)


def test_training_start_prints_a_one_line_summary(tmp_path, capsys):
    trainer = _trainer(tmp_path, synthetic_pairs(16), max_steps=1)
    trainer.train()
    lines = [line for line in capsys.readouterr().out.splitlines() if line.startswith("pair_dpo:")]
    assert len(lines) == 1
    summary = lines[0]
    for part in ("world_size=1", "8 pairs/step", "in 2 micro-batches", "attention sdpa_segments", "online, unpinned"):
        assert part in summary, summary
    assert "leaf" not in summary and trainer.zero3_leaf_classes == ()  # no ZeRO-3: no leaf modules
    with_leaves = run_summary(trainer.args, attn_backend="x", source=None, zero3_leaf_classes=("LlamaDecoderLayer",))
    assert with_leaves.endswith("| ZeRO-3 leaf modules LlamaDecoderLayer")


def test_floating_point_ops_count_non_embedding_parameters_once(tmp_path):
    trainer = _trainer(tmp_path, synthetic_pairs(8))
    batch = trainer.data_collator(synthetic_pairs(2))
    expected_params = trainer.model.num_parameters(exclude_embeddings=True)
    assert trainer.floating_point_ops(batch) == 8 * expected_params * batch.num_tokens
    assert trainer._flop_params == expected_params
