"""A picture of the chart's Grafana dashboard from real data, where no Grafana can be installed: the services run on
this machine (tiny random-weight models; a stable draft and a worse canary taking a quarter of the requests), a real
Prometheus (Debian's `prometheus` package) scrapes them, `specsplit bench serve` loads them at rising request rates,
and each panel's own PromQL is asked of Prometheus and drawn with matplotlib in the dashboard's layout.

    apt-get install prometheus
    python bench/render_dashboard.py --out charts/specsplit/dashboards/specsplit.png

The operator's panel stays empty: no operator (nor cluster) runs here. Series get the labels the chart's monitors add
(namespace, app_kubernetes_io_instance, app_kubernetes_io_component) from Prometheus' static configuration.
"""

import argparse
import json
import shutil
import subprocess
import sys
import tempfile
import time
import urllib.parse
import urllib.request
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "tests"))
sys.path.insert(0, str(REPO / "tests" / "e2e"))

from cluster import free_port  # noqa: E402
from specsplit.services.service_commands import printed, spawn_service, stop_processes  # noqa: E402
from specsplit.services.telemetry.grafana_dashboard import build_dashboard  # noqa: E402
from tiny_models import build_model, perturbed_copy, save_model  # noqa: E402

NAMESPACE, INSTANCE = "demo", "coder"


def start_services(root: Path, started: list) -> dict:
    """The workers and the coordinator, each added to `started` as it starts (so a failed start stops the others)."""
    target = build_model("qwen2", seed=0)
    save_model(target, root / "target")
    save_model(perturbed_copy(target, 0.003), root / "stable")
    save_model(perturbed_copy(target, 0.03), root / "canary")
    common = ["--host", "127.0.0.1", "--port", "0", "--metrics-port", "0", "--num-kv-blocks", "512"]
    processes, addresses = {}, {}
    for name, argv in (("target", ["target", "--model", str(root / "target"), *common]),
                       ("draft", ["draft", "--model", str(root / "stable"), *common]),
                       ("draft-canary", ["draft", "--model", str(root / "canary"), *common])):
        processes[name], addresses[name] = spawn_service(argv)
        started.append(processes[name])
    processes["coordinator"], addresses["coordinator"] = spawn_service([
        "coordinator", "--target", addresses["target"], "--draft-variant", f"stable:3:{addresses['draft']}",
        "--draft-variant", f"canary:1:{addresses['draft-canary']}", "--host", "127.0.0.1", "--port", "0",
        "--http-port", "0", "--metrics-port", "0", "-k", "6", "--max-num-seqs", "16"])
    started.append(processes["coordinator"])
    return processes


