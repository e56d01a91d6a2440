"""Precomputed reference log-probs in one process: same losses as the online reference, a keyed cache that is reused
without building the reference, the identity on resume; and the DeepSpeed reference configuration (no launch)."""

from __future__ import annotations

import json
import shutil

import pytest
import torch

from pair_dpo_trainer import ConfigError, PairDPOConfig, PairDPOTrainer, SnapshotIntegrityError
from pair_dpo_trainer.collators.packed import PackedPairCollator
from pair_dpo_trainer.demo import DEMO_REVISION, bundled_model_dir, bundled_pairs_path
from pair_dpo_trainer.integrity import IDENTITY_FILENAME, parameter_digest, read_identity
from pair_dpo_trainer.reference import manager as manager_module
from pair_dpo_trainer.reference.deepspeed import reference_ds_config
from pair_dpo_trainer.reference.precompute import PrecomputedReference, dataset_fingerprint
from pair_dpo_trainer.training.checks import check_config
from tests.dpo_fixtures import cpu_config, synthetic_pairs
from tests.models import tiny_llama, tiny_tokenizer
from tests.test_reference_gate import _reweight


def _trainer(tmp_path, *, pairs=None, out="out", model=None, **kwargs) -> PairDPOTrainer:
    options = dict(output_dir=str(tmp_path / out), max_steps=4)
    options.update(kwargs)
    return PairDPOTrainer(
        model=model if model is not None else tiny_llama(0),
        args=cpu_config(tmp_path, **options),
        train_dataset=pairs if pairs is not None else synthetic_pairs(40),
        eval_dataset=synthetic_pairs(10, seed=4),
        processing_class=tiny_tokenizer(),
    )


def _losses(trainer: PairDPOTrainer) -> list[float]:
    return [entry["loss"] for entry in trainer.state.log_history if "loss" in entry]


def _no_build(*args, **kwargs):
    raise AssertionError("the reference was built although the cache holds its log-probs")


@pytest.mark.integration
def test_precomputed_equals_online_and_the_cache_is_reused_without_building_the_reference(tmp_path, monkeypatch):
    online = _trainer(tmp_path, out="online")
    online.train()
    first = _trainer(tmp_path, precompute_ref_log_probs=True)
    first.train()
    assert first.reference_manager.builds == 1 and isinstance(first.reference, PrecomputedReference)
    assert _losses(first) == pytest.approx(_losses(online), abs=1e-6)
    assert first.evaluate()["eval_loss"] == pytest.approx(online.evaluate()["eval_loss"], abs=1e-6)
    cache = tmp_path / "out" / "ref_logps_cache"
    assert len(list(cache.glob("ref_logps-*.pt"))) == 2  # train and eval
    assert not list(cache.glob(".*tmp"))  # written atomically, nothing left behind

    monkeypatch.setattr(manager_module, "build_reference", _no_build)
    again = _trainer(tmp_path, precompute_ref_log_probs=True)
    again.train()
    assert again.reference_manager.builds == 0
    assert _losses(again) == _losses(first)
    assert again.reference_identity == first.reference_identity  # from the cache, without the model


@pytest.mark.integration
def test_precompute_with_a_token_budget_keeps_its_micro_batches_within_it(tmp_path, monkeypatch):
    """The reference pass of a budget run packs by the same budget (and equals the online budget run)."""
    from pair_dpo_trainer.reference import precompute

    budget = dict(per_device_train_batch_size=8, gradient_accumulation_steps=1, max_tokens_per_microbatch=50)
    online = _trainer(tmp_path, out="online", **budget)
    online.train()
    rows = []

    class RecordingLoader(precompute.DataLoader):  # the reference pass's loader
        def __iter__(self):
            for batch in super().__iter__():
                rows.append(batch.num_tokens)
                yield batch

    monkeypatch.setattr(precompute, "DataLoader", RecordingLoader)
    pre = _trainer(tmp_path, precompute_ref_log_probs=True, per_device_eval_batch_size=64, **budget)
    pre.train()
    assert rows and max(rows) <= 50 < sum(rows) / 2  # the pass ran in budget-sized rows, not 64-pair ones
    assert _losses(pre) == pytest.approx(_losses(online), abs=1e-6)


