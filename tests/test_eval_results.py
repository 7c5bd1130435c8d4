"""The evaluation report's statistics: the Wilson interval of an accuracy."""

from __future__ import annotations

import pytest

from megatron_wedlm.eval.report import COLUMNS, format_interval
from megatron_wedlm.eval.results import MethodResult, wilson_interval


def test_wilson_interval_matches_a_hand_computed_value():
    # 8 of 10, z = 1.96: centre (0.8 + 1.96^2/20) / (1 + 1.96^2/10) = 0.71674,
    # half-width 1.96 * sqrt(0.8*0.2/10 + 1.96^2/400) / 1.38415 = 0.22658
    lo, hi = wilson_interval(8, 10)
    assert lo == pytest.approx(0.4902, abs=1e-4) and hi == pytest.approx(0.9433, abs=1e-4)
    # 0 of 20: the interval still has width (upper = 1.96^2/20 / (1 + 1.96^2/20) = 0.1611)
    assert wilson_interval(0, 20) == (0.0, pytest.approx(0.1611, abs=1e-4))
    assert wilson_interval(20, 20) == (pytest.approx(0.8389, abs=1e-4), 1.0)
    for bad in ((3, 0), (-1, 5), (6, 5)):
        with pytest.raises(ValueError, match="successes <= n"):
            wilson_interval(*bad)


def test_method_result_reports_its_interval_in_json_and_in_the_table():
    r = MethodResult("counting", "streaming", 0.3, num_examples=10, num_correct=8, generated_tokens=50,
                     forwards=10, slots=60, seconds=1.0)
    assert r.to_dict()["accuracy_ci95"] == wilson_interval(8, 10)
    assert MethodResult.from_dict(r.to_dict()) == r
    cells = {header: cell(r) for header, cell in COLUMNS}
    assert cells["95% CI (%)"] == format_interval(wilson_interval(8, 10)) == "49.0-94.3"
