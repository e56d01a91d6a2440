"""The tiled MLP (``tiled_mlp``): in float64 on the tiny Llama, per-sequence log-probs and every parameter's gradient
equal the untiled model's (1e-10 relative) on packed rows of several pairs, with tile sizes that do not divide the row,
alone and under activation checkpointing, host offload and LoRA; the MLP's intermediate never spans more than one
tile, in forward or backward; bad values are refused in one place."""

from __future__ import annotations

import pytest
import torch
from transformers.models.llama import modeling_llama

from pair_dpo_trainer.collators import PackedPairCollator
from pair_dpo_trainer.errors import ConfigError
from pair_dpo_trainer.modeling import enable_pair_varlen
from pair_dpo_trainer.modeling.checkpointing import apply_activation_checkpointing, offload_activations
from pair_dpo_trainer.modeling.logprobs import packed_policy_logps
from pair_dpo_trainer.modeling.tiled_mlp import apply_tiled_mlp
from tests.dpo_fixtures import synthetic_pairs
from tests.models import tiny_llama


def _float64_norm(self, hidden: torch.Tensor) -> torch.Tensor:
    """Llama's RMSNorm in the input's dtype (transformers computes it in float32, which would round float64)."""
    variance = hidden.pow(2).mean(-1, keepdim=True)
    return self.weight * (hidden * torch.rsqrt(variance + self.variance_epsilon))


@pytest.fixture
def float64_norm(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(modeling_llama.LlamaRMSNorm, "forward", _float64_norm)


def _model(lora: bool) -> torch.nn.Module:
    model = tiny_llama(seed=0).double()
    if lora:  # adapters on the MLP's projections, B non-zero so every adapter weight has a gradient
        import peft

        targets = ["gate_proj", "up_proj", "down_proj", "q_proj"]
        config = peft.LoraConfig(r=4, lora_alpha=8, lora_dropout=0.0, target_modules=targets)
        model = peft.get_peft_model(model, config)
        torch.manual_seed(1)
        for name, param in model.named_parameters():
            if "lora_B" in name:
                torch.nn.init.normal_(param, std=0.05)
    enable_pair_varlen(model, "sdpa_segments", device="cpu")
    return model.train()


def _logps_and_grads(model: torch.nn.Module, batch) -> tuple[torch.Tensor, list[torch.Tensor | None]]:
    logps = packed_policy_logps(model, batch, chunk_size=5).logps
    weights = torch.linspace(0.5, 1.5, logps.numel(), dtype=logps.dtype)
    params = [p for p in model.parameters() if p.requires_grad]
    return logps.detach(), list(torch.autograd.grad((logps * weights).sum(), params, allow_unused=True))


def _relative(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).abs().max() / b.abs().max().clamp(min=1e-300))


