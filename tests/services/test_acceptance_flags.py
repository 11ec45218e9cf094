"""The acceptance-method flags: defaults, bad values refused before anything starts, and `serve` handing them on
to its target process unchanged."""

import pytest

from specsplit.cli import build_parser
from specsplit.services.errors import InvalidArgument
from specsplit.services.target.acceptance_flags import acceptance_argv, acceptance_policy_from_args
from specsplit.services.target.acceptance_method import AcceptancePolicy


def policy(*argv: str) -> AcceptancePolicy:
    return acceptance_policy_from_args(build_parser().parse_args(["target", "--model", "m", *argv]))


def test_defaults_are_lossless():
    assert policy() == AcceptancePolicy("rejection", 0.09, 0.3, False)
    assert not policy().may_be_lossy


def test_typical_and_its_parameters():
    assert policy("--acceptance-method", "typical", "--posterior-threshold", "0.2", "--posterior-alpha", "0.5") == \
        AcceptancePolicy("typical", 0.2, 0.5, False)
    assert policy("--allow-typical-per-request", "--posterior-alpha", "0.1") == AcceptancePolicy("rejection", 0.09, 0.1, True)


@pytest.mark.parametrize("argv,message", [
    (["--posterior-threshold", "0.2"], "apply to typical acceptance"),
    (["--acceptance-method", "typical", "--posterior-threshold", "1.0"], "posterior_threshold must be in"),
    (["--acceptance-method", "typical", "--posterior-alpha", "-1"], "posterior_alpha must be"),
    (["--acceptance-method", "typical", "--posterior-alpha", "nan"], "posterior_alpha must be"),
])
def test_bad_values_are_refused(argv, message):
    with pytest.raises(InvalidArgument, match=message):
        policy(*argv)


def test_serve_hands_the_flags_to_its_target():
    flags = ["--acceptance-method", "typical", "--posterior-threshold", "0.15", "--posterior-alpha", "0.25",
             "--allow-typical-per-request"]
    serve = build_parser().parse_args(["serve", *flags, "--no-logprobs-while-speculating"])
    assert policy(*acceptance_argv(serve)) == policy(*flags) == AcceptancePolicy("typical", 0.15, 0.25, True)
    assert not serve.logprobs_while_speculating
    assert acceptance_argv(build_parser().parse_args(["serve"])) == []
    assert build_parser().parse_args(["coordinator", "--target", "t:1"]).logprobs_while_speculating


def test_generate_sends_the_flags_as_the_requests_choice():
    from specsplit.cli import sampling_params_from_args

    args = build_parser().parse_args(["generate", "--server", "h:1", "--prompt", "x", "--acceptance-method", "typical",
                                      "--posterior-alpha", "0.4"])
    params = sampling_params_from_args(args)
    assert (params.acceptance_method, params.posterior_threshold, params.posterior_alpha) == ("typical", None, 0.4)
    plain = sampling_params_from_args(build_parser().parse_args(["generate", "--server", "h:1", "--prompt", "x"]))
    assert (plain.acceptance_method, plain.posterior_threshold, plain.posterior_alpha) == (None, None, None)
