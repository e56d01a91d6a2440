"""The objectives inside PairDPOTrainer (one process): reference-free objectives build no reference, per-token
variants and TRL's metrics against independent padded computations, BCO's running mean and TR-DPO's synced
reference across steps, checkpoints and resume, step-level objectives independent of gradient accumulation."""

from __future__ import annotations

import hashlib
import json
import math

import pytest
import torch
import torch.nn.functional as F
from transformers import TrainerCallback

from pair_dpo_trainer.collators.padded import PaddedPairCollator
from pair_dpo_trainer.errors import PairDPOError
from pair_dpo_trainer.fault_tolerance.checkpoint import MANIFEST_FILENAME
from pair_dpo_trainer.integrity import read_identity
from pair_dpo_trainer.reference import NoReference
from pair_dpo_trainer.reference.sync import SYNCED_REFERENCE_FILENAME
from pair_dpo_trainer.training.objective_state import OBJECTIVE_STATE_FILENAME
from tests.dpo_fixtures import cpu_config, synthetic_pairs
from tests.models import other_architecture_llama, tiny_llama
from tests.test_trainer import _trainer


def _padded(model, pairs):
    """Independent per-sequence quantities from full [T, V] logits of right-padded rows (sdpa, float64 math)."""
    model = model.eval()
    model.set_attn_implementation("sdpa")
    batch = PaddedPairCollator()(pairs)
    with torch.no_grad():
        logits = model(input_ids=batch.input_ids, attention_mask=batch.attention_mask, use_cache=False).logits.double()
    log_probs = logits.log_softmax(-1)
    mask = batch.completion_mask.bool()
    token = log_probs.gather(-1, batch.labels.clamp(min=0)[..., None]).squeeze(-1) * mask
    lss = (log_probs.exp() ** 2).sum(-1).log()
    valid = batch.attention_mask[:, 1:].bool()  # every token after the first (ORPO's NLL, as TRL's ORPOTrainer)
    every = log_probs[:, :-1].gather(-1, batch.input_ids[:, 1:, None]).squeeze(-1) * valid
    return {
        "sequence_logps": every.sum(-1),
        "sequence_counts": valid.sum(-1).double(),
        "token_logps": token,
        "mask": mask,
        "logps": token.sum(-1),
        "counts": mask.sum(-1).double(),
        "mean_logits": (logits.mean(-1) * mask).sum(-1),
        "entropy": (-(log_probs.exp() * log_probs).sum(-1) * mask).sum(-1),
        "top1": ((logits.argmax(-1) == batch.labels) & mask).sum(-1).double(),
        "wpo": ((token - lss) * mask).sum(-1),
    }


# ---------------------------------------------------------------- reference-free objectives
@pytest.mark.parametrize("loss_type", [["simpo"], ["orpo"], ["sft"], ["simpo", "sft"]])
def test_reference_free_objectives_build_no_reference_and_match_the_padded_formula(tmp_path, loss_type):
    pairs = synthetic_pairs(12, seed=4)
    # one eval micro-batch: sft's token mean is per eval micro-batch (docs/losses.md), here the whole set
    trainer = _trainer(tmp_path, pairs, loss_type=loss_type, beta=2.0, per_device_eval_batch_size=16)
    assert isinstance(trainer.reference, NoReference) and trainer.reference_manager.builds == 0
    assert trainer.reference_identity is None and trainer.reference_source is None
    batch = trainer.data_collator(pairs[:2])
    assert trainer.floating_point_ops(batch) == 6 * trainer._flop_params * batch.num_tokens  # no reference forward
    metrics = trainer.evaluate()
    q = _padded(tiny_llama(0), pairs)
    pc, pr, nc, nr = q["logps"][0::2], q["logps"][1::2], q["counts"][0::2], q["counts"][1::2]
    orpo_nll = -q["sequence_logps"][0::2].sum() / q["sequence_counts"][0::2].sum()  # TRL's: prompt + completion
    formulas = {  # Meng et al. 2024 Eq. 6 (gamma 0.5); Hong et al. 2024 Eq. 6-7; token-mean NLL
        "simpo": -F.logsigmoid(2.0 * (pc / nc - pr / nr) - 0.5),
        "orpo": orpo_nll
        - 2.0
        * F.logsigmoid((pc / nc - pr / nr) - (torch.log(-torch.expm1(pc / nc)) - torch.log(-torch.expm1(pr / nr)))),
        "sft": -pc / nc.mean(),
    }
    expected = sum(formulas[name] for name in loss_type)
    assert metrics["eval_loss"] == pytest.approx(float(expected.mean()), rel=1e-5)
    if len(loss_type) > 1:
        for name in loss_type:
            assert metrics[f"eval_loss/{name}"] == pytest.approx(float(formulas[name].mean()), rel=1e-5)


