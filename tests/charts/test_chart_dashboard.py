"""The Grafana dashboard the chart ships: off by default; when on, a ConfigMap labelled for Grafana's dashboard
sidecar whose JSON is the dashboard built in services/telemetry/grafana_dashboard.py, loads as a dashboard with
Grafana's own models (grafana-foundation-sdk), lays its panels out without overlap, and queries parse as PromQL.
That the queries name metrics the processes export is checked against real processes: tests/e2e/test_observability.py
(the services) and tests/operator/test_operator_command.py (the operator)."""

import json

import pytest
from chart_render import NAMESPACE, of_kind, render
from grafana_foundation_sdk.cog.encoder import JSONEncoder
from grafana_foundation_sdk.cog.plugins import register_default_plugins
from grafana_foundation_sdk.models import prometheus, timeseries
from grafana_foundation_sdk.models.dashboard import Dashboard, Panel, RowPanel

from dashboard_queries import DASHBOARD, TARGET_LABELS, panel_queries, parse, selectors
from specsplit.services.telemetry.grafana_dashboard import dashboard_json

ON = {"monitoring": {"grafanaDashboard": {"enabled": True}, "podMonitor": {"enabled": True}}}


def _configmap(values) -> dict:
    (configmap,) = [c for c in of_kind(render(values), "ConfigMap") if c["metadata"]["name"].endswith("-dashboard")]
    return configmap


def test_off_by_default():
    assert not [c for c in of_kind(render(), "ConfigMap") if c["metadata"]["name"].endswith("-dashboard")]


def test_a_configmap_for_the_sidecar_holding_the_built_dashboard():
    configmap = _configmap(ON)
    assert configmap["metadata"]["labels"]["grafana_dashboard"] == "1"
    assert configmap["metadata"]["namespace"] == NAMESPACE
    assert json.loads(configmap["data"]["specsplit.json"]) == json.loads(DASHBOARD.read_text())
    assert DASHBOARD.read_text() == dashboard_json()  # the file is what the module builds: regenerate it if not
    elsewhere = _configmap({"monitoring": {"grafanaDashboard": {
        "enabled": True, "namespace": "grafana", "labels": {"grafana_dashboard": "specsplit"},
        "annotations": {"grafana_folder": "LLM serving"}}}})
    assert elsewhere["metadata"]["namespace"] == "grafana"
    assert elsewhere["metadata"]["labels"]["grafana_dashboard"] == "specsplit"
    assert elsewhere["metadata"]["annotations"] == {"grafana_folder": "LLM serving"}


def test_it_loads_as_a_grafana_dashboard():
    """Grafana's generated models read every panel as a time series of Prometheus queries, and write it back."""
    register_default_plugins()  # the panel and query types (timeseries, prometheus) by their names
    board = json.loads(_configmap(ON)["data"]["specsplit.json"])
    loaded = Dashboard.from_json(board)
    assert loaded.title == board["title"] and loaded.uid == board["uid"]
    rows = [p for p in loaded.panels if isinstance(p, RowPanel)]
    panels = [p for p in loaded.panels if isinstance(p, Panel)]
    assert len(rows) == 4 and len(panels) == 14 and len(rows) + len(panels) == len(board["panels"])
    for panel in panels:
        assert panel.type_val == "timeseries" and isinstance(panel.options, timeseries.Options), panel.title
        assert panel.targets and all(isinstance(t, prometheus.Dataquery) and t.expr for t in panel.targets)
    assert {v.name for v in loaded.templating.list_val} == {"datasource", "namespace", "deployment"}
    written = json.loads(json.dumps(loaded, cls=JSONEncoder))
    assert [p["title"] for p in written["panels"]] == [p["title"] for p in board["panels"]]
    assert [t["expr"] for p in written["panels"] for t in p.get("targets", [])] == \
        [t["expr"] for p in board["panels"] for t in p.get("targets", [])]
    ids = [p["id"] for p in board["panels"]]
    assert len(ids) == len(set(ids))


def test_panels_tile_the_grid_without_overlap():
    cells = set()
    for panel in json.loads(DASHBOARD.read_text())["panels"]:
        g = panel["gridPos"]
        assert 0 <= g["x"] and g["x"] + g["w"] <= 24
        mine = {(x, y) for x in range(g["x"], g["x"] + g["w"]) for y in range(g["y"], g["y"] + g["h"])}
        assert not mine & cells, panel["title"]
        cells |= mine


@pytest.mark.parametrize("title, expr", panel_queries(json.loads(DASHBOARD.read_text())))
def test_every_query_is_promql_on_one_speculative_deployment(title, expr):
    parse(expr)  # raises on a syntax error
    for selector in selectors(expr):
        assert selector.name.startswith("specsplit_"), (title, selector.name)
        # Each series is matched to the deployment itself: grouping by a label elsewhere in the query selects nothing.
        assert {"namespace", "app_kubernetes_io_instance" if not selector.name.startswith("specsplit_operator_")
                else "name"} <= selector.matchers, (title, selector)
    assert "$deployment" in expr and "$namespace" in expr


def test_the_monitors_copy_the_labels_the_queries_select_by():
    manifests = render({"monitoring": {"podMonitor": {"enabled": True}, "serviceMonitor": {"enabled": True}}})
    for monitor in of_kind(manifests, "PodMonitor") + of_kind(manifests, "ServiceMonitor"):
        if monitor["metadata"]["labels"].get("app.kubernetes.io/component") == "operator":
            assert monitor["spec"]["podMetricsEndpoints"][0]["honorLabels"] is True  # its `namespace` label wins
            continue
        copied = {label.replace(".", "_").replace("/", "_") for label in monitor["spec"]["podTargetLabels"]}
        assert copied == TARGET_LABELS - {"namespace"}
