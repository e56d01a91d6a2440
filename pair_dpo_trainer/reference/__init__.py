"""The reference of DPO: how it is built, verified, identified and run.

- :mod:`.base`: the ``Reference`` protocol and the in-process references (``NoReference``, ``FrozenReference``).
- :mod:`.engine`: ``DeepSpeedReference``, the reference as its own inference-only DeepSpeed engine.
- :mod:`.precompute`: ``precompute_ref_log_probs``: one reference pass, a keyed cache, ``PrecomputedReference``.
- :mod:`.build`: ``build_reference``, the one place where reference modes are selected.
- :mod:`.manager`: ``ReferenceManager``, when the reference is built, identified, checked, precomputed and freed.
- :mod:`.source`: which local directory and pinned revision the reference comes from, verified before loading.
- :mod:`.gate`: the reference identity written beside every checkpoint and checked on resume.
"""

from pair_dpo_trainer.reference.base import FrozenReference, NoReference, Reference, load_reference_model

__all__ = ["FrozenReference", "NoReference", "Reference", "load_reference_model"]
