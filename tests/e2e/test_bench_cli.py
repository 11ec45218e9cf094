"""`specsplit bench` against a real `specsplit serve` of the tiny models (one for the whole module): over the OpenAI
HTTP API and over gRPC, JSON and PNG written, every request reaching the server; a malformed JSONL line named; the
in-process latency and throughput modes; and, last, the server going away mid-run."""

import json
import subprocess
import sys
import time

import pytest

from cluster import scrape
from specsplit.bench.serve_process import ServeProcess
from specsplit.cli import main

PNG = b"\x89PNG\r\n\x1a\n"
LATENCIES = ("ttft_ms", "tpot_ms", "itl_ms", "e2el_ms")


@pytest.fixture(scope="module")
def served(tiny_pair):
    # A fixed k: every request drafts (the speculation fields are the harness's to report), where the adaptive policy
    # might find speculating this tiny pair not worth it and leave them empty.
    with ServeProcess(["--target", str(tiny_pair["target"]), "--draft", str(tiny_pair["close"]), "--dtype", "float64",
                       "--num-kv-blocks", "256", "-k", "4", "--speculation", "fixed"]) as serve:
        yield serve


def _requests_finished(served) -> float:
    samples = scrape(served.metrics_url("coordinator"))
    return sum(v for (name, _), v in samples.items() if name == "specsplit_requests_total")


def _check_fields(summary: dict, completed: int, output_len: int) -> None:
    assert summary["completed"] == completed and summary["failed"] == 0 and summary["interrupted"] is None
    assert summary["total_output_tokens"] == completed * output_len  # ignore_eos: exactly as many as asked
    assert summary["request_throughput"] > 0 and summary["output_tokens_per_s"] > 0
    for key in LATENCIES:
        d = summary[key]
        assert set(d) == {"mean", "p50", "p90", "p99"}
        assert 0 < d["p50"] <= d["p90"] <= d["p99"], (key, d)


def test_serve_over_http_writes_json_and_plot(served, tiny_pair, tmp_path, capsys):
    before = _requests_finished(served)
    out = tmp_path / "http.json"
    code = main(["bench", "serve", "--url", served.http_url, "--workload", "random", "--tokenizer",
                 str(tiny_pair["target"]), "--input-len", "8", "--output-len", "6", "--num-prompts", "6",
                 "--max-concurrency", "3", "--json", str(out), "--plot", str(tmp_path / "http.png")])
    printed = capsys.readouterr().out
    assert code == 0
    result = json.loads(out.read_text())
    _check_fields(result, completed=6, output_len=6)
    assert result["total_input_tokens"] == 6 * 8 and len(result["runs"]) == 1
    assert result["backend"] == "openai-http" and result["max_concurrency"] == 3 and result["request_rate"] == "inf"
    assert 0 <= result["acceptance_rate"] <= 1 and 1 <= result["tokens_per_round"] <= 5  # from the server's field
    assert {"commit", "machine", "command", "date"} <= set(result)
    assert (tmp_path / "http.png").read_bytes()[:8] == PNG
    assert "Serving Benchmark Result" in printed and "P99 ITL (ms)" in printed
    assert _requests_finished(served) == before + 6 + 1  # every request (and the warm-up) reached the server


def test_serve_over_grpc_with_a_jsonl_file_and_two_rates(served, tmp_path, capsys):
    workload = tmp_path / "w.jsonl"
    workload.write_text("\n".join(json.dumps(line) for line in [
        {"prompt": "def add(a, b):"},
        {"messages": [{"role": "user", "content": "write a loop"}]},
        {"conversations": [{"from": "human", "value": "hi"}, {"from": "gpt", "value": "hello"}]},
    ]) + "\n")
    out = tmp_path / "grpc.json"
    code = main(["bench", "serve", "--grpc", served.address, "--workload", str(workload), "--output-len", "5",
                 "--num-prompts", "4", "--request-rate", "40,inf", "--num-warmups", "0", "--no-progress",
                 "--json", str(out), "--plot", str(tmp_path / "rates.png")])
    assert code == 0
    result = json.loads(out.read_text())
    assert result["backend"] == "grpc" and [run["request_rate"] for run in result["runs"]] == [40.0, "inf"]
    for run in result["runs"]:
        _check_fields(run, completed=4, output_len=5)
        assert run["acceptance_rate"] is not None
    assert "ttft_ms" not in result  # several runs: their numbers are under "runs" only
    assert (tmp_path / "rates.png").read_bytes()[:8] == PNG
    assert "rate 40.0" in capsys.readouterr().out  # the runs side by side


