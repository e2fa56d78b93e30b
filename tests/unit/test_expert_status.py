"""The router's view of a worker group's expert load: the measured per-layer max/mean of rank loads."""

from __future__ import annotations

import pytest

from deepinfer.services.router import ExpertStatus


def test_expert_max_over_mean_is_the_mean_over_busy_layers() -> None:
    st = ExpertStatus(3, (10, 30), ((30, 10), (20, 20), (0, 0)))
    # Layer 0: 30 / 20 = 1.5; layer 1: 1.0; the idle layer does not count.
    assert st.expert_max_over_mean == pytest.approx(1.25)
    assert st.max_over_mean == pytest.approx(1.5)


def test_idle_or_dense_groups_read_as_balanced() -> None:
    assert ExpertStatus(0, (0, 0)).expert_max_over_mean == 1.0
    assert ExpertStatus(0, (0, 0), ((0, 0),)).expert_max_over_mean == 1.0
    assert ExpertStatus(0, (0, 0)).max_over_mean == 1.0
