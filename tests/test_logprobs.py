"""Chunked log-probs vs naive, and packed (pair_varlen) vs padded (sdpa) parity on tiny models."""

from __future__ import annotations

import pytest
import torch
from transformers import (
    LlamaConfig,
    LlamaForCausalLM,
    MistralConfig,
    MistralForCausalLM,
    Qwen2Config,
    Qwen2ForCausalLM,
    Qwen3Config,
    Qwen3ForCausalLM,
)

from pair_dpo_trainer.collators import PackedPairCollator, PaddedPairCollator
from pair_dpo_trainer.errors import ConfigError
from pair_dpo_trainer.losses.length_weights import length_desensitized_weights, with_length_desensitization
from pair_dpo_trainer.modeling import enable_pair_varlen
from pair_dpo_trainer.modeling.chunked_head import (
    chunked_token_logps,
    module_chunked_token_logps,
    naive_token_logps,
    naive_token_stats,
)
from pair_dpo_trainer.modeling.logprobs import packed_policy_logps, packed_sequence_logps, padded_sequence_logps
from tests.dpo_fixtures import random_features

VOCAB = 101
TINY = {
    "vocab_size": VOCAB,
    "hidden_size": 48,
    "intermediate_size": 96,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 12,
    "initializer_range": 0.2,  # sharper attention than 0.02, so that leaks across sequences would show
    "pad_token_id": 0,
}
SLIDING = {"use_sliding_window": True, "sliding_window": 6, "max_window_layers": 1}
ARCHS = {
    "llama": (LlamaForCausalLM, LlamaConfig, {}),
    "qwen2": (Qwen2ForCausalLM, Qwen2Config, {}),
    "qwen2_sliding": (Qwen2ForCausalLM, Qwen2Config, SLIDING),
    "qwen3_sliding": (Qwen3ForCausalLM, Qwen3Config, SLIDING),
    "mistral_sliding": (MistralForCausalLM, MistralConfig, {"sliding_window": 6}),
}


def tiny_model(arch: str, seed: int = 0) -> torch.nn.Module:
    model_cls, config_cls, extra = ARCHS[arch]
    torch.manual_seed(seed)
    model = model_cls(config_cls(**TINY, **extra)).float()
    model.set_attn_implementation("sdpa")
    return model


def tiny_features(seed: int, n: int) -> list[dict[str, list[int]]]:
    return random_features(seed, n, vocab=VOCAB, prompt_len=(2, 10), completion_len=(1, 9))


