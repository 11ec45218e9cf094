"""The acceptance-method flags (services/target/acceptance_method.py) of `specsplit target`, `serve` and `generate`.

On `target`, `serve` and `generate --local` they set the deployment; on `generate --server` they become the request's
own choice (GenerateRequest.acceptance), which the target accepts only where its deployment allows.
"""

from specsplit.services.errors import InvalidArgument
from specsplit.services.target.acceptance_method import (
    ACCEPTANCE_METHODS, DEFAULT_POSTERIOR_ALPHA, DEFAULT_POSTERIOR_THRESHOLD, REJECTION, TYPICAL, AcceptancePolicy,
)


def add_acceptance_args(p, deployment: bool = True) -> None:
    """`deployment`: the command runs a target (it also gets --allow-typical-per-request)."""
    p.add_argument("--acceptance-method", choices=ACCEPTANCE_METHODS, default=None,
                   help="how the target keeps proposals: rejection (default; lossless, output distributed exactly as "
                   "the target's) or typical (NOT LOSSLESS: keeps proposals the target finds likely enough, accepting "
                   "more at high temperature; sampled output is no longer the target's distribution, greedy stays "
                   "exact)" + ("" if deployment else "; with --server, asked for this request only"))
    p.add_argument("--posterior-threshold", type=float, default=None, metavar="P",
                   help=f"typical acceptance (NOT LOSSLESS): accept d when p(d) > min(P, ALPHA * exp(-entropy(p))); "
                   f"P in [0, 1), default {DEFAULT_POSTERIOR_THRESHOLD}")
    p.add_argument("--posterior-alpha", type=float, default=None, metavar="ALPHA",
                   help=f"typical acceptance (NOT LOSSLESS): the entropy scale ALPHA >= 0, default {DEFAULT_POSTERIOR_ALPHA}")
    if deployment:
        p.add_argument("--allow-typical-per-request", action="store_true",
                       help="let requests opt in to typical acceptance (NOT LOSSLESS) while the rest stay lossless; "
                       "without it a target with --acceptance-method rejection refuses them (INVALID_ARGUMENT)")


def acceptance_policy_from_args(args) -> AcceptancePolicy:
    allow = getattr(args, "allow_typical_per_request", False)
    method = args.acceptance_method or REJECTION
    parameters = args.posterior_threshold is not None or args.posterior_alpha is not None
    if parameters and method != TYPICAL and not allow:
        raise InvalidArgument("--posterior-threshold and --posterior-alpha apply to typical acceptance: add "
                              "--acceptance-method typical or --allow-typical-per-request")
    return AcceptancePolicy(
        method=method,
        posterior_threshold=_first(args.posterior_threshold, DEFAULT_POSTERIOR_THRESHOLD),
        posterior_alpha=_first(args.posterior_alpha, DEFAULT_POSTERIOR_ALPHA),
        allow_typical_per_request=allow,
    )


def acceptance_argv(args) -> list[str]:
    """The flags again, for a target process started by `serve`."""
    argv = []
    if args.acceptance_method:
        argv += ["--acceptance-method", args.acceptance_method]
    if args.posterior_threshold is not None:
        argv += ["--posterior-threshold", repr(args.posterior_threshold)]
    if args.posterior_alpha is not None:
        argv += ["--posterior-alpha", repr(args.posterior_alpha)]
    if getattr(args, "allow_typical_per_request", False):
        argv.append("--allow-typical-per-request")
    return argv


def _first(value, default):
    return default if value is None else value
