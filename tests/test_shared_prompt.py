"""The shared-prompt layout (``[p c r]`` per pair, the prompt computed once) against the unshared one (``[p c][p r]``):
the row itself, the attention mask it implies, and, in float64 on the tiny model, per-sequence log-probs, every
objective's loss and every parameter's gradient, on the pair shapes where an off-by-one would show."""

from __future__ import annotations

import random

import pytest
import torch
from transformers.models.llama import modeling_llama

from pair_dpo_trainer.collators import PackedPairCollator
from pair_dpo_trainer.data.tokenize import truncate_pair
from pair_dpo_trainer.losses import LOSS_FUNCTIONS
from pair_dpo_trainer.losses.base import LossParams, StepContext
from pair_dpo_trainer.losses.length_weights import with_length_desensitization
from pair_dpo_trainer.modeling import enable_pair_varlen
from pair_dpo_trainer.modeling.attention import varlen_attention
from pair_dpo_trainer.modeling.logprobs import packed_policy_logps, packed_sequence_logps
from pair_dpo_trainer.testing.cpu_varlen import block_mask_varlen_attn, install_traceable_varlen
from pair_dpo_trainer.training.pair_logps import pair_logps_from_sequences
from tests.models import EOS, VOCAB, tiny_llama

FEATURES = ("prompt_input_ids", "chosen_input_ids", "rejected_input_ids")


def _pair(prompt, chosen, rejected) -> dict[str, list[int]]:
    return dict(zip(FEATURES, (list(prompt), list(chosen), list(rejected)), strict=True))


def _tokens(rng: random.Random, length: int) -> list[int]:
    return [rng.randrange(4, VOCAB) for _ in range(length)]


def _truncated_pair(rng: random.Random) -> dict[str, list[int]]:
    cut = truncate_pair(_tokens(rng, 9), _tokens(rng, 8) + [EOS], _tokens(rng, 6) + [EOS], max_length=12,
                        max_prompt_length=5)  # fmt: skip
    assert cut.truncated
    return _pair(cut.prompt_ids, cut.chosen_ids, cut.rejected_ids)


def _cases() -> dict[str, list[dict[str, list[int]]]]:
    rng = random.Random(3)
    shared_head = _tokens(rng, 4)
    return {
        "one_token_prompts": [_pair(_tokens(rng, 1), _tokens(rng, 3), _tokens(rng, 5)) for _ in range(3)],
        "prompt_longer_than_completions": [_pair(_tokens(rng, 17), _tokens(rng, 2), _tokens(rng, 3))],
        "one_token_completions": [_pair(_tokens(rng, 4), _tokens(rng, 1), _tokens(rng, 1)) for _ in range(2)],
        "chosen_equals_rejected_but_last": [_pair(_tokens(rng, 3), shared_head + [5], shared_head + [6])],
        "truncated_pairs": [_truncated_pair(rng) for _ in range(2)],
        "empty_prompt": [_pair([], _tokens(rng, 3), _tokens(rng, 2))],
        "many_pairs_in_one_row": [
            _pair(_tokens(rng, rng.randint(1, 9)), _tokens(rng, rng.randint(1, 6)), _tokens(rng, rng.randint(1, 6)))
            for _ in range(12)
        ],
    }


CASES = _cases()


def test_literal_shared_row() -> None:
    batch = PackedPairCollator(share_prompt=True)([_pair([5, 6], [7, 2], [8, 9, 2])])
    assert batch.input_ids.tolist() == [[5, 6, 7, 2, 8, 9, 2]]
    assert batch.position_ids.tolist() == [[0, 1, 2, 3, 2, 3, 4]]
    assert batch.cu_seqlens.tolist() == [0, 4, 7] and batch.max_seqlen == 4
    assert batch.kv_index.tolist() == [0, 1, 2, 3, 0, 1, 4, 5, 6]
    assert batch.cu_seqlens_k.tolist() == [0, 4, 9] and batch.max_seqlen_k == 5
    assert batch.completion_positions.tolist() == [1, 2, 1, 4, 5]
    assert batch.completion_targets.tolist() == [7, 2, 8, 9, 2]
    assert batch.completion_sequences.tolist() == [0, 0, 1, 1, 1]
    assert batch.num_real_tokens == 7 and batch.num_unshared_tokens == 9 and batch.num_shared_prompt_tokens == 2