def start_prometheus(root: Path, processes: dict, started: list) -> str:
    """Prometheus scraping `processes`, put first in `started` (stopped before what it scrapes); returns its URL."""
    jobs = []
    for component, process in processes.items():
        target = printed(process.startup_lines, " metrics on ").removeprefix("http://").removesuffix("/metrics")
        jobs.append({"targets": [target], "labels": {"namespace": NAMESPACE, "app_kubernetes_io_instance": INSTANCE,
                                                     "app_kubernetes_io_component": component}})
    config = root / "prometheus.yml"
    config.write_text(json.dumps({"global": {"scrape_interval": "2s", "evaluation_interval": "2s"},
                                  "scrape_configs": [{"job_name": "specsplit", "static_configs": jobs}]}))
    port = free_port()
    process = subprocess.Popen([shutil.which("prometheus"), f"--config.file={config}",
                                f"--storage.tsdb.path={root / 'tsdb'}", f"--web.listen-address=127.0.0.1:{port}"],
                               stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    started.insert(0, process)
    url = f"http://127.0.0.1:{port}"
    for _ in range(100):
        try:
            urllib.request.urlopen(url + "/-/ready", timeout=1)
            return url
        except OSError:
            time.sleep(0.2)
    raise RuntimeError("prometheus did not start")


def load(http_url: str, tokenizer: Path, rates: str, prompts: int) -> None:
    subprocess.run([sys.executable, "-m", "specsplit", "bench", "serve", "--url", http_url, "--tokenizer",
                    str(tokenizer), "--input-len", "32", "--output-len", "48", "--num-prompts", str(prompts),
                    "--request-rate", rates, "--no-progress"], check=True, stdout=subprocess.DEVNULL)


def query_range(url: str, expr: str, start: float, end: float, step: float) -> list[dict]:
    expr = (expr.replace("$__rate_interval", "20s").replace("$namespace", NAMESPACE)
            .replace("$deployment", INSTANCE))
    query = urllib.parse.urlencode({"query": expr, "start": start, "end": end, "step": step})
    with urllib.request.urlopen(f"{url}/api/v1/query_range?{query}", timeout=30) as response:
        return json.load(response)["data"]["result"]


def legend(template: str, labels: dict) -> str:
    for key, value in labels.items():
        template = template.replace("{{" + key + "}}", value)
    return template


def draw(board: dict, data: dict, start: float, out: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.ticker import FuncFormatter, PercentFormatter

    rows = max(p["gridPos"]["y"] + p["gridPos"]["h"] for p in board["panels"]) + 1  # + a line for the title
    figure = plt.figure(figsize=(24, rows * 0.6), facecolor="#111217")
    figure.text(0.005, 0.997, board["title"] + "   (namespace demo, deployment coder)", color="#d8d9da", fontsize=13,
                va="top")

    def box(g, top_pad, bottom_pad, left_pad):
        """The axes rectangle of a grid position (24 columns; rows of `rows` units, the first for the title)."""
        left, width = g["x"] / 24, g["w"] / 24
        top = 1 - (g["y"] + 1) / rows
        height = g["h"] / rows
        return [left + left_pad, top - height + bottom_pad, width - left_pad - 0.006, height - top_pad - bottom_pad]

    for panel in board["panels"]:
        g = panel["gridPos"]
        if panel["type"] == "row":
            figure.text(0.005, 1 - (g["y"] + 1.6) / rows, panel["title"], color="#d8d9da", fontsize=12,
                        fontweight="bold")
            continue
        axis = figure.add_axes(box(g, top_pad=0.022, bottom_pad=0.018, left_pad=0.03))
        axis.set_facecolor("#181b1f")
        for spine in axis.spines.values():
            spine.set_color("#2c3235")
        axis.tick_params(colors="#9fa7b3", labelsize=7)
        axis.set_title(panel["title"], color="#d8d9da", fontsize=10, loc="left")
        series = data[panel["id"]]
        for label, points in series:
            axis.plot([(t - start) / 60 for t, _ in points], [v for _, v in points], linewidth=1.2, label=label)
        if not series:
            axis.text(0.5, 0.5, "No data (no operator runs in this local demo)", color="#9fa7b3", ha="center",
                      va="center", fontsize=8, transform=axis.transAxes)
        unit = panel["fieldConfig"]["defaults"]["unit"]
        if unit == "percentunit":
            axis.yaxis.set_major_formatter(PercentFormatter(1.0))
        elif unit == "s":
            axis.yaxis.set_major_formatter(FuncFormatter(lambda v, _: f"{v * 1e3:.0f} ms"))
        axis.xaxis.set_major_formatter(FuncFormatter(lambda v, _: f"{int(v)}:{round(v % 1 * 60):02d}"))
        axis.grid(True, color="#2c3235", linewidth=0.5)
        axis.set_ylim(bottom=0)
        if series:
            axis.legend(fontsize=6, loc="upper left", facecolor="#181b1f", edgecolor="#2c3235", labelcolor="#d8d9da",
                        ncol=2 if len(series) > 3 else 1)
    figure.savefig(out, dpi=72, facecolor=figure.get_facecolor())


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", default=str(REPO / "charts" / "specsplit" / "dashboards" / "specsplit.png"))
    parser.add_argument("--rates", default="2,4,8,16", help="request rates of the load, one bench run each")
    parser.add_argument("--prompts", type=int, default=120, help="requests per rate")
    parser.add_argument("--data", default=None, help="keep the queried series in this JSON file; if it exists, draw "
                        "from it instead of running anything")
    args = parser.parse_args()
    if args.data and Path(args.data).is_file():
        kept = json.loads(Path(args.data).read_text())
        draw(build_dashboard(), {int(k): v for k, v in kept["series"].items()}, kept["start"], Path(args.out))
        print(f"wrote {args.out} from {args.data}")
        return
    if shutil.which("prometheus") is None:
        raise SystemExit("needs Prometheus: apt-get install prometheus")
    root = Path(tempfile.mkdtemp(prefix="specsplit-dashboard-"))
    started = []
    try:
        processes = start_services(root, started)
        url = start_prometheus(root, processes, started)
        start = time.time()
        time.sleep(10)  # a few idle scrapes first
        http_url = printed(processes["coordinator"].startup_lines, " OpenAI API on ")
        load(http_url, root / "target", args.rates, args.prompts)
        time.sleep(10)
        end = time.time()
        board = build_dashboard()
        data = {}
        for panel in board["panels"]:
            data[panel["id"]] = [(legend(target["legendFormat"], result["metric"]),
                                  [(float(t), float(v)) for t, v in result["values"] if v not in ("NaN", "+Inf")])
                                 for target in panel.get("targets", [])
                                 for result in query_range(url, target["expr"], start, end, 5)]
        if args.data:
            Path(args.data).write_text(json.dumps({"start": start, "series": data}))
        draw(board, data, start, Path(args.out))
        print(f"wrote {args.out} ({(end - start) / 60:.1f} minutes of data)")
    finally:
        stop_processes(started, timeout=30)
        shutil.rmtree(root, ignore_errors=True)


if __name__ == "__main__":
    main()