@pytest.mark.integration
def test_a_different_key_recomputes(tmp_path):
    _trainer(tmp_path, precompute_ref_log_probs=True).train()
    cache = tmp_path / "out" / "ref_logps_cache"
    before = set(cache.glob("ref_logps-*.pt"))
    other_data = _trainer(tmp_path, precompute_ref_log_probs=True, pairs=synthetic_pairs(40, seed=9))
    other_data.train()
    assert other_data.reference_manager.builds == 1
    other_length = _trainer(tmp_path, precompute_ref_log_probs=True, max_length=2048)
    other_length.train()
    assert other_length.reference_manager.builds == 1
    other_reference = _trainer(tmp_path, precompute_ref_log_probs=True, model=tiny_llama(3))  # unpinned: its digest
    other_reference.train()
    assert other_reference.reference_manager.builds == 1
    other_layout = _trainer(tmp_path, precompute_ref_log_probs=True, share_prompt=False)  # prompts packed twice
    other_layout.train()
    assert other_layout.reference_manager.builds == 1
    # new data: a new train entry (the eval set is the same); new length, reference or layout: new train and eval ones
    assert len(set(cache.glob("ref_logps-*.pt")) - before) == 1 + 2 + 2 + 2


@pytest.mark.integration
def test_an_unreadable_cache_file_is_recomputed(tmp_path):
    _trainer(tmp_path, precompute_ref_log_probs=True).train()
    for path in (tmp_path / "out" / "ref_logps_cache").glob("ref_logps-*.pt"):
        path.write_bytes(b"not a torch file")
    trainer = _trainer(tmp_path, precompute_ref_log_probs=True)
    trainer.train()
    assert trainer.reference_manager.builds == 1


def test_evaluating_another_dataset_computes_its_log_probs(tmp_path):
    trainer = _trainer(tmp_path, precompute_ref_log_probs=True)
    other = synthetic_pairs(6, seed=11)
    metrics = trainer.evaluate(other)
    online = _trainer(tmp_path, out="online").evaluate(other)
    assert metrics["eval_loss"] == pytest.approx(online["eval_loss"], abs=1e-6)


@pytest.mark.integration
def test_a_changed_pinned_reference_is_refused_on_resume_before_the_reference_pass(tmp_path):
    model_dir = tmp_path / "snapshot"
    shutil.copytree(bundled_model_dir(), model_dir)
    rows = [json.loads(line) for line in open(bundled_pairs_path(), encoding="utf-8").readlines()[:32]]

    def trainer(max_steps: int) -> PairDPOTrainer:
        config = PairDPOConfig(
            output_dir=str(tmp_path / "out"),
            report_to="none",
            use_cpu=True,
            disable_tqdm=True,
            per_device_train_batch_size=4,
            gradient_accumulation_steps=1,
            max_steps=max_steps,
            save_strategy="steps",
            save_steps=2,
            max_length=128,
            max_prompt_length=64,
            ref_model_revision=DEMO_REVISION,
            precompute_ref_log_probs=True,
        )
        return PairDPOTrainer(model=str(model_dir), args=config, train_dataset=rows)

    first = trainer(2)
    first.train()
    identity = read_identity(tmp_path / "out" / "checkpoint-2")
    assert identity.pinned and identity == first.reference_identity
    cache = tmp_path / "out" / "ref_logps_cache"
    entries = set(cache.glob("ref_logps-*.pt"))
    trainer(4).train(resume_from_checkpoint=True)  # same snapshot: the cache is reused and the identity matches
    _reweight(model_dir, scale=1.5)  # verifies against its rewritten metadata, but is another reference
    changed = trainer(4)
    with pytest.raises(SnapshotIntegrityError) as info:
        changed.train(resume_from_checkpoint=True)
    assert info.value.reason_code == "reference_changed"
    assert set(cache.glob("ref_logps-*.pt")) == entries  # refused before the pass: nothing was computed
    assert changed.state.global_step == 0
    assert (tmp_path / "out" / "checkpoint-4" / IDENTITY_FILENAME).is_file()


def test_collator_packs_ref_logps_as_float32_in_sequence_order():
    features = [
        {"prompt_input_ids": [5, 6], "chosen_input_ids": [7, 2], "rejected_input_ids": [8, 2]},
        {"prompt_input_ids": [5], "chosen_input_ids": [9, 2], "rejected_input_ids": [4, 2]},
    ]
    assert PackedPairCollator()(features).ref_logps is None
    with_logps = [dict(f, ref_chosen_logps=-1.0 - i, ref_rejected_logps=-2.0 - i) for i, f in enumerate(features)]
    batch = PackedPairCollator()(with_logps).to("cpu")
    assert batch.ref_logps.dtype == torch.float32
    assert batch.ref_logps.tolist() == [-1.0, -2.0, -2.0, -3.0]
    with pytest.raises(ConfigError) as info:
        PackedPairCollator()([with_logps[0], features[1]])
    assert info.value.reason_code == "ref_logps_missing"
    with pytest.raises(ConfigError) as info:
        PrecomputedReference().sequence_logps(PackedPairCollator()(features))
    assert info.value.reason_code == "ref_logps_missing"


