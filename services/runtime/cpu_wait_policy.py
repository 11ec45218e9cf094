"""How torch's OpenMP threads wait between parallel regions, chosen per machine state and process layout before
torch loads OpenMP (libgomp reads its settings once, at load). Imports nothing heavy: the `specsplit` command runs it
first thing.

A decoder step is a few hundred parallel regions. A thread that spins between them starts the next one at once; one
that sleeps costs a wake-up per region but leaves the core to whoever else wants it. So:
- on a quiet machine spinning may win (not measured on a quiet machine in bench/results yet: the first quiet start
  measures it for itself);
- on a machine loaded by another job, a spinning thread holds a core the other job wants while its own team waits
  for a thread that was descheduled: 3-8x slower than sleeping on a loaded 2-core Xeon
  (bench/bench_cpu_wait_policy.py, bench/results/cpu_wait_policy_xeon.json);
- with `serve` the draft and the target are two processes on the same cores taking turns: a process that spins
  long after its turn takes the cores from the other's.

The choice, per process:
1. OMP_WAIT_POLICY or GOMP_SPINCOUNT set by hand: kept.
2. Chosen by the specsplit process that started this one (`serve` for its workers: CHOSEN_ENV): kept.
3. SPECSPLIT_OMP_WAIT=passive | active | spin:N (GOMP_SPINCOUNT=N): that, for any command.
4. Processes whose layout is not known (layout_of): PASSIVE, as before the measured choice existed. These are the
   ones that compute little on the CPU (a coordinator: one thread; a client), those that compute on another device,
   and lone `target` / `draft` workers, which may take turns with a partner on the same cores without knowing it.
5. The machine is busy (other processes used more than LOADED_CORES cores over a short look at /proc/stat): PASSIVE,
   and nothing is measured or cached.
6. Otherwise (`serve`, `generate --local`, `bench latency|throughput`, on the CPU) the candidate measured fastest
   for this machine and layout ("one": one process computing; "turns": two processes taking turns on the same cores,
   as `serve`'s draft and target): each candidate runs a decoder-shaped workload in fresh processes (wait_probe.py),
   a few seconds at the first quiet start, cached in <cache>/cpu_wait.json per CPU model, cores, torch version and
   layout. Of the candidates within MARGIN of the fastest the least spinning is taken: a machine that gets busy
   after a process started keeps that process's choice, and a shorter spin costs less then.
SPECSPLIT_OMP_WAIT=auto is the default; =measure measures again and replaces the cached choice.
"""

import os
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

from specsplit.services.runtime.json_cache import read_cache, write_cache
from specsplit.services.runtime.machine import available_cores, machine_key

WAIT_ENV = "SPECSPLIT_OMP_WAIT"
CHOSEN_ENV = "SPECSPLIT_OMP_WAIT_CHOSEN"  # what a parent chose for the processes it starts
WAIT_REASON_ENV = "SPECSPLIT_OMP_WAIT_REASON"  # what was chosen and why, for the process's start-up line
CACHE_FILE = "cpu_wait.json"
LOADED_CORES = 0.5   # other processes busier than this many cores: the machine is loaded
LOAD_LOOK_S = 0.25   # how long /proc/stat is watched
MARGIN = 0.05        # the least spinning candidate within this of the fastest is taken
PROBE_TIMEOUT_S = 120.0
# Least spinning first. GOMP_SPINCOUNT counts spins before sleeping, roughly 100 per microsecond: 0.1, 1 and 10 ms
# (bounded spins sleep when their process waits for the other's; how much of active's gain each keeps is what the
# measurement finds out).
CANDIDATES = ("passive", "spin:10000", "spin:100000", "spin:1000000", "active")
USER_VARIABLES = ("OMP_WAIT_POLICY", "GOMP_SPINCOUNT")


@dataclass
class WaitChoice:
    policy: str                 # passive | active | spin:N | set by hand
    reason: str                 # why, for the log line
    settings: dict = field(default_factory=dict)  # environment variables to set

    def describe(self) -> str:
        return f"{self.policy} ({self.reason})"


def settings_of(policy: str) -> dict:
    if policy == "passive":
        return {"OMP_WAIT_POLICY": "PASSIVE"}
    if policy == "active":
        return {"OMP_WAIT_POLICY": "ACTIVE"}
    if policy.startswith("spin:") and policy[5:].isdigit():
        return {"GOMP_SPINCOUNT": policy[5:]}
    raise ValueError(f"{WAIT_ENV} must be passive, active, spin:N, auto or measure, not {policy!r}")


