"""`helm lint --strict` (Helm's own linter, through helm-python-sdk) is clean for every value set."""

import helm_python
import pytest
from chart_render import CHART_DIR, KUBE_VERSION
from chart_values import VALUE_SETS

INFO, WARNING, ERROR = 1, 2, 3


def lint(values):
    return helm_python.lint(CHART_DIR, values, strict=True, namespace="ml", kube_version=f"v{KUBE_VERSION}.0")


@pytest.mark.parametrize("value_set", VALUE_SETS)
def test_lint_is_clean(value_set):
    report = lint(VALUE_SETS[value_set])
    assert report["total_charts_linted"] == 1
    problems = [m for m in report["messages"] if m["severity"] >= WARNING]
    assert not problems and not report["errors"], problems or report["errors"]
    # What is left is advice only (Helm recommends an icon; the project has none).
    assert {m["error"] for m in report["messages"]} <= {"icon is recommended"}


def test_lint_reports_a_bad_value():
    report = lint({"image": {"tag": "latest"}})
    assert any(m["severity"] == ERROR and "/image/tag" in m["error"] for m in report["messages"])
