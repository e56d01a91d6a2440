"""When the reference is built, identified, checked on resume, precomputed and freed: the trainer's one entry point.

Timeline of a run (:class:`ReferenceManager`):

Details: reference/README.md, "Module notes", ``manager.py``.
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Mapping
from pathlib import Path
from typing import Any, cast

import torch
from transformers import PreTrainedModel

from pair_dpo_trainer.config.sections import BatchLimits, DataOptions, LayerOptions, ReferenceOptions, ScheduleOptions
from pair_dpo_trainer.errors import ConfigError
from pair_dpo_trainer.integrity import ReferenceIdentity, parameter_digest, read_identity
from pair_dpo_trainer.parallel.gather import gathered_named_parameters
from pair_dpo_trainer.reference.base import Reference
from pair_dpo_trainer.reference.build import build_reference
from pair_dpo_trainer.reference.gate import check_resume_identity, compute_identity
from pair_dpo_trainer.reference.precompute import (
    CacheEntry,
    PrecomputedReference,
    WithRefLogps,
    cache_key,
    cache_path,
    compute_ref_logps,
    dataset_fingerprint,
    read_cache,
    write_cache,
)
from pair_dpo_trainer.reference.source import ReferenceSource

logger = logging.getLogger(__name__)


class ReferenceManager:
    """Owns the run's reference and identity.

    Args:
        options: The run's reference section (``uses_reference``, precompute, TR-DPO, the engine options).
        layers: The run's layer section (how an in-process reference runs).
        policy: The policy before any training step (unwrapped).
        source: The reference's provenance (None when reference-free).
        ref_model: An explicit reference model, if the user passed one.
        deepspeed_config: The run's DeepSpeed configuration when DeepSpeed is enabled, else None.
        mixed_precision: The accelerator's mixed precision (``"no"``, ``"bf16"``, ``"fp16"``), for the cache key.
        fsdp_plugin: The run's FSDP2 plugin when FSDP2 is enabled (the reference is then sharded or replicated by
            :mod:`~pair_dpo_trainer.reference.fsdp`), else None.
        share_prompt: The run's packed layout (the precompute pass packs its rows the same way).
        limits / schedule / data: The run's batch limits, schedule and data sections (the precompute pass and its
            cache key).
        device: This rank's device.
        should_save: This process writes files (the precompute cache).

    Attributes:
        builds: How many times a reference model was built (0 after a precompute cache hit).

    The option combinations are checked before (``training.checks.run_problems``, the trainer's one runtime check).
    """

    def __init__(
        self,
        options: ReferenceOptions,
        layers: LayerOptions,
        policy: PreTrainedModel,
        *,
        source: ReferenceSource | None,
        ref_model: PreTrainedModel | None,
        deepspeed_config: Mapping[str, Any] | None,
        limits: BatchLimits,
        schedule: ScheduleOptions,
        data: DataOptions,
        device: torch.device | str,
        should_save: bool = True,
        mixed_precision: str = "no",
        fsdp_plugin: Any = None,
        share_prompt: bool = False,
    ) -> None:
        self.options = options
        self.layers = layers
        self.limits, self.schedule, self.data = limits, schedule, data
        self.device = device
        self.should_save = should_save
        self.share_prompt = share_prompt
        self.source = source
        self.builds = 0
        self._policy = policy
        self._ref_model = ref_model
        self._deepspeed_config = deepspeed_config
        self._fsdp_plugin = fsdp_plugin
        self._precision = _precision(policy, deepspeed_config, mixed_precision, fsdp_plugin)
        self._checked: str | None = None
        self._reference: Reference | None = None
        self._identity: ReferenceIdentity | None = None
        self._logps: dict[int, tuple[Any, torch.Tensor]] = {}  # id(dataset) -> (dataset, [N, 2] logps)
        self._key_reference: dict[str, Any] | None = None
        self._synced_step: int | None = None  # TR-DPO: step of the last sync (None: the reference is the snapshot)
        lazy = deepspeed_config is not None or options.precompute_ref_log_probs
        if not options.uses_reference or not lazy:
            self._build()
        if options.precompute_ref_log_probs:
            self._key_reference = self._reference_key()  # the starting weights: before any step or restore

    @property
    def reference(self) -> Reference:
        """The reference (``sequence_logps``); builds a lazy reference now if needed (a collective).

        Raises:
            ConfigError: ``ref_logps_missing`` for a precomputed run before ``train()`` / ``evaluate()``.
        """
        if self._reference is None and not self.options.precompute_ref_log_probs:
            self._build()
        if self._reference is None:
            raise ConfigError(
                "ref_logps_missing",
                "precompute_ref_log_probs=True: the reference log-probs are computed by train() or evaluate(); call "
                "one of them before running the reference.",
            )
        return self._reference

    @property
    def runs_reference_forward(self) -> bool:
        """Whether each training micro-batch runs a reference forward (a reference that is neither absent nor
        precomputed)."""
        return self.options.runs_forward

    @property
    def reference_if_built(self) -> Reference | None:
        """The reference if it exists now (never builds one), else None."""
        return self._reference

    @property
    def identity(self) -> ReferenceIdentity | None:
        """The reference identity (None for reference-free runs, or before a lazy reference is prepared)."""
        return self._identity

    def prepare(self, datasets: Mapping[str, Any], resume_from_checkpoint: str | None = None) -> None:
        """Builds or precomputes the reference as configured, then checks the checkpoint's identity on resume.

        Collective under DeepSpeed and in multi-process runs: every rank calls it at the same point.

        Args:
            datasets: Name -> tokenised pairs whose reference log-probs a precomputed run needs (train and eval).
            resume_from_checkpoint: The checkpoint directory of a resume, else None.

        Raises:
            SnapshotIntegrityError: ``identity_missing`` / ``reference_changed`` (see ``check_resume_identity``),
                before any pass over the data.
        """
        if not self.options.uses_reference:
            return
        if self.options.precompute_ref_log_probs:
            self._precompute(datasets, resume_from_checkpoint)
        elif self._reference is None:
            self._build()
        if resume_from_checkpoint and self._checked != resume_from_checkpoint:
            self._restore_synced(resume_from_checkpoint)
            check_resume_identity(resume_from_checkpoint, self._built_identity())
            self._checked = resume_from_checkpoint

    def attach(self, dataset: Any) -> Any:
        """``dataset`` with its precomputed log-probs as features (unchanged when nothing was precomputed)."""
        if not self.options.precompute_ref_log_probs or dataset is None:
            return dataset
        entry = self._logps.get(id(dataset))
        return dataset if entry is None else WithRefLogps(dataset, entry[1])

    # ------------------------------------------------------------------ TR-DPO
    def sync_with(self, policy: torch.nn.Module, *, step: int) -> None:
        """TR-DPO at an optimizer-step boundary: ``ref <- alpha * policy + (1 - alpha) * ref`` (every rank)."""
        from pair_dpo_trainer.reference.sync import mix_into_reference

        mix_into_reference(self._synced_model(), policy, self.options.ref_model_mixup_alpha)
        self._synced_step = int(step)

    def _synced_model(self) -> torch.nn.Module:
        model = self.reference.model
        if model is None:
            raise ConfigError(
                "unsupported_combination",
                f"sync_ref_model=True needs an in-process reference model; this run's reference is "
                f"{type(self.reference).__name__}: set sync_ref_model=False.",
            )
        return model

    def _identify(self) -> None:
        """(Re)computes the identity of the built reference, recording the TR-DPO sync step."""
        assert self.source is not None and self._reference is not None, "identified only once built, with a source"
        identity = compute_identity(
            self.source,
            self._reference,
            vocab_size=self._policy.config.vocab_size,
            device=self.device,
            sequence_shard=self.schedule.sequence_shard,
        )
        self._identity = dataclasses.replace(identity, synced_step=self._synced_step)

    def checkpoint_identity(self) -> ReferenceIdentity | None:
        """The identity a checkpoint records now: after a TR-DPO sync the reference is re-identified (its synced
        weights' digests and ``synced_step``). Call on every rank (a probe forward)."""
        if self._identity is not None and self._synced_step is not None:
            self._identify()
        return self._identity

    def write_synced_weights(self, checkpoint_dir: str | Path) -> None:
        """After a TR-DPO sync, writes the synced reference's weights into the (staged) checkpoint; else nothing."""
        if self._synced_step is None:
            return
        from pair_dpo_trainer.reference.sync import save_synced_reference

        save_synced_reference(checkpoint_dir, self._synced_model())

    def _restore_synced(self, checkpoint_dir: str) -> None:
        """With ``sync_ref_model``, loads a checkpoint's synced reference weights (when it recorded a sync) and
        re-identifies the reference, so the resume check compares the synced weights, not the snapshot."""
        if not self.options.sync_ref_model:
            return
        try:
            recorded = read_identity(checkpoint_dir)
        except FileNotFoundError:
            return  # check_resume_identity reports identity_missing
        if recorded.synced_step is None:
            return
        from pair_dpo_trainer.reference.sync import load_synced_reference

        load_synced_reference(checkpoint_dir, self._synced_model())
        self._synced_step = recorded.synced_step
        self._identify()

    # ------------------------------------------------------------------ building
    def _build(self) -> None:
        """Builds the reference and, for a non-free reference, its identity (collective under ZeRO-3)."""
        self._reference = build_reference(
            self.options,
            self.layers,
            self._policy,
            source=self.source,
            ref_model=self._ref_model,
            device=self.device,
            deepspeed_config=self._deepspeed_config,
            fsdp_plugin=self._fsdp_plugin,
        )
        if self.options.sync_ref_model:  # TR-DPO: refuse a reference it cannot mix now, not at the first sync
            from pair_dpo_trainer.reference.sync import require_mixable

            require_mixable(self._synced_model(), self._policy)
        if self.source is None:
            return
        self.builds += 1
        self._identify()

    def _built_identity(self) -> ReferenceIdentity:
        """The identity of the built (or cached) reference, which ``_build`` / ``_remember`` set before any check."""
        assert self._identity is not None, "the reference is identified when it is built or read from the cache"
        return self._identity

    def _release(self) -> None:
        """Frees the built reference after a precompute pass; from now on batches carry the log-probs."""
        if self._reference is not None:
            self._reference.release()
        self._reference = PrecomputedReference()
        if torch.cuda.is_available():
            torch.cuda.empty_cache()

    # ------------------------------------------------------------------ precompute
    def _reference_key(self) -> dict[str, Any]:
        """The reference part of the cache key: the verified manifest, else a digest of the starting weights.

        Unpinned, the starting weights are the explicit ``ref_model``, else the policy itself when the reference is
        its copy or its own directory; an unpinned reference from another directory is loaded once to digest it.
        """
        snapshot = self.source.snapshot if self.source is not None else None
        if snapshot is not None:  # pinned: the verified snapshot's manifest
            return {"pinned": True, "digest": snapshot.manifest_digest}
        model = self._ref_model
        if model is None and self.source is not None and self.source.directory not in (None, self._policy_dir()):
            from pair_dpo_trainer.reference.base import load_reference_model

            model = load_reference_model(self._policy, self.source.directory)
        digest = parameter_digest(gathered_named_parameters(model if model is not None else self._policy))
        return {"pinned": False, "digest": digest}

    def _policy_dir(self) -> str | None:
        return getattr(self._policy, "name_or_path", None) or None

    def _precompute(self, datasets: Mapping[str, Any], resume_from_checkpoint: str | None) -> None:
        """Fills ``self._logps`` for every dataset from the cache or one reference pass; frees a built reference."""
        pending = {name: ds for name, ds in datasets.items() if ds is not None and id(ds) not in self._logps}
        if not pending:
            return
        from pair_dpo_trainer.parallel.agreement import all_gather_cpu, assert_ranks_agree

        keys = {name: self._key(ds) for name, ds in pending.items()}
        assert_ranks_agree("reference log-prob cache keys", repr([cache_path("", key).name for key in keys.values()]))
        path = {name: cache_path(self.options.ref_logps_cache_path, key) for name, key in keys.items()}
        entries = {name: read_cache(path[name], keys[name], len(ds)) for name, ds in pending.items()}
        rank_flags = all_gather_cpu([entries[name] is not None for name in pending])  # a hit only if on every rank
        hits = dict(zip(pending, (all(flags) for flags in zip(*rank_flags, strict=True)), strict=True))
        for name, ds in pending.items():
            if hits[name]:
                logger.info("reference log-probs of %s: cache hit %s", name, path[name])
                self._remember(ds, cast(CacheEntry, entries[name]))  # a hit: read on this rank
                continue
            if self._reference is None or isinstance(self._reference, PrecomputedReference):
                self._build()
                if resume_from_checkpoint:  # refuse a changed reference before the (long) pass
                    check_resume_identity(resume_from_checkpoint, self._built_identity())
                    self._checked = resume_from_checkpoint
            logps = compute_ref_logps(
                self._reference,
                ds,
                schedule=self.schedule,
                data=self.data,
                limits=self.limits,
                device=self.device,
                desc=name,
                share_prompt=self.share_prompt,
            )
            entry = CacheEntry(logps=logps, identity=self._built_identity().to_dict())
            if self.should_save:
                write_cache(path[name], keys[name], entry)
            self._remember(ds, entry)
        if not isinstance(self._reference, PrecomputedReference):
            self._release()

    def _key(self, dataset: Any) -> dict[str, Any]:
        return cache_key(
            fingerprint=dataset_fingerprint(dataset),
            reference=cast("dict[str, Any]", self._key_reference),  # set in __init__ for a precomputed run
            limits=self.limits,
            precision=self._precision,
            share_prompt=self.share_prompt,
        )

    def _remember(self, dataset: Any, entry: CacheEntry) -> None:
        self._logps[id(dataset)] = (dataset, entry.logps)
        if self._identity is None:
            self._identity = ReferenceIdentity.from_dict(entry.identity)


def _precision(
    policy: torch.nn.Module, deepspeed_config: Mapping[str, Any] | None, mixed_precision: str, fsdp_plugin: Any = None
) -> str:
    """The reference's compute precision as recorded in the cache key, e.g. ``"deepspeed:bfloat16"``,
    ``"fsdp2:bfloat16"`` (the same for a sharded and a replicated FSDP2 reference)."""
    if fsdp_plugin is not None:
        from pair_dpo_trainer.parallel.fsdp2 import compute_dtype

        return "fsdp2:" + str(compute_dtype(fsdp_plugin) or policy.dtype).removeprefix("torch.")
    if deepspeed_config is not None:

        def enabled(section: str) -> bool:
            return str((deepspeed_config.get(section) or {}).get("enabled", False)).lower() == "true"

        return "deepspeed:" + ("bfloat16" if enabled("bf16") else "float16" if enabled("fp16") else "float32")
    return f"{str(policy.dtype).removeprefix('torch.')}|{mixed_precision}"
