"""How torch's OpenMP threads wait between parallel regions, chosen per machine state and process layout before
torch loads OpenMP (libgomp reads its settings once, at load). Imports nothing heavy: the `specsplit` command runs it
first thing.

A decoder step is a few hundred parallel regions. A thread that spins between them starts the next one at once; one
that sleeps costs a wake-up per region but leaves the core to whoever else wants it. So:
- on a quiet machine spinning wins (a 2-core AMD EPYC decoded the real pair 25-30% faster with OMP_WAIT_POLICY=ACTIVE
  than PASSIVE);
- on a machine loaded by another job, a spinning thread holds a core the other job wants while its own team waits
  for a thread that was descheduled: 3-7x slower than sleeping on a loaded 2-core Xeon
  (bench/bench_cpu_wait_policy.py);
- with `serve` the draft and the target are two processes on the same cores taking turns: a process that spins
  long after its turn takes the cores from the other's.

The choice, per process:
1. OMP_WAIT_POLICY or GOMP_SPINCOUNT set by hand: kept.
2. Chosen by the specsplit process that started this one (`serve` for its workers: CHOSEN_ENV): kept.
3. Processes that compute nothing on the CPU (a coordinator: one thread; a client): PASSIVE.
4. The machine is busy (other processes used more than LOADED_CORES cores over a short look at /proc/stat): PASSIVE,
   and nothing is measured or cached.
5. Otherwise the candidate measured fastest for this machine and layout ("one": one process computing, as
   `generate --local` or a lone worker; "turns": two processes taking turns on the same cores, as `serve`): each
   candidate runs a decoder-shaped workload in fresh processes (wait_probe.py), a few seconds at the first quiet
   start, cached in <cache>/cpu_wait.json per CPU model, cores, torch version and layout. Of the candidates within
   MARGIN of the fastest the least spinning is taken: a machine that gets busy after a process started keeps that
   process's choice, and a shorter spin costs less then.
SPECSPLIT_OMP_WAIT overrides: passive | active | spin:N (GOMP_SPINCOUNT=N) | auto (the default) | measure (measure
again and replace the cached choice).
"""

import os
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

from specsplit.services.runtime import json_cache
from specsplit.services.runtime.json_cache import read_cache
from specsplit.services.runtime.machine import cpu_model

WAIT_ENV = "SPECSPLIT_OMP_WAIT"
CHOSEN_ENV = "SPECSPLIT_OMP_WAIT_CHOSEN"  # what a parent chose for the processes it starts
WAIT_REASON_ENV = "SPECSPLIT_OMP_WAIT_REASON"  # what was chosen and why, for the process's start-up line
CACHE_FILE = "cpu_wait.json"
LOADED_CORES = 0.5   # other processes busier than this many cores: the machine is loaded
LOAD_LOOK_S = 0.25   # how long /proc/stat is watched
MARGIN = 0.05        # the least spinning candidate within this of the fastest is taken
PROBE_TIMEOUT_S = 120.0
# Least spinning first. GOMP_SPINCOUNT counts spins before sleeping, roughly 100 per microsecond: 0.1, 1 and 10 ms
# (the last keeps nearly all of active's gain within a step, and sleeps when its process waits for the other's).
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


def layout_of(argv: list[str]) -> str | None:
    """The process layout a `specsplit` command line computes in: "one", "turns" (serve: its workers take turns),
    or None when it computes nothing on the CPU worth a choice (a coordinator, a client, model preparation)."""
    words = [a for a in argv if not a.startswith("-")]
    command = words[0] if words else None
    if command == "serve":
        return "turns"
    if command in ("target", "draft", "bench") or (command == "generate" and "--local" in argv):
        return "one"
    return None


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
        return WaitChoice("passive", "computes little on the CPU", settings_of("passive"))
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
                                  "measured_in_s": time.perf_counter() - started, **machine_key(cores),
                                  "date": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())})
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
    apply(choice, environ, for_children=layout_of(argv) == "turns")
    environ[WAIT_REASON_ENV] = choice.describe()
    return choice


def without_wait_choice(environ) -> dict:
    """`environ` less this process's choice: a specsplit command started with it chooses its own, as by a user."""
    return {k: v for k, v in environ.items() if k not in (*USER_VARIABLES, CHOSEN_ENV, WAIT_REASON_ENV)}


def others_busy_cores(look: float = LOAD_LOOK_S) -> float:
    """Cores kept busy by other processes over `look` seconds (this process sleeps meanwhile); 0 off Linux."""
    try:
        first = _cpu_times()
        time.sleep(look)
        second = _cpu_times()
    except (OSError, ValueError):
        return 0.0
    total = sum(second) - sum(first)
    idle = (second[3] + second[4]) - (first[3] + first[4])
    if total <= 0:
        return 0.0
    return (total - idle) / total * (os.cpu_count() or 1)


def _cpu_times() -> list[int]:
    with open("/proc/stat") as f:
        fields = f.readline().split()
    return [int(v) for v in fields[1:9]]


def measure_candidates(layout: str, steps: int = 12) -> dict[str, float]:
    """Seconds per step (per round of both processes for "turns") of the probe workload under each candidate."""
    seconds = {}
    for policy in CANDIDATES:
        env = {k: v for k, v in os.environ.items() if k not in USER_VARIABLES and k != CHOSEN_ENV}
        env.update(settings_of(policy))
        command = [sys.executable, "-m", "specsplit.services.runtime.wait_probe", "--steps", str(steps),
                   "--layout", layout]
        out = subprocess.run(command, env=env, capture_output=True, text=True, timeout=PROBE_TIMEOUT_S, check=True)
        seconds[policy] = float(out.stdout.strip().splitlines()[-1])
    return seconds


def machine_key(cores: int | None = None) -> dict:
    try:
        from importlib.metadata import version

        torch_version = version("torch")
    except Exception:  # not installed as a distribution
        torch_version = "?"
    return {"cpu": cpu_model(), "cores": cores or os.cpu_count(), "torch": torch_version}


def cache_key(layout: str, cores: int | None = None) -> str:
    """Per CPU, cores, torch, layout and the candidates measured (another set measures again)."""
    m = machine_key(cores)
    return f"{m['cpu']}|{m['cores']} cores|torch {m['torch']}|{layout}|{','.join(CANDIDATES)}"


def default_cache_file() -> Path:
    root = os.environ.get("SPECSPLIT_CACHE")
    if root:
        return Path(root).expanduser() / CACHE_FILE
    xdg = os.environ.get("XDG_CACHE_HOME")
    base = Path(xdg).expanduser() if xdg else Path.home() / ".cache"
    return base / "specsplit" / CACHE_FILE


def write_cache(path: Path, key: str, entry: dict) -> None:
    try:
        json_cache.write_cache(path, key, entry)
    except OSError:
        pass  # a read-only cache measures again next start, nothing worse
