"""The command channel of a tensor-parallel replica (runtime/tensor_parallel_commands.py), rank 0 and its followers
as threads of this process meeting on a real TCP store: commands arrive in order and intact on every follower (a
step's inputs as raw bytes, its shape defined once; a pickled command larger than a socket's buffer), on both
channels; and a lost peer is reported at once on either side, never a hang."""

import datetime
import socket
import threading

import numpy as np
import pytest
import torch.distributed as dist

from specsplit.services.runtime import tensor_parallel_commands as commands
from specsplit.services.runtime.tensor_parallel_commands import CommandChannelClosed, open_command_channel
from specsplit.services.target.verify_steps import VerifyShape
from specsplit.services.sampling.logits_processing import SamplingFlags


def open_channels(kind: str, world_size: int, poll: bool = False, before_followers=None) -> list:
    """Every rank's end, opened as a replica's ranks do: rank 0 first, then (after `before_followers(store)`, if
    given) the others."""
    store = dist.TCPStore("127.0.0.1", 0, world_size, True, timeout=datetime.timedelta(seconds=60),
                          wait_for_workers=False)
    channels: list = [None] * world_size

    def open_rank(rank):
        rank_store = store if rank == 0 else dist.TCPStore("127.0.0.1", store.port, world_size, False,
                                                           timeout=datetime.timedelta(seconds=60))
        channels[rank] = open_command_channel(rank, world_size, rank_store, poll, kind)

    driver = threading.Thread(target=open_rank, args=(0,))
    driver.start()
    if before_followers is not None:
        before_followers(store)
    threads = [driver] + [threading.Thread(target=open_rank, args=(r,)) for r in range(1, world_size)]
    for t in threads[1:]:
        t.start()
    for t in threads:
        t.join(timeout=60)
    assert all(c is not None for c in channels)
    channels[0].store = store  # keep the store alive with the channels
    return channels


def shape(width: int) -> VerifyShape:
    return VerifyShape(width=width, steps=width - 1, support=1, greedy=True, sampling=SamplingFlags(False, False, True),
                       logprobs=False, synthetic=None, max_context=256)


@pytest.mark.parametrize("kind, poll", [("socket", True), ("socket", False), ("gloo", False)])
def test_every_follower_gets_every_command_in_order(kind, poll):
    channels = open_channels(kind, 3, poll)
    big = list(range(300_000))  # pickled, larger than a socket's buffer: the sender blocks until it is read
    steps = [np.arange(n, n + 40, dtype=np.int64) for n in range(5)]
    sent = [("forward", big), *[("step", "verify", shape(1 + i % 2), 8, host, 8) for i, host in enumerate(steps)],
            ("tables", ("grow",)), ("stop",)]
    received: dict[int, list] = {1: [], 2: []}

    def follow(rank):
        while True:
            command = channels[rank].receive()
            received[rank].append(command)
            if command[0] == "stop":
                return

    threads = [threading.Thread(target=follow, args=(r,)) for r in (1, 2)]
    for t in threads:
        t.start()
    for command in sent:
        if command[0] == "step":
            channels[0].send_step(*command[1:])
        else:
            channels[0].send(command)
    for t in threads:
        t.join(timeout=60)
    for rank in (1, 2):
        got = received[rank]
        assert [c[0] for c in got] == [c[0] for c in sent]
        assert got[0] == sent[0]
        for want, have in zip(sent[1:6], got[1:6]):
            assert have[1:4] == want[1:4] and have[5] == want[5]  # program, shape, rows, bucket
            assert have[4].dtype == np.int64 and np.array_equal(have[4], want[4])
        assert got[6:] == sent[6:]
    if kind == "socket":  # two shapes: each defined once, then named by number
        assert len(channels[0]._defined) == 2 and len(channels[1]._definitions) == 2
    for channel in channels:
        channel.close()


def test_eager_steps_carry_their_shape_and_keep_no_definitions():
    """Without graphs a step's shape follows the exact context (a new one every decode step): each travels with its
    step and neither end keeps it, so a long-lived eager replica does not grow."""
    driver, follower = open_channels("socket", 2)
    shapes = [VerifyShape(width=2, steps=1, support=1, greedy=True, sampling=SamplingFlags(False, False, True),
                          logprobs=False, synthetic=None, max_context=context) for context in range(10, 40)]
    received = []
    thread = threading.Thread(target=lambda: received.extend(follower.receive() for _ in shapes))
    thread.start()
    for context, step_shape in enumerate(shapes):
        driver.send_step("verify", step_shape, 1, np.full(6, context, dtype=np.int64), None)
    thread.join(timeout=60)
    assert [c[2] for c in received] == shapes and [c[5] for c in received] == [None] * len(shapes)
    assert [int(c[4][0]) for c in received] == list(range(len(shapes)))
    assert len(driver._defined) == 0 and len(follower._definitions) == 1
    driver.close()
    follower.close()


def test_only_the_replicas_followers_join(monkeypatch):
    """Before the real followers: a connection that says nothing, one with a wrong token claiming rank 1, and ones
    with the right token claiming rank 0 or 3 of a 3-rank replica. All are turned away; the real ranks join and get
    the commands."""
    monkeypatch.setattr(commands, "JOIN_READ_TIMEOUT_SECONDS", 0.5)
    strangers = []

    def connect_strangers(store):
        watcher = dist.TCPStore("127.0.0.1", store.port, 3, False, timeout=datetime.timedelta(seconds=60))
        shared = dist.PrefixStore("commands", watcher)  # (a store client is not shared between threads)
        path = shared.get("address").decode()[len("unix:"):]
        token = shared.get("token")
        for join in (b"", commands._JOIN.pack(1, bytes(16)), commands._JOIN.pack(0, token),
                     commands._JOIN.pack(3, token)):
            stranger = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            stranger.connect(path)
            stranger.sendall(join)
            strangers.append(stranger)

    channels = open_channels("socket", 3, before_followers=connect_strangers)
    assert sorted(channels[0].peers) == [1, 2]
    channels[0].send(("tables", ("grow",)))
    assert channels[1].receive() == channels[2].receive() == ("tables", ("grow",))
    for stranger in strangers:
        stranger.settimeout(30)
        assert stranger.recv(1) == b""  # closed by rank 0, never sent a command
        stranger.close()
    for channel in channels:
        channel.close()


def test_a_lost_follower_fails_rank_zeros_next_send():
    driver, follower = open_channels("socket", 2)
    follower.close()
    with pytest.raises(CommandChannelClosed, match="rank 1"):
        for _ in range(100):  # the first writes may land in the socket's buffer before the close is seen
            driver.send(("tables", ("grow",)))
    driver.close()


def test_a_lost_driver_ends_a_followers_wait():
    driver, follower = open_channels("socket", 2, poll=True)
    errors = []

    def wait():
        try:
            follower.receive()
        except CommandChannelClosed as error:
            errors.append(error)

    thread = threading.Thread(target=wait)
    thread.start()
    driver.close()
    thread.join(timeout=30)
    assert not thread.is_alive() and errors and "rank 0" in str(errors[0])
    follower.close()
