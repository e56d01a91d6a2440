"""TR-DPO: the reference follows the policy (``sync_ref_model``), and a checkpoint keeps the synced reference.

Gorbatovski et al. 2024, "Learn Your Reference Model for Real Good Alignment", arXiv:2404.09656, Sec. 3 (soft
update): every ``ref_model_sync_steps`` optimizer steps ``ref <- alpha * policy + (1 - alpha) * ref`` with
``alpha = ref_model_mixup_alpha`` (the hard update is ``alpha = 1``).

The synced reference is no longer the verified snapshot: its identity record says so (``synced_step``) and carries
the parameter and probe digests of the synced weights, which a checkpoint stores beside the record
(``pair_dpo_synced_reference.safetensors``). On resume the reference is rebuilt from the verified snapshot, the
synced weights are loaded from the checkpoint, and the identity check compares THEIR digest with the record.
"""

from __future__ import annotations

import os
from pathlib import Path

import torch

from pair_dpo_trainer.atomic import require_regular
from pair_dpo_trainer.errors import ConfigError, SnapshotIntegrityError
from pair_dpo_trainer.modeling.wrappers import unwrap_model

SYNCED_REFERENCE_FILENAME = "pair_dpo_synced_reference.safetensors"


def _named(module: torch.nn.Module) -> dict[str, torch.nn.Parameter]:
    return dict(unwrap_model(module).named_parameters())


def require_mixable(reference: torch.nn.Module, policy: torch.nn.Module) -> None:
    """Checks, when the reference is built, that TR-DPO can mix the two models.

    Raises:
        ConfigError: ``unsupported_combination`` when they do not have the same parameters (names and shapes):
            TR-DPO mixes weights, so the reference must have the policy's architecture.
    """
    targets, sources = _named(reference), _named(policy)
    if set(targets) != set(sources) or any(targets[k].shape != sources[k].shape for k in targets):
        raise ConfigError(
            "unsupported_combination",
            "sync_ref_model=True mixes the policy's weights into the reference, but they do not have the same "
            "parameters (names and shapes): use a reference of the policy's architecture, or sync_ref_model=False.",
        )


def mix_into_reference(reference: torch.nn.Module, policy: torch.nn.Module, alpha: float) -> None:
    """``ref <- alpha * policy + (1 - alpha) * ref`` for every parameter, matched by name (in the reference's dtype).

    Raises:
        ConfigError: see :func:`require_mixable`.
    """
    require_mixable(reference, policy)
    targets, sources = _named(reference), _named(policy)
    with torch.no_grad():
        for name, target in targets.items():
            target.mul_(1.0 - alpha).add_(sources[name].detach().to(target.dtype), alpha=alpha)


def save_synced_reference(checkpoint_dir: str | os.PathLike[str], reference: torch.nn.Module) -> Path:
    """Writes the synced reference's parameters into the checkpoint (safetensors, atomically)."""
    from safetensors.torch import save_file

    target = Path(checkpoint_dir) / SYNCED_REFERENCE_FILENAME
    tensors = {name: p.detach().to("cpu").contiguous() for name, p in _named(reference).items()}
    partial = target.with_name(target.name + ".tmp")
    save_file(tensors, str(partial))
    os.replace(partial, target)
    return target


def load_synced_reference(checkpoint_dir: str | os.PathLike[str], reference: torch.nn.Module) -> None:
    """Loads the synced parameters of a checkpoint into ``reference`` (every parameter, exact names and shapes).

    Raises:
        SnapshotIntegrityError: ``synced_reference_missing`` when the checkpoint's identity records a synced
            reference but the weights file is missing or does not fit the reference.
    """
    from safetensors.torch import load_file

    source = Path(checkpoint_dir) / SYNCED_REFERENCE_FILENAME
    targets = _named(reference)
    try:
        require_regular(source)  # a FIFO would block load_file's open
        tensors = load_file(str(source))
    except (OSError, ValueError) as exc:
        raise SnapshotIntegrityError(
            "synced_reference_missing",
            f"the checkpoint records a TR-DPO synced reference but its weights cannot be read ({exc}): resume from "
            "a complete checkpoint, or start a new run.",
            str(source),
        ) from None
    if set(tensors) != set(targets) or any(tensors[k].shape != targets[k].shape for k in targets):
        raise SnapshotIntegrityError(
            "synced_reference_missing",
            "the checkpoint's synced reference weights do not have the reference's parameters: resume with the "
            "reference the run was started with.",
            str(source),
        )
    with torch.no_grad():
        for name, target in targets.items():
            target.copy_(tensors[name].to(dtype=target.dtype))
