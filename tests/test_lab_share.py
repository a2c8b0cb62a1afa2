"""The lab's share-group scenarios on one broker behind the fault proxy, audited in one run: the
audit's rows equal each scenario's ground truth (the checks of tests/test_lab_scenarios.py)."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest

from audit.lab.runner import LabResult
from audit.lab.share import SHARE_SCENARIOS
from tests.test_lab_scenarios import _check, proxied_run


@pytest.fixture(scope="module")
def share_result(tmp_path_factory: pytest.TempPathFactory, spark: Any) -> Iterator[LabResult]:
    yield from proxied_run(tmp_path_factory, spark, tuple(SHARE_SCENARIOS))


@pytest.mark.e2e
@pytest.mark.kafka
@pytest.mark.spark
@pytest.mark.parametrize("name", tuple(SHARE_SCENARIOS))
def test_audit_reports_exactly_the_ground_truth(share_result: LabResult, name: str) -> None:
    _check(share_result, name)
