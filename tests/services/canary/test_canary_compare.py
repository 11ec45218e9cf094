"""`specsplit canary compare` on real (tiny) models: the same prompts through a close and an unrelated draft and
the target alone; the report says which draft is better, shows outputs identical, and plots acceptance and
latency."""

import json

import matplotlib.image
import pytest

from specsplit.cli import main
from specsplit.services.canary.compare import read_prompts
from specsplit.services.telemetry.confidence_intervals import wilson

PROMPTS = ["def add(a, b):", "hello world", "import os\\nimport sys\\n"]


@pytest.fixture(scope="module")
def report(tiny_pair, tmp_path_factory):
    root = tmp_path_factory.mktemp("canary")
    prompts = root / "prompts.txt"
    prompts.write_text("\n".join(PROMPTS) + "\n\n")
    out = root / "out"
    code = main(["canary", "compare", "--target", str(tiny_pair["target"]), "--draft", str(tiny_pair["close"]),
                 "--draft", str(tiny_pair["unrelated"]), "--prompts", str(prompts), "--max-tokens", "8",
                 "--ignore-eos", "-k", "3", "--dtype", "float64", "--num-kv-blocks", "64", "--out", str(out)])
    return code, out


def test_report_from_real_runs(report):
    code, out = report
    assert code == 0
    data = json.loads((out / "report.json").read_text())
    assert [r["label"] for r in data["runs"]] == ["close", "unrelated", "target only"]
    assert data["identical_outputs"] is True
    close, unrelated, alone = data["runs"]
    for run in data["runs"]:
        assert run["requests"] == len(PROMPTS) and len(run["latency_seconds"]) == len(PROMPTS)
        assert run["tokens_per_second"] > 0
    for run in (close, unrelated):
        assert run["drafted_tokens"] > 0
        assert run["acceptance_rate"] == pytest.approx(run["accepted_tokens"] / run["drafted_tokens"])
        assert run["acceptance_rate_ci95"] == pytest.approx(list(wilson(run["accepted_tokens"], run["drafted_tokens"])))
        assert len(run["acceptance_per_position"]) == 3
        assert 1.0 <= run["mean_accepted_length"] <= 4.0
    assert alone["drafted_tokens"] == 0 and alone["acceptance_rate"] is None
    assert close["acceptance_rate"] > unrelated["acceptance_rate"]

    markdown = (out / "report.md").read_text()
    assert "**Outputs identical:** yes" in markdown
    for label in ("close", "unrelated", "target only"):
        assert f"| {label} | {len(PROMPTS)} |" in markdown
    assert "| draft | pos 1 | pos 2 | pos 3 |" in markdown
    assert "close accepts more (the interval excludes 0)" in markdown
    assert "vs the target alone" in markdown


def test_plot_is_a_real_image(report):
    _, out = report
    image = matplotlib.image.imread(out / "report.png")
    height, width = image.shape[:2]
    assert width > 800 and height > 300
    assert image.std() > 0.05  # not a blank canvas


def test_prompt_files(tmp_path):
    jsonl = tmp_path / "p.jsonl"
    jsonl.write_text('{"prompt": "a\\nb", "id": 1}\n\n{"prompt": "c"}\n')
    assert read_prompts(str(jsonl)) == ["a\nb", "c"]
    txt = tmp_path / "p.txt"
    txt.write_text("one\n\ntwo\\nlines\n")
    assert read_prompts(str(txt)) == ["one", "two\nlines"]