def _grads(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {name: p.grad.clone() for name, p in model.named_parameters() if p.grad is not None}


@pytest.mark.parametrize("dtype,tol", [(torch.float64, 1e-10), (torch.float32, 1e-5)])
@pytest.mark.parametrize("chunk_size", [1, 3, 7, 64])
def test_chunked_matches_naive(dtype: torch.dtype, tol: float, chunk_size: int) -> None:
    gen = torch.Generator().manual_seed(chunk_size)
    n, hidden_size, vocab = 20, 16, 37  # chunk sizes 3 and 7 do not divide 20
    hidden = torch.randn(n, hidden_size, generator=gen, dtype=dtype, requires_grad=True)
    weight = torch.randn(vocab, hidden_size, generator=gen, dtype=dtype, requires_grad=True)
    targets = torch.randint(0, vocab, (n,), generator=gen)
    upstream = torch.randn(n, generator=gen, dtype=dtype)

    results = []
    for fn in (naive_token_logps, lambda h, w, t: chunked_token_logps(h, w, t, chunk_size)):
        out = fn(hidden, weight, targets)
        grad_h, grad_w = torch.autograd.grad((out * upstream).sum(), (hidden, weight))
        results.append((out, grad_h, grad_w))
    (ref, ref_gh, ref_gw), (got, got_gh, got_gw) = results
    assert got.dtype == (torch.float64 if dtype == torch.float64 else torch.float32)
    assert (got - ref).abs().max() < tol
    assert (got_gh - ref_gh).abs().max() < tol and (got_gw - ref_gw).abs().max() < tol


def test_chunked_gradcheck_float64() -> None:
    gen = torch.Generator().manual_seed(0)
    hidden = torch.randn(7, 5, generator=gen, dtype=torch.float64, requires_grad=True)
    weight = torch.randn(11, 5, generator=gen, dtype=torch.float64, requires_grad=True)
    targets = torch.randint(0, 11, (7,), generator=gen)
    assert torch.autograd.gradcheck(lambda h, w: chunked_token_logps(h, w, targets, 3), (hidden, weight))


def test_chunked_bf16_close_to_naive_and_weight_only_grad() -> None:
    gen = torch.Generator().manual_seed(1)
    hidden = torch.randn(30, 16, generator=gen).to(torch.bfloat16)
    weight = torch.randn(50, 16, generator=gen).to(torch.bfloat16).requires_grad_()
    targets = torch.randint(0, 50, (30,), generator=gen)
    got = chunked_token_logps(hidden, weight, targets, 8)
    ref = naive_token_logps(hidden, weight, targets)
    assert got.dtype == torch.float32 and (got - ref).abs().max() < 1e-5
    (grad_w,) = torch.autograd.grad(got.sum(), (weight,))
    (ref_w,) = torch.autograd.grad(ref.sum(), (weight,))
    assert grad_w.dtype == torch.bfloat16 and (grad_w.float() - ref_w.float()).abs().max() < 0.1


def test_module_chunked_matches_naive() -> None:
    torch.manual_seed(0)
    head = torch.nn.Linear(16, 37, bias=False).double()
    hidden = torch.randn(20, 16, dtype=torch.float64, requires_grad=True)
    targets = torch.randint(0, 37, (20,))
    calls = []
    head.register_forward_pre_hook(lambda module, args: calls.append(args[0].shape[0]))
    got = module_chunked_token_logps(head, hidden, targets, 6)  # 4 chunks, ONE module call (ZeRO-3: one gather)
    assert calls == [20] and "forward" not in vars(head)
    ref = naive_token_logps(hidden, head.weight, targets)
    assert (got - ref).abs().max() < 1e-10
    g1 = torch.autograd.grad(got.sum(), (hidden, head.weight))
    g2 = torch.autograd.grad(ref.sum(), (hidden, head.weight))
    assert all((a - b).abs().max() < 1e-10 for a, b in zip(g1, g2, strict=True))


@pytest.mark.parametrize("arch", sorted(ARCHS))
def test_packed_matches_padded_values_and_grads(arch: str) -> None:
    model = tiny_model(arch)
    features = tiny_features(seed=3, n=3)
    padded, packed = PaddedPairCollator()(features), PackedPairCollator()(features)
    weights = torch.randn(2 * len(features), generator=torch.Generator().manual_seed(5))

    ref = padded_sequence_logps(model, padded)
    (ref * weights).sum().backward()
    ref_grads = _grads(model)
    model.zero_grad(set_to_none=True)

    assert enable_pair_varlen(model, "auto", device="cpu") == "sdpa_segments"
    got = packed_sequence_logps(model, packed, chunk_size=5)
    (got * weights).sum().backward()
    got_grads = _grads(model)

    assert got.shape == (6,) and got.dtype == torch.float32
    assert (got - ref).abs().max().item() < 1e-4, (got, ref)
    assert ref_grads.keys() == got_grads.keys()
    worst = max((got_grads[k] - ref_grads[k]).abs().max().item() for k in ref_grads)
    assert worst < 1e-4


def test_packed_with_pad_segment_matches_padded() -> None:
    model = tiny_model("llama")
    features = tiny_features(seed=4, n=2)
    ref = padded_sequence_logps(model, PaddedPairCollator()(features))
    enable_pair_varlen(model, "sdpa_segments")
    batch = PackedPairCollator(pad_to_multiple_of=16, pad_token_id=0)(features)
    assert batch.num_tokens % 16 == 0 and batch.cu_seqlens.shape[0] == 2 * 2 + 2
    got = packed_sequence_logps(model, batch)
    assert (got - ref).abs().max().item() < 1e-4


def test_packed_logps_make_no_host_sync(monkeypatch: pytest.MonkeyPatch) -> None:
    """The log-prob part of the hot path (after the forward) calls nothing that waits for the device."""
    import pair_dpo_trainer.modeling.logprobs as lp

    model = tiny_model("llama")
    enable_pair_varlen(model, "sdpa_segments")
    batch = PackedPairCollator()(tiny_features(seed=6, n=2))
    hidden = lp.packed_hidden_states(model, batch).detach()
    monkeypatch.setattr(lp, "packed_hidden_states", lambda _m, _b: hidden)

    def forbidden(*_args, **_kwargs):
        raise AssertionError("host sync in the log-prob hot path")

    for name in ("item", "cpu", "tolist", "nonzero", "__bool__", "numpy"):
        monkeypatch.setattr(torch.Tensor, name, forbidden)
    out = lp.packed_sequence_logps(model, batch, chunk_size=4)
    out.sum().backward()
    policy = lp.packed_policy_logps(model, with_length_desensitization(batch, 0.5), chunk_size=4)  # stats + LD
    policy.logps.sum().backward()
    monkeypatch.undo()
    assert out.shape == (4,) and policy.token_stats.shape == (4, 4)


@pytest.mark.parametrize("name,value", [("final_logit_softcapping", 30.0), ("logit_scale", 0.5)])
def test_logit_transforms_are_refused(name: str, value: float) -> None:
    model = tiny_model("llama")
    setattr(model.config, name, value)
    enable_pair_varlen(model, "sdpa_segments")
    with pytest.raises(ConfigError) as info:
        packed_sequence_logps(model, PackedPairCollator()(tiny_features(0, 1)))
    assert info.value.reason_code == "logit_transform_unsupported"


def test_packed_logps_refuse_non_varlen_attention() -> None:
    model = tiny_model("llama")  # sdpa: would build a dense [T, T] mask (or leak across sequences)
    with pytest.raises(ConfigError) as info:
        packed_sequence_logps(model, PackedPairCollator()(tiny_features(0, 1)))
    assert info.value.reason_code == "attn_not_varlen"


def test_wrapped_model_is_unwrapped_and_called() -> None:
    """A DDP/DeepSpeed-like wrapper (``.module``) is called itself, so its forward hooks would run."""

    class Wrapper(torch.nn.Module):
        def __init__(self, module: torch.nn.Module) -> None:
            super().__init__()
            self.module = module
            self.calls = 0

        def forward(self, **kwargs):
            self.calls += 1
            return self.module(**kwargs)

    model = tiny_model("qwen2")
    features = tiny_features(seed=8, n=2)
    ref = padded_sequence_logps(model, PaddedPairCollator()(features))
    wrapper = Wrapper(model)
    enable_pair_varlen(wrapper)
    got = packed_sequence_logps(wrapper, PackedPairCollator()(features))
    assert wrapper.calls == 1 and (got - ref).abs().max().item() < 1e-4


# ---------------------------------------------------------------- per-token statistics and LD-DPO
@pytest.mark.parametrize("dtype,tol", [(torch.float64, 1e-10), (torch.float32, 1e-4)])
@pytest.mark.parametrize("chunk_size", [1, 7, 64])
def test_chunked_stats_match_naive_and_leave_the_gradient_unchanged(dtype, tol, chunk_size) -> None:
    gen = torch.Generator().manual_seed(chunk_size)
    hidden = torch.randn(20, 16, generator=gen, dtype=dtype, requires_grad=True)
    weight = torch.randn(37, 16, generator=gen, dtype=dtype, requires_grad=True)
    targets = torch.randint(0, 37, (20,), generator=gen)
    targets[:5] = (hidden[:5].detach() @ weight.detach().t()).argmax(-1)  # some targets are the argmax
    logps, stats = chunked_token_logps(hidden, weight, targets, chunk_size, with_stats=True)
    assert stats.shape == (20, 4) and not stats.requires_grad
    assert (stats - naive_token_stats(hidden, weight, targets)).abs().max() < tol
    assert stats[:5, 2].tolist() == [1.0] * 5
    plain = chunked_token_logps(hidden, weight, targets, chunk_size)
    assert torch.equal(logps, plain)
    grads = torch.autograd.grad(logps.sum(), (hidden, weight))
    expected = torch.autograd.grad(naive_token_logps(hidden, weight, targets).sum(), (hidden, weight))
    assert all((a - b).abs().max() < tol for a, b in zip(grads, expected, strict=True))


def test_module_chunked_with_stats_is_one_head_call() -> None:
    torch.manual_seed(0)
    head = torch.nn.Linear(16, 37, bias=False).double()
    hidden, targets = torch.randn(20, 16, dtype=torch.float64), torch.randint(0, 37, (20,))
    calls = []
    head.register_forward_pre_hook(lambda module, args: calls.append(args[0].shape[0]))
    _, stats = module_chunked_token_logps(head, hidden, targets, 6, with_stats=True)
    assert calls == [20] and (stats - naive_token_stats(hidden, head.weight, targets)).abs().max() < 1e-10


def _ld_weights_from_lengths(features, alpha: float) -> list[float]:
    """LD-DPO weights in packed order, from the completion lengths alone (plain Python, independent)."""
    weights = []
    for feature in features:
        scored = [len(feature["chosen_input_ids"]), len(feature["rejected_input_ids"])]
        shared = min(scored)
        for length in scored:
            weights += [1.0 if t < shared else alpha for t in range(length)]
    return weights


def test_ld_weights_keep_the_shared_length_and_scale_the_tail() -> None:
    features = tiny_features(seed=2, n=5)
    batch = PackedPairCollator()(features)
    got = length_desensitized_weights(batch, 0.25)
    assert got.tolist() == _ld_weights_from_lengths(features, 0.25)


def test_policy_pass_equals_a_naive_float64_computation_values_stats_and_gradients() -> None:
    """Packed, chunked, LD-weighted sums and per-token statistics vs full [T, V] float64 logits on padded rows."""
    model = tiny_model("llama").double()
    features = tiny_features(seed=9, n=3)
    alpha = 0.4
    padded = PaddedPairCollator()(features)
    upstream = torch.randn(6, generator=torch.Generator().manual_seed(2), dtype=torch.float64)

    logits = model(input_ids=padded.input_ids, attention_mask=padded.attention_mask, use_cache=False).logits
    log_probs = logits.log_softmax(-1)
    mask = padded.completion_mask.bool()
    targets = padded.labels.clamp(min=0)
    token_logps = log_probs.gather(-1, targets[..., None]).squeeze(-1)
    weights = torch.zeros_like(token_logps)
    weights[mask] = torch.tensor(_ld_weights_from_lengths(features, alpha), dtype=torch.float64)
    expected_logps = (token_logps * weights).sum(-1)
    mean_logits = (logits.mean(-1) * mask).sum(-1)
    entropy = (-(log_probs.exp() * log_probs).sum(-1) * mask).sum(-1)
    top1 = ((logits.argmax(-1) == targets) & mask).sum(-1).double()
    wpo = ((token_logps - (log_probs.exp() ** 2).sum(-1).log()) * mask).sum(-1)
    (expected_logps * upstream).sum().backward()
    expected_grads = _grads(model)
    model.zero_grad(set_to_none=True)

    enable_pair_varlen(model, "sdpa_segments")
    batch = with_length_desensitization(PackedPairCollator()(features), alpha)
    got = packed_policy_logps(model, batch, chunk_size=5)
    (got.logps * upstream).sum().backward()
    torch.testing.assert_close(got.logps, expected_logps.detach(), rtol=1e-10, atol=1e-10)
    plain = (token_logps * mask).sum(-1).detach()
    torch.testing.assert_close(got.nll_logps.detach(), plain, rtol=1e-10, atol=1e-10)
    stats = torch.stack([mean_logits, entropy, top1, wpo], dim=1).detach()
    torch.testing.assert_close(got.token_stats, stats, rtol=1e-9, atol=1e-9)
    got_grads = _grads(model)
    for name, grad in expected_grads.items():
        torch.testing.assert_close(got_grads[name], grad, rtol=1e-9, atol=1e-10, msg=name)


@pytest.mark.parametrize("share_prompt", [False, True])
def test_fsdp2_in_forward_head_returns_the_same_statistics_and_gradients(monkeypatch, share_prompt) -> None:
    """Under FSDP2 the chunked head runs inside the model's own head call (one ``[P, 5]`` output: log-probs and
    statistics); here the same path runs unsharded (``is_fsdp_managed`` forced) against the default path; with
    shared prompts the model keeps the prompt's last row twice (``logits_to_keep`` with a repeated position), once
    per completion."""
    import pair_dpo_trainer.modeling.logprobs as lp

    collator = PackedPairCollator(share_prompt=share_prompt)
    batch = with_length_desensitization(collator(tiny_features(seed=4, n=3)), 0.5)
    assert batch.completion_positions.unique().numel() < batch.completion_positions.numel() or not share_prompt
    results = []
    for in_forward in (False, True):
        model = tiny_model("llama")
        enable_pair_varlen(model, "sdpa_segments")
        monkeypatch.setattr(lp, "is_fsdp_managed", lambda _model, forced=in_forward: forced)
        out = lp.packed_policy_logps(model, batch, chunk_size=5)
        (out.logps * torch.arange(1.0, 7.0)).sum().backward()
        results.append((out, _grads(model)))
        assert model.lm_head.forward.__func__ is type(model.lm_head).forward  # the instance override is gone
    (want, want_grads), (got, got_grads) = results
    torch.testing.assert_close(got.logps, want.logps, rtol=0, atol=1e-5)
    torch.testing.assert_close(got.token_stats, want.token_stats, rtol=1e-5, atol=1e-5)
    assert not got.token_stats.requires_grad
    for name, grad in want_grads.items():
        torch.testing.assert_close(got_grads[name], grad, rtol=1e-5, atol=1e-6, msg=name)


@pytest.mark.integration
def test_the_compiled_head_kernels_compute_what_the_eager_ones_do():
    """``torch_compile=True`` fuses the chunked head's element-wise work (``compile_head_kernels``): the same
    log-probs, statistics and gradients as the eager kernels, which match the full-logits reference."""
    from pair_dpo_trainer.modeling import chunked_head

    torch.manual_seed(0)
    weight = torch.randn(500, 24, requires_grad=True)
    hidden = torch.randn(200, 24, requires_grad=True)
    targets = torch.randint(0, 500, (200,))

    def run():
        logps, stats = chunked_head.chunked_token_logps(hidden, weight, targets, 64, with_stats=True)
        (logps * torch.linspace(0, 1, 200)).sum().backward()
        grads = hidden.grad.clone(), weight.grad.clone()
        hidden.grad = weight.grad = None
        return logps.detach(), stats, grads

    eager = run()
    torch.testing.assert_close(
        eager[0], chunked_head.naive_token_logps(hidden, weight, targets).detach(), rtol=0, atol=1e-5
    )
    try:
        chunked_head.compile_head_kernels("aot_eager")
        assert chunked_head._HEAD_KERNELS["stats"] is not chunked_head._EAGER_HEAD_KERNELS["stats"]
        compiled = run()
    finally:
        chunked_head.eager_head_kernels()
    torch.testing.assert_close(compiled[0], eager[0], rtol=0, atol=1e-6)
    torch.testing.assert_close(compiled[1], eager[1], rtol=0, atol=1e-4)
    for got, expected in zip(compiled[2], eager[2], strict=True):
        torch.testing.assert_close(got, expected, rtol=0, atol=1e-6)


def test_per_sequence_sums_do_not_depend_on_the_order_tokens_are_added():
    """CUDA's ``index_add`` adds atomically in an order that varies run to run; the per-sequence log-prob sums must
    come out the same whatever the order (else policy and reference differ at step 0 and the loss is not ln 2).
    Checked by adding the same tokens in two orders, against the float64 sum rounded once."""
    from pair_dpo_trainer.modeling.logprobs import _sequence_sums

    generator = torch.Generator().manual_seed(0)
    sequences = torch.randint(0, 8, (6000,), generator=generator).sort().values
    values = -torch.exp(3 * torch.randn(6000, generator=generator))  # log-probs over several orders of magnitude
    order = torch.randperm(6000, generator=generator)
    first = _sequence_sums(values, sequences, 8)
    second = _sequence_sums(values[order], sequences[order], 8)
    exact = torch.zeros(8, dtype=torch.float64).index_add(0, sequences, values.double()).float()
    assert first.dtype == torch.float32 and torch.equal(first, second) and torch.equal(first, exact)
    stats = torch.stack([values, values.square()], dim=1)
    assert torch.equal(_sequence_sums(stats, sequences, 8), _sequence_sums(stats[order], sequences[order], 8))
