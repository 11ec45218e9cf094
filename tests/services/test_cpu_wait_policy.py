"""How OpenMP threads wait, chosen per process before torch loads OpenMP (services/runtime/cpu_wait_policy.py): set by
hand or by the parent process kept, passive where nothing computes or the machine is busy, else the candidate
measured fastest for the machine and process layout (least spinning within the margin), measured once and cached."""

import os
import subprocess
import sys

import pytest

from specsplit.services.runtime import cpu_wait_policy as wait
from specsplit.services.runtime.cpu_wait_policy import CHOSEN_ENV, WAIT_ENV, WAIT_REASON_ENV, apply, decide

QUIET = lambda: 0.1  # noqa: E731 (other processes' busy cores)
BUSY = lambda: 1.3  # noqa: E731


class Measure:
    """Scripted seconds per step for each candidate; counts the measurements."""

    def __init__(self, seconds):
        self.seconds, self.layouts = seconds, []

    def __call__(self, layout):
        self.layouts.append(layout)
        return dict(self.seconds)


def never(layout):
    raise AssertionError("nothing must be measured here")


@pytest.fixture
def cache(tmp_path):
    return tmp_path / "cpu_wait.json"


def test_set_by_hand_or_by_the_parent_is_kept(cache):
    choice = decide(["serve"], {"OMP_WAIT_POLICY": "ACTIVE"}, QUIET, never, cache)
    assert choice.policy == "set by hand" and choice.settings == {} and "OMP_WAIT_POLICY=ACTIVE" in choice.reason
    inherited = decide(["target", "--model", "m"], {CHOSEN_ENV: "spin:10000", "GOMP_SPINCOUNT": "10000",
                                                    WAIT_REASON_ENV: "spin:10000 (measured)"}, BUSY, never, cache)
    assert inherited.policy == "spin:10000" and inherited.settings == {"GOMP_SPINCOUNT": "10000"}
    assert "started this one: spin:10000 (measured)" in inherited.reason
    assert decide(["serve"], {WAIT_ENV: "spin:500"}, BUSY, never, cache).settings == {"GOMP_SPINCOUNT": "500"}
    with pytest.raises(ValueError, match="passive, active, spin:N"):
        decide(["serve"], {WAIT_ENV: "sometimes"}, QUIET, never, cache)


@pytest.mark.parametrize("argv", [["coordinator", "--target", "x"], ["generate", "--server", "h:1"], ["models", "list"],
                                  [], ["bench", "serve", "--url", "http://h:1"]])
def test_processes_that_compute_little_wait_passively_without_measuring(argv, cache):
    assert decide(argv, {}, QUIET, never, cache).policy == "passive"


@pytest.mark.parametrize("argv, layout", [
    (["--log-level", "DEBUG", "serve", "--target", "t"], "turns"),  # a global option's value is not the command
    (["--log-level=DEBUG", "generate", "--local", "--target", "t"], "one"),
    (["serve", "--draft", "none"], "one"), (["serve", "--proposer=ngram"], "one"),  # only the target computes
    (["serve", "--device", "cuda"], None), (["generate", "--local", "--device=cuda:0"], None),
    (["bench", "latency"], "one"), (["bench", "throughput", "--device", "cpu"], "one"), (["bench", "serve"], None),
    (["target", "--model", "m"], None), (["draft", "--model", "m"], None),  # lone workers: partner unknown
    (["generate", "--server", "h:1", "--prompt", "serve"], None),
])
def test_the_layout_is_read_from_the_subcommand_and_known_only_where_the_command_runs_every_computing_process(
        argv, layout):
    assert wait.layout_of(argv) == layout


def test_lone_workers_and_other_devices_wait_passively_unless_told(cache):
    """A lone worker may take turns with a partner on the same cores (its default must not depend on which of the two
    started first), and a GPU worker has nothing to gain from timing a CPU workload at every start."""
    for argv in (["target", "--model", "m"], ["draft", "--model", "m"]):
        choice = decide(argv, {}, QUIET, never, cache)
        assert choice.settings == {"OMP_WAIT_POLICY": "PASSIVE"} and "lone" in choice.reason
    on_gpu = decide(["target", "--model", "m", "--device", "cuda"], {}, QUIET, never, cache)
    assert on_gpu.policy == "passive" and on_gpu.reason == "computes on cuda"
    assert decide(["serve", "--device", "cuda:0"], {}, QUIET, never, cache).policy == "passive"
    assert decide(["target", "--model", "m"], {WAIT_ENV: "active"}, QUIET, never, cache).policy == "active"
    assert not cache.exists()


def test_serve_hands_its_choice_to_its_workers_after_global_options_and_without_a_draft():
    for argv in (["--log-level", "DEBUG", "serve", "--target", "t"], ["serve", "--draft", "none"]):
        env = {WAIT_ENV: "spin:500"}
        wait.choose_for_command(argv, env)
        assert env[CHOSEN_ENV] == "spin:500" and env["GOMP_SPINCOUNT"] == "500"
    env = {WAIT_ENV: "spin:500"}
    wait.choose_for_command(["--log-level", "DEBUG", "generate", "--local"], env)
    assert CHOSEN_ENV not in env


def test_the_subcommands_known_before_torch_loads_are_the_parsers():
    import argparse

    from specsplit.cli import build_parser

    subparsers = next(a for a in build_parser()._actions if isinstance(a, argparse._SubParsersAction))
    assert set(wait.COMMANDS) == set(subparsers.choices)


def test_a_busy_machine_waits_passively_and_nothing_is_measured_or_cached(cache):
    choice = decide(["generate", "--local", "--target", "t"], {}, BUSY, never, cache)
    assert choice.settings == {"OMP_WAIT_POLICY": "PASSIVE"} and "machine busy: 1.3 cores" in choice.reason
    assert not cache.exists()


