"""docs/migrating_from_trl.md's tables, checked row by row against the parity suite's runs (``harness``).

The loss-type table says, for each TRL 1.16 ``loss_type``, which of ours to use and what the suite finds when both
train on the same rows ("same", "same loss", "differs", "differs from step 2"); the row-shape table says how each
shape is tokenised ("same tokens"); the metrics table says which metrics are TRL's ("Same ..."). A row added, removed
or changed in the guide is checked here; a claim the suite does not confirm fails.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from tests.trl import harness
from tests.trl.test_training import REWARDS

pytest.importorskip("trl")
pytestmark = pytest.mark.slow  # reads the suite's runs (shared with test_training.py when run together)

GUIDE = Path(__file__).resolve().parents[2] / "docs" / "migrating_from_trl.md"
VERDICTS = ("same", "same loss", "differs", "differs from step 2")
SHAPES = {
    "Plain strings": "strings",
    "Conversations": "conversations",
    "Implicit prompt, strings": "implicit strings",
    "Implicit prompt, conversations": "implicit conversations",
}
"""The row-shape table's first column -> the harness's rows of that shape."""


def _table(heading: str) -> list[list[str]]:
    """The cells of the first table after ``heading`` (its header and separator rows dropped)."""
    text = GUIDE.read_text(encoding="utf-8")
    section = text[text.index(heading) :]
    rows = []
    for line in section.splitlines()[1:]:
        if line.startswith("## "):
            break
        if line.startswith("|"):
            rows.append([cell.strip() for cell in line.strip().strip("|").split("|")])
        elif rows:
            break
    return rows[2:]


def _names(cell: str) -> list[str]:
    return re.findall(r"`([a-z_]+)`", cell)


def loss_rows() -> list[tuple[str, str, str]]:
    """``(TRL name, our name, verdict)`` for every pair of names in the loss-type table."""
    out = []
    for cells in _table("## 4. Loss types"):
        theirs, ours, verdict = _names(cells[0]), _names(cells[1]) or _names(cells[0]), cells[2]  # "same names"
        out.extend((t, o, verdict) for t, o in zip(theirs, ours, strict=True))
    return out


def test_the_loss_table_covers_every_trl_loss_type_with_a_verdict():
    from tests.trl.test_training import TRL_LOSSES

    rows = loss_rows()
    assert {verdict for _, _, verdict in rows} <= set(VERDICTS)
    assert {theirs for theirs, _, verdict in rows if verdict.startswith("same")} == set(TRL_LOSSES)


@pytest.mark.parametrize("theirs,ours,verdict", loss_rows(), ids=lambda value: str(value))
def test_each_loss_row_is_what_the_suite_finds(theirs, ours, verdict):
    trl, mine, _ = harness.run("strings", harness.options_for([theirs]), harness.options_for([ours]))
    if verdict == "same":
        assert harness.same(trl, mine) == []
    elif verdict == "same loss":
        assert harness.same(trl, mine, tuple(n for n in harness.SHARED_METRICS if n not in REWARDS)) == []
        assert harness.same(trl, mine, REWARDS) != []
    elif verdict == "differs":
        assert "loss" in harness.same(trl, mine)
    else:  # differs from step 2: against our run under TRL's name (equal to TRL's: the row above), bit for bit
        _, under_trls_name, _ = harness.run("strings", harness.options_for([theirs]))
        assert mine.values("loss")[0] == under_trls_name.values("loss")[0]
        assert mine.values("loss")[1:] != under_trls_name.values("loss")[1:]


def test_each_row_shape_is_tokenised_as_the_guide_says():
    rows = _table("## 5. Datasets")
    assert [cells[0] for cells in rows] == list(SHAPES)
    for cells in rows:
        trl, ours, _ = harness.run(SHAPES[cells[0]], harness.options_for(["sigmoid"]))
        assert cells[-1] == "same tokens"
        assert harness.same(trl, ours) == [], cells[0]


def test_the_metrics_the_guide_calls_trls_are_trls():
    trl, ours, _ = harness.run("strings", harness.options_for(["sigmoid"]))
    claimed = [name for cells in _table("## 6. Metrics") if cells[1].startswith("Same") for name in _metric(cells[0])]
    assert set(claimed) >= set(harness.SHARED_METRICS) - {"grad_norm"}
    assert harness.same(trl, ours, tuple(claimed)) == []


def _metric(cell: str) -> list[str]:
    return re.findall(r"`([a-z_/]+)`", cell)
