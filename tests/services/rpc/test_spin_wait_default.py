"""When a process spins while it awaits a round's answer by default: on an accelerator, with four cores to spare,
counting a container's CPU limit (cgroup v2 cpu.max), which the CPU affinity does not show."""

import pytest

from specsplit.services.rpc import round_channel


@pytest.fixture
def eight_cpus(monkeypatch, tmp_path):
    """A node of 8 CPUs; returns a writer of this process's cpu.max."""
    monkeypatch.setattr(round_channel.os, "sched_getaffinity", lambda pid: set(range(8)), raising=False)
    cpu_max = tmp_path / "cpu.max"
    monkeypatch.setattr(round_channel, "CGROUP_CPU_MAX", str(cpu_max))
    return cpu_max.write_text


def test_no_limit_counts_the_cpus(eight_cpus):
    assert round_channel.spin_wait_default(on_accelerator=True)  # no cpu.max at all (no cgroup v2)
    eight_cpus("max 100000\n")
    assert round_channel.spin_wait_default(on_accelerator=True)
    assert not round_channel.spin_wait_default(on_accelerator=False)  # the cores compute the model


@pytest.mark.parametrize("cpu_max, spins", [("50000 100000\n", False), ("350000 100000\n", False),
                                            ("400000 100000\n", True), ("1600000 100000\n", True)])
def test_a_container_limit_below_four_cores_turns_it_off(eight_cpus, cpu_max, spins):
    eight_cpus(cpu_max)
    assert round_channel.cgroup_cpu_quota(round_channel.CGROUP_CPU_MAX) == pytest.approx(
        int(cpu_max.split()[0]) / 100000)
    assert round_channel.spin_wait_default(on_accelerator=True) is spins


def test_an_unreadable_quota_is_no_limit(eight_cpus):
    eight_cpus("garbage\n")
    assert round_channel.cgroup_cpu_quota(round_channel.CGROUP_CPU_MAX) is None
    assert round_channel.spin_wait_default(on_accelerator=True)