def test_dataset_fingerprint_depends_on_token_ids_only():
    datasets = pytest.importorskip("datasets")
    pairs = synthetic_pairs(12)
    as_dataset = datasets.Dataset.from_list([dict(p, extra="x") for p in pairs])
    assert dataset_fingerprint(as_dataset) == dataset_fingerprint(pairs)
    changed = [dict(p) for p in pairs]
    changed[5] = dict(changed[5], chosen_input_ids=changed[5]["chosen_input_ids"] + [7])
    assert dataset_fingerprint(changed) != dataset_fingerprint(pairs)


def test_precompute_with_reference_free_and_offload_without_deepspeed_are_refused(tmp_path):
    with pytest.raises(ConfigError) as info:
        check_config(PairDPOConfig(output_dir=str(tmp_path), reference_free=True, precompute_ref_log_probs=True))
    assert info.value.reason_code == "unsupported_combination"
    with pytest.raises(ConfigError) as info:
        _trainer(tmp_path, ref_offload_params=True)
    assert info.value.reason_code == "unsupported_combination" and "DeepSpeed" in str(info.value)
    for stage in (0, 3):
        with pytest.raises(ConfigError) as info:
            _trainer(tmp_path, ref_zero_stage=stage)
        assert info.value.reason_code == "unsupported_combination" and "ref_zero_stage" in str(info.value)


def test_parameter_digest_accepts_loaders_called_in_sorted_order():
    model = tiny_llama(0)
    calls: list[str] = []

    def loader(name, param):
        def load():
            calls.append(name)
            return param

        return load

    lazy = parameter_digest((name, loader(name, p)) for name, p in model.named_parameters())
    assert lazy == parameter_digest(model.named_parameters())
    assert calls == sorted(calls) and len(calls) == len(list(model.parameters()))


TRAIN_DS_CONFIG = {
    "train_micro_batch_size_per_gpu": 2,
    "gradient_accumulation_steps": 2,
    "optimizer": {"type": "AdamW", "params": {"lr": 1e-5}},
    "scheduler": {"type": "WarmupLR"},
    "bf16": {"enabled": True},
    "zero_optimization": {
        "stage": 3,
        "offload_optimizer": {"device": "cpu"},
        "offload_param": {"device": "cpu"},
        "reduce_bucket_size": "auto",
        "stage3_param_persistence_threshold": 0,
    },
}


def test_reference_ds_config_is_inference_only_and_scales_with_the_hidden_size():
    config = reference_ds_config(TRAIN_DS_CONFIG, hidden_size=1024, offload_params=None)
    assert "optimizer" not in config and "scheduler" not in config and config["bf16"] == {"enabled": True}
    zero = config["zero_optimization"]
    assert zero["stage"] == 3 and "offload_optimizer" not in zero
    assert zero["offload_param"] == {"device": "cpu"}  # None: as the policy
    assert zero["reduce_bucket_size"] == 1024 * 1024
    assert zero["stage3_prefetch_bucket_size"] == int(0.9 * 1024 * 1024)
    assert zero["stage3_param_persistence_threshold"] == 0  # the user's value wins
    assert TRAIN_DS_CONFIG["zero_optimization"]["reduce_bucket_size"] == "auto"  # the run's config is untouched
    on_device = reference_ds_config(TRAIN_DS_CONFIG, hidden_size=8, offload_params=False)
    assert on_device["zero_optimization"]["offload_param"] == {"device": "none"}
    assert (
        reference_ds_config(TRAIN_DS_CONFIG, hidden_size=8, offload_params=True)["zero_optimization"]["offload_param"][
            "device"
        ]
        == "cpu"
    )


def test_reference_ds_config_replicates_without_zero3_and_names_bad_options():
    stage2 = dict(TRAIN_DS_CONFIG, zero_optimization={"stage": 2})
    assert reference_ds_config(stage2, hidden_size=8, offload_params=None)["zero_optimization"] == {"stage": 0}
    with pytest.raises(ConfigError) as info:
        reference_ds_config(stage2, hidden_size=8, offload_params=True)
    assert info.value.reason_code == "unsupported_combination"
    with pytest.raises(ConfigError) as info:
        reference_ds_config(TRAIN_DS_CONFIG, hidden_size=None, offload_params=None)
    assert info.value.reason_code == "bad_deepspeed_config"


