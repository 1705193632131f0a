"""The plan benchmark's comparison of predicted and measured figures (given numbers)."""
from __future__ import annotations

import pytest

from benchmarks.plan import pairwise_agreement, summarise


def test_summarise_orders_agreement_and_memory():
    res = {
        "a": {"predicted_epoch_s": 1.0, "measured_epoch_s": 2.0, "peak_error": 0.10},
        "b": {"predicted_epoch_s": 3.0, "measured_epoch_s": 5.0, "peak_error": -0.30},
        "c": {"predicted_epoch_s": 2.0, "measured_epoch_s": 6.0, "peak_error": 0.25},
        "d": {"predicted_epoch_s": 4.0, "measured_epoch_s": 1.0, "peak_error": 0.0},
    }
    s = summarise(res, ["a", "b", "c", "d"], {"a": "x", "b": "y", "c": "y", "d": "z"})
    assert s["predicted_order"] == ["a", "c", "b", "d"]
    assert s["measured_order"] == ["d", "a", "b", "c"]
    assert not s["order_matches"]
    # pairs: ab+ ac+ ad- bc- bd- cd-  -> 2 of 6
    assert s["pairwise_order_agreement"] == pytest.approx(2 / 6)
    assert s["peak_within_25pct"] == 3
    # engines by their best case: x 1 / 2, y 2 / 5, z 4 / 1
    assert s["engine_predicted_order"] == ["x", "y", "z"]
    assert s["engine_measured_order"] == ["z", "x", "y"]
    assert not s["engine_order_matches"]
    assert pairwise_agreement([1, 2, 3], [10, 20, 30]) == 1.0
