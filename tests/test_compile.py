"""Regional ``torch.compile`` of the decoder layers (``pair_dpo_trainer.modeling.compile``).

On CPU the CUDA varlen kernels do not run, so the traceable tests swap a block-mask SDPA in as the ``torch_varlen``
kernel (``testing.cpu_varlen.install_traceable_varlen``: same signature, same semantics): everything else, the
attention
function included, is the product's code.
"""

from __future__ import annotations

import pytest
import torch
from torch._dynamo.utils import counters

from pair_dpo_trainer import PairDPOConfig, PairDPOTrainer
from pair_dpo_trainer.collators import PackedPairCollator
from pair_dpo_trainer.errors import ConfigError
from pair_dpo_trainer.modeling.attention import enable_pair_varlen
from pair_dpo_trainer.modeling.compile import compile_decoder_layers, decoder_layers, is_compiled
from pair_dpo_trainer.modeling.logprobs import packed_sequence_logps
from pair_dpo_trainer.testing.cpu_varlen import install_traceable_varlen
from pair_dpo_trainer.training.checks import check_config
from tests.dpo_fixtures import cpu_config, random_features, synthetic_pairs
from tests.models import tiny_llama, tiny_tokenizer


@pytest.fixture
def traceable_varlen(monkeypatch: pytest.MonkeyPatch) -> str:
    """Makes ``torch_varlen`` available on CPU with a traceable block-mask kernel (``dpo_fixtures``)."""
    torch._dynamo.reset()
    counters.clear()
    yield install_traceable_varlen(monkeypatch)
    torch._dynamo.reset()


def _batches(n: int = 3, share_prompt: bool = False):
    """Packed micro-batches whose length, sequence count and longest sequence all differ."""
    sizes = [(2, (2, 6), (1, 5)), (3, (4, 12), (2, 9)), (4, (1, 3), (6, 14))][:n]
    collator = PackedPairCollator(share_prompt=share_prompt)
    return [
        collator(random_features(seed, pairs, vocab=64, prompt_len=p, completion_len=c))
        for seed, (pairs, p, c) in enumerate(sizes)
    ]


def _graphs() -> int:
    return counters["stats"]["unique_graphs"]


def _step(model, batch) -> tuple[torch.Tensor, torch.Tensor]:
    logps = packed_sequence_logps(model, batch)
    logps.sum().backward()
    grad = model.model.layers[0].mlp.up_proj.weight.grad.clone()
    model.zero_grad()
    return logps.detach(), grad