@pytest.mark.parametrize(
    "tile,checkpointing,offload,lora",
    [
        (7, "off", False, False),
        (13, "full", False, False),
        (11, "selective", True, False),
        ("auto", "layers:2", False, False),
        (9, "full", True, True),
    ],
)
def test_tiled_equals_untiled_in_float64(float64_norm, tile, checkpointing, offload, lora) -> None:
    pairs = synthetic_pairs(6, seed=4)
    batch = PackedPairCollator(share_prompt=True)(pairs)
    rows = batch.input_ids.shape[-1]
    assert rows % 7 and rows % 9 and rows % 11 and rows % 13 and rows > 32  # tiles that do not divide the row
    model = _model(lora)
    expected_logps, expected_grads = _logps_and_grads(model, batch)
    apply_activation_checkpointing(model, checkpointing)
    offload_activations(model, offload)
    assert apply_tiled_mlp(model, tile) == 2
    spans: list[int] = []
    hooks = [
        layer.mlp.down_proj.register_forward_hook(lambda _m, inputs, _o: spans.append(inputs[0].shape[-2]))
        for layer in model.get_decoder().layers
    ]
    logps, grads = _logps_and_grads(model, batch)
    for hook in hooks:
        hook.remove()
    limit = tile if tile != "auto" else 32  # auto: tiles of at most hidden_size (32) tokens
    assert spans and max(spans) <= limit < rows, "the MLP's intermediate spans one tile at most"
    tiles = -(-rows // limit)
    assert len(spans) >= 2 * 2 * tiles, "each of the 2 layers runs its tiles in forward and again in backward"
    assert _relative(logps, expected_logps) <= 1e-10
    names = [name for name, p in model.named_parameters() if p.requires_grad]
    assert len(names) == len(grads) and (not lora or all("lora" in n for n in names))
    for name, got, want in zip(names, grads, expected_grads, strict=True):
        assert (got is None) == (want is None), name
        if want is not None:
            assert want.abs().max() > 0, name
            assert _relative(got, want) <= 1e-10, name


def test_without_gradients_the_tiles_run_in_turn_and_agree(float64_norm) -> None:
    """The reference's and evaluation's forward (no autograd): tiled == untiled, tile by tile."""
    batch = PackedPairCollator(share_prompt=True)(synthetic_pairs(5, seed=6))
    model = _model(lora=False).eval()
    with torch.no_grad():
        expected = packed_policy_logps(model, batch, chunk_size=5).logps
        apply_tiled_mlp(model, 10)
        got = packed_policy_logps(model, batch, chunk_size=5).logps
    assert _relative(got, expected) <= 1e-12
    assert apply_tiled_mlp(model, None) == 0


@pytest.mark.parametrize("value", [0, -3, "big", 2.5, True, "0"])
def test_a_bad_tiled_mlp_value_is_refused_with_its_reason_code(tmp_path, value) -> None:
    from tests.dpo_fixtures import cpu_config

    with pytest.raises(ConfigError) as refused:
        cpu_config(tmp_path, tiled_mlp=value)
    assert [code for code, _ in refused.value.problems] == ["bad_tiled_mlp"]
    assert "tiled_mlp=" in str(refused.value)
    with pytest.raises(ConfigError) as direct:
        apply_tiled_mlp(tiny_llama(0), value)
    assert direct.value.reason_code == "bad_tiled_mlp"


def test_compiled_layers_with_tiles_equal_the_eager_untiled_model(float64_norm, monkeypatch) -> None:
    """Regional compile (``aot_eager``, the traceable CPU varlen kernel) of checkpointed layers whose MLP runs in
    tiles: the tiled MLP runs eagerly between the compiled pieces and the results are the eager model's."""
    from pair_dpo_trainer.modeling.compile import compile_decoder_layers
    from pair_dpo_trainer.testing.cpu_varlen import install_traceable_varlen

    torch._dynamo.reset()
    batch = PackedPairCollator(share_prompt=True)(synthetic_pairs(6, seed=4))
    model = tiny_llama(seed=0).double()
    enable_pair_varlen(model, install_traceable_varlen(monkeypatch), device="cpu")
    model.train()
    expected_logps, expected_grads = _logps_and_grads(model, batch)
    apply_activation_checkpointing(model, "full")
    apply_tiled_mlp(model, 7)
    compile_decoder_layers(model, backend="aot_eager")
    logps, grads = _logps_and_grads(model, batch)
    assert _relative(logps, expected_logps) <= 1e-10
    for got, want in zip(grads, expected_grads, strict=True):
        assert _relative(got, want) <= 1e-10


def test_tiles_are_refused_where_the_mlp_weights_are_sharded(tmp_path) -> None:
    from pair_dpo_trainer.training.checks import run_problems
    from tests.dpo_fixtures import cpu_config, run_setup

    args = cpu_config(tmp_path, tiled_mlp="auto")
    assert run_problems(args, run_setup()) == []
    problems = run_problems(args, run_setup(zero3=True))
    assert [code for code, text in problems if "tiled_mlp='auto'" in text] == ["unsupported_combination"]


def test_ddp_sees_each_mlp_gradient_once_per_backward(float64_norm) -> None:
    """Under DDP (one gloo rank, in process) the tiles' parameter gradients reach the reducer once per backward, two
    steps in a row, under full checkpointing: the gradients equal the untiled DDP model's."""
    import copy

    import torch.distributed as dist

    from tests.ports import free_port

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{free_port()}", rank=0, world_size=1)
    try:
        base, ids = tiny_llama(0).double(), torch.randint(4, 64, (1, 50), generator=torch.Generator().manual_seed(0))
        grads = []
        for tile in (None, 7):
            model = copy.deepcopy(base).train()
            apply_activation_checkpointing(model, "full")
            apply_tiled_mlp(model, tile)
            ddp = torch.nn.parallel.DistributedDataParallel(model)
            for _ in range(2):
                model.zero_grad()
                ddp(ids, use_cache=False).logits.square().mean().backward()
            grads.append({name: p.grad.clone() for name, p in model.named_parameters()})
    finally:
        dist.destroy_process_group()
    for name, want in grads[0].items():
        assert _relative(grads[1][name], want) <= 1e-10, name


def test_the_mlp_intermediates_are_not_kept_for_backward() -> None:
    """What autograd keeps for backward (saved-tensor hooks, parameters excluded): without checkpointing the tiled
    layers keep the MLP's input only, not its four intermediate-wide tensors (gate, SiLU(gate), up, their product)."""
    model = tiny_llama(0).train()
    ids = torch.randint(4, 64, (1, 96), generator=torch.Generator().manual_seed(0))
    params = {p.data_ptr() for p in model.parameters()}

    def saved_bytes() -> int:
        total = 0

        def pack(tensor: torch.Tensor) -> torch.Tensor:
            nonlocal total
            total += 0 if tensor.data_ptr() in params else tensor.numel() * tensor.element_size()
            return tensor

        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            loss = model(ids, use_cache=False).logits.sum()
        loss.backward()  # outside the hooks: the tiles' recompute in backward is transient, one tile at a time
        return total

    untiled = saved_bytes()
    apply_tiled_mlp(model, 16)
    tiled = saved_bytes()
    config = model.config
    intermediates = config.num_hidden_layers * 96 * 4 * config.intermediate_size * 4  # float32 bytes
    assert untiled - tiled >= intermediates