# ---------------------------------------------------------------- TRL's metrics
def test_eval_logs_trl_token_metrics_from_the_chunked_head(tmp_path):
    pairs = synthetic_pairs(12, seed=6)
    metrics = _trainer(tmp_path, pairs, ref_model=tiny_llama(1)).evaluate()
    q = _padded(tiny_llama(0), pairs)
    chosen, rejected = slice(0, None, 2), slice(1, None, 2)
    nc, nr = q["counts"][chosen].sum(), q["counts"][rejected].sum()
    expected = {
        "eval_logits/chosen": q["mean_logits"][chosen].sum() / nc,
        "eval_logits/rejected": q["mean_logits"][rejected].sum() / nr,
        "eval_entropy": q["entropy"].sum() / (nc + nr),
        "eval_mean_token_accuracy": q["top1"][chosen].sum() / nc,
    }
    for key, value in expected.items():
        assert metrics[key] == pytest.approx(float(value), rel=1e-5, abs=1e-6), key


@pytest.mark.integration
def test_training_logs_cumulative_num_tokens_that_survive_a_resume(tmp_path):
    pairs = synthetic_pairs(48, seed=2)
    straight = _trainer(tmp_path / "a", pairs, max_steps=4, logging_steps=2, save_strategy="no")
    straight.train()
    logged = [entry["num_tokens"] for entry in straight.state.log_history if "num_tokens" in entry]
    costs = [2 * len(p["prompt_input_ids"]) + len(p["chosen_input_ids"]) + len(p["rejected_input_ids"]) for p in pairs]
    plan = straight._train_sampler.rank_plan(0)
    tokens = [sum(costs[i] for microbatch in plan[step] for i in microbatch) for step in range(4)]
    assert logged == [sum(tokens[:2]), sum(tokens)]  # packed tokens of every step so far (TRL's num_tokens)
    first = _trainer(tmp_path / "b", pairs, max_steps=4, logging_steps=2, save_strategy="steps", save_steps=3)
    first.train()
    checkpoint = tmp_path / "b" / "out" / "checkpoint-3"  # step 3 was saved but not logged: folded at the save
    assert json.loads((checkpoint / "trainer_state.json").read_text())["num_input_tokens_seen"] == sum(tokens[:3])
    resumed = _trainer(tmp_path / "b", pairs, max_steps=4, logging_steps=2, save_strategy="no")
    resumed.train(resume_from_checkpoint=str(checkpoint))
    assert [e["num_tokens"] for e in resumed.state.log_history if "num_tokens" in e][-1] == sum(tokens)


# ---------------------------------------------------------------- per-token variants
def test_ld_alpha_and_wpo_eval_losses_equal_the_padded_formula(tmp_path):
    pairs = synthetic_pairs(10, seed=8)
    alpha, beta = 0.3, 0.5
    metrics = _trainer(
        tmp_path, pairs, ref_model=tiny_llama(1), ld_alpha=alpha, use_weighting=True, beta=beta
    ).evaluate()
    sums = {}
    for name, seed in (("policy", 0), ("ref", 1)):
        q = _padded(tiny_llama(seed), pairs)
        lengths = q["counts"].view(-1, 2)
        shared = lengths.min(dim=1).values.repeat_interleave(2)
        position = q["mask"].cumsum(-1)  # 1-based position within the completion
        weights = torch.where(position <= shared[:, None], 1.0, alpha) * q["mask"]
        sums[name] = (q["token_logps"] * weights).sum(-1)  # Liu et al. 2024: shared + alpha * tail
        if name == "policy":
            wpo = torch.exp(q["wpo"] / q["counts"])  # Zhou et al. 2024: exp(mean(log p - log sum p^2))
    h = (sums["policy"][0::2] - sums["ref"][0::2]) - (sums["policy"][1::2] - sums["ref"][1::2])
    expected = -F.logsigmoid(beta * h) * wpo[0::2] * wpo[1::2]
    assert metrics["eval_loss"] == pytest.approx(float(expected.mean()), rel=1e-4)


