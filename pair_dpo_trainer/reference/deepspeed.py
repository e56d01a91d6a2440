"""The reference under DeepSpeed: its own inference-only engine, sharded like the policy.

With DeepSpeed the frozen reference is a second ``deepspeed.initialize``-d engine built from the run's DeepSpeed
configuration (the one the Trainer uses for the policy), changed as follows:

Details: reference/README.md, "Module notes", ``deepspeed.py``.
"""

from __future__ import annotations

import contextlib
import copy
import gc
import logging
from collections.abc import Callable, Iterator, Mapping
from typing import TYPE_CHECKING, Any

import torch

from pair_dpo_trainer.collators.batch import PackedPairBatch
from pair_dpo_trainer.errors import ConfigError, Problem, raise_problems
from pair_dpo_trainer.modeling.chunked_head import DEFAULT_CHUNK_SIZE
from pair_dpo_trainer.modeling.logprobs import packed_sequence_logps
from pair_dpo_trainer.parallel.gather import gathered_named_parameters
from pair_dpo_trainer.parallel.zero3 import mark_zero3_leaf_modules

if TYPE_CHECKING:
    pass

logger = logging.getLogger(__name__)

HIDDEN_SIZE_KEYS: dict[str, Callable[[int], int]] = {
    "reduce_bucket_size": lambda h: h * h,
    "stage3_prefetch_bucket_size": lambda h: int(0.9 * h * h),
    "stage3_param_persistence_threshold": lambda h: 10 * h,
}
"""ZeRO-3 tuning keys derived from the hidden size ``h`` when the configuration leaves them unset or ``"auto"``."""


def hidden_size_of(model_config: Any) -> int | None:
    """The hidden size of a model's ``config`` (the largest of ``hidden_sizes``; a multimodal model's text config), or
    None."""
    for cfg in (model_config, getattr(model_config, "text_config", None)):
        if cfg is None:
            continue
        if isinstance(getattr(cfg, "hidden_size", None), int):
            return cfg.hidden_size
        if getattr(cfg, "hidden_sizes", None):
            return max(cfg.hidden_sizes)
    return None


def ref_zero_stage_problem(stage: Any) -> str | None:
    """Why ``ref_zero_stage=stage`` is not a valid value (None, or the int 0 or 3), or None when it is."""
    if stage is None or (isinstance(stage, int) and not isinstance(stage, bool) and stage in (0, 3)):
        return None
    return f"ref_zero_stage={stage!r}: use None (follow the policy), 0 or 3."


def reference_zero_stage_problems(
    train_config: Mapping[str, Any], *, zero_stage: int | None, offload_params: bool | None
) -> list[Problem]:
    """``(reason_code, message)`` for every reference ZeRO setting the run's DeepSpeed configuration cannot run.

    Args:
        train_config: The run's DeepSpeed configuration.
        zero_stage: ``PairDPOConfig.ref_zero_stage``: None follows the policy (3 under ZeRO-3, else 0); 0 replicates
            the reference even under a ZeRO-3 policy; 3 shards it (needs a ZeRO-3 policy).
        offload_params: ``PairDPOConfig.ref_offload_params`` (offloading needs a sharded reference).

    Returns:
        ``bad_ref_zero_stage`` for a stage other than None, 0 or 3; ``unsupported_combination`` for
        ``ref_zero_stage=3`` without a ZeRO-3 policy, or ``ref_offload_params=True`` with a stage 0 reference.
    """
    problem = ref_zero_stage_problem(zero_stage)
    if problem is not None:
        return [("bad_ref_zero_stage", problem)]
    problems: list[Problem] = []
    policy_stage = (train_config.get("zero_optimization") or {}).get("stage", 0)
    if policy_stage != 3 and zero_stage == 3:
        problems.append(
            (
                "unsupported_combination",
                f"ref_zero_stage=3 shards the reference like a ZeRO-3 policy, but the run uses ZeRO stage "
                f"{policy_stage}: leave ref_zero_stage unset (or 0) to replicate the reference, or train with ZeRO "
                "stage 3.",
            )
        )
    if _stage(policy_stage, zero_stage) == 0 and offload_params:
        reason = "ref_zero_stage=0 replicates it" if policy_stage == 3 else f"the run uses ZeRO stage {policy_stage}"
        problems.append(
            (
                "unsupported_combination",
                f"ref_offload_params=True offloads a ZeRO-3 sharded reference, but {reason}: set "
                "ref_offload_params=False (or leave it unset), or shard the reference (ZeRO stage 3 with "
                "ref_zero_stage unset or 3).",
            )
        )
    return problems


