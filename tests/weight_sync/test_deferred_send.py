"""``WeightSender.send(defer=True)`` (the async trainer's send): it returns with the last
bucket on the wire and the acknowledgements owed; :meth:`WeightSender.settle` (the next
send) waits for them. The sender and a receiver run in this process, each with its own
store connection and Gloo rank, as two processes would."""

from __future__ import annotations

import threading

import pytest
import torch

from portarl.rollout.weight_sync import PeerLost, SyncGroup, WeightReceiver, WeightSender


@pytest.fixture
def pair():
    """A connected sender (rank 0) and receiver (rank 1)."""
    sender = SyncGroup("127.0.0.1", 0, 0, 2, timeout_s=60)
    receiver = SyncGroup("127.0.0.1", sender.port, 1, 2, timeout_s=60)
    joined = threading.Thread(target=receiver.connect)
    joined.start()
    try:
        sender.connect()
    finally:
        joined.join()
    try:
        yield sender, receiver
    finally:
        receiver.close()
        sender.close()


def test_a_deferred_version_is_the_callers_tensor_as_it_was_at_send(pair):
    """The receiver takes part only after ``send`` returned and after the caller changed its
    tensor in place (as the trainer's optimizer does): it still gets the bytes of the version
    sent (a one-tensor bucket is otherwise broadcast from the caller's tensor itself)."""
    sender_group, receiver_group = pair
    sender, receiver = WeightSender(sender_group), WeightReceiver(receiver_group, loaded=-1)
    weight = torch.arange(1000, dtype=torch.float32)
    sent = weight.clone()
    sender.send(0, [("w", weight)], defer=True)  # returns: nobody has received anything yet
    assert sender.unsettled == 0
    weight.mul_(-3.0)  # the optimizer step after the publish
    version, tensors, _ = receiver.receive()
    assert version == 0 and torch.equal(tensors["w"], sent)
    sender.settle()
    assert sender.unsettled is None
    sender.send(1, [("w", weight)], defer=True)
    version, tensors, _ = receiver.receive()
    assert version == 1 and torch.equal(tensors["w"], sent * -3.0)
    sender.settle()


def test_the_next_send_reports_a_receiver_that_failed_on_a_deferred_version(pair):
    """A receiver that gives up on a deferred version is reported by the next send (its
    settle), which sends nothing more: the group is closed."""
    sender_group, receiver_group = pair
    sender = WeightSender(sender_group)
    sender.send(0, [("w", torch.ones(10)), ("b", torch.zeros(3))], defer=True)
    receiver_group.fail("the worker could not load version 0")
    with pytest.raises(PeerLost, match="rank 1 gave up: the worker could not load version 0"):
        sender.send(1, [("w", torch.ones(10))], defer=True)
    assert sender_group.closed and sender.version == 0


class _SendsAfterFirstHeaderCheck:
    """The receiver's store connection, with the sender's whole deferred send (header, then
    commit) run right after the receiver's first look for the bucket header: the
    interleaving in which a receiver that looked for the header before the commit missed
    the header and took the commit for a version with no buckets."""

    def __init__(self, store, send):
        self._store, self._send = store, send

    def check(self, keys):
        found = self._store.check(keys)
        if self._send is not None and "/bucket/" in keys[0]:
            send, self._send = self._send, None
            send()
        return found

    def __getattr__(self, name):
        return getattr(self._store, name)


def test_a_commit_posted_right_after_its_header_is_not_taken_for_an_empty_version(pair):
    sender_group, receiver_group = pair
    sender, receiver = WeightSender(sender_group), WeightReceiver(receiver_group, loaded=-1)
    weight = torch.arange(100, dtype=torch.float32)
    receiver_group.store = _SendsAfterFirstHeaderCheck(receiver_group.store,
                                                       lambda: sender.send(0, [("w", weight)], defer=True))
    version, tensors, _ = receiver.receive()
    assert version == 0 and torch.equal(tensors["w"], weight)
    sender.settle()
