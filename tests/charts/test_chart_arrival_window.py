"""The coordinator's arrival window (`--arrival-window-ms`) in the chart: off unless set; set, the
SpeculativeDeployment carries it and the operator passes it to the coordinator wherever it runs (its own pods, or
every target pod when co-located), as the real CLI parses it."""

import pytest

from chart_render import coordinator_command, operator_objects, render, speculative_deployment
from specsplit.cli import build_parser


@pytest.mark.parametrize("colocated", [False, True])
def test_the_window_reaches_the_coordinator_only_where_set(colocated):
    default = speculative_deployment(render({"coordinator": {"colocated": colocated}}))
    assert "arrivalWindowMs" not in default["spec"]["coordinator"]
    assert "--arrival-window-ms" not in coordinator_command(operator_objects(default), colocated)

    cr = speculative_deployment(render({"coordinator": {"colocated": colocated, "arrivalWindowMs": 2.5}}))
    assert cr["spec"]["coordinator"]["arrivalWindowMs"] == 2.5
    command = coordinator_command(operator_objects(cr), colocated)
    assert build_parser().parse_args(command[1:]).arrival_window_ms == 2.5  # the flag _coordinator_options reads


def test_a_negative_window_is_refused_by_the_chart():
    with pytest.raises(Exception, match="arrivalWindowMs"):
        render({"coordinator": {"arrivalWindowMs": -1}})
