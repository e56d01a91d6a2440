"""Tools beside the benchmarks: the demo-asset generator, a random pinned snapshot for scale checks, loss-curve
overlays. Run from the repository root as ``python -m benchmarks.tools.<name>``."""