def _stage(policy_stage: int, zero_stage: int | None) -> int:
    return 3 if policy_stage == 3 and zero_stage != 0 else 0


def reference_zero_stage(
    train_config: Mapping[str, Any], *, zero_stage: int | None, offload_params: bool | None
) -> int:
    """The reference engine's ZeRO stage (3: sharded, 0: replicated) for the run's DeepSpeed configuration.

    Args:
        train_config: The run's DeepSpeed configuration.
        zero_stage: ``PairDPOConfig.ref_zero_stage`` (checked by ``training.checks.run_problems`` already).
        offload_params: ``PairDPOConfig.ref_offload_params``.

    Raises:
        ConfigError: the problems of :func:`reference_zero_stage_problems`, for a caller that skipped the checks.
    """
    raise_problems(reference_zero_stage_problems(train_config, zero_stage=zero_stage, offload_params=offload_params))
    return _stage((train_config.get("zero_optimization") or {}).get("stage", 0), zero_stage)


def reference_ds_config(
    train_config: Mapping[str, Any],
    *,
    hidden_size: int | None,
    offload_params: bool | None,
    zero_stage: int | None = None,
) -> dict[str, Any]:
    """The DeepSpeed configuration of the reference engine, derived from the run's (see the module docstring).

    Args:
        train_config: The run's DeepSpeed configuration (not modified).
        hidden_size: The reference's hidden size, for the ``"auto"`` ZeRO-3 tuning values.
        offload_params: ``PairDPOConfig.ref_offload_params``.
        zero_stage: ``PairDPOConfig.ref_zero_stage``: None follows the policy (3 under ZeRO-3, else 0); 0 replicates
            the reference even under a ZeRO-3 policy; 3 shards it (needs a ZeRO-3 policy).

    Raises:
        ConfigError: ``unsupported_combination`` for ``ref_offload_params=True`` with a stage 0 reference (no ZeRO-3
            policy, or ``ref_zero_stage=0``), or ``ref_zero_stage=3`` without a ZeRO-3 policy; ``bad_ref_zero_stage``
            for a stage other than None, 0 or 3; ``bad_deepspeed_config`` when an ``"auto"`` tuning value needs a
            hidden size the model does not have.
    """
    config = copy.deepcopy(dict(train_config))
    for key in ("optimizer", "scheduler"):
        config.pop(key, None)
    zero = dict(config.get("zero_optimization") or {})
    if reference_zero_stage(train_config, zero_stage=zero_stage, offload_params=offload_params) == 0:
        config["zero_optimization"] = {"stage": 0}
        return config
    zero.pop("offload_optimizer", None)
    if offload_params is not None:
        zero["offload_param"] = (
            {"device": "cpu", "pin_memory": torch.cuda.is_available()} if offload_params else {"device": "none"}
        )
    for key, rule in HIDDEN_SIZE_KEYS.items():
        if zero.get(key, "auto") != "auto":
            continue
        if hidden_size is None:
            raise ConfigError(
                "bad_deepspeed_config",
                f"zero_optimization.{key} is 'auto' (or unset) and the reference config has no hidden_size to "
                "derive it from: set a number in the DeepSpeed config.",
            )
        zero[key] = rule(hidden_size)
    config["zero_optimization"] = zero
    return config