@pytest.mark.parametrize("case", sorted(CASES))
@pytest.mark.parametrize("pad", [None, 8])
def test_shared_row_describes_the_unshared_sequences(case: str, pad: int | None) -> None:
    """The keys gathered for each segment are exactly the unshared sequence (ids and positions), and every scored
    token is scored by the same (context, target) as in the unshared row."""
    features = CASES[case]
    shared = PackedPairCollator(share_prompt=True, pad_to_multiple_of=pad)(features)
    plain = PackedPairCollator(pad_to_multiple_of=pad)(features)
    real, sequences = plain.num_real_tokens, plain.num_sequences + 1
    gathered_ids = shared.input_ids[0].index_select(0, shared.kv_index)
    gathered_positions = shared.position_ids[0].index_select(0, shared.kv_index)
    assert torch.equal(gathered_ids[:real], plain.input_ids[0, :real])
    assert torch.equal(gathered_positions[:real], plain.position_ids[0, :real])
    assert torch.equal(shared.cu_seqlens_k[:sequences], plain.cu_seqlens[:sequences])
    assert shared.num_tokens % 8 == 0 if pad else shared.num_pad_tokens == 0
    assert shared.num_real_tokens == sum(len(f[k]) for f in features for k in FEATURES)
    assert shared.num_unshared_tokens == plain.num_real_tokens
    assert torch.equal(shared.scored_targets(), plain.scored_targets())
    assert torch.equal(shared.scored_sequences(), plain.scored_sequences())
    # a scored row holds the token just before its target in the scored sequence
    contexts = plain.input_ids[0].index_select(0, plain.completion_positions)
    assert torch.equal(shared.input_ids[0].index_select(0, shared.completion_positions), contexts)


def _allowed(batch) -> torch.Tensor:
    """``[T, T]`` bool: query row ``i`` may attend to row ``j``, from the batch's query/key segments and ``kv_index``
    under the bottom-right causal rule, built with plain Python."""
    total = batch.num_tokens
    allowed = torch.zeros(total, total, dtype=torch.bool)
    cu_q, cu_k, kv = batch.cu_seqlens.tolist(), batch.cu_seqlens_k.tolist(), batch.kv_index.tolist()
    for s in range(len(cu_q) - 1):
        length_q, length_k = cu_q[s + 1] - cu_q[s], cu_k[s + 1] - cu_k[s]
        for i in range(length_q):
            for j in range(i + length_k - length_q + 1):
                allowed[cu_q[s] + i, kv[cu_k[s] + j]] = True
    return allowed


@pytest.mark.parametrize("case", ["many_pairs_in_one_row", "one_token_completions", "empty_prompt"])
def test_no_rejected_query_attends_to_a_chosen_key(case: str) -> None:
    features = CASES[case]
    batch = PackedPairCollator(share_prompt=True, pad_to_multiple_of=8)(features)
    allowed = _allowed(batch)
    start = 0
    for feature in features:
        p, c, r = (len(feature[k]) for k in FEATURES)
        prompt, chosen, rejected = (range(start, start + p), range(start + p, start + p + c),
                                    range(start + p + c, start + p + c + r))  # fmt: skip
        for i in rejected:
            seen = set(allowed[i].nonzero().flatten().tolist())
            assert seen == set(prompt) | set(range(rejected.start, i + 1))  # never a chosen key
        for i in [*prompt, *chosen]:
            assert set(allowed[i].nonzero().flatten().tolist()) == set(range(start, i + 1))
        start += p + c + r


