"""Tests of the benchmark package (its tools, suites and report), on the CPU."""
