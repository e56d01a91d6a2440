"""Sequence parallelism (``sequence_parallel_size``): Ulysses over packed pair rows, checked against one process.

The launches run real processes (ranks forked by the fork server, gloo on CPU; tests/sp_worker.py): one of 2 ranks
(one group of 2) for the model-level float64 comparison, the 3-step training run and its resume; one of 4 ranks
(2 groups of 2) for the training run against DP=1. The DP=1 runs are in this process. The host-side pieces (the
row's slices, the checks) are tested in-process.
"""

from __future__ import annotations

import json
import math

import pytest
import torch

from pair_dpo_trainer.collators.packed import PackedPairCollator
from pair_dpo_trainer.errors import ConfigError, PreferenceRowError
from pair_dpo_trainer.modeling.sequence_parallel import head_problems
from pair_dpo_trainer.parallel.sequence import sequence_parallel_problems
from tests.dpo_fixtures import cpu_config, synthetic_pairs
from tests.launch import ranks
from tests.models import tiny_llama, tiny_tokenizer
from tests.sp_worker import BUDGET, EVAL_PAIRS, STEPS, long_pairs, one_process, train_options

# ---------------------------------------------------------------- host side (no process group)


@pytest.mark.parametrize("share_prompt", [True, False])
@pytest.mark.parametrize("size", [2, 3])
def test_the_slices_of_a_row_cover_it_once_and_split_its_scored_tokens(share_prompt, size):
    features = synthetic_pairs(4, seed=5)
    whole = PackedPairCollator(share_prompt=share_prompt, score_chosen_prompts=True)(features)
    shards = [
        PackedPairCollator(share_prompt=share_prompt, score_chosen_prompts=True, sequence_shard=(r, size))(features)
        for r in range(size)
    ]
    length = shards[0].num_tokens
    assert length % size == 0 and length - whole.num_tokens < size  # padded to the group, by less than its size
    spans = [(b.sequence_shard.start, b.sequence_shard.end) for b in shards]
    assert spans == [(r * length // size, (r + 1) * length // size) for r in range(size)]
    scored = torch.cat([b.completion_positions.index_select(0, b.sequence_shard.completion_index) for b in shards])
    assert torch.equal(scored.sort().values, whole.completion_positions.sort().values)  # every scored token once
    for batch in shards:
        start, end = batch.sequence_shard.start, batch.sequence_shard.end
        local = batch.completion_positions.index_select(0, batch.sequence_shard.completion_index)
        assert bool(((local >= start) & (local < end)).all())
        prompts = batch.prompt_positions.index_select(0, batch.sequence_shard.prompt_index)
        assert bool(((prompts >= start) & (prompts < end)).all())
    assert sum(b.sequence_shard.prompt_index.numel() for b in shards) == whole.prompt_positions.numel()
    assert sum(b.num_real_tokens for b in shards) == whole.num_real_tokens  # FLOPs and throughput count once
    assert sum(b.num_unshared_tokens for b in shards) == whole.num_unshared_tokens
    assert [b.counts_pairs for b in shards] == [True] + [False] * (size - 1)
    for batch in shards:  # the first step's layout line reports the whole row on any rank
        assert batch.num_row_tokens == whole.num_real_tokens
        assert batch.num_row_unshared_tokens == whole.num_unshared_tokens


def test_each_ranks_slice_keeps_the_rows_pad_multiple():
    """float8 pads rows to a multiple of 16 tokens for its matmuls: under a group each rank's slice is one."""
    batch = PackedPairCollator(pad_to_multiple_of=16, sequence_shard=(1, 2))(synthetic_pairs(4))  # 7 x 16 alone
    assert batch.num_tokens % 32 == 0 and (batch.sequence_shard.end - batch.sequence_shard.start) % 16 == 0


def test_a_padded_budget_row_must_split_evenly_over_the_group():
    with pytest.raises(ValueError, match="multiple of the group size 2"):
        PackedPairCollator(pad_to_length=41, sequence_shard=(0, 2))
    batch = PackedPairCollator(pad_to_length=40, sequence_shard=(1, 2))(synthetic_pairs(1))
    assert (batch.num_tokens, batch.sequence_shard.start) == (40, 20)


def test_heads_that_do_not_split_over_the_group_are_refused_naming_the_counts():
    assert head_problems(32, 8, 8) == [] and head_problems(32, 2, 8) == []  # 2 key/value heads, each copied 4 times
    [(code, message)] = head_problems(12, 4, 8)
    assert code == "sequence_parallel_heads" and "12 query heads and 4 key/value heads" in message
    assert head_problems(32, 3, 8)[0][0] == "sequence_parallel_heads"


def test_what_sequence_parallelism_cannot_combine_with_is_refused():
    problems = sequence_parallel_problems(
        2, world_size=3, fsdp=True, checkpointing_mode="auto", process_group=True, step_objectives=["sft", "aot"]
    )
    assert [code for code, _ in problems] == ["sequence_parallel_world"] + ["sequence_parallel_unsupported"] * 3
    assert "multiple of 2 processes, got 3" in problems[0][1]
    assert "loss_type ['sft', 'aot'] read quantities of the whole optimizer step" in problems[2][1]
    assert sequence_parallel_problems(2, world_size=4, fsdp=False, checkpointing_mode="off", process_group=True) == []
    assert sequence_parallel_problems(1, world_size=1, fsdp=True, checkpointing_mode="auto", process_group=False) == []


def test_the_runtime_check_refuses_a_group_with_step_level_objectives_and_a_world_that_does_not_split(tmp_path):
    """The trainer's one runtime check collects every sequence-parallel problem with the others, before any group
    is created: a single process cannot form a group of 2, and ``sft`` / ``bco_pair_shift`` read step quantities."""
    from tests.dpo_fixtures import runtime_error

    args = cpu_config(tmp_path, sequence_parallel_size=2, loss_type=["sigmoid", "sft", "bco_pair_shift"])
    error = runtime_error(args)
    codes = [code for code, _ in error.problems]
    assert codes == ["sequence_parallel_world", "sequence_parallel_unsupported"], error.problems
    assert "['sft', 'bco_pair_shift']" in error.problems[1][1]
    assert runtime_error(cpu_config(tmp_path, sequence_parallel_size=2), process_group=True) is not None  # world 1
    assert runtime_error(cpu_config(tmp_path, loss_type=["sigmoid", "sft"])) is None  # no group: no refusal


def test_bad_sizes_and_accelerates_parallelism_config_are_refused_when_the_config_is_built(tmp_path):
    with pytest.raises(ConfigError) as caught:
        cpu_config(tmp_path, sequence_parallel_size=0)
    assert caught.value.reason_code == "bad_sequence_parallel_size"
    from accelerate.parallelism_config import ParallelismConfig

    with pytest.raises(ConfigError, match="sequence_parallel_size=N") as caught:
        cpu_config(tmp_path, parallelism_config=ParallelismConfig(sp_size=1))
    assert caught.value.reason_code == "unsupported_combination"


def test_a_pair_longer_than_one_ranks_budget_is_refused_without_a_group(tmp_path):
    """The long pair of the launches below (50 tokens shared) against one rank's budget: refused before training."""
    from pair_dpo_trainer import PairDPOTrainer

    options = train_options(tmp_path / "one", 1)
    with pytest.raises(PreferenceRowError) as caught:
        PairDPOTrainer(
            model=tiny_llama(0),
            args=cpu_config(tmp_path, **options),
            train_dataset=long_pairs(24),
            processing_class=tiny_tokenizer(),
        )
    assert caught.value.reason_code == "pair_too_long"


# ---------------------------------------------------------------- real processes


@pytest.fixture(scope="module")
def two_ranks(tmp_path_factory):
    out = tmp_path_factory.mktemp("sp2")
    output = ranks("sp_worker.py", out, args=("2", "model,compiled,train,resume,precompute,too_long,resize"))
    return out, output


@pytest.fixture(scope="module")
def dp1(tmp_path_factory):
    """The same training run in one process, its row budget the group's (2 x BUDGET tokens)."""
    return one_process(tmp_path_factory.mktemp("dp1"), pairs_per_step=4, eval_pairs=synthetic_pairs(EVAL_PAIRS, seed=9))


def _rel(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> float:
    return max(float((a[n] - b[n]).abs().max() / b[n].abs().max().clamp_min(1e-12)) for n in b)


@pytest.mark.distributed
@pytest.mark.slow
@pytest.mark.parametrize("case", ["kv2_shared", "kv2_unshared", "kv1_shared", "kv1_unshared"])
def test_two_ranks_give_the_log_probs_and_gradients_of_one_in_float64(two_ranks, case):
    """Per-sequence log-probs (LD-weighted and plain), the chosen prompts' NLL sums and counts, the token statistics
    and every parameter's gradient of a group of 2 equal the model run whole (float64); with 2 key/value heads (one
    per rank) and with 1 (copied to both ranks)."""
    out, _ = two_ranks
    result = json.loads((out / "model.json").read_text())[case]
    assert result["grad_norm"] > 1.0  # the loss reaches every parameter: the comparison is not of zeros
    for name in ("logps", "nll_logps", "prompt_logps", "prompt_token_counts", "token_stats", "grads"):
        assert result[name] <= 1e-12, (name, result)


@pytest.mark.distributed
@pytest.mark.slow
def test_compiled_layers_of_a_group_trace_the_all_to_alls_in_one_graph_and_match_eager(two_ranks):
    """``torch_compile``'s regional compile (fullgraph, dynamic shapes) of a group's decoder layers: the all-to-alls
    trace (no graph break: fullgraph would raise), one graph serves 3 rows of different lengths, and the log-probs and
    gradients equal the eager whole model's (float32)."""
    out, _ = two_ranks
    result = json.loads((out / "compiled.json").read_text())
    assert result["compiled"] == 2 and result["graphs"] == 1 and result["breaks"] == 0
    assert max(result["diffs"]) < 1e-4, result


@pytest.mark.distributed
@pytest.mark.slow
def test_three_adamw_steps_of_a_group_of_two_equal_one_process(two_ranks, dp1):
    """Parameters, losses (step 0 is ln 2 exactly: the group's loss counts each pair once), the first step's
    gradients and the micro-batch plan of a group of 2 (each rank holding half of every row, the long pair
    included) equal one process with the group's row budget, within fp32 noise."""
    out, stdout = two_ranks
    group = torch.load(out / "train.pt")
    assert group["microbatch_counts"] == dp1["microbatch_counts"]
    assert len(group["losses"]) == STEPS and group["losses"][0] == pytest.approx(math.log(2), abs=1e-6)
    assert group["losses"] == pytest.approx(dp1["losses"], rel=1e-5)
    assert _rel(group["grads"], dp1["grads"]) < 1e-4
    assert _rel(group["params"], dp1["params"]) < 1e-4
    for key in ("eval_loss", "eval_rewards/margins", "eval_logps/chosen"):
        assert group["eval"][key] == pytest.approx(dp1["eval"][key], abs=1e-5), key
    summary = "world_size=2 = 1 data-parallel x 2 sequence-parallel | 4 pairs/step (4 per group in rows of <= 80"
    assert summary in stdout


@pytest.mark.distributed
@pytest.mark.slow
def test_a_resumed_group_equals_the_uninterrupted_run(two_ranks):
    out, _ = two_ranks
    resumed, whole = torch.load(out / "resume.pt"), torch.load(out / "train.pt")
    assert _rel(resumed["params"], whole["params"]) == 0.0


@pytest.mark.distributed
@pytest.mark.slow
def test_reference_log_probs_precomputed_by_a_group_train_like_the_online_reference(two_ranks):
    """The precompute pass under groups (each pair computed by its group, reported once) gives the online run's
    losses."""
    out, _ = two_ranks
    precomputed = json.loads((out / "precompute.json").read_text())["losses"]
    online = torch.load(out / "train.pt")["losses"]
    assert precomputed == pytest.approx(online, abs=1e-6)


@pytest.mark.distributed
@pytest.mark.slow
def test_a_pair_longer_than_the_groups_row_is_refused_on_every_rank_naming_the_limit(two_ranks):
    out, _ = two_ranks
    for rank in range(2):
        result = json.loads((out / f"too_long_rank{rank}.json").read_text())
        assert result["reason_code"] == "pair_too_long", result
        assert "costs 50 tokens" in result["message"]
        assert "max_tokens_per_microbatch=20 tokens per rank x sequence_parallel_size=2 = 40" in result["message"]


@pytest.mark.distributed
@pytest.mark.slow
def test_a_group_checkpoint_resumed_with_another_data_parallel_size_is_refused_on_every_rank(two_ranks):
    """2 ranks without groups are 2 data-parallel ranks: the schedule differs from the group's, so the resumed step
    would index other pairs."""
    out, _ = two_ranks
    codes = [json.loads((out / f"resize_rank{r}.json").read_text())["reason_code"] for r in range(2)]
    assert codes == ["resume_data_mismatch", "resume_data_mismatch"]


@pytest.mark.distributed
@pytest.mark.slow
def test_a_group_checkpoint_resumed_by_one_process_with_the_same_schedule_equals_the_group(two_ranks, tmp_path):
    """One process with the group's row budget plans the group's schedule: the group's checkpoint-2 resumed there
    trains step 3 to the group's parameters (the group size changes nothing but who computes which tokens)."""
    from pair_dpo_trainer import PairDPOTrainer

    out, _ = two_ranks
    options = train_options(tmp_path / "run", 1, max_tokens_per_microbatch=2 * BUDGET, save_strategy="no")
    trainer = PairDPOTrainer(
        model=tiny_llama(0), args=cpu_config(tmp_path, **options), train_dataset=long_pairs(24),
        processing_class=tiny_tokenizer(),
    )  # fmt: skip
    trainer.train(resume_from_checkpoint=str(out / "run" / "checkpoint-2"))
    whole = torch.load(out / "train.pt")
    params = {n: p.detach() for n, p in trainer.model.named_parameters()}
    assert _rel(params, whole["params"]) < 1e-5


@pytest.fixture(scope="module")
def four_ranks(tmp_path_factory):
    out = tmp_path_factory.mktemp("sp2dp2")
    ranks("sp_worker.py", out, nproc=4, args=("2", "train"))
    return torch.load(out / "train.pt")


@pytest.mark.distributed
@pytest.mark.slow
def test_two_groups_of_two_equal_one_process_over_the_same_eight_pairs_per_step(four_ranks, tmp_path):
    """4 ranks = 2 data-parallel groups x 2 sequence-parallel ranks, 4 pairs per group per step, against one process
    with the 8 pairs of each step (its row budget the group's): the same gradients, losses, parameters and eval (DDP's
    mean over 4 ranks of 2 groups' shares is the mean over the step's pairs; the eval's 13 pairs split over 2
    groups)."""
    one = one_process(tmp_path, pairs_per_step=8, eval_pairs=synthetic_pairs(EVAL_PAIRS, seed=9))
    assert four_ranks["losses"][0] == pytest.approx(math.log(2), abs=1e-6)
    assert four_ranks["losses"] == pytest.approx(one["losses"], rel=1e-5)
    assert _rel(four_ranks["grads"], one["grads"]) < 1e-4
    assert _rel(four_ranks["params"], one["params"]) < 1e-4
    for key in ("eval_loss", "eval_rewards/margins", "eval_logps/chosen"):
        assert four_ranks["eval"][key] == pytest.approx(one["eval"][key], abs=1e-5), key