@pytest.mark.parametrize("kernel", ["sdpa_segments", "block_mask"])
def test_attention_kernels_follow_the_query_and_key_segments(kernel: str) -> None:
    """Both CPU kernels against explicit softmax attention under :func:`_allowed`; and the gradient of a rejected
    output with respect to a chosen key is exactly zero."""
    batch = PackedPairCollator(share_prompt=True, pad_to_multiple_of=8)(CASES["many_pairs_in_one_row"])
    gen = torch.Generator().manual_seed(0)
    total = batch.num_tokens
    q = torch.randn(total, 4, 8, generator=gen, dtype=torch.float64)
    k, v = (torch.randn(total, 2, 8, generator=gen, dtype=torch.float64, requires_grad=True) for _ in range(2))
    kg, vg = k.index_select(0, batch.kv_index), v.index_select(0, batch.kv_index)
    if kernel == "sdpa_segments":
        out = varlen_attention(q, kg, vg, batch.cu_seqlens, batch.max_seqlen, backend="sdpa_segments", scale=0.3,
                               cu_seqlens_k=batch.cu_seqlens_k, max_seqlen_k=batch.max_seqlen_k)  # fmt: skip
    else:
        out = block_mask_varlen_attn(q, kg, vg, batch.cu_seqlens, batch.cu_seqlens_k, batch.max_seqlen,
                                     batch.max_seqlen_k, scale=0.3, window_size=(-1, 0), enable_gqa=True)  # fmt: skip
    scores = torch.einsum("ihd,jhd->hij", q, k.repeat_interleave(2, dim=1)) * 0.3
    expected = torch.einsum("hij,jhd->ihd", scores.masked_fill(~_allowed(batch), float("-inf")).softmax(-1),
                            v.repeat_interleave(2, dim=1))  # fmt: skip
    torch.testing.assert_close(out, expected, rtol=1e-12, atol=1e-12)
    rejected_rows = batch.sequence_index[0] % 2 == 1
    chosen_rows = (batch.sequence_index[0] % 2 == 0) & (batch.sequence_index[0] < batch.num_sequences)
    chosen_completion = chosen_rows & ~_prompt_rows(CASES["many_pairs_in_one_row"], total)
    grad_k, grad_v = torch.autograd.grad(out[rejected_rows].sum(), (k, v))
    assert grad_k[chosen_completion].abs().max() == 0 and grad_v[chosen_completion].abs().max() == 0
    assert grad_k[~chosen_completion].abs().max() > 0


def _prompt_rows(features, total: int) -> torch.Tensor:
    rows = torch.zeros(total, dtype=torch.bool)
    start = 0
    for feature in features:
        p, c, r = (len(feature[k]) for k in FEATURES)
        rows[start : start + p] = True
        start += p + c + r
    return rows


def _float64_norm(self, hidden: torch.Tensor) -> torch.Tensor:
    """Llama's RMSNorm in the input's dtype (transformers computes it in float32, which rounds a float64 model's
    gradients to float32 where the two layouts sum the prompt's two gradient streams in different places)."""
    variance = hidden.pow(2).mean(-1, keepdim=True)
    return self.weight * (hidden * torch.rsqrt(variance + self.variance_epsilon))


@pytest.fixture
def float64_llama(monkeypatch: pytest.MonkeyPatch):
    monkeypatch.setattr(modeling_llama.LlamaRMSNorm, "forward", _float64_norm)
    policy, reference = tiny_llama(seed=0).double(), tiny_llama(seed=1).double()
    return policy, reference


def _objective_losses(policy, reference, batch) -> dict[str, torch.Tensor]:
    seq = packed_policy_logps(policy, batch, chunk_size=5)
    with torch.no_grad():
        ref = packed_sequence_logps(reference, batch, chunk_size=5)
    logps = pair_logps_from_sequences(seq, ref, batch)
    params = LossParams(beta=0.3, label_smoothing=0.1, nll_weight=0.7)
    losses = {"sequence_logps": seq.logps, "token_stats": seq.token_stats, "prompt_logps": seq.prompt_logps}
    for name, fn in LOSS_FUNCTIONS.items():
        losses[name] = fn(logps, params, StepContext(bco_delta=0.2))
    return losses


def _relative(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).abs().max() / b.abs().max().clamp(min=1e-300))


@pytest.mark.parametrize("case", sorted(CASES))
@pytest.mark.parametrize("backend", ["sdpa_segments", "traceable_varlen"])
def test_shared_equals_unshared_in_float64(case, backend, float64_llama, monkeypatch) -> None:
    """Per-sequence log-probs, statistics, every objective's loss and every parameter's gradient of every objective:
    shared == unshared to 1e-10 relative (LD-DPO weights and ORPO's prompt scoring on)."""
    policy, reference = float64_llama
    name = install_traceable_varlen(monkeypatch) if backend == "traceable_varlen" else backend
    for model in (policy, reference):
        enable_pair_varlen(model, name, device="cpu")
    results = []
    for share in (False, True):
        batch = PackedPairCollator(share_prompt=share, score_chosen_prompts=True, pad_to_multiple_of=16)(CASES[case])
        losses = _objective_losses(policy, reference, with_length_desensitization(batch, 0.5))
        grads = {}
        for objective in LOSS_FUNCTIONS:
            total = losses[objective].sum() + 0.01 * losses["sequence_logps"].sum()  # every sequence's gradient
            grads[objective] = torch.autograd.grad(total, list(policy.parameters()), retain_graph=True,
                                                   allow_unused=True)  # fmt: skip
        results.append((losses, grads))
    (plain, plain_grads), (shared, shared_grads) = results
    for key, value in plain.items():
        assert _relative(shared[key].detach(), value.detach()) <= 1e-10, key
    names = [param_name for param_name, _ in policy.named_parameters()]
    for objective, expected in plain_grads.items():
        for param_name, got, want in zip(names, shared_grads[objective], expected, strict=True):
            if want is None:
                assert got is None
                continue
            assert _relative(got, want) <= 1e-10, (objective, param_name)


