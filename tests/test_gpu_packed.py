"""GPU checks of the packed path (run on the GPU machine: ``pytest -m gpu -s tests/test_gpu_packed.py``).

Prints the numbers quoted in docs/benchmarks.md ("Packed log-probs and attention (GPU)").
"""

from __future__ import annotations

import time

import pytest
import torch

from pair_dpo_trainer.collators import PackedPairCollator, PaddedPairCollator
from pair_dpo_trainer.modeling import BACKENDS, enable_pair_varlen, select_attn_backend, varlen_attention
from pair_dpo_trainer.modeling.chunked_head import chunked_token_logps, naive_token_logps
from pair_dpo_trainer.modeling.logprobs import packed_sequence_logps, padded_sequence_logps
from tests.dpo_fixtures import random_features
from tests.models import GPU_VOCAB, llama_100m

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]

VOCAB = GPU_VOCAB
_llama_100m = llama_100m


def _features(seed: int, n: int) -> list[dict[str, list[int]]]:
    return random_features(seed, n, vocab=VOCAB, prompt_len=(64, 512), completion_len=(32, 512), first_id=3)


def _kernel_backends() -> list[str]:
    found = []
    for name in BACKENDS[:2]:
        try:
            found.append(select_attn_backend(name, "cuda", torch.bfloat16))
        except Exception as error:  # noqa: BLE001 - report and continue
            print(f"[gpu] backend {name} unavailable: {error}")
    return found


@pytest.mark.parametrize("window", [None, 64])
def test_kernel_backends_match_sdpa_segments(window) -> None:
    gen = torch.Generator(device="cuda").manual_seed(0)
    lengths = [1, 37, 300, 129, 1000]
    cu = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32, device="cuda")
    total = sum(lengths)

    def rand(heads: int) -> torch.Tensor:
        return torch.randn(total, heads, 64, generator=gen, device="cuda", dtype=torch.bfloat16)

    q, k, v = rand(16), rand(8), rand(8)  # GQA 16 query / 8 kv heads
    ref = varlen_attention(q, k, v, cu, max(lengths), backend="sdpa_segments", sliding_window=window)
    backends = _kernel_backends()
    assert backends, "no varlen kernel backend on this GPU"
    for backend in backends:
        got = varlen_attention(q, k, v, cu, max(lengths), backend=backend, sliding_window=window)
        err = (got.float() - ref.float()).abs().max().item()
        print(f"[gpu] varlen_attention {backend} vs sdpa_segments window={window}: max abs err {err:.4g}")
        assert err < 2e-2


def test_shared_prompt_kernels_match_sdpa_segments() -> None:
    """The shared-prompt layout's one varlen call (query segments [p c], [r]; key segments [p c], [p r] gathered by
    ``kv_index``; causal aligned bottom-right) on each CUDA kernel against the per-segment SDPA reference; a rejected
    query's gradient never reaches a chosen key (exactly zero)."""
    feats = _features(seed=5, n=6)
    batch = PackedPairCollator(share_prompt=True, pad_to_multiple_of=64)(feats).to("cuda")
    total = batch.num_tokens
    gen = torch.Generator(device="cuda").manual_seed(0)

    def rand(heads: int) -> torch.Tensor:
        return torch.randn(total, heads, 64, generator=gen, device="cuda", dtype=torch.bfloat16)

    q, k, v = rand(16), rand(8).requires_grad_(), rand(8).requires_grad_()
    segments = dict(cu_seqlens_k=batch.cu_seqlens_k, max_seqlen_k=batch.max_seqlen_k)

    def attend(backend: str) -> torch.Tensor:
        kg, vg = k.index_select(0, batch.kv_index), v.index_select(0, batch.kv_index)
        return varlen_attention(q, kg, vg, batch.cu_seqlens, batch.max_seqlen, backend=backend, **segments)

    ref = attend("sdpa_segments")
    sequence = batch.sequence_index[0]
    rejected = sequence % 2 == 1
    chosen_completion = torch.zeros_like(rejected)
    start = 0
    for f in feats:
        p, c, r = (len(f[key]) for key in ("prompt_input_ids", "chosen_input_ids", "rejected_input_ids"))
        chosen_completion[start + p : start + p + c] = True
        start += p + c + r
    backends = _kernel_backends()
    assert backends, "no varlen kernel backend on this GPU"
    for backend in backends:
        got = attend(backend)
        err = (got.float() - ref.float()).abs().max().item()
        grad_k, grad_v = torch.autograd.grad(got[rejected].float().sum(), (k, v))
        leak = max(grad_k[chosen_completion].abs().max().item(), grad_v[chosen_completion].abs().max().item())
        print(f"[gpu] shared-prompt varlen_attention {backend} vs sdpa_segments: max abs err {err:.4g}, leak {leak}")
        assert err < 2e-2 and leak == 0.0 and grad_k[~chosen_completion].abs().max().item() > 0


