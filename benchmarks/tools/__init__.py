"""Tools beside the benchmarks: a random pinned snapshot for scale checks, loss-curve overlays. Run from the
repository root as ``python -m benchmarks.tools.<name>``; the demo assets are built by
``tools/build_demo_assets.py``."""
