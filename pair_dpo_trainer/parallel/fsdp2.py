"""FSDP2 for the policy: Accelerate's ``fully_shard`` path, switched on where Accelerate drops it, and checked.

The policy is sharded by Accelerate itself (``FullyShardedDataParallelPlugin`` with ``fsdp_version=2``, applied by
``accelerator.prepare`` inside ``Trainer.train``): every decoder layer (``TRANSFORMER_BASED_WRAP`` with the model's
``_no_split_modules``), the input embedding, the final norm + LM head and the root become ``fully_shard`` units with
the plugin's ``reshard_after_forward``, mixed precision, CPU offload and activation checkpointing. This module only
makes sure that the FSDP2 the user asked for is what runs, and tells the packed path when a module is sharded:

Details: parallel/README.md, "Module notes", ``fsdp2.py``.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import os
from collections.abc import Iterator
from typing import Any

import torch

from pair_dpo_trainer.config.sections import FsdpOptions
from pair_dpo_trainer.errors import ConfigError, Problem
from pair_dpo_trainer.modeling.wrappers import is_fsdp_managed

logger = logging.getLogger(__name__)


def requested_fsdp_plugin(fsdp: FsdpOptions) -> Any:
    """The FSDP plugin the run asks for (TrainingArguments ``fsdp`` / ``fsdp_config``, else ``accelerate launch``'s
    ``ACCELERATE_USE_FSDP`` environment), or None. Built the way the Trainer and Accelerate build it."""
    from accelerate.utils import FullyShardedDataParallelPlugin

    plugin_args = fsdp.plugin_args
    if plugin_args is not None:
        return FullyShardedDataParallelPlugin(**plugin_args)
    if os.environ.get("ACCELERATE_USE_FSDP", "false").lower() == "true":
        return FullyShardedDataParallelPlugin()
    return None


def requested_fsdp_version(fsdp: FsdpOptions) -> int | None:
    """The FSDP version the run asks for (TrainingArguments, else ``accelerate launch``'s ``FSDP_VERSION``), or None
    without FSDP; read before Accelerate builds the plugin (an FSDP1 plugin fails to build on a CPU-only machine)."""
    plugin_args = fsdp.plugin_args
    if plugin_args is not None:
        return int(plugin_args.get("fsdp_version", 1))
    if os.environ.get("ACCELERATE_USE_FSDP", "false").lower() == "true":
        return int(os.environ.get("FSDP_VERSION", "1"))
    return None


def check_fsdp_version(fsdp: FsdpOptions) -> None:
    """Refuses FSDP1 before Accelerate builds its plugin.

    Raises:
        ConfigError: ``fsdp1_unsupported``.
    """
    version = requested_fsdp_version(fsdp)
    if version is not None and version != 2:
        raise ConfigError(*_fsdp1_problem(version))


def _fsdp1_problem(version: Any) -> tuple[str, str]:
    return (
        "fsdp1_unsupported",
        f"fsdp_version={version}: pair_dpo_trainer supports FSDP2 only (torch fully_shard). Set "
        "fsdp_config={'fsdp_version': 2} (accelerate config: fsdp_version: 2), or use DeepSpeed ZeRO-3.",
    )


def find_fsdp2_plugin(accelerator: Any, fsdp: FsdpOptions) -> Any:
    """The run's FSDP plugin (Accelerate's, else the one ``fsdp`` asks for where Accelerate dropped it: CPU
    processes), or None without FSDP; not yet checked (``fsdp2_problems``) nor installed (:func:`setup_fsdp2`)."""
    from accelerate.utils import DistributedType

    state = accelerator.state
    plugin = getattr(state, "fsdp_plugin", None) if state.distributed_type == DistributedType.FSDP else None
    return plugin if plugin is not None else requested_fsdp_plugin(fsdp)


def setup_fsdp2(accelerator: Any, fsdp: FsdpOptions) -> Any:
    """The trainer's entry point, right after the Accelerator exists: returns the run's FSDP2 plugin, or None.

    Installs the plugin in Accelerate's state when Accelerate dropped it (CPU processes) and clears its output cast
    (module docstring). What is not supported (:func:`fsdp2_problems`, no process group) is refused before, by the
    trainer's one runtime check (``training.checks.run_problems``).

    Args:
        accelerator: The Trainer's ``Accelerator``.
        fsdp: The run's FSDP section (what ``TrainingArguments`` asks of FSDP).
    """
    from accelerate.utils import DistributedType

    plugin = find_fsdp2_plugin(accelerator, fsdp)
    if plugin is None:
        return None
    if accelerator.state.distributed_type != DistributedType.FSDP:
        _install(accelerator, plugin)
    policy = plugin.mixed_precision_policy
    if getattr(policy, "output_dtype", None) is not None:
        plugin.mixed_precision_policy = dataclasses.replace(policy, output_dtype=None)
    return plugin


def fsdp2_problems(plugin: Any, fsdp: FsdpOptions, *, process_group: bool = True) -> list[Problem]:
    """``(reason_code, message)`` for every FSDP setting pair DPO does not run (an empty list: supported).

    Args:
        plugin: The run's FSDP plugin.
        fsdp: The run's FSDP section (the Trainer's checkpointing and saving fields).
        process_group: Whether ``torch.distributed`` is initialised (FSDP2 needs one).
    """
    if int(getattr(plugin, "fsdp_version", 1)) != 2:
        return [_fsdp1_problem(plugin.fsdp_version)]
    problems: list[Problem] = []
    if not process_group:
        problems.append(("unsupported_combination", "FSDP2 needs a process group: launch with accelerate or torchrun."))
    if getattr(plugin, "cpu_ram_efficient_loading", False):
        problems.append(
            (
                "unsupported_combination",
                "fsdp cpu_ram_efficient_loading=True loads the weights on rank 0 only, but the reference is loaded "
                "(or copied from the policy) and verified on every rank: set fsdp_cpu_ram_efficient_loading: false.",
            )
        )
    if fsdp.parallelism_config:
        problems.append(
            (
                "unsupported_combination",
                "parallelism_config (tensor / context / sequence parallel meshes) with FSDP2: pair_dpo_trainer shards "
                "data-parallel only (packed rows are not split across ranks): remove parallelism_config.",
            )
        )
    problems.extend(_checkpointing_problems(plugin, fsdp))
    if fsdp.save_only_model and ("SHARDED" in str(plugin.state_dict_type) or fsdp.load_best_model_at_end):
        problems.append(
            (
                "unsupported_combination",
                "save_only_model=True under FSDP2 with SHARDED_STATE_DICT checkpoints or load_best_model_at_end "
                "(the Trainer's own FSDP rule): set save_only_model=False, or fsdp_state_dict_type: FULL_STATE_DICT "
                "without load_best_model_at_end.",
            )
        )
    return problems


def _checkpointing_problems(plugin: Any, fsdp: FsdpOptions) -> list[Problem]:
    """FSDP's activation checkpointing with the Trainer's, or with ``torch_compile`` (the decoder layers are compiled
    in place before Accelerate wraps them for checkpointing, the reverse of Accelerate's own order: not verified)."""
    if not getattr(plugin, "activation_checkpointing", False):
        return []
    if fsdp.gradient_checkpointing:
        return [
            (
                "unsupported_combination",
                "FSDP activation_checkpointing and gradient_checkpointing=True would both recompute every decoder "
                "layer: keep one (fsdp_activation_checkpointing: true and gradient_checkpointing=False under FSDP).",
            )
        ]
    if fsdp.torch_compile:
        return [
            (
                "unsupported_combination",
                "torch_compile=True with FSDP activation_checkpointing: pair_dpo_trainer compiles the decoder layers "
                "before Accelerate wraps them in checkpoint wrappers, an order it does not verify. Use "
                "gradient_checkpointing=True (the Trainer's per-layer checkpointing) with "
                "fsdp_activation_checkpointing false, or set torch_compile=False.",
            )
        ]
    return []


def _install(accelerator: Any, plugin: Any) -> None:
    """What Accelerate's state does for FSDP on an accelerator device, done on the CPU (gloo) too.

    Both shared states are set: ``AcceleratorState()`` copies ``PartialState``'s ``distributed_type`` over its own
    each time it is constructed (Accelerate does so internally), which would silently turn FSDP back into DDP.
    """
    from accelerate.state import PartialState
    from accelerate.utils import DistributedType

    mixed_precision = accelerator.state.mixed_precision
    if mixed_precision != "no":
        plugin.set_mixed_precision(mixed_precision)
    PartialState().distributed_type = DistributedType.FSDP
    accelerator.state.distributed_type = DistributedType.FSDP
    accelerator.state.fsdp_plugin = plugin
    logger.info("FSDP2 enabled on %s (Accelerate enables FSDP only on accelerator devices)", accelerator.device)


def check_evaluable(plugin: Any, model: torch.nn.Module) -> None:
    """Refuses an evaluation under FSDP2 before Accelerate sharded the policy (it does so only together with the
    optimizer, in ``train()``; the Trainer's own model-only ``accelerator.prepare`` raises under FSDP2).

    Raises:
        ConfigError: ``unsupported_combination``.
    """
    if plugin is not None and not is_fsdp_managed(model):
        raise ConfigError(
            "unsupported_combination",
            "evaluate() before train() under FSDP2: Accelerate shards the policy only together with its optimizer "
            "(in train()); evaluate after train(), or set eval_on_start=True to evaluate at step 0 of train().",
        )


def compute_dtype(plugin: Any) -> torch.dtype | None:
    """The dtype FSDP2 all-gathers parameters in and computes with (``param_dtype``); None: the parameters' own."""
    return getattr(plugin.mixed_precision_policy, "param_dtype", None)


def offloads_params(plugin: Any) -> bool:
    """Whether the plugin keeps sharded parameters in CPU memory (``fsdp_offload_params``)."""
    from torch.distributed.fsdp import CPUOffloadPolicy

    return isinstance(plugin.cpu_offload, CPUOffloadPolicy)


@contextlib.contextmanager
def full_state_dict(plugin: Any) -> Iterator[None]:
    """While inside, the plugin saves a full state dict (gathered on rank 0): the final ``save_model`` of a run
    that checkpoints with ``SHARDED_STATE_DICT`` then writes loadable weights, not nothing. Restored on exit."""
    from torch.distributed.fsdp import StateDictType

    if plugin.state_dict_type == StateDictType.FULL_STATE_DICT:
        yield
        return
    names = ("state_dict_type", "state_dict_config", "optim_state_dict_config")
    previous = {name: getattr(plugin, name) for name in names}
    plugin.state_dict_config = plugin.optim_state_dict_config = None  # rebuilt for FULL_STATE_DICT
    plugin.set_state_dict_type("FULL_STATE_DICT")
    try:
        yield
    finally:
        for name, value in previous.items():
            setattr(plugin, name, value)