@pytest.mark.integration
def test_precomputed_reference_applies_ld_alpha_like_the_online_one(tmp_path):
    pairs = synthetic_pairs(24, seed=3)
    options = {"ld_alpha": 0.2, "max_steps": 3, "learning_rate": 5e-2}
    online = _trainer(tmp_path / "on", pairs, ref_model=None, **options)
    online.train()
    pre = _trainer(tmp_path / "pre", pairs, precompute_ref_log_probs=True, **options)
    pre.train()
    assert _losses_after(pre, 0) == pytest.approx(_losses_after(online, 0), abs=1e-6)
    plain = _trainer(tmp_path / "pre", pairs, precompute_ref_log_probs=True, max_steps=1)  # same cache dir, no ld_alpha
    plain.train()
    assert plain.reference_manager.builds == 1  # another key: the LD-weighted cache is not reused for plain sums


# ---------------------------------------------------------------- BCO's running reward mean
@pytest.mark.integration
def test_bco_delta_is_the_mean_reward_of_all_previous_steps(tmp_path):
    pairs = synthetic_pairs(48, seed=3)
    trainer = _trainer(tmp_path, pairs, loss_type="bco_pair_shift", max_steps=3, learning_rate=5e-2)
    trainer.train()
    logged = [entry for entry in trainer.state.log_history if "rewards/chosen" in entry]
    # every step has 8 pairs: delta = mean over steps of (mean chosen reward + mean rejected reward) / 2
    expected = sum((e["rewards/chosen"] + e["rewards/rejected"]) / 2 for e in logged) / len(logged)
    state = trainer.objective_runtime.bco_state.state_dict()
    assert state["reward_count"] == 2 * 8 * 3
    assert float(trainer.objective_runtime.bco_state.delta()) == pytest.approx(expected, rel=1e-5, abs=1e-9)
    assert abs(expected) > 1e-4  # the policy moved, so delta is not trivially 0


def _losses_after(trainer, step):
    return [entry["loss"] for entry in trainer.state.log_history if "loss" in entry and entry["step"] > step]


@pytest.mark.parametrize(
    "options", [{"loss_type": "bco_pair_shift"}, {"sync_ref_model": True, "ref_model_sync_steps": 2}]
)
@pytest.mark.integration
def test_stateful_objectives_resume_exactly(tmp_path, options):
    pairs = synthetic_pairs(48, seed=2)
    common = {"max_steps": 5, "learning_rate": 5e-2, **options}
    straight = _trainer(tmp_path / "a", pairs, save_strategy="no", **common)
    straight.train()
    first = _trainer(tmp_path / "b", pairs, save_strategy="steps", save_steps=3, **common)
    first.train()
    checkpoint = tmp_path / "b" / "out" / "checkpoint-3"
    resumed = _trainer(tmp_path / "b", pairs, save_strategy="no", **common)
    resumed.train(resume_from_checkpoint=str(checkpoint))
    assert _losses_after(resumed, 3) == pytest.approx(_losses_after(straight, 3), abs=1e-6)
    if "loss_type" in options:
        state = json.loads((checkpoint / OBJECTIVE_STATE_FILENAME).read_text())
        assert state["bco_pair_shift"]["reward_count"] == 2 * 8 * 3
    else:
        assert read_identity(checkpoint).synced_step == 2 and (checkpoint / SYNCED_REFERENCE_FILENAME).is_file()


@pytest.mark.integration
def test_bco_resume_without_its_state_is_refused(tmp_path):
    """A complete checkpoint of another objective has no BCO state (objective_state_missing); a BCO checkpoint
    without its state file is not complete (the checkpoint manifest lists it: checkpoint_incomplete)."""
    pairs = synthetic_pairs(32, seed=2)
    other = _trainer(tmp_path / "a", pairs, loss_type="sigmoid", max_steps=2, save_strategy="steps", save_steps=2)
    other.train()
    resumed = _trainer(tmp_path / "a", pairs, loss_type="bco_pair_shift", max_steps=3, save_strategy="no")
    with pytest.raises(PairDPOError) as info:  # the recorded objective differs: refused before anything loads
        resumed.train(resume_from_checkpoint=str(tmp_path / "a" / "out" / "checkpoint-2"))
    assert info.value.reason_code == "resume_objective_mismatch" and "loss_type" in str(info.value)
    resumed = _trainer(  # accepted anyway: BCO still needs its running reward mean
        tmp_path / "a", pairs, loss_type="bco_pair_shift", max_steps=3, save_strategy="no",
        allow_resume_data_mismatch=True,
    )  # fmt: skip
    with pytest.raises(PairDPOError) as info:
        resumed.train(resume_from_checkpoint=str(tmp_path / "a" / "out" / "checkpoint-2"))
    assert info.value.reason_code == "objective_state_missing" and "loss_type" in str(info.value)

    first = _trainer(
        tmp_path / "b", pairs, loss_type="bco_pair_shift", max_steps=2, save_strategy="steps", save_steps=2
    )
    first.train()
    checkpoint = tmp_path / "b" / "out" / "checkpoint-2"
    (checkpoint / OBJECTIVE_STATE_FILENAME).unlink()
    resumed = _trainer(tmp_path / "b", pairs, loss_type="bco_pair_shift", max_steps=3, save_strategy="no")
    with pytest.raises(PairDPOError) as info:
        resumed.train(resume_from_checkpoint=str(checkpoint))
    assert info.value.reason_code == "checkpoint_incomplete"


