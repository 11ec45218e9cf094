"""How a target decides which proposals to keep: rejection sampling (lossless, the default) or typical acceptance
(NOT lossless, opt-in; kernels/typical_acceptance.py).

The deployment chooses (`specsplit target --acceptance-method`, `--posterior-threshold`, `--posterior-alpha`):
- `rejection` (default): every sequence is verified losslessly. A request asking for typical acceptance is refused
  (INVALID_ARGUMENT) unless the target also runs with `--allow-typical-per-request`, which lets requests opt in
  one by one while the rest stay lossless.
- `typical`: every sequence is verified with typical acceptance unless its request asks for `rejection` (a request
  may always ask to stay lossless).
A request may also set its own posterior threshold and alpha when its method resolves to typical.

The target resolves each sequence's method once, at prefill, from the request's choice (carried in WorkerSampling)
and this policy; the sequence keeps it, and the prefill verdict tells the coordinator, which reports it in the
response statistics and labels the acceptance metrics with it. (Torch-free: the client validates with it too; the
verifier's batched call is services/target/typical_batch.py.)
"""

import logging
import math
from dataclasses import dataclass, replace

from specsplit.services.errors import InvalidArgument

REJECTION = "rejection"
TYPICAL = "typical"
ACCEPTANCE_METHODS = (REJECTION, TYPICAL)
DEFAULT_POSTERIOR_THRESHOLD = 0.09
DEFAULT_POSTERIOR_ALPHA = 0.3

log = logging.getLogger(__name__)


def check_acceptance(method: str | None, posterior_threshold: float | None, posterior_alpha: float | None) -> None:
    """A method name and parameters that make sense (None = not chosen). The threshold must stay below 1: with a
    bound of 1 a greedy (one-hot) row could never accept its own argmax."""
    if method is not None and method not in ACCEPTANCE_METHODS:
        raise InvalidArgument(f"acceptance method must be one of {', '.join(ACCEPTANCE_METHODS)}, got {method!r}")
    if posterior_threshold is not None and not (0.0 <= posterior_threshold < 1.0):
        raise InvalidArgument(f"posterior_threshold must be in [0, 1), got {posterior_threshold}")
    if posterior_alpha is not None and not (0.0 <= posterior_alpha < math.inf):
        raise InvalidArgument(f"posterior_alpha must be finite and >= 0, got {posterior_alpha}")
    if method == REJECTION and (posterior_threshold is not None or posterior_alpha is not None):
        raise InvalidArgument("posterior_threshold and posterior_alpha apply to typical acceptance only, not rejection")


@dataclass(frozen=True)
class AcceptancePolicy:
    """One target's setting: the method sequences get by default, its parameters, and whether requests may opt in
    to typical acceptance when the default is rejection."""

    method: str = REJECTION
    posterior_threshold: float = DEFAULT_POSTERIOR_THRESHOLD
    posterior_alpha: float = DEFAULT_POSTERIOR_ALPHA
    allow_typical_per_request: bool = False

    def __post_init__(self):
        check_acceptance(self.method, None, None)
        check_acceptance(None, self.posterior_threshold, self.posterior_alpha)

    @property
    def may_be_lossy(self) -> bool:
        return self.method == TYPICAL or self.allow_typical_per_request

    def resolve(self, sampling):
        """A WorkerSampling with its method and parameters settled; InvalidArgument if it may not have them."""
        check_acceptance(sampling.acceptance_method or None, sampling.posterior_threshold, sampling.posterior_alpha)
        method = sampling.acceptance_method or self.method
        if method == TYPICAL and self.method != TYPICAL and not self.allow_typical_per_request:
            raise InvalidArgument(
                "typical acceptance (NOT lossless) is not enabled on this target: it verifies with lossless rejection "
                "sampling only (start it with --acceptance-method typical or --allow-typical-per-request)"
            )
        if method == REJECTION:
            if sampling.posterior_threshold is not None or sampling.posterior_alpha is not None:
                raise InvalidArgument("posterior_threshold and posterior_alpha apply to typical acceptance, but this "
                                      "target verifies with rejection sampling")
            return replace(sampling, acceptance_method=REJECTION)
        return replace(
            sampling,
            acceptance_method=TYPICAL,
            posterior_threshold=_first(sampling.posterior_threshold, self.posterior_threshold),
            posterior_alpha=_first(sampling.posterior_alpha, self.posterior_alpha),
        )

    def warn_if_lossy(self, where: str) -> None:
        if self.method == TYPICAL:
            log.warning(
                "TYPICAL ACCEPTANCE is the default in %s (posterior threshold %g, alpha %g): output is NOT distributed "
                "as the target model's (greedy stays exact). Requests may ask for lossless rejection sampling.",
                where, self.posterior_threshold, self.posterior_alpha,
            )
        elif self.allow_typical_per_request:
            log.warning(
                "%s lets requests opt in to TYPICAL ACCEPTANCE, which is NOT lossless (posterior threshold %g, "
                "alpha %g by default); other requests stay lossless.", where, self.posterior_threshold,
                self.posterior_alpha,
            )


def _first(value, default):
    return default if value is None else value
