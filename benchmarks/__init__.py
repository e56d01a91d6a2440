"""Benchmarks of pair_dpo_trainer, and the TRL DPOTrainer baseline they are compared with, as one package.

Run from the repository root (no install, no ``sys.path`` edits)::

    python -m benchmarks.run --list                       # the suites
    python -m benchmarks.run --suite h200-smoke --dry-run # the exact commands, nothing run
    python -m benchmarks.run --suite h200-smoke           # run them; rows in $OUT/results.jsonl, then the table

Modules: ``run`` (the runner), ``suites`` (every suite as data: runs with tags, ratios; ``speed_suites`` and
``multi_gpu`` hold some of them), ``dpo`` (our trainer on the comparison workload), ``trl_dpo`` (TRL's DPOTrainer on
the same workload; optional, needs ``trl``), ``workload`` (the shared model sizes, the one model builder, the pair
draws, the LoRA config), ``ceiling`` (raw-loop ceilings), ``rows`` (row fields and the step probe), ``report``
(markdown table, per-GPU ratios), ``alloc_check`` (the allocator through the library API), ``profile_summary``,
``sampler``, ``integrity``, ``cudagraph_probe``;
``tools/`` holds the random-model writer and the loss-curve plot; ``tests/`` tests all of it on the CPU. The
benchmarks import the package, never ``tests/``. See docs/benchmarks_howto.md.
"""