class DeepSpeedReference:
    """The frozen reference as an inference-only DeepSpeed engine.

    Args:
        engine: The reference's ``DeepSpeedEngine`` (built by :func:`build_deepspeed_reference`).
        chunk_size: Tokens per chunk of the log-prob computation.
        leaf_modules: ``PairDPOConfig.zero3_leaf_modules``, applied to a stage 3 engine (see ``parallel.zero3``).
    """

    probe = True

    def __init__(self, engine: Any, chunk_size: int = DEFAULT_CHUNK_SIZE) -> None:
        self.engine: Any = engine
        self.model: torch.nn.Module | None = engine.module
        self.chunk_size = chunk_size

    @property
    def zero_stage(self) -> int:
        """The reference engine's ZeRO stage (3 or 0)."""
        return int(self.engine.zero_optimization_stage())

    @torch.no_grad()
    def sequence_logps(self, batch: PackedPairBatch) -> torch.Tensor:
        """Per-sequence completion log-probs ``[2n]`` float32 (a collective under ZeRO-3: all ranks call it)."""
        return packed_sequence_logps(self.engine, batch, chunk_size=self.chunk_size)

    def identity_parameters(self) -> Iterator[tuple[str, torch.Tensor | Callable[[], Any]]]:
        """The parameters of the identity's digest, gathered one at a time under ZeRO-3 (see the module docstring)."""
        if self.model is None:
            raise RuntimeError("the reference engine was released after the precompute pass")
        return gathered_named_parameters(self.model)

    def release(self) -> None:
        """Destroys the engine and drops the model, so its memory can be reused (after a precompute pass)."""
        self.engine.destroy()
        self.engine = self.model = None
        gc.collect()
        if torch.cuda.is_available():
            torch.cuda.empty_cache()


@contextlib.contextmanager
def reference_zero_init(config: Mapping[str, Any]) -> Iterator[None]:
    """While loading the reference, ``from_pretrained`` partitions it with the reference's own configuration.

    Once a ZeRO-3 Trainer exists, transformers loads every model under ``deepspeed.zero.Init`` with the run's
    (policy's) configuration, found through a module-level weak reference. Inside this context that reference points
    to ``config`` instead, so the partitions are created where the reference engine keeps them (``offload_param``);
    for a stage 0 reference (``ref_zero_stage=0``) it is cleared, so the reference is loaded whole. The previous
    configuration is restored on exit. Outside a ZeRO-3 run this does nothing.
    """
    from transformers.integrations import deepspeed as hf_deepspeed

    if not hf_deepspeed.is_deepspeed_zero3_enabled():
        yield
        return
    previous = hf_deepspeed._hf_deepspeed_config_weak_ref
    holder = None
    if config["zero_optimization"].get("stage") == 3:
        holder = hf_deepspeed.HfDeepSpeedConfig(dict(config))  # registers itself as the module's weak reference
    else:
        hf_deepspeed.unset_hf_deepspeed_config()  # no zero.Init: a replicated reference is loaded whole
    try:
        yield
    finally:
        hf_deepspeed._hf_deepspeed_config_weak_ref = previous
        del holder


def build_deepspeed_reference(
    model: torch.nn.Module, *, config: Mapping[str, Any], chunk_size: int, leaf_modules: str = "auto"
) -> DeepSpeedReference:
    """Wraps a loaded reference model (packed attention configured) in its own inference-only engine.

    Args:
        model: The reference model, whole on the CPU or already ZeRO-3 partitioned at load time (``zero.Init``;
            only for a stage 3 ``config``).
        config: The reference's DeepSpeed configuration (:func:`reference_ds_config`).
        chunk_size: Tokens per chunk of the log-prob computation.

    Raises:
        ConfigError: ``unsupported_combination`` for a ZeRO-3 partitioned model with a stage 0 configuration;
            ``zero3_leaf_modules_not_found`` (:func:`~pair_dpo_trainer.parallel.zero3.mark_zero3_leaf_modules`).
    """
    import deepspeed

    if config["zero_optimization"].get("stage") != 3 and any(hasattr(p, "ds_id") for p in model.parameters()):
        raise ConfigError(
            "unsupported_combination",
            "the reference model is already ZeRO-3 partitioned (loaded under deepspeed.zero.Init), but its engine "
            "replicates it (ref_zero_stage=0): pass the reference as a directory (ref_model_name_or_path) instead of "
            "a ref_model object, or leave ref_zero_stage unset to shard it like the policy.",
        )
    model = model.eval().requires_grad_(False)
    if config["zero_optimization"].get("stage") == 3:
        mark_zero3_leaf_modules(model, leaf_modules)
    engine, *_ = deepspeed.initialize(model=model, config=dict(config))
    engine.eval()
    logger.info("reference engine: ZeRO stage %s", config["zero_optimization"]["stage"])
    return DeepSpeedReference(engine, chunk_size=chunk_size)
