"""Keeps the cyclic garbage collector off the imported modules' objects in test processes.

Test processes train many tiny models, and every ``Trainer.train()`` starts with accelerate's ``free_memory``: a full
``gc.collect()`` that walks every tracked object, about half a million once torch, transformers and deepspeed are
imported, which takes longer than a tiny run's steps. :func:`freeze_import_heap` moves what is alive now into the
collector's permanent generation (``gc.freeze``): later collections walk only objects created afterwards.

Only objects that live as long as the process should be frozen: a frozen object that later becomes unreachable in a
reference cycle is never reclaimed (reference counting still frees the rest). Hence the callers freeze right after
imports, and pytest's fixture again only when a test imported new modules.
"""

from __future__ import annotations

import gc
import sys

_modules_frozen = 0


def freeze_import_heap() -> None:
    """Collects once, then freezes every object alive now (call right after the process's imports)."""
    global _modules_frozen
    gc.collect()
    gc.freeze()
    _modules_frozen = len(sys.modules)


def freeze_new_imports() -> None:
    """:func:`freeze_import_heap` again when modules were imported since the last freeze (lazily imported libraries
    add their objects then), else nothing."""
    if len(sys.modules) != _modules_frozen:
        freeze_import_heap()
