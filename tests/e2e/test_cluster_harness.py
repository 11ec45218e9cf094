"""The end-to-end harness itself: a group start in which one service fails still leaves every service it did start
in the cluster, so the fixture's stop() ends them (a failed start once left three coordinators running past the
suite)."""

import pytest

from cluster import Cluster


def test_a_failed_start_keeps_the_started_services_for_stop(tiny_pair):
    cluster = Cluster()
    local = ["--host", "127.0.0.1", "--port", "0", "--metrics-port", "-1"]
    try:
        with pytest.raises(RuntimeError, match="exited with 1 before listening"):
            cluster.start({"up": ["target", "--model", str(tiny_pair["target"]), "--dtype", "float64",
                                  "--num-kv-blocks", "16", *local],
                           "refused": ["coordinator", "--target", "127.0.0.1:1", *local, "--max-num-seqs", "0"]})
        assert list(cluster.processes) == ["up"] and cluster.processes["up"].poll() is None
    finally:
        cluster.stop()
    assert cluster.processes["up"].poll() is not None