# The `specsplit` subcommands (cli.build_parser's; a test keeps the two equal). The parser itself imports torch, so
# the subcommand is found by name: the first of these on the command line (global options, `--log-level X`, come
# before it and take no subcommand's name as their value).
COMMANDS = ("generate", "target", "draft", "coordinator", "serve", "models", "canary", "bench")


def command_of(argv: list[str]) -> str | None:
    return next((word for word in argv if word in COMMANDS), None)


def option_value(argv: list[str], option: str, default: str | None = None) -> str | None:
    """The value of `--option V` or `--option=V` in argv (the last given), else `default`."""
    value = default
    for i, word in enumerate(argv):
        if word == option and i + 1 < len(argv):
            value = argv[i + 1]
        elif word.startswith(option + "="):
            value = word[len(option) + 1:]
    return value


def layout_of(argv: list[str]) -> str | None:
    """The process layout a `specsplit` command line computes in, where it is known: "one" (one process computing:
    `generate --local`, `bench latency|throughput`, `serve` without a draft model) or "turns" (`serve`: its draft and
    target take turns on the same cores). None otherwise: processes that compute little on the CPU, those that compute
    on another device, and lone workers (`target`, `draft`), which may share the cores with a partner they know
    nothing of (README: started "on one machine or many")."""
    command = command_of(argv)
    if command is None or option_value(argv, "--device", "cpu") != "cpu":
        return None
    after = argv[argv.index(command) + 1:]
    if command == "serve":
        alone = option_value(after, "--draft") == "none" or option_value(after, "--proposer") == "ngram"
        return "one" if alone else "turns"
    if command == "generate" and "--local" in after:
        return "one"
    if command == "bench" and next((w for w in after if not w.startswith("-")), None) in ("latency", "throughput"):
        return "one"
    return None


def unmeasured_reason(argv: list[str]) -> str:
    """Why a command line whose layout_of is None waits passively, for the log line."""
    command = command_of(argv)
    if command in ("target", "draft"):
        device = option_value(argv, "--device", "cpu")
        if device != "cpu":
            return f"computes on {device}"
        return (f"a lone {command} worker may share its cores with another (set {WAIT_ENV} to choose; `serve` "
                f"measures for its workers)")
    if command is not None and option_value(argv, "--device", "cpu") != "cpu":
        return f"computes on {option_value(argv, '--device')}"
    return "computes little on the CPU"


def decide(argv: list[str], environ=os.environ, busy_cores=None, measure=None, cache_file: Path | None = None,
           cores: int | None = None) -> WaitChoice:
    """The wait policy for a process started with `argv` (see the module's docstring for the order of rules)."""
    if any(v in environ for v in USER_VARIABLES) and CHOSEN_ENV not in environ:
        return WaitChoice("set by hand", ", ".join(f"{v}={environ[v]}" for v in USER_VARIABLES if v in environ))
    if CHOSEN_ENV in environ:
        policy = environ[CHOSEN_ENV]
        said = environ.get(WAIT_REASON_ENV, policy)
        return WaitChoice(policy, f"chosen by the process that started this one: {said}", settings_of(policy))
    requested = environ.get(WAIT_ENV, "auto")
    if requested not in ("auto", "measure"):
        return WaitChoice(requested, f"{WAIT_ENV}={requested}", settings_of(requested))
    layout = layout_of(argv)
    if layout is None:
        return WaitChoice("passive", unmeasured_reason(argv), settings_of("passive"))
    busy = (busy_cores or others_busy_cores)()
    if busy > LOADED_CORES:
        return WaitChoice("passive", f"machine busy: {busy:.1f} cores used by other processes", settings_of("passive"))
    cache_file = cache_file or default_cache_file()
    key = cache_key(layout, cores)
    cached = read_cache(cache_file).get(key)
    if cached is not None and requested != "measure" and cached.get("policy") in CANDIDATES:
        return WaitChoice(cached["policy"], f"measured for {layout} process{'es' if layout == 'turns' else ''} on "
                          f"this machine, cached", settings_of(cached["policy"]))
    started = time.perf_counter()
    try:
        seconds = (measure or measure_candidates)(layout)
    except (OSError, subprocess.SubprocessError, ValueError) as error:
        return WaitChoice("passive", f"measurement failed: {error}"[:200], settings_of("passive"))
    if (busy_cores or others_busy_cores)() > LOADED_CORES:  # someone else started meanwhile: not trustworthy
        return WaitChoice("passive", "machine got busy while measuring", settings_of("passive"))
    policy = pick(seconds)
    write_cache(cache_file, key, {"policy": policy, "seconds": seconds, "layout": layout,
                                  "measured_in_s": time.perf_counter() - started, **machine_key(cores=cores),
                                  "date": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())}, quiet=True)
    timings = ", ".join(f"{name} {1e3 * s:.1f} ms" for name, s in sorted(seconds.items(), key=lambda kv: kv[1]))
    return WaitChoice(policy, f"measured for {layout}: {timings} per step", settings_of(policy))


