"""TRL 1.16's ``DPOTrainer`` and ours, trained on the same model, rows and settings (``tests/trl/harness.py``).

For every ``loss_type`` the two share, the losses, every shared metric (names and values) and the tokens per step
agree at every step; so do string rows, conversations, implicit prompts (strings and conversations) and LoRA. Where
we deliberately differ, the test shows the difference and that the run summary says it. Runs are cached in the
harness and shared with ``test_migration_guide.py``. TRL is test-only: skipped without it.
"""

from __future__ import annotations

import pytest

from tests.trl import harness

pytest.importorskip("trl")
pytestmark = pytest.mark.slow  # 2 trainings of 3 steps per case, ~3 s each on 2 cores

TRL_LOSSES = (
    "sigmoid",
    "hinge",
    "ipo",
    "exo_pair",
    "nca_pair",
    "robust",
    "bco_pair",
    "sppo_hard",
    "aot",
    "aot_unpaired",
    "apo_zero",
    "apo_down",
    "discopop",
    "sft",
    "sigmoid_norm",
)
"""TRL 1.16's ``DPOTrainer`` loss types: every one exists here under its name with TRL's formula."""


REWARDS = ("rewards/chosen", "rewards/rejected", "rewards/margins", "rewards/accuracies")


@pytest.mark.parametrize("loss_type", TRL_LOSSES)
def test_every_trl_loss_type_trains_exactly_as_trl(loss_type):
    trl, ours, summary = harness.run("strings", harness.options_for([loss_type]))
    assert trl.values("loss")[-1] != trl.values("loss")[0]  # the runs moved
    if loss_type != "sft":
        assert harness.same(trl, ours) == [], loss_type
        return
    # sft alone needs no reference: none is built here, so the rewards are beta * log pi (TRL builds one anyway and
    # logs rewards against it); the loss, the gradient and every other metric are TRL's
    assert harness.same(trl, ours, tuple(n for n in harness.SHARED_METRICS if n not in REWARDS)) == []
    assert set(harness.same(trl, ours, REWARDS)) >= {"rewards/chosen", "rewards/rejected"}
    assert "| reference-free |" in summary and "rewards/* are beta * log pi" in summary


def test_a_mixture_trains_as_trl_and_logs_its_components():
    options = harness.options_for(["sigmoid", "bco_pair", "sft"], loss_weights=[0.8, 0.2, 1.0])
    trl, ours, summary = harness.run("strings", options)
    assert harness.same(trl, ours) == []
    assert {"loss/sigmoid", "loss/bco_pair", "loss/sft"} <= ours.names
    assert "0.8*sigmoid + 0.2*bco_pair + 1*sft" in summary


@pytest.mark.parametrize("rows", sorted(harness.ROWS))
def test_every_row_shape_gives_trls_tokens_losses_and_metrics(rows):
    """Plain strings (raw text, no template, although the tokenizer has one), conversations (the template), and
    rows whose prompt is only inside chosen / rejected (TRL's extract_prompt): the same tokens per step too."""
    trl, ours, summary = harness.run(rows, harness.options_for(["sigmoid"]))
    assert harness.same(trl, ours) == [], rows
    rendering = "chat template" if "conversations" in rows else "raw text"
    assert f"train: {rendering}" in summary


def test_the_metric_names_are_trls_plus_throughput():
    trl, ours, _ = harness.run("strings", harness.options_for(["sigmoid"]))
    assert trl.names <= ours.names
    assert ours.names - trl.names == {"tokens_per_second", "pairs_per_second", "packed_tokens_per_second"}
    assert set(harness.SHARED_METRICS) <= trl.names


def test_lora_through_peft_config_trains_as_trl():
    """``peft_config=`` wraps the policy as TRL does (seeded adapters); the reference is the adapter-disabled base."""
    pytest.importorskip("peft")
    trl, ours, summary = harness.run("conversations", harness.options_for(["sigmoid"]), lora=True)
    assert harness.same(trl, ours) == []
    assert "the policy with its PEFT adapters disabled" in summary


def test_label_smoothing_makes_sigmoid_cdpo_here_trl_ignores_it_and_the_summary_says_so():
    plain = harness.run("strings", harness.options_for(["sigmoid"]))
    trl, ours, summary = harness.run("strings", harness.options_for(["sigmoid"], label_smoothing=0.2))
    assert harness.same(trl, plain[0]) == []  # TRL: label_smoothing changes nothing for sigmoid
    assert "loss" in harness.same(trl, ours)
    assert "makes 'sigmoid' conservative DPO (cDPO" in summary and "TRL 1.16's 'sigmoid' ignores" in summary


def test_the_papers_forms_have_their_own_names_and_differ_from_trls():
    """``ipo_sum`` (IPO's Eq. 17 on summed log-ratios) differs from TRL's ``ipo`` once the policy moves;
    ``bco_pair_shift`` (BCO's running reward shift) equals TRL's ``bco_pair`` at step 1, then differs."""
    trl, ours, _ = harness.run("strings", {"loss_type": ["ipo"]}, {"loss_type": ["ipo_sum"]})
    assert ours.values("loss")[0] == trl.values("loss")[0]  # the policy is the reference at step 1: both (1/2b)^2
    assert ours.values("loss")[1] != pytest.approx(trl.values("loss")[1], rel=1e-3)
    trl, shifted, _ = harness.run("strings", {"loss_type": ["bco_pair"]}, {"loss_type": ["bco_pair_shift"]})
    _, plain, _ = harness.run("strings", {"loss_type": ["bco_pair"]})  # equal to TRL's (the test above)
    assert shifted.values("loss")[0] == plain.values("loss")[0]  # no previous step: delta = 0
    assert shifted.values("loss")[1:] != plain.values("loss")[1:]  # the running reward mean of the steps before