# ---------------------------------------------------------------- TR-DPO
class _PolicyAtStepEnd(TrainerCallback):
    def __init__(self):
        self.params = {}

    def on_step_end(self, args, state, control, model=None, **kwargs):
        self.params[state.global_step] = {n: p.detach().clone() for n, p in model.named_parameters()}


def test_sync_ref_model_mixes_the_policy_into_the_reference_every_sync_steps(tmp_path):
    pairs = synthetic_pairs(48, seed=5)
    trainer = _trainer(
        tmp_path, pairs, max_steps=5, sync_ref_model=True, ref_model_mixup_alpha=0.3, ref_model_sync_steps=2
    )
    recorder = _PolicyAtStepEnd()
    trainer.add_callback(recorder)
    trainer.train()
    expected = {n: p.detach().clone() for n, p in tiny_llama(0).named_parameters()}  # the starting reference
    for step in (2, 4):  # Gorbatovski et al. 2024: ref <- alpha * policy + (1 - alpha) * ref
        expected = {n: 0.3 * recorder.params[step][n] + 0.7 * r for n, r in expected.items()}
    for name, param in trainer.reference.model.named_parameters():
        torch.testing.assert_close(param, expected[name], rtol=1e-6, atol=1e-7, msg=name)
    assert trainer.reference_manager._synced_step == 4


def test_tr_dpo_is_refused_where_there_is_no_separate_in_process_reference(tmp_path):
    from tests.dpo_fixtures import runtime_error

    args = cpu_config(tmp_path, sync_ref_model=True)
    error = runtime_error(args, deepspeed_config={"train_batch_size": 1})  # DeepSpeed: the reference is its engine
    assert error.reason_code == "unsupported_combination" and "sync_ref_model" in str(error)
    error = runtime_error(args, peft_policy=True)  # PEFT: the reference is the policy with its adapters disabled
    assert error.reason_code == "unsupported_combination" and "PEFT" in str(error)
    other = other_architecture_llama()
    with pytest.raises(PairDPOError) as info:  # another architecture: refused when the reference is built
        _trainer(tmp_path, synthetic_pairs(8), ref_model=other, sync_ref_model=True)
    assert info.value.reason_code == "unsupported_combination" and "architecture" in str(info.value)


def test_tr_dpo_resume_checks_the_synced_weights_not_the_snapshot(tmp_path):
    pairs = synthetic_pairs(32, seed=1)
    options = {"sync_ref_model": True, "ref_model_sync_steps": 1, "learning_rate": 5e-2}
    first = _trainer(tmp_path, pairs, max_steps=2, save_strategy="steps", save_steps=2, **options)
    first.train()
    checkpoint = tmp_path / "out" / "checkpoint-2"
    record = read_identity(checkpoint)
    snapshot = _trainer(tmp_path / "fresh", pairs).reference_identity  # the same starting reference, never synced
    assert record.synced_step == 2 and snapshot.synced_step is None
    assert record.param_digest != snapshot.param_digest and record.manifest_digest == snapshot.manifest_digest

    without_sync = _trainer(tmp_path, pairs, max_steps=3, save_strategy="no", learning_rate=5e-2)
    with pytest.raises(PairDPOError) as info:  # sync_ref_model is part of the recorded objective
        without_sync.train(resume_from_checkpoint=str(checkpoint))
    assert info.value.reason_code == "resume_objective_mismatch" and "sync_ref_model" in str(info.value)
    without_sync = _trainer(  # accepted anyway: the reference gate still sees a synced reference
        tmp_path, pairs, max_steps=3, save_strategy="no", learning_rate=5e-2, allow_resume_data_mismatch=True
    )
    with pytest.raises(PairDPOError) as info:
        without_sync.train(resume_from_checkpoint=str(checkpoint))
    assert info.value.reason_code == "reference_changed" and "TR-DPO" in str(info.value)

    from safetensors.torch import load_file, save_file

    tensors = load_file(str(checkpoint / SYNCED_REFERENCE_FILENAME))
    name = sorted(tensors)[0]
    tensors[name] = tensors[name] + 1e-3
    save_file(tensors, str(checkpoint / SYNCED_REFERENCE_FILENAME))
    tampered = _trainer(tmp_path, pairs, max_steps=3, save_strategy="no", **options)
    with pytest.raises(PairDPOError) as info:  # its SHA-256 is not the manifest's
        tampered.train(resume_from_checkpoint=str(checkpoint))
    assert info.value.reason_code == "checkpoint_tampered" and SYNCED_REFERENCE_FILENAME in str(info.value)

    manifest_path = checkpoint / MANIFEST_FILENAME  # a manifest that vouches for the change: the gate still sees it
    manifest = json.loads(manifest_path.read_text())
    data = (checkpoint / SYNCED_REFERENCE_FILENAME).read_bytes()
    manifest["files"][SYNCED_REFERENCE_FILENAME] = len(data)
    manifest["sha256"][SYNCED_REFERENCE_FILENAME] = hashlib.sha256(data).hexdigest()
    manifest_path.write_text(json.dumps(manifest))
    tampered = _trainer(tmp_path, pairs, max_steps=3, save_strategy="no", **options)
    with pytest.raises(PairDPOError) as info:
        tampered.train(resume_from_checkpoint=str(checkpoint))
    assert info.value.reason_code == "reference_changed" and "parameter digest" in str(info.value)