def pick(seconds: dict[str, float]) -> str:
    """The least spinning candidate within MARGIN of the fastest."""
    fastest = min(seconds.values())
    return next(c for c in CANDIDATES if c in seconds and seconds[c] <= (1.0 + MARGIN) * fastest)


def apply(choice: WaitChoice, environ=os.environ, for_children: bool = False) -> None:
    """Set the choice's variables (before torch loads); `for_children`: the processes this one starts keep it."""
    for variable in USER_VARIABLES:
        if choice.settings and variable not in choice.settings:
            environ.pop(variable, None)
    environ.update(choice.settings)
    if for_children and choice.settings:
        environ[CHOSEN_ENV] = choice.policy


def choose_for_command(argv: list[str], environ=os.environ) -> WaitChoice:
    """What the `specsplit` command runs before anything loads torch."""
    choice = decide(argv, environ)
    apply(choice, environ, for_children=command_of(argv) == "serve")  # its workers: chosen for them
    environ[WAIT_REASON_ENV] = choice.describe()
    return choice


def without_wait_choice(environ) -> dict:
    """`environ` less this process's choice: a specsplit command started with it chooses its own, as by a user."""
    return {k: v for k, v in environ.items() if k not in (*USER_VARIABLES, CHOSEN_ENV, WAIT_REASON_ENV)}


def others_busy_cores(look: float = LOAD_LOOK_S) -> float:
    """Cores this process may run on (its affinity) kept busy by other processes over `look` seconds (this process
    sleeps meanwhile); 0 off Linux."""
    try:
        first = _cpu_times()
        time.sleep(look)
        second = _cpu_times()
    except (OSError, ValueError, IndexError):
        return 0.0
    total = sum(second) - sum(first)
    idle = (second[3] + second[4]) - (first[3] + first[4])
    if total <= 0:
        return 0.0
    return (total - idle) / total * available_cores()


def _cpu_times(stat: str = "/proc/stat") -> list[int]:
    """The first 8 time columns summed over the CPUs this process may run on (all of them without an affinity)."""
    try:
        mine = {f"cpu{c}" for c in os.sched_getaffinity(0)}
    except AttributeError:  # not Linux
        mine = None
    with open(stat) as f:
        lines = [line.split() for line in f if line.startswith("cpu")]
    rows = [fields for fields in lines[1:] if mine is None or fields[0] in mine] or lines[:1]
    return [sum(int(fields[i]) for fields in rows) for i in range(1, 9)]


def measure_candidates(layout: str, steps: int = 12) -> dict[str, float]:
    """Seconds per step (per round of both processes for "turns") of the probe workload under each candidate."""
    return {policy: probe_seconds(policy, layout, steps) for policy in CANDIDATES}


def environment_for(policy: str, environ=os.environ) -> dict:
    """`environ` with `policy`'s variables instead of any choice made in it, for a process started to run under it."""
    env = {k: v for k, v in environ.items() if k not in USER_VARIABLES and k != CHOSEN_ENV}
    env.update(settings_of(policy))
    return env


def probe_seconds(policy: str, layout: str, steps: int = 12, timeout: float = PROBE_TIMEOUT_S) -> float:
    """Seconds per step of the probe workload (wait_probe.py) in a fresh process waiting under `policy`."""
    command = [sys.executable, "-P", "-m", "specsplit.services.runtime.wait_probe", "--steps", str(steps), "--layout", layout]
    out = subprocess.run(command, env=environment_for(policy), capture_output=True, text=True, timeout=timeout,
                         check=True)
    return float(out.stdout.strip().splitlines()[-1])


def cache_key(layout: str, cores: int | None = None) -> str:
    """Per CPU, cores, torch, layout and the candidates measured (another set measures again)."""
    m = machine_key(cores=cores)
    return f"{m['cpu']}|{m['cores']} cores|torch {m['torch']}|{layout}|{','.join(CANDIDATES)}"


def default_cache_file() -> Path:
    from specsplit.services.models.prepare import cache_root  # imports no torch

    return cache_root() / CACHE_FILE
