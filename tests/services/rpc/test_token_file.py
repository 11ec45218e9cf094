"""The bearer-token file: the throttle slows failure answers, not guesses, so a token must be long enough that
guessing is hopeless (rpc/auth_throttle.py)."""

import pytest

from specsplit.services.rpc.security import read_tokens
from specsplit.services.rpc.worker_credentials import MIN_SECRET_CHARS


def test_tokens_are_read_one_per_line_without_comments(tmp_path):
    path = tmp_path / "tokens"
    path.write_text("# team tokens\n" + "a" * MIN_SECRET_CHARS + "\n\n  " + "b" * 40 + "  \n")
    assert read_tokens(str(path)) == ["a" * MIN_SECRET_CHARS, "b" * 40]


@pytest.mark.parametrize("text", ["", "# only a comment\n", "long-enough-token-1\nshort\n"])
def test_an_empty_file_or_a_short_token_is_refused(tmp_path, text):
    path = tmp_path / "tokens"
    path.write_text(text)
    with pytest.raises(ValueError, match="no tokens|at least 16 characters"):
        read_tokens(str(path))