def test_shared_prompt_layout_matches_unshared_bf16() -> None:
    """The 100M model in bf16: per-sequence log-probs and gradients of the shared-prompt row against the unshared
    one (rounding only), and the fwd+bwd time of each (printed: the prompt computed once)."""
    model = _llama_100m()
    backend = enable_pair_varlen(model, "auto")
    feats = _features(seed=6, n=8)
    weights = torch.randn(16, device="cuda")
    runs = {}
    for share in (False, True):
        batch = PackedPairCollator(share_prompt=share)(feats).pin_memory().to("cuda", non_blocking=True)
        out, elapsed = _timed_step(lambda b=batch: packed_sequence_logps(model, b), weights)
        grad = torch.cat([p.grad.float().flatten() for p in model.parameters()])
        model.zero_grad(set_to_none=True)
        runs[share] = (out, grad, elapsed, batch.num_tokens)
    (plain, plain_grad, plain_time, plain_tokens), (shared, shared_grad, shared_time, shared_tokens) = (
        runs[False],
        runs[True],
    )
    rel = ((shared - plain).abs() / plain.abs()).max().item()
    cosine = torch.nn.functional.cosine_similarity(shared_grad, plain_grad, dim=0).item()
    print(
        f"\n[gpu] {torch.cuda.get_device_name()} {backend}: shared T={shared_tokens} vs unshared T={plain_tokens}: "
        f"logps max rel diff {rel:.3g}, grad cosine {cosine:.6f}; fwd+bwd unshared {plain_time * 1e3:.1f} ms, "
        f"shared {shared_time * 1e3:.1f} ms ({plain_time / shared_time:.2f}x)"
    )
    assert shared_tokens < plain_tokens
    assert rel < 1e-2 and cosine > 0.999


def _no_dense_mask_spy(size: int):
    from torch.utils._python_dispatch import TorchDispatchMode
    from torch.utils._pytree import tree_leaves

    class Spy(TorchDispatchMode):
        def __init__(self) -> None:
            super().__init__()
            self.hits: list[tuple[int, ...]] = []

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            out = func(*args, **(kwargs or {}))
            for t in tree_leaves(out):
                if isinstance(t, torch.Tensor) and t.dim() >= 2 and t.shape[-2:] == (size, size):
                    self.hits.append(tuple(t.shape))
            return out

    return Spy()


def _timed_step(fn, weights: torch.Tensor, repeats: int = 3) -> tuple[torch.Tensor, float]:
    out = fn()
    (out * weights).sum().backward()  # warm-up
    torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(repeats):
        out = fn()
        (out * weights).sum().backward()
    torch.cuda.synchronize()
    return out.detach(), (time.perf_counter() - start) / repeats