# ---------------------------------------------------------------- the option, the planner's cost, resume, the cache
@pytest.mark.parametrize("arch,supported", [("llama", True), ("qwen2", True), ("qwen2_sliding", False),
                                            ("mistral_sliding", False)])  # fmt: skip
def test_share_prompt_resolves_per_model_and_refuses_an_explicit_request_it_cannot_honour(arch, supported) -> None:
    from pair_dpo_trainer.errors import ConfigError
    from pair_dpo_trainer.modeling.attention import resolve_share_prompt
    from tests.test_logprobs import tiny_model

    model = tiny_model(arch)
    enable_pair_varlen(model, "sdpa_segments", device="cpu")
    share, reason = resolve_share_prompt(None, model)
    assert share is supported and (reason is None) is supported
    assert resolve_share_prompt(False, model) == (False, "share_prompt=False")
    if supported:
        assert resolve_share_prompt(True, model) == (True, None)
        return
    assert "sliding-window" in reason
    with pytest.raises(ConfigError) as refused:
        resolve_share_prompt(True, model)
    assert refused.value.reason_code == "share_prompt_unsupported" and "share_prompt" in str(refused.value)


def test_a_bad_share_prompt_value_is_refused(tmp_path) -> None:
    from pair_dpo_trainer.errors import ConfigError
    from tests.dpo_fixtures import cpu_config

    with pytest.raises(ConfigError) as refused:
        cpu_config(tmp_path, share_prompt="yes")
    assert [code for code, _ in refused.value.problems] == ["bad_share_prompt"]


def test_the_run_summary_names_the_layout(tmp_path) -> None:
    from pair_dpo_trainer.observability.summary import run_summary
    from tests.dpo_fixtures import cpu_config

    args = cpu_config(tmp_path)
    assert "| layout shared prompt |" in run_summary(args, attn_backend="x", share_prompt=True)
    why = "MistralForCausalLM has sliding-window attention layers (sliding_window=6)"
    line = run_summary(args, attn_backend="x", share_prompt=False, unshared_reason=why)
    assert f"| layout unshared ({why}) |" in line


def _budget_trainer(tmp_path, pairs, **options):
    from pair_dpo_trainer import PairDPOTrainer
    from tests.dpo_fixtures import cpu_config
    from tests.models import tiny_tokenizer

    budget = dict(per_device_train_batch_size=8, gradient_accumulation_steps=1, max_tokens_per_microbatch=60)
    return PairDPOTrainer(
        model=tiny_llama(0),
        args=cpu_config(tmp_path, **{"max_steps": 3, **budget, **options}),
        train_dataset=pairs,
        eval_dataset=pairs[:12],
        processing_class=tiny_tokenizer(),
    )


def _losses(trainer) -> list[float]:
    return [entry["loss"] for entry in trainer.state.log_history if "loss" in entry]