@pytest.mark.integration
@pytest.mark.parametrize("share_prompt", [False, True])
def test_dynamic_layers_compile_once_for_every_packed_shape_without_graph_breaks(traceable_varlen, share_prompt):
    batches = _batches(share_prompt=share_prompt)
    if share_prompt:  # the gathered keys' segments and longest key segment change too
        assert all(b.shares_prompt for b in batches) and len({b.max_seqlen_k for b in batches}) == 3
    assert len({b.input_ids.shape[1] for b in batches}) == 3
    assert len({b.max_seqlen for b in batches}) == 3 and len({b.num_sequences for b in batches}) == 3
    eager = tiny_llama()
    enable_pair_varlen(eager, traceable_varlen)
    model = tiny_llama()
    enable_pair_varlen(model, traceable_varlen)
    assert compile_decoder_layers(model, backend="aot_eager", fullgraph=True) == 2  # fullgraph: a break raises
    assert is_compiled(model) and not is_compiled(eager)
    got = [_step(model, b) for b in batches[:1]]
    after_first = _graphs()
    got += [_step(model, b) for b in batches[1:]]
    assert after_first >= 1 and _graphs() == after_first, "a new packed shape recompiled the layers"
    for batch, (logps, grad) in zip(batches, got, strict=True):
        want_logps, want_grad = _step(eager, batch)
        torch.testing.assert_close(logps, want_logps, rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(grad, want_grad, rtol=1e-5, atol=1e-6)
    # The same run with static shapes recompiles per shape: the counter above can see a recompile.
    static = tiny_llama()
    enable_pair_varlen(static, traceable_varlen)
    compile_decoder_layers(static, backend="aot_eager", dynamic=False)
    before = _graphs()
    _step(static, batches[0])
    first = _graphs()
    _step(static, batches[1])
    assert first > before and _graphs() > first


@pytest.mark.slow  # inductor compiles the layers on the CPU (~30 s)
def test_inductor_layers_match_eager_logps_and_grads(traceable_varlen) -> None:
    batches = _batches(2)
    eager, model = tiny_llama(), tiny_llama()
    for m in (eager, model):
        enable_pair_varlen(m, traceable_varlen)
    compile_decoder_layers(model)  # inductor (C++ on CPU), dynamic
    for batch in batches:
        (logps, grad), (want_logps, want_grad) = _step(model, batch), _step(eager, batch)
        torch.testing.assert_close(logps, want_logps, rtol=1e-4, atol=1e-4)
        torch.testing.assert_close(grad, want_grad, rtol=1e-4, atol=1e-5)


def test_compile_keeps_parameter_names_and_is_idempotent() -> None:
    model = tiny_llama()
    names = [n for n, _ in model.named_parameters()]
    assert compile_decoder_layers(model, backend="eager") == 2
    assert compile_decoder_layers(model, backend="eager") == 0
    assert [n for n, _ in model.named_parameters()] == names
    assert list(model.state_dict()) == names
    assert len(decoder_layers(model)) == 2


@pytest.mark.parametrize("mode", ["reduce-overhead", "max-autotune"])
def test_cuda_graph_modes_are_refused(tmp_path, mode: str) -> None:
    with pytest.raises(ConfigError) as info:
        check_config(PairDPOConfig(output_dir=str(tmp_path), torch_compile_mode=mode, use_cpu=True, report_to="none"))
    assert info.value.reason_code == "unsupported_combination" and "torch_compile_mode" in str(info.value)
    with pytest.raises(ConfigError):
        compile_decoder_layers(tiny_llama(), backend="eager", mode=mode)


@pytest.mark.integration
def test_trainer_compiles_policy_and_reference_layers_and_matches_eager(tmp_path, traceable_varlen) -> None:
    """torch_compile=True: the decoder layers of both models are compiled in place (not the whole model by
    accelerate), the reference stays a separate frozen copy, and the losses equal an eager run's."""
    losses = {}
    for compiled in (False, True):
        args = cpu_config(
            tmp_path / str(compiled),
            max_steps=2,
            attn_backend=traceable_varlen,
            torch_compile=compiled,
            torch_compile_backend="aot_eager" if compiled else None,
        )
        trainer = PairDPOTrainer(
            tiny_llama(), args, train_dataset=synthetic_pairs(16), processing_class=tiny_tokenizer()
        )
        reference = trainer.reference.model
        start = reference.model.layers[0].mlp.up_proj.weight.clone()
        history = trainer.train()
        losses[compiled] = [log["loss"] for log in trainer.state.log_history if "loss" in log]
        assert is_compiled(trainer.model) is compiled and is_compiled(reference) is compiled
        assert type(trainer.model).__name__ == "LlamaForCausalLM"  # no whole-model OptimizedModule
        assert torch.equal(reference.model.layers[0].mlp.up_proj.weight, start)  # the reference never trains
        assert not torch.equal(trainer.model.model.layers[0].mlp.up_proj.weight, start)
        assert history.global_step == 2
    assert len(losses[True]) == 2
    torch.testing.assert_close(losses[True], losses[False], rtol=1e-4, atol=1e-5)


def test_compile_without_a_varlen_kernel_is_refused(tmp_path) -> None:
    """On the CPU (auto -> sdpa_segments) every compiled layer would break on the host-side segment bounds."""
    args = cpu_config(tmp_path, torch_compile=True, torch_compile_backend="aot_eager")
    with pytest.raises(ConfigError) as info:
        PairDPOTrainer(tiny_llama(), args, train_dataset=synthetic_pairs(8), processing_class=tiny_tokenizer())
    assert info.value.reason_code == "unsupported_combination" and "sdpa_segments" in str(info.value)