def test_varlen_packed_matches_padded_sdpa_bf16() -> None:
    torch.backends.cuda.enable_cudnn_sdp(False)  # cuDNN SDPA stalls on new padded shapes (notes/gpu.md)
    model = _llama_100m()
    feats = _features(seed=0, n=8)
    padded = PaddedPairCollator()(feats).pin_memory().to("cuda", non_blocking=True)
    packed = PackedPairCollator()(feats).pin_memory().to("cuda", non_blocking=True)
    weights = torch.randn(16, device="cuda")
    print(f"\n[gpu] {torch.cuda.get_device_name()} torch {torch.__version__}")
    print(f"[gpu] packed T={packed.num_tokens} tokens, padded {tuple(padded.input_ids.shape)}")

    with torch.no_grad():
        ref = padded_sequence_logps(model, padded)
    ref_step, ref_time = _timed_step(lambda: padded_sequence_logps(model, padded), weights)
    ref_grad = torch.cat([p.grad.float().flatten() for p in model.parameters()])
    model.zero_grad(set_to_none=True)

    backend = enable_pair_varlen(model, "auto")
    assert backend in ("flash_attn", "torch_varlen")
    spy = _no_dense_mask_spy(packed.num_tokens)
    with torch.no_grad(), spy:
        got = packed_sequence_logps(model, packed)
    assert spy.hits == [], spy.hits[:5]
    got_step, got_time = _timed_step(lambda: packed_sequence_logps(model, packed), weights)
    got_grad = torch.cat([p.grad.float().flatten() for p in model.parameters()])

    rel = ((got - ref).abs() / ref.abs()).max().item()
    cosine = torch.nn.functional.cosine_similarity(got_grad, ref_grad, dim=0).item()
    print(f"[gpu] backend={backend}: max rel diff of per-sequence logps {rel:.3g} (no grad), grad cosine {cosine:.5f}")
    print(f"[gpu] logps packed {got[:4].tolist()} padded {ref[:4].tolist()}")
    print(
        f"[gpu] fwd+bwd: padded sdpa {ref_time * 1e3:.1f} ms, packed {backend} {got_time * 1e3:.1f} ms "
        f"({packed.num_tokens / got_time:.0f} real tok/s packed)"
    )
    assert rel < 2e-2
    assert ((got_step - ref_step).abs() / ref_step.abs()).max().item() < 2e-2
    assert cosine > 0.99


def _peak_fwd_bwd(fn, hidden: torch.Tensor, weight: torch.Tensor) -> tuple[torch.Tensor, float, float]:
    hidden.grad = weight.grad = None
    torch.cuda.synchronize()
    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    start = time.perf_counter()
    out = fn()
    (out[0] if isinstance(out, tuple) else out).sum().backward()  # (logps, stats) with the per-token statistics
    torch.cuda.synchronize()
    elapsed = time.perf_counter() - start
    peak = (torch.cuda.max_memory_allocated() - base) / 2**30
    hidden.grad = weight.grad = None
    return (tuple(o.detach() for o in out) if isinstance(out, tuple) else out.detach()), peak, elapsed


HEAD_SHAPE = {"vocab": 152064, "hidden_size": 2048, "tokens": 16384, "chunk": 4096}
"""A Qwen2.5-1.5B-sized LM head at a 16k-token micro-batch."""


