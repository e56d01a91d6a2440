"""The CUDA caching allocator setting ``train.py`` applies when the user has not chosen one.

Packed micro-batches change length every step (with a token budget they vary up to the budget), so the caching
allocator's fixed-size segments fragment (reserved memory far above the allocated peak on a long-tailed length mix);
``expandable_segments:True`` (segments that grow in place) reserves close to the peak at the same speed (measured:
``docs/benchmarks.md``). ``PairDPOConfig`` (and so ``train.py`` and every library user) applies it unless either
allocator variable is set (any value, e.g. ``expandable_segments:False``, keeps PyTorch's choice: set it to opt out):
through the environment before CUDA initialises, or through PyTorch's allocator-settings call once it has (new
segments only). The run summary says which.
"""

from __future__ import annotations

import os
import sys
from collections.abc import MutableMapping

ALLOC_CONF_VARS = ("PYTORCH_CUDA_ALLOC_CONF", "PYTORCH_ALLOC_CONF")
"""The variables PyTorch reads the allocator configuration from (``PYTORCH_ALLOC_CONF`` is the newer name)."""

DEFAULT_ALLOC_CONF = "expandable_segments:True"


def default_cuda_allocator(environ: MutableMapping[str, str] | None = None) -> str | None:
    """Sets ``PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True`` unless an allocator variable is set already.

    Must run before CUDA initialises (the allocator reads the variable once); a no-op afterwards.

    Args:
        environ: The environment to change (default ``os.environ``).

    Returns:
        The value set, or None when nothing was changed (a variable already set, or CUDA already initialised).
    """
    environ = os.environ if environ is None else environ
    if any(environ.get(name) for name in ALLOC_CONF_VARS):
        return None
    torch = sys.modules.get("torch")
    if torch is not None and torch.cuda.is_initialized():
        return None
    environ["PYTORCH_CUDA_ALLOC_CONF"] = DEFAULT_ALLOC_CONF
    return DEFAULT_ALLOC_CONF


def apply_allocator_default(environ: MutableMapping[str, str] | None = None) -> str:
    """The allocator setting of this process, applying ``expandable_segments:True`` when nobody chose one.

    Before CUDA initialises the variable is set (:func:`default_cuda_allocator`); afterwards the running allocator
    is reconfigured, which affects only segments allocated from now on.

    Returns:
        One line for the run summary: what the allocator uses and who chose it.
    """
    environ = os.environ if environ is None else environ
    torch = sys.modules["torch"]
    if not torch.cuda.is_available():
        return "no CUDA device (the CUDA allocator is not used)"
    chosen = next((f"{name}={environ[name]}" for name in ALLOC_CONF_VARS if environ.get(name)), None)
    if chosen is not None:
        return f"{chosen} (set before the run)"
    if default_cuda_allocator(environ) is not None:
        return f"{DEFAULT_ALLOC_CONF} (pair_dpo default; set PYTORCH_CUDA_ALLOC_CONF to choose another)"
    setter = getattr(torch._C, "_accelerator_setAllocatorSettings", None) or torch.cuda.memory._set_allocator_settings
    try:
        setter(DEFAULT_ALLOC_CONF)
    except (AttributeError, RuntimeError) as exc:
        return (
            f"PyTorch's default: CUDA started before the config and the allocator could not be reconfigured ({exc}); "
            f"set PYTORCH_CUDA_ALLOC_CONF={DEFAULT_ALLOC_CONF} before anything touches CUDA"
        )
    return (
        f"{DEFAULT_ALLOC_CONF} for new segments (CUDA started before the config; set PYTORCH_CUDA_ALLOC_CONF earlier)"
    )