def test_reference_ds_config_zero_stage_replicates_or_shards_the_reference():
    for stage in (None, 3):  # a ZeRO-3 policy: sharded by default
        assert reference_ds_config(TRAIN_DS_CONFIG, hidden_size=8, offload_params=None, zero_stage=stage) == (
            reference_ds_config(TRAIN_DS_CONFIG, hidden_size=8, offload_params=None)
        )
    replicated = reference_ds_config(TRAIN_DS_CONFIG, hidden_size=None, offload_params=False, zero_stage=0)
    assert replicated["zero_optimization"] == {"stage": 0}  # no hidden size needed, no offload
    assert replicated["bf16"] == {"enabled": True} and "optimizer" not in replicated and "scheduler" not in replicated
    stage2 = dict(TRAIN_DS_CONFIG, zero_optimization={"stage": 2})
    assert reference_ds_config(stage2, hidden_size=8, offload_params=None, zero_stage=0)["zero_optimization"] == {
        "stage": 0
    }
    for config, stage, offload, option in (
        (stage2, 3, None, "ref_zero_stage=3"),  # nothing to shard like
        (TRAIN_DS_CONFIG, 0, True, "ref_offload_params=True"),  # offloading needs a sharded reference
    ):
        with pytest.raises(ConfigError) as info:
            reference_ds_config(config, hidden_size=8, offload_params=offload, zero_stage=stage)
        assert info.value.reason_code == "unsupported_combination" and option in str(info.value)
    with pytest.raises(ConfigError) as info:
        reference_ds_config(TRAIN_DS_CONFIG, hidden_size=8, offload_params=None, zero_stage=2)
    assert info.value.reason_code == "bad_ref_zero_stage"


def test_reference_zero_init_loads_a_replicated_reference_whole_in_a_zero3_run():
    pytest.importorskip("deepspeed")
    from transformers.integrations import deepspeed as hf_deepspeed

    from pair_dpo_trainer.reference.deepspeed import reference_zero_init

    run = hf_deepspeed.HfDeepSpeedConfig({"train_micro_batch_size_per_gpu": 1, "zero_optimization": {"stage": 3}})
    try:
        replicated = reference_ds_config(run.config, hidden_size=8, offload_params=None, zero_stage=0)
        with reference_zero_init(replicated):  # from_pretrained sees no ZeRO-3 run: no zero.Init (tests/ds_worker.py)
            assert not hf_deepspeed.is_deepspeed_zero3_enabled() and hf_deepspeed.deepspeed_config() is None
        assert hf_deepspeed.is_deepspeed_zero3_enabled() and hf_deepspeed.deepspeed_config() is run.config
        with pytest.raises(RuntimeError), reference_zero_init(replicated):
            raise RuntimeError("a failed load")
        assert hf_deepspeed.deepspeed_config() is run.config  # restored on errors too
    finally:
        hf_deepspeed.unset_hf_deepspeed_config()


def test_a_partitioned_model_is_refused_by_a_replicated_reference_engine():
    pytest.importorskip("deepspeed")
    from pair_dpo_trainer.reference.deepspeed import build_deepspeed_reference

    model = tiny_llama(0)
    next(model.parameters()).ds_id = 0  # as deepspeed.zero.Init marks a partitioned parameter
    with pytest.raises(ConfigError) as info:
        build_deepspeed_reference(model, config={"zero_optimization": {"stage": 0}}, chunk_size=64)
    assert info.value.reason_code == "unsupported_combination" and "ref_zero_stage=0" in str(info.value)


def test_reference_zero_init_swaps_the_global_deepspeed_config_only_inside():
    pytest.importorskip("deepspeed")
    from transformers.integrations import deepspeed as hf_deepspeed

    from pair_dpo_trainer.reference.deepspeed import reference_zero_init

    run = hf_deepspeed.HfDeepSpeedConfig({"train_micro_batch_size_per_gpu": 1, "zero_optimization": {"stage": 3}})
    try:
        reference = reference_ds_config(run.config, hidden_size=8, offload_params=True)
        with reference_zero_init(reference):
            assert hf_deepspeed.deepspeed_config()["zero_optimization"]["offload_param"]["device"] == "cpu"
        assert hf_deepspeed.deepspeed_config() is run.config
    finally:
        hf_deepspeed.unset_hf_deepspeed_config()
    with reference_zero_init(reference):  # no ZeRO-3 run: nothing to swap
        assert hf_deepspeed.deepspeed_config() is None