def test_a_malformed_jsonl_line_is_named_and_nothing_is_sent(served, tmp_path, capsys):
    workload = tmp_path / "bad.jsonl"
    workload.write_text('{"prompt": "fine"}\n{"prompt": "also fine"}\n{"prompt": "cut off\n')
    before = _requests_finished(served)
    code = main(["bench", "serve", "--url", served.http_url, "--workload", str(workload), "--num-prompts", "2"])
    assert code == 2
    assert f"{workload}:3: not valid JSON" in capsys.readouterr().err
    assert _requests_finished(served) == before


def test_latency_and_throughput_in_one_process(tiny_pair, tmp_path):
    models = ["--target", str(tiny_pair["target"]), "--draft", str(tiny_pair["close"]), "--dtype", "float64",
              "-k", "4", "--speculation", "fixed", "--no-progress"]
    latency = tmp_path / "latency.json"
    assert main(["bench", "latency", *models, "--input-len", "6", "--output-len", "8", "--batch-size", "2",
                 "--num-iters", "2", "--num-iters-warmup", "0", "--json", str(latency)]) == 0
    throughput = tmp_path / "throughput.json"
    assert main(["bench", "throughput", *models, "--workload", "humaneval", "--output-len", "6", "--num-prompts", "3",
                 "--num-warmups", "0", "--json", str(throughput)]) == 0
    for path, completed, output_len in ((latency, 4, 8), (throughput, 3, 6)):
        result = json.loads(path.read_text())
        for mode in ("target_only", "speculative"):
            _check_fields(result[mode], completed, output_len)
        assert result["target_only"]["acceptance_rate"] is None and result["target_only"]["tokens_per_round"] == 1.0
        assert 0 <= result["speculative"]["acceptance_rate"] <= 1
        speedup = result["speedup"]  # the ratios of the two modes' own numbers
        assert speedup["output_tokens_per_s"] == pytest.approx(
            result["speculative"]["output_tokens_per_s"] / result["target_only"]["output_tokens_per_s"])
        assert speedup["tpot_p50"] == pytest.approx(
            result["target_only"]["tpot_ms"]["p50"] / result["speculative"]["tpot_ms"]["p50"])
    assert json.loads(latency.read_text())["speculative"]["batch_latency_s"]["p50"] > 0


def test_a_server_going_away_ends_the_run_with_what_was_measured(served, tiny_pair, tmp_path):
    """Runs last: it stops the module's server."""
    out = tmp_path / "gone.json"
    before = _requests_finished(served)
    bench = subprocess.Popen([sys.executable, "-m", "specsplit", "bench", "serve", "--url", served.http_url,
                              "--tokenizer", str(tiny_pair["target"]), "--input-len", "4", "--output-len", "4",
                              "--num-prompts", "400", "--request-rate", "20", "--no-progress", "--json", str(out)],
                             stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    deadline = time.monotonic() + 120
    while _requests_finished(served) < before + 5:  # the warm-up and a few measured requests are through
        assert bench.poll() is None and time.monotonic() < deadline, bench.communicate()
        time.sleep(0.1)
    served.stop()
    stdout, stderr = bench.communicate(timeout=120)
    assert bench.returncode == 1, stderr
    result = json.loads(out.read_text())
    assert 4 <= result["completed"] < 400 and result["interrupted"]
    assert result["ttft_ms"]["p50"] > 0  # what was measured is reported
    assert "the server went away" in stderr and "Serving Benchmark Result" in stdout
    assert "specsplit/__main__.py bench serve --url" in result["command"]
