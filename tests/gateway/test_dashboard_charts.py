"""The dashboard's curves (ui/charts.py): bounded however long the run, honest about what they hold."""

from __future__ import annotations

import itertools
import math
import xml.etree.ElementTree as ET

from loopline.gateway.ui.charts import MAX_POINTS, Curve, svg


def test_a_curve_keeps_a_bounded_thinned_history_of_a_long_run():
    curve = Curve("loss")
    for step in range(1, 100_001):
        curve.add(step, 1 / step)
    assert MAX_POINTS <= len(curve.points) < 2 * MAX_POINTS
    steps = [x for x, _ in curve.points]
    assert steps == sorted(steps) and steps[0] == 1
    gaps = {b - a for a, b in itertools.pairwise(steps)}
    assert len(gaps) == 1  # evenly thinned: every stride-th step
    assert steps[-1] > 100_000 - 2 * next(iter(gaps))  # and up to date


def test_non_finite_values_are_left_out_and_a_restart_redraws_from_its_step():
    curve = Curve("loss")
    for step, value in ((1, 3.0), (2, math.nan), (3, math.inf), (4, 2.0), (5, 1.5)):
        curve.add(step, value)
    assert curve.points == [(1, 3.0), (4, 2.0), (5, 1.5)]
    curve.add(4, 9.0)  # a restarted job logs step 4 again: its new run is what is drawn
    assert curve.points == [(1, 3.0), (4, 9.0)]


def test_the_svg_names_what_it_shows_and_escapes_names():
    curve = Curve("<script>")
    for step in (1, 2, 3):
        curve.add(step, step * 0.5)
    drawn = ET.fromstring(str(svg(curve, title='reward "<b>"')))
    assert drawn.get("role") == "img" and drawn.get("data-points") == "3"
    assert drawn.get("aria-label") == 'reward "<b>": 3 points, last 1.5 at step 3'
    assert len(drawn.find("{*}polyline").get("points").split()) == 3
    ticks = [t.text for t in drawn.iter() if t.get("class") == "tick" and t.get("text-anchor") == "middle"]
    assert ticks == ["1", "2", "3"]  # whole steps, each once
    empty = ET.fromstring(str(svg(Curve("x"), title="x")))
    assert empty.get("data-points") == "0" and "none yet" in empty.get("aria-label")