# ---------------------------------------------------------------- step-level objectives vs gradient accumulation
class _FirstGrads(TrainerCallback):
    def __init__(self):
        self.grads = None

    def on_pre_optimizer_step(self, args, state, control, model=None, **kwargs):
        if self.grads is None:
            self.grads = {n: p.grad.detach().clone() for n, p in model.named_parameters()}


@pytest.mark.parametrize("loss_type", ["aot", "aot_unpaired", "sft"])
def test_step_level_objectives_do_not_depend_on_gradient_accumulation(tmp_path, loss_type):
    """8 pairs per step as 1 x 8, 2 x 4 or token-budget micro-batches (the same global batch): the same first
    gradient, since AOT sorts and sft averages over the optimizer step, not the micro-batch."""
    pairs = synthetic_pairs(32, seed=7)
    layouts = {
        "ga1": {"per_device_train_batch_size": 8, "gradient_accumulation_steps": 1},
        "ga2": {"per_device_train_batch_size": 4, "gradient_accumulation_steps": 2},
        "budget": {"per_device_train_batch_size": 8, "gradient_accumulation_steps": 1, "max_tokens_per_microbatch": 48},
    }
    grads = {}
    for name, layout in layouts.items():
        trainer = _trainer(
            tmp_path / name,
            pairs,
            ref_model=None if loss_type == "sft" else tiny_llama(1),
            loss_type=loss_type,
            max_steps=1,
            **layout,
        )
        recorder = _FirstGrads()
        trainer.add_callback(recorder)
        trainer.train()
        grads[name] = recorder.grads
        if name == "budget":
            assert trainer._train_sampler.microbatch_counts()[0] >= 2  # a step of several token-budget micro-batches
    scale = max(float(g.abs().max()) for g in grads["ga1"].values())
    assert math.isfinite(scale) and scale > 0
    for name in ("ga2", "budget"):
        for key, grad in grads["ga1"].items():
            assert float((grads[name][key] - grad).abs().max()) / scale < 1e-5, (name, key)


def test_run_summary_names_the_mixture_and_the_reference_free_mode(tmp_path):
    from pair_dpo_trainer.observability.summary import run_summary

    mixture = cpu_config(tmp_path, loss_type=["sigmoid", "bco_pair", "sft"], loss_weights=[0.8, 0.2, 1.0], ld_alpha=0.5)
    line = run_summary(mixture, attn_backend="x", source=None)
    assert "loss 0.8*sigmoid + 0.2*bco_pair + 1*sft (ld_alpha=0.5)" in line
    simpo = run_summary(cpu_config(tmp_path, loss_type="simpo"), attn_backend="x", source=None)
    assert "| reference-free |" in simpo and "reference reference-free" not in simpo and "loss simpo," in simpo


def test_the_run_summary_counts_one_micro_batch_in_the_singular(tmp_path):
    from pair_dpo_trainer.observability.summary import run_summary

    one = run_summary(cpu_config(tmp_path, gradient_accumulation_steps=1), attn_backend="x", source=None)
    two = run_summary(cpu_config(tmp_path, gradient_accumulation_steps=2), attn_backend="x", source=None)
    assert "(4 per rank in 1 micro-batch)" in one and "(8 per rank in 2 micro-batches)" in two
