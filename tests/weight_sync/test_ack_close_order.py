"""The sender's wait for acknowledgements when a receiver acknowledges and closes the group
while another receiver still owes its acknowledgement (the race behind the two-receiver
tests' rare failures, made deterministic here: the close is injected between the sender's
poll of the acknowledgements and its liveness check of the receivers)."""

from __future__ import annotations

import pytest

from portarl.rollout.weight_sync import PeerLost, SyncGroup
from portarl.rollout.weight_sync.protocol import wait_for_acknowledgements

ROUND, VERSION = 3, 7


@pytest.fixture
def group():
    """A sender (rank 0, hosting the store) and two receivers, in this process (each its own
    store connection, as separate processes have); no communicator is needed."""
    sender = SyncGroup("127.0.0.1", 0, 0, 3, timeout_s=60)
    receivers = {r: SyncGroup("127.0.0.1", sender.port, r, 3, timeout_s=60) for r in (1, 2)}
    try:
        yield sender, receivers
    finally:
        for receiver in receivers.values():
            receiver.close()
        sender.close()


def _acknowledge(receiver: SyncGroup) -> None:
    receiver.store.set(receiver.key("round", ROUND, "ack", receiver.rank), b"1")


def _between_poll_and_check(sender: SyncGroup, monkeypatch, steps) -> list:
    """Run ``steps[i]()`` just before the sender's ``i``-th liveness check (after its poll)."""
    real, calls = sender.check_peers, []

    def check_peers(ranks, what=""):
        calls.append(list(ranks))
        if len(calls) <= len(steps):
            steps[len(calls) - 1]()
        return real(ranks, what)

    monkeypatch.setattr(sender, "check_peers", check_peers)
    return calls


def test_a_receiver_that_acknowledged_then_closed_is_not_lost(group, monkeypatch):
    sender, receivers = group

    def receiver_2_acknowledges_and_closes():
        _acknowledge(receivers[2])
        receivers[2].close()

    calls = _between_poll_and_check(sender, monkeypatch,
                                    [receiver_2_acknowledges_and_closes, lambda: _acknowledge(receivers[1])])
    wait_for_acknowledgements(sender, ROUND, VERSION)
    assert calls[:2] == [[1, 2], [1]], calls  # rank 2 was closed at the first check, and not reported


def test_a_receiver_that_closed_without_acknowledging_is_lost(group, monkeypatch):
    sender, receivers = group

    def receiver_1_acknowledges_receiver_2_closes():
        _acknowledge(receivers[1])
        receivers[2].close()

    _between_poll_and_check(sender, monkeypatch, [receiver_1_acknowledges_receiver_2_closes])
    with pytest.raises(PeerLost, match=f"rank 2 closed the group .*acknowledgements of version {VERSION}") as err:
        wait_for_acknowledgements(sender, ROUND, VERSION)
    assert err.value.rank == 2


def test_a_transfer_that_fails_with_its_lost_sender_is_the_loss_not_the_transport_error(group, monkeypatch):
    """A receiver inside a bucket's transfer when the sender dies: the liveness check finds
    the sender gone, and the re-poll of the transfer (it may have completed just before)
    raises the transport's own error (Gloo's "Connection reset by peer"). The wait reports
    the lost peer, so the receiver refuses the version and keeps the previous one, instead
    of failing with the transport error (seen once the SIGKILL test's timer became a gate)."""
    _, receivers = group
    receiver = receivers[1]
    polls = []

    def transfer_done():
        polls.append(1)
        if len(polls) == 1:
            return None  # still on the wire at the first poll
        raise RuntimeError("pair.cc:537] Read error: Connection reset by peer")

    def sender_gone(ranks, what=""):
        raise PeerLost(f"weight sync: the sender's process is gone (while waiting for {what})", 0)

    monkeypatch.setattr(receiver, "check_peers", sender_gone)
    with pytest.raises(PeerLost, match="the sender's process is gone"):
        receiver.wait_until(transfer_done, [0], "the transfer of bucket 0 of version 2")
    assert len(polls) == 2