def test_the_budget_plans_prompt_plus_completions_and_trains_as_the_unshared_layout(tmp_path) -> None:
    """Under a token budget a shared pair costs P + C + R: the planner packs more pairs per micro-batch, every row
    keeps to the budget, and the run's losses and parameters equal the unshared run's (fp32 noise)."""
    from tests.dpo_fixtures import synthetic_pairs

    pairs = synthetic_pairs(32, seed=1)
    shared = _budget_trainer(tmp_path / "shared", pairs, share_prompt=True)
    plain = _budget_trainer(tmp_path / "plain", pairs, share_prompt=False)
    expected = [sum(len(p[k]) for k in FEATURES) for p in pairs]
    assert shared._costs(shared.train_dataset).tolist() == expected
    assert plain._costs(plain.train_dataset).tolist() == [
        c + len(p["prompt_input_ids"]) for c, p in zip(expected, pairs, strict=True)
    ]
    steps = list(shared.get_train_dataloader())
    assert all(mb.shares_prompt and mb.num_tokens <= 60 for step in steps for mb in step.microbatches)
    shared.train()
    plain.train()
    assert sum(shared._train_sampler.microbatch_counts()) < sum(plain._train_sampler.microbatch_counts())
    assert _losses(shared) == pytest.approx(_losses(plain), abs=1e-6)
    plain_params = dict(plain.model.named_parameters())
    for name, param in shared.model.named_parameters():
        torch.testing.assert_close(param, plain_params[name], atol=2e-5, rtol=0, msg=name)
    assert shared.evaluate()["eval_loss"] == pytest.approx(plain.evaluate()["eval_loss"], abs=1e-6)


def test_the_budget_admits_a_pair_by_its_cost_in_the_run_layout(tmp_path) -> None:
    """A pair with P + C + R <= budget < 2P + C + R: the shared-prompt run admits it (on every input path: in-memory
    rows, a tokenised ``datasets.Dataset``) and trains it in a row within the budget; the unshared run refuses it with
    ``pair_too_long`` naming its cost and the limit."""
    from datasets import Dataset

    from pair_dpo_trainer.errors import PreferenceRowError
    from tests.dpo_fixtures import synthetic_pairs

    rng = random.Random(5)
    long_pair = _pair(_tokens(rng, 25), _tokens(rng, 4) + [EOS], _tokens(rng, 5) + [EOS])  # 36 shared, 61 unshared
    pairs = [long_pair, *synthetic_pairs(15, seed=2)]
    shared = _budget_trainer(tmp_path / "shared", pairs, share_prompt=True, max_steps=2)
    assert shared._costs(shared.train_dataset).tolist()[0] == 36
    shared.train()
    assert all(mb.num_tokens <= 60 for step in shared.get_train_dataloader() for mb in step.microbatches)
    for dataset in (pairs, Dataset.from_list(pairs)):
        with pytest.raises(PreferenceRowError) as refused:
            _budget_trainer(tmp_path / "plain", dataset, share_prompt=False)
        assert refused.value.reason_code == "pair_too_long"
        assert "row 0" in str(refused.value) and "costs 61 tokens" in str(refused.value)
        assert "max_tokens_per_microbatch=60" in str(refused.value)


def test_resuming_with_the_other_layout_is_refused(tmp_path) -> None:
    from pair_dpo_trainer.errors import CheckpointError
    from tests.dpo_fixtures import synthetic_pairs

    pairs = synthetic_pairs(32, seed=1)
    _budget_trainer(tmp_path, pairs, save_strategy="steps", save_steps=2).train()
    checkpoint = str(tmp_path / "out" / "checkpoint-2")
    with pytest.raises(CheckpointError) as refused:
        _budget_trainer(tmp_path, pairs, share_prompt=False).train(resume_from_checkpoint=checkpoint)
    assert refused.value.reason_code == "resume_data_mismatch" and "layout 'shared_prompt' -> None" in str(
        refused.value
    )


def test_metrics_count_tokens_as_trl_does_and_as_packed(tmp_path) -> None:
    """``num_tokens`` / ``tokens_per_second`` count each prompt twice (TRL's numbers), ``packed_tokens_per_second``
    the tokens that ran; the FLOPs count the tokens that ran."""
    from tests.dpo_fixtures import synthetic_pairs

    pairs = synthetic_pairs(32, seed=1)
    trainer = _budget_trainer(tmp_path, pairs, max_steps=1)
    step = next(iter(trainer.get_train_dataloader()))
    trainer.train()
    (logged,) = [entry for entry in trainer.state.log_history if "num_tokens" in entry]
    step_pairs = [pairs[i] for microbatch in trainer._train_sampler.rank_plan(0)[0] for i in microbatch]
    packed = sum(len(p[k]) for p in step_pairs for k in FEATURES)
    twice = packed + sum(len(p["prompt_input_ids"]) for p in step_pairs)
    assert logged["num_tokens"] == twice and step.num_unshared_tokens == twice and step.num_real_tokens == packed
    assert logged["packed_tokens_per_second"] / logged["tokens_per_second"] == pytest.approx(packed / twice)
    assert trainer.floating_point_ops(step) == 8 * trainer._flop_params * packed
