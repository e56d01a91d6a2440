"""The CUDA caching allocator setting ``train.py`` applies when the user has not chosen one.

Packed micro-batches change length every step (with a token budget they vary up to the budget), so the caching
allocator's fixed-size segments fragment (reserved memory far above the allocated peak on a long-tailed length mix);
``expandable_segments:True`` (segments that grow in place) reserves close to the peak at the same speed (measured:
``docs/benchmarks.md``, token-budget section). ``train.py`` therefore sets
``PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True`` before CUDA initialises, unless either allocator variable is
already set (any value, e.g. ``expandable_segments:False``, keeps PyTorch's choice; set it to opt out). Library use
(``PairDPOTrainer`` in your own script) changes nothing: call :func:`default_cuda_allocator` first thing, or set the
variable yourself.
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