def test_a_quiet_machine_measures_once_per_layout_and_takes_the_least_spinning_of_the_fastest(cache):
    measure = Measure({"passive": 0.130, "spin:10000": 0.101, "spin:100000": 0.098, "active": 0.097})
    first = decide(["generate", "--local"], {}, QUIET, measure, cache)
    assert first.policy == "spin:10000" and first.settings == {"GOMP_SPINCOUNT": "10000"}  # within 5% of active
    assert "passive 130.0 ms" in first.reason
    again = decide(["bench", "latency", "--target", "t"], {}, QUIET, never, cache)  # the same layout: the cache
    assert again.policy == "spin:10000" and "cached" in again.reason
    turns = Measure({"passive": 0.20, "spin:10000": 0.25, "spin:100000": 0.30, "active": 0.9})
    assert decide(["serve"], {}, QUIET, turns, cache).policy == "passive"  # two processes: measured on their own
    assert measure.layouts == ["one"] and turns.layouts == ["turns"]
    spin_long = Measure({"passive": 0.10, "spin:10000": 0.09, "spin:100000": 0.08, "spin:1000000": 0.072,
                         "active": 0.070})
    assert decide(["generate", "--local"], {WAIT_ENV: "measure"}, QUIET, spin_long, cache).policy == "spin:1000000"
    remeasure = Measure({"passive": 0.10, "spin:10000": 0.2, "spin:100000": 0.2, "active": 0.2})
    assert decide(["generate", "--local"], {WAIT_ENV: "measure"}, QUIET, remeasure, cache).policy == "passive"
    assert decide(["generate", "--local"], {}, QUIET, never, cache).policy == "passive"


def test_a_machine_that_gets_busy_while_measuring_is_not_trusted(cache):
    looks = iter([0.1, 1.5])
    measure = Measure({"passive": 0.3, "spin:10000": 0.1, "spin:100000": 0.1, "active": 0.1})
    choice = decide(["generate", "--local"], {}, lambda: next(looks), measure, cache)
    assert choice.policy == "passive" and "busy while measuring" in choice.reason and not cache.exists()


def test_apply_sets_the_variables_and_hands_serves_choice_to_its_processes():
    env = {"OMP_WAIT_POLICY": "PASSIVE"}
    apply(wait.WaitChoice("spin:10000", "measured", {"GOMP_SPINCOUNT": "10000"}), env, for_children=True)
    assert env == {"GOMP_SPINCOUNT": "10000", CHOSEN_ENV: "spin:10000"}  # a spin count alone: no policy beside it
    env = {"OMP_WAIT_POLICY": "ACTIVE"}
    apply(wait.WaitChoice("set by hand", "OMP_WAIT_POLICY=ACTIVE"), env)
    assert env == {"OMP_WAIT_POLICY": "ACTIVE"}


def test_the_specsplit_command_decides_before_torch_loads():
    """In a fresh interpreter, as `specsplit generate --local` starts: the variables are set before torch is."""
    env = {k: v for k, v in os.environ.items() if k not in ("OMP_WAIT_POLICY", "GOMP_SPINCOUNT", CHOSEN_ENV)}
    env[WAIT_ENV] = "spin:2000"
    code = ("import sys; sys.argv = ['specsplit', 'generate', '--local']; import specsplit.cli, os; "
            "print('torch' in sys.modules, os.environ.get('GOMP_SPINCOUNT'), os.environ.get('OMP_WAIT_POLICY'))")
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True).stdout
    assert out.split() == ["False", "2000", "None"]


def test_the_probe_workload_runs_in_two_processes_taking_turns():
    """The real measurement's workload (one candidate: the rest only differ in the environment)."""
    env = {**os.environ, "OMP_WAIT_POLICY": "PASSIVE"}
    out = subprocess.run([sys.executable, "-m", "specsplit.services.runtime.wait_probe", "--layout", "turns",
                          "--steps", "2"], env=env, capture_output=True, text=True, timeout=120, check=True)
    assert 0 < float(out.stdout.strip()) < 10


def test_the_load_look_counts_only_the_cores_this_process_may_run_on(tmp_path, monkeypatch):
    """A process pinned to some cores of a large machine: the other cores' load is not its business."""
    stat = tmp_path / "stat"
    stat.write_text("cpu  30 0 0 70 0 0 0 0 0 0\ncpu0 10 0 0 0 0 0 0 0 0 0\ncpu1 20 0 0 0 0 0 0 0 0 0\n"
                    "cpu2 0 0 0 70 0 0 0 0 0 0\nintr 1\n")
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: {2})
    assert wait._cpu_times(str(stat)) == [0, 0, 0, 70, 0, 0, 0, 0]
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: {0, 1})
    assert wait._cpu_times(str(stat)) == [30, 0, 0, 0, 0, 0, 0, 0]
    assert wait.machine_key()["cores"] == 2


def test_the_cache_lives_with_the_models_cache_and_a_read_only_one_is_no_error(tmp_path, monkeypatch):
    monkeypatch.setenv("SPECSPLIT_CACHE", str(tmp_path / "c"))
    assert wait.default_cache_file() == tmp_path / "c" / wait.CACHE_FILE
    blocked = tmp_path / "file"
    blocked.write_text("")
    measure = Measure({"passive": 0.2, "active": 0.1})
    choice = decide(["generate", "--local"], {}, QUIET, measure, blocked / "cpu_wait.json")  # its folder is a file
    assert choice.policy == "active" and measure.layouts == ["one"]
