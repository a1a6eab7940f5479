"""The tour picture's speed panels show plait.metrics' figures per layout: MFU (percent),
step time and the largest rank's peak memory, one bar per layout, none invented."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from plait.demo.pictures import _speed_panels


def test_speed_panels_plot_each_layouts_metrics() -> None:
    plt = pytest.importorskip("matplotlib.pyplot")
    rows = [
        SimpleNamespace(layout="ddp", mfu=0.125, step_ms=40.0, memory_peak_mib=512.0),
        SimpleNamespace(layout="tp", mfu=0.05, step_ms=90.0, memory_peak_mib=300.0),
        SimpleNamespace(layout="none", mfu=None, step_ms=70.0, memory_peak_mib=None),
    ]
    fig, (speed, peak) = plt.subplots(1, 2)
    try:
        _speed_panels(speed, peak, rows)
        assert [b.get_height() for b in speed.patches] == [12.5, 5.0, 0.0]
        twin = [a for a in fig.axes if a not in (speed, peak)][0]
        assert [b.get_height() for b in twin.patches] == [40.0, 90.0, 70.0]
        assert [b.get_height() for b in peak.patches] == [512.0, 300.0, 0.0]
        assert [t.get_text() for t in peak.get_xticklabels()] == ["ddp", "tp", "none"]
    finally:
        plt.close(fig)
