"""Test-wide fixtures: every test gets its own tokenised-pairs cache, so no test sees another's entries; the one-process
run the 2-node tests compare with is trained once per session."""

from __future__ import annotations

import pytest

from tests.gc_heap import freeze_import_heap, freeze_new_imports
from tests.timing import TIME_SCALE, scaled


def pytest_configure(config):
    """pytest-timeout's limit (setup.cfg, written for an idle machine) stretches with the machine's load."""
    if getattr(config.option, "timeout", None):
        config.option.timeout = scaled(float(config.option.timeout))


def pytest_collection_modifyitems(config, items):
    """A slow or multi-process test belongs to the integration tier (setup.cfg) without saying so twice."""
    for item in items:
        if item.get_closest_marker("slow") or item.get_closest_marker("distributed"):
            item.add_marker(pytest.mark.integration)


def pytest_report_header(config):
    return f"wait deadlines x{TIME_SCALE:.2f} (tests/timing.py; PAIR_DPO_TEST_TIME_SCALE to fix it)"


@pytest.fixture(scope="session", autouse=True)
def _collected_modules_out_of_the_collectors_view():
    """Every ``Trainer.train()`` runs a full ``gc.collect()``: the objects of the modules imported while collecting
    are frozen before any fixture trains (tests/gc_heap.py)."""
    freeze_import_heap()


@pytest.fixture(autouse=True)
def _new_imports_out_of_the_collectors_view():
    """The same for modules a test or fixture imported lazily (transformers' model classes, deepspeed)."""
    freeze_new_imports()


@pytest.fixture(autouse=True)
def _private_pairs_cache(tmp_path_factory, monkeypatch):
    """``HF_DATASETS_CACHE`` (where ``dataset_cache_dir`` defaults to) is a fresh directory for each test; processes
    a test launches inherit it."""
    monkeypatch.setenv("HF_DATASETS_CACHE", str(tmp_path_factory.mktemp("hf_datasets_cache")))


@pytest.fixture(autouse=True)
def _eager_head_kernels():
    """``torch_compile=True`` compiles the chunked head's element-wise work process-wide; each test starts eager."""
    yield
    from pair_dpo_trainer.modeling.chunked_head import eager_head_kernels

    eager_head_kernels()


@pytest.fixture(scope="session")
def dp1_reference(tmp_path_factory):
    """The DP=1 run of the 2-node tests (``tests.multinode.train_dp1``): gradients, losses, final parameters."""
    from tests.multinode import train_dp1

    return train_dp1(tmp_path_factory.mktemp("dp1"))
