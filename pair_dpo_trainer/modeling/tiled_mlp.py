"""Tiled MLP: every decoder layer's MLP runs over the packed row in sequence tiles, so its intermediate activations
(``intermediate_size`` x tokens, three such tensors for a gated MLP) exist for one tile at a time, in forward and in
backward (the idea of ALST's tiled MLP, arXiv:2506.13996).

Forward with gradients: the tiles run without autograd and only the MLP's input is saved. Backward: each tile's MLP
runs again with autograd, and ``torch.autograd.grad`` gives that tile's input gradient and its share of the MLP's
trainable parameters' gradients; the shares are summed over the tiles (in float32 for lower-precision parameters) and
returned once, because the parameters are inputs of the autograd function. So each parameter's gradient accumulates
once per micro-batch, as without tiles: DDP's reducer hooks fire once, frozen LoRA base weights get none. Without
gradients (the reference's forward, evaluation) the tiles just run one after another.

Cost: the MLP's forward runs twice per micro-batch (once more in backward), as under activation checkpointing; the
largest MLP temporaries shrink from ``rows x intermediate_size`` to ``tile x intermediate_size``. The MLP is the
per-token part of a layer, so tiling the sequence computes exactly the same function (float64: equal to rounding).

The wrapper is installed on the MLP class's ``forward`` (one class-level wrapper reading a per-instance tile size), so
parameter names, PEFT adapters and activation checkpointing of the layer around it are unchanged. Under
``torch_compile`` the tiled MLP runs eagerly between the compiled pieces of the layer (``torch._dynamo.disable``:
Dynamo does not trace an autograd function whose backward calls ``torch.autograd.grad``).

Details: modeling/README.md, "Module notes", ``tiled_mlp.py``.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable, Sequence
from typing import Any

import torch

from pair_dpo_trainer.config.option_checks import parse_tiled_mlp
from pair_dpo_trainer.errors import ConfigError
from pair_dpo_trainer.modeling.layers import find_decoder_layers
from pair_dpo_trainer.modeling.wrappers import unwrap_model

_TILE = "_pair_dpo_mlp_tile"
_WRAPPED = "_pair_dpo_mlp_tiled"


def tile_tokens(setting: int | str, rows: int, hidden_size: int) -> int:
    """Tokens per tile for a row of ``rows`` tokens: the setting's count, or for ``"auto"`` the row split evenly into
    ``ceil(rows / hidden_size)`` tiles (each tile's intermediate then holds about as many values as one MLP weight).

    Example:
        >>> tile_tokens(1000, 5000, 64), tile_tokens("auto", 5000, 1536), tile_tokens("auto", 100, 1536)
        (1000, 1250, 100)
    """
    if setting == "auto":
        return math.ceil(rows / max(1, math.ceil(rows / hidden_size)))
    return int(setting)


class _TiledMLP(torch.autograd.Function):
    """``forward(x)`` of one MLP in tiles along the sequence dimension; see the module docstring."""

    @staticmethod
    def forward(ctx: Any, run: Callable[[torch.Tensor], torch.Tensor], tile: int, x: torch.Tensor, *params: Any):
        ctx.run, ctx.tile, ctx.params = run, tile, params
        ctx.save_for_backward(x)
        with torch.no_grad():
            return torch.cat([run(piece) for piece in x.split(tile, dim=-2)], dim=-2)

    @staticmethod
    def backward(ctx: Any, grad_out: torch.Tensor) -> tuple[Any, ...]:
        (x,) = ctx.saved_tensors
        need_x = ctx.needs_input_grad[2]
        wanted = [i for i, p in enumerate(ctx.params) if ctx.needs_input_grad[3 + i]]
        params = [ctx.params[i] for i in wanted]
        grad_x = torch.empty_like(x) if need_x else None
        sums: list[torch.Tensor | None] = [None] * len(params)
        for start in range(0, x.shape[-2], ctx.tile):
            piece = x[..., start : start + ctx.tile, :].detach().requires_grad_(need_x)
            with torch.enable_grad():
                out = ctx.run(piece)
            inputs = ([piece] if need_x else []) + params
            grads = torch.autograd.grad(out, inputs, grad_out[..., start : start + ctx.tile, :], allow_unused=True)
            if need_x:
                assert grad_x is not None
                grad_x[..., start : start + ctx.tile, :] = grads[0]
            _accumulate(sums, grads[1:] if need_x else grads)
        param_grads: list[torch.Tensor | None] = [None] * len(ctx.params)
        for i, total in zip(wanted, sums, strict=True):
            param_grads[i] = None if total is None else total.to(ctx.params[i].dtype)
        return (None, None, grad_x, *param_grads)


def _accumulate(sums: list[torch.Tensor | None], grads: Sequence[torch.Tensor | None]) -> None:
    """Adds one tile's parameter gradients to ``sums`` (float32 for lower-precision floats, else their dtype)."""
    for i, grad in enumerate(grads):
        if grad is None:
            continue
        if grad.dtype in (torch.bfloat16, torch.float16):
            grad = grad.float()
        sums[i] = grad if sums[i] is None else sums[i] + grad  # type: ignore[operator]


@torch._dynamo.disable
def _tiled(module: torch.nn.Module, inner: Callable[..., Any], tile: int, x: torch.Tensor) -> torch.Tensor:
    """The MLP of ``x`` in tiles of ``tile`` tokens: through :class:`_TiledMLP` when gradients flow, else a loop."""
    run = functools.partial(inner, module)
    params = [p for p in module.parameters() if p.requires_grad]
    if torch.is_grad_enabled() and (x.requires_grad or params):
        return _TiledMLP.apply(run, tile, x, *params)
    return torch.cat([run(piece) for piece in x.split(tile, dim=-2)], dim=-2)


def _tiled_forward(inner: Callable[..., Any]) -> Callable[..., Any]:
    @functools.wraps(inner)
    def forward(self: torch.nn.Module, x: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
        setting = getattr(self, _TILE, None)
        if setting is None or args or kwargs or x.dim() < 2:
            return inner(self, x, *args, **kwargs)
        tile = tile_tokens(setting, x.shape[-2], x.shape[-1])
        if x.shape[-2] <= tile:
            return inner(self, x)
        return _tiled(self, inner, tile, x)

    return forward


def apply_tiled_mlp(model: torch.nn.Module, setting: Any) -> int:
    """Sets the tile size of every decoder layer's MLP (``layer.mlp``) of ``model``; returns how many MLPs are tiled.

    Call before the layers are compiled; calling it again re-sets the tiles (None: off).

    Args:
        model: A transformers causal LM (or a wrapper around one).
        setting: ``PairDPOConfig.tiled_mlp``: None (off), ``"auto"`` or a tile size in tokens.

    Example:
        >>> from transformers import LlamaConfig, LlamaForCausalLM
        >>> m = LlamaForCausalLM(LlamaConfig(hidden_size=16, intermediate_size=32, num_hidden_layers=3,
        ...     num_attention_heads=2, vocab_size=64))
        >>> apply_tiled_mlp(m, 512), apply_tiled_mlp(m, None)
        (3, 0)

    Raises:
        ConfigError: ``bad_tiled_mlp`` for a value that is not None, ``"auto"`` or a positive tile size;
            ``tiled_mlp_unsupported`` for a model whose decoder layers have no ``mlp`` module.
    """
    try:
        tile = parse_tiled_mlp(setting)
    except ValueError as exc:
        raise ConfigError("bad_tiled_mlp", str(exc)) from exc
    layers = find_decoder_layers(model)
    mlps = [getattr(layer, "mlp", None) for layer in layers] if layers is not None else []
    if tile is not None and (not mlps or not all(isinstance(m, torch.nn.Module) for m in mlps)):
        raise ConfigError(
            "tiled_mlp_unsupported",
            f"tiled_mlp={setting!r} tiles the MLP of every decoder layer (its 'mlp' module), but "
            f"{type(unwrap_model(model)).__name__} has no such layers that pair_dpo_trainer recognises: set it to "
            "None.",
        )
    for mlp in mlps:
        if mlp is None:
            continue
        cls = type(mlp)
        if not cls.__dict__.get(_WRAPPED, False):
            cls.forward = _tiled_forward(cls.forward)
            setattr(cls, _WRAPPED, True)
        setattr(mlp, _TILE, tile)
    return 0 if tile is None else len(mlps)


def tiled_mlp_problems(setting: Any, *, sharded: bool) -> list[tuple[str, str]]:
    """``tiled_mlp`` with ZeRO-3 / FSDP2: the tiles' backward takes the gradients of the MLP's registered parameters,
    which are shards there (the layer computes with gathered copies)."""
    if setting is None or not sharded:
        return []
    return [
        (
            "unsupported_combination",
            f"tiled_mlp={setting!r} computes the MLP's parameter gradients in its own backward, but DeepSpeed ZeRO-3 "
            "and FSDP2 shard those parameters (the layer computes with gathered copies): set tiled_mlp=None, or "
            "train unsharded (one GPU, DDP, ZeRO-1/2).",
        )
    ]