def head_inputs() -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(hidden [N, H], weight [V, H], targets [N])`` of :data:`HEAD_SHAPE`, bf16, deterministic."""
    vocab, hidden_size, tokens = HEAD_SHAPE["vocab"], HEAD_SHAPE["hidden_size"], HEAD_SHAPE["tokens"]
    gen = torch.Generator(device="cuda").manual_seed(0)
    weight = (torch.randn(vocab, hidden_size, generator=gen, device="cuda") * 0.02).bfloat16().requires_grad_()
    hidden = torch.randn(tokens, hidden_size, generator=gen, device="cuda").bfloat16().requires_grad_()
    targets = torch.randint(0, vocab, (tokens,), generator=gen, device="cuda")
    return hidden, weight, targets


def test_chunked_logps_peak_memory_vs_naive() -> None:
    vocab, hidden_size, tokens, chunk = HEAD_SHAPE.values()
    hidden, weight, targets = head_inputs()

    runs = {}
    for name, fn in (
        ("naive", lambda: naive_token_logps(hidden, weight, targets)),
        ("chunked", lambda: chunked_token_logps(hidden, weight, targets, chunk)),
    ):
        _peak_fwd_bwd(fn, hidden, weight)  # warm-up (kernels, allocator)
        runs[name] = _peak_fwd_bwd(fn, hidden, weight)
    (naive_out, naive_peak, naive_time), (chunk_out, chunk_peak, chunk_time) = runs["naive"], runs["chunked"]
    err = (naive_out - chunk_out).abs().max().item()
    print(
        f"\n[gpu] log-probs fwd+bwd V={vocab} N={tokens} H={hidden_size} bf16: "
        f"naive peak {naive_peak:.2f} GiB {naive_time * 1e3:.1f} ms; "
        f"chunked({chunk}) peak {chunk_peak:.2f} GiB {chunk_time * 1e3:.1f} ms; max abs diff {err:.3g}"
    )
    assert chunk_peak < naive_peak / 2
    assert err < 1e-2


@pytest.mark.parametrize("share_prompt", [False, True])
def test_compiled_layers_torch_varlen_stop_compiling_and_match_eager(share_prompt) -> None:
    """Regional compile on the real kernel: no graph break (fullgraph), at most two graphs for packed rows of four
    different shapes, the same per-sequence log-probs and gradients as eager (bf16); prints eager vs compiled time.
    With shared prompts the gathered key segments and the longest key segment change with every row too."""
    from torch._dynamo.utils import counters

    from pair_dpo_trainer.modeling.compile import compile_decoder_layers

    torch._dynamo.reset()
    counters.clear()
    eager, model = _llama_100m(), _llama_100m()
    for m in (eager, model):
        assert enable_pair_varlen(m, "auto") in ("flash_attn", "torch_varlen")
    compile_decoder_layers(model, fullgraph=True)
    batches = [
        PackedPairCollator(share_prompt=share_prompt)(_features(seed, n)).pin_memory().to("cuda", non_blocking=True)
        for seed, n in ((1, 8), (2, 5), (3, 11), (4, 7))
    ]
    assert len({b.num_tokens for b in batches}) == 4 and len({b.max_seqlen for b in batches}) == 4
    assert not share_prompt or len({b.max_seqlen_k for b in batches}) == 4
    graphs, times = [], {}
    for batch in batches:
        weights = torch.randn(batch.num_sequences, device="cuda")
        got, got_time = _timed_step(lambda b=batch: packed_sequence_logps(model, b), weights)
        graphs.append(counters["stats"]["unique_graphs"])
        got_grad = torch.cat([p.grad.float().flatten() for p in model.parameters()])
        want, want_time = _timed_step(lambda b=batch: packed_sequence_logps(eager, b), weights)
        want_grad = torch.cat([p.grad.float().flatten() for p in eager.parameters()])
        model.zero_grad(set_to_none=True)
        eager.zero_grad(set_to_none=True)
        rel = ((got - want).abs() / want.abs()).max().item()
        cosine = torch.nn.functional.cosine_similarity(got_grad, want_grad, dim=0).item()
        times[batch.num_tokens] = (want_time, got_time)
        print(
            f"[gpu] compiled T={batch.num_tokens}: logps max rel diff {rel:.3g}, grad cosine {cosine:.5f}; "
            f"fwd+bwd eager {want_time * 1e3:.1f} ms, compiled {got_time * 1e3:.1f} ms"
        )
        assert rel < 2e-2 and cosine > 0.99
    with torch.no_grad():
        packed_sequence_logps(model, batches[0])
        no_grad_graphs = counters["stats"]["unique_graphs"]
        for batch in batches[1:]:
            packed_sequence_logps(model, batch)
    final = counters["stats"]["unique_graphs"]
    print(f"[gpu] unique graphs after each train batch {graphs}; after the no-grad batches {no_grad_graphs} -> {final}")
    # Each longest-segment int (max_seqlen; with shared prompts max_seqlen_k too) is specialised on first sight and
    # made symbolic when it changes (one recompile each, measured on an H100: [1, 1, 2, 2] shared); tensor shapes are
    # symbolic from the start. After that no packed shape compiles again.
    ints = 2 if share_prompt else 1
    assert graphs[0] >= 1 and graphs[-1] <= graphs[0] + ints and graphs[-1] == graphs[-2]
    assert share_prompt or graphs[2:] == [graphs[1]] * 2  # one int: stable from the second shape on
    assert final == no_grad_graphs
