"""pair_varlen attention: backend selection, exactness per segment, no dense mask, the use_cache pitfall."""

from __future__ import annotations

import math

import pytest
import torch
import transformers.masking_utils as masking_utils
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves
from transformers import AttentionInterface

from pair_dpo_trainer.collators import PackedPairCollator, PaddedPairCollator
from pair_dpo_trainer.errors import ConfigError
from pair_dpo_trainer.modeling import (
    PAIR_VARLEN,
    enable_pair_varlen,
    packed_forward_kwargs,
    register_pair_varlen,
    select_attn_backend,
    varlen_attention,
)
from pair_dpo_trainer.modeling.logprobs import padded_sequence_logps
from tests.dpo_fixtures import random_features
from tests.models import SHARP_VOCAB
from tests.models import sharp_llama as tiny_llama

VOCAB = SHARP_VOCAB


def features(seed: int, n: int) -> list[dict[str, list[int]]]:
    return random_features(seed, n, vocab=VOCAB, prompt_len=(3, 9), completion_len=(2, 8))


def logps_from_logits(logits: torch.Tensor, labels: torch.Tensor, index: torch.Tensor, count: int):
    """Per-sequence sums from full packed logits (used with the default transformers path)."""
    token = logits.float().log_softmax(-1).gather(-1, labels.clamp(min=0)[..., None]).squeeze(-1)
    token = token * (labels != -100)
    return torch.zeros(count).index_add(0, index.flatten(), token.flatten())


class SquareTensorSpy(TorchDispatchMode):
    """Records every op output whose last two dims are both ``size`` (a dense ``[T, T]`` mask or score)."""

    def __init__(self, size: int) -> None:
        super().__init__()
        self.size = size
        self.hits: list[tuple[str, tuple[int, ...]]] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in tree_leaves(out):
            if isinstance(t, torch.Tensor) and t.dim() >= 2 and t.shape[-2:] == (self.size, self.size):
                self.hits.append((str(func), tuple(t.shape)))
        return out


def test_select_attn_backend_on_cpu() -> None:
    assert select_attn_backend("auto", "cpu") == "sdpa_segments"
    assert select_attn_backend("sdpa_segments", "cpu") == "sdpa_segments"
    for name in ("torch_varlen", "flash_attn"):
        with pytest.raises(ConfigError) as info:
            select_attn_backend(name, "cpu")
        assert info.value.reason_code == "attn_backend_unavailable"
    with pytest.raises(ConfigError) as info:
        select_attn_backend("xformers", "cpu")
    assert info.value.reason_code == "unknown_attn_backend"


def test_registration_and_enable() -> None:
    assert register_pair_varlen() == PAIR_VARLEN
    assert PAIR_VARLEN in AttentionInterface().valid_keys()
    model = tiny_llama()
    assert enable_pair_varlen(model, device="cpu") == "sdpa_segments"
    assert model.config._attn_implementation == PAIR_VARLEN
    with pytest.raises(ConfigError) as info:
        enable_pair_varlen(model, "torch_varlen", device="cpu")
    assert info.value.reason_code == "attn_backend_unavailable"


def test_backend_is_resolved_where_attention_runs() -> None:
    """Validated for CUDA at enable time, run on the CPU: the forward refuses with a clear reason."""
    model = tiny_llama()
    try:
        enable_pair_varlen(model, "torch_varlen", device="cuda")
    except ConfigError:
        pytest.skip("this torch has no torch.nn.attention.varlen")
    with pytest.raises(ConfigError) as info:
        model(input_ids=torch.tensor([[1, 2, 3]]), use_cache=False)
    assert info.value.reason_code == "attn_backend_unavailable"


def _reference_attention(q, k, v, bounds, scale, window=None):
    """Explicit softmax attention per segment, float64."""
    groups = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(groups, 1), v.repeat_interleave(groups, 1)
    out = torch.zeros_like(q)
    for a, b in zip(bounds[:-1], bounds[1:], strict=True):
        scores = torch.einsum("qhd,khd->hqk", q[a:b], k[a:b]) * scale
        i = torch.arange(b - a)
        allowed = i[:, None] >= i[None, :]
        if window is not None:
            allowed &= (i[:, None] - i[None, :]) < window
        scores = scores.masked_fill(~allowed, float("-inf"))
        out[a:b] = torch.einsum("hqk,khd->qhd", scores.softmax(-1), v[a:b])
    return out


@pytest.mark.parametrize("window", [None, 3])
def test_sdpa_segments_is_exact_with_gqa_scale_and_window(window) -> None:
    gen = torch.Generator().manual_seed(0)
    bounds = [0, 5, 6, 13, 21]
    q = torch.randn(21, 6, 8, generator=gen, dtype=torch.float64)
    k = torch.randn(21, 2, 8, generator=gen, dtype=torch.float64)
    v = torch.randn(21, 2, 8, generator=gen, dtype=torch.float64)
    cu = torch.tensor(bounds, dtype=torch.int32)
    got = varlen_attention(q, k, v, cu, 8, backend="sdpa_segments", scale=0.3, sliding_window=window)
    ref = _reference_attention(q, k, v, bounds, 0.3, window)
    assert got.shape == (21, 6, 8) and (got - ref).abs().max() < 1e-12


