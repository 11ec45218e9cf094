"""The coordinator's batch limits (`--max-num-seqs`, `--max-waiting`) in the chart: the coordinator's defaults
unless set; set, the SpeculativeDeployment carries them and the operator passes them to the coordinator wherever it
runs (its own pods, or every target pod when co-located), as the real CLI parses them."""

import pytest

from chart_render import coordinator_command, operator_objects, render, speculative_deployment
from specsplit.cli import build_parser
from specsplit.services.service_commands import _coordinator_options


@pytest.mark.parametrize("colocated", [False, True])
def test_the_limits_reach_the_coordinator_only_where_set(colocated):
    default = speculative_deployment(render({"coordinator": {"colocated": colocated}}))
    assert not {"maxNumSeqs", "maxWaiting"} & set(default["spec"]["coordinator"])
    command = coordinator_command(operator_objects(default), colocated)
    assert "--max-num-seqs" not in command and "--max-waiting" not in command

    cr = speculative_deployment(render({"coordinator": {"colocated": colocated, "maxNumSeqs": 48,
                                                        "maxWaiting": 200}}))
    assert (cr["spec"]["coordinator"]["maxNumSeqs"], cr["spec"]["coordinator"]["maxWaiting"]) == (48, 200)
    args = build_parser().parse_args(coordinator_command(operator_objects(cr), colocated)[1:])
    assert (args.max_num_seqs, args.max_waiting) == (48, 200)  # the flags _coordinator_options reads


@pytest.mark.parametrize("key", ["maxNumSeqs", "maxWaiting"])
def test_a_limit_below_one_is_refused_by_the_chart(key):
    with pytest.raises(Exception, match=key):
        render({"coordinator": {key: 0}})


@pytest.mark.parametrize("flag, value, low", [("--max-num-seqs", "0", 1), ("--max-waiting", "-1", 0)])
def test_a_limit_below_its_floor_is_refused_by_the_cli(flag, value, low):
    # --max-waiting 0 stays a coordinator that refuses every new request (tests/e2e/test_openai_http.py's "full")
    args = build_parser().parse_args(["coordinator", "--target", "127.0.0.1:1", flag, value])
    with pytest.raises(SystemExit, match=f"{flag} must be >= {low}"):
        _coordinator_options(args)
