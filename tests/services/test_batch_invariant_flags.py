"""`--batch-invariant`: on serve, target, draft and generate --local; switched on for the whole process; handed by
`serve` to its workers; refused where it cannot hold (a client, tensor parallelism)."""

import json

import pytest

from invariance_scenarios import save_flat_pair
from specsplit.cli import build_parser, main
from specsplit.kernels import dispatch
from specsplit.kernels.dispatch import BATCH_INVARIANT_ENV, batch_invariant
from specsplit.services.errors import InvalidArgument
from specsplit.services.rpc.worker_process import build_worker_service
from specsplit.services.service_commands import batch_invariant_argv


@pytest.mark.parametrize("argv", [["serve"], ["target", "--model", "m"], ["draft", "--model", "m"],
                                  ["generate", "--local", "--target", "m"]])
def test_the_flag_is_on_every_command_that_runs_models(argv):
    assert not build_parser().parse_args(argv).batch_invariant
    assert build_parser().parse_args([*argv, "--batch-invariant"]).batch_invariant


def test_serve_hands_it_to_its_workers_and_refuses_sharded_models(monkeypatch):
    monkeypatch.setattr(dispatch, "_MODE", True)  # as cli.main leaves it for --batch-invariant
    assert batch_invariant_argv(build_parser().parse_args(["serve"])) == []
    assert batch_invariant_argv(build_parser().parse_args(["serve", "--batch-invariant"])) == ["--batch-invariant"]
    sharded = build_parser().parse_args(["serve", "--batch-invariant", "--target-tensor-parallel-size", "2"])
    with pytest.raises(InvalidArgument, match="tensor-parallel size 1"):
        batch_invariant_argv(sharded)


def test_a_worker_refuses_sharding_in_the_mode(monkeypatch):
    monkeypatch.setattr(dispatch, "_MODE", True)
    with pytest.raises(InvalidArgument, match=r"tensor-parallel size 1 \(got target 2\)"):
        build_worker_service("target", "no-such-model", tensor_parallel_size=2)


def test_generate_local_runs_in_the_mode(tmp_path, monkeypatch, capsys):
    monkeypatch.setattr(dispatch, "_MODE", False)  # both restored after the test; main switches them on
    monkeypatch.setenv(BATCH_INVARIANT_ENV, "0")
    pair = save_flat_pair(tmp_path)
    outputs = {}
    for k in (0, 4):
        assert main(["generate", "--local", "--batch-invariant", "--target", str(pair["target"]), "--draft",
                     str(pair["close"]), "--dtype", "bfloat16", "--prompt-ids", "5,6,7,8", "--max-tokens", "8",
                     "--ignore-eos", "-k", str(k), "--json"]) == 0
        outputs[k] = json.loads(capsys.readouterr().out.strip().splitlines()[-1])["token_ids"]
    assert batch_invariant()
    assert outputs[4] == outputs[0] and len(outputs[0]) == 8


def test_a_client_cannot_ask_for_it():
    with pytest.raises(SystemExit, match="not of a client"):
        main(["generate", "--server", "localhost:1", "--prompt", "x", "--batch-invariant"])