def test_attention_feature_guards() -> None:
    q = torch.randn(4, 2, 8)
    cu = torch.tensor([0, 4], dtype=torch.int32)
    with pytest.raises(ConfigError) as info:
        varlen_attention(q, q, q, cu, 4, backend="sdpa_segments", softcap=30.0)
    assert info.value.reason_code == "attn_feature_unsupported"
    with pytest.raises(ConfigError):
        varlen_attention(q, q, q, cu, 4, backend="sdpa_segments", causal=False, sliding_window=2)


def test_packed_forward_builds_no_dense_mask(monkeypatch: pytest.MonkeyPatch) -> None:
    model = tiny_llama()
    enable_pair_varlen(model, "sdpa_segments")
    batch = PackedPairCollator()(features(seed=5, n=4))
    size = batch.num_tokens
    assert size not in (VOCAB, 48, 96, 12, 24)  # no weight or activation dim

    def refuse(*_args, **_kwargs):
        raise AssertionError("a mask builder ran for a packed pair_varlen forward")

    monkeypatch.setattr(masking_utils, "find_packed_sequence_indices", refuse)
    for name in list(masking_utils.ALL_MASK_ATTENTION_FUNCTIONS._global_mapping):
        monkeypatch.setitem(masking_utils.ALL_MASK_ATTENTION_FUNCTIONS._global_mapping, name, refuse)
    seen_masks = []
    real = AttentionInterface._global_mapping[PAIR_VARLEN]

    def spy(module, query, key, value, attention_mask, **kwargs):
        seen_masks.append(attention_mask)
        assert "cu_seq_lens_q" in kwargs and kwargs["max_length_q"] == batch.max_seqlen
        return real(module, query, key, value, attention_mask, **kwargs)

    monkeypatch.setitem(AttentionInterface._global_mapping, PAIR_VARLEN, spy)
    with SquareTensorSpy(size) as shapes:
        model(**packed_forward_kwargs(batch))
    assert seen_masks == [None, None]  # one call per layer, never a mask
    assert shapes.hits == []


def test_square_tensor_spy_detects_the_default_dense_mask() -> None:
    """Control for the test above: the default sdpa path does build a [T, T] mask for the same row."""
    model = tiny_llama()
    batch = PackedPairCollator()(features(seed=5, n=4))
    with SquareTensorSpy(batch.num_tokens) as shapes:
        model(input_ids=batch.input_ids, position_ids=batch.position_ids, use_cache=False)
    assert shapes.hits


def test_packed_forward_with_cache_leaks_across_sequences() -> None:
    """The pitfall pair_varlen avoids: sdpa in eval mode defaults to use_cache=True, and the row then becomes
    one long causal sequence (sequences attend to earlier ones)."""
    model = tiny_llama().eval()
    feats = features(seed=2, n=3)
    packed = PackedPairCollator()(feats)
    with torch.no_grad():
        reference = padded_sequence_logps(model, PaddedPairCollator()(feats))
        logits = model(input_ids=packed.input_ids, position_ids=packed.position_ids).logits
        leaky = logps_from_logits(logits, packed.labels, packed.sequence_index, 6)
        logits = model(input_ids=packed.input_ids, position_ids=packed.position_ids, use_cache=False).logits
        isolated = logps_from_logits(logits, packed.labels, packed.sequence_index, 6)
    assert (leaky - reference).abs().max() > 1e-2
    assert (isolated - reference).abs().max() < 1e-4  # transformers' own packed-mask path, CPU only


def test_pair_varlen_refuses_an_attention_mask() -> None:
    model = tiny_llama()
    enable_pair_varlen(model)
    attention = model.model.layers[0].self_attn
    q = torch.randn(1, 4, 5, 12)
    with pytest.raises(ConfigError) as info:
        AttentionInterface()[PAIR_VARLEN](attention, q, q, q, torch.ones(1, 1, 5, 5, dtype=torch.bool))
    assert info.value.reason_code == "attn_feature_unsupported"


def test_pair_varlen_without_boundaries_is_plain_causal() -> None:
    """Called without cu_seq_lens (e.g. a plain batch), every row is one causal sequence."""
    model = tiny_llama()
    input_ids = torch.randint(1, VOCAB, (2, 9), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        ref = model(input_ids=input_ids, use_cache=False).logits
        enable_pair_varlen(model)
        got = model(input_ids=input_ids, use_cache=False).logits
    assert (got - ref).abs().max() < 1e-5
    assert math.isfinite(got.abs().max().item())
