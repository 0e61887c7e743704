"""mecefo.heal: heals carry tensors and JSON, never a pickle, and only between peers that prove the run's token.

Two replicas are two threads, each with its own gloo process group over one TCPStore (the sockets a heal uses
between replica processes); the fake peers are a sender without the token, and torchft's own PGTransport sending a
pickle that would run code."""

import os
import pickle
import stat
import threading
from datetime import timedelta

import pytest
import torch
import torch.distributed as dist

from mecefo import heal
from mecefo.errors import UsageError

pytestmark = pytest.mark.filterwarnings("ignore:The given buffer is not writable")  # (torchft's PGTransport, the fake peer)
TIMEOUT = timedelta(seconds=5)


class Recording:
    """A process group that records the tags it sends and receives on."""

    def __init__(self, pg):
        self.pg, self.sent, self.received = pg, [], []

    def send(self, tensors, dst, tag):
        self.sent.append((dst, tag))
        return self.pg.send(tensors, dst, tag)

    def recv(self, tensors, src, tag):
        self.received.append((src, tag))
        return self.pg.recv(tensors, src, tag)


@pytest.fixture
def pair(monkeypatch) -> list[Recording]:
    """Two replicas' process groups: torchft's gloo group (what a replica heals over), configured as one group of 2
    in two threads (their rendezvous), on the loopback (as the launcher pins gloo)."""
    from torchft import ProcessGroupGloo

    monkeypatch.setenv("GLOO_SOCKET_IFNAME", "lo")
    store = dist.TCPStore("127.0.0.1", 0, 2, is_master=True, wait_for_workers=False)
    pgs = [ProcessGroupGloo(timeout=TIMEOUT) for _ in range(2)]
    threads = [threading.Thread(target=pgs[r].configure, args=(f"127.0.0.1:{store.port}/heal", f"r{r}", r, 2))
               for r in (0, 1)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    yield [Recording(pg) for pg in pgs]
    for pg in pgs:
        pg.abort()


def _transport(pg, rank: int, token: bytes, session: str = "quorum 3", timeout=TIMEOUT, log=print):
    return heal.HealTransport(pg, timeout, torch.device("cpu"), token, identity=lambda: (session, rank), log=log)


def _exchange(send, recv) -> dict:
    """send() in one thread, recv() in this one; the receiver's result or exception, and the sender's."""
    found = {}

    def sender():
        try:
            send()
        except Exception as e:  # (a refused peer's sends fail when the receiver stops reading)
            found["send_error"] = e

    t = threading.Thread(target=sender)
    t.start()
    try:
        found["state"] = recv()
    except Exception as e:
        found["recv_error"] = e
    t.join(timeout=30)
    return found


def _state() -> dict:
    """A heal's state as mecefo.ft sends it: a model's and AdamW's (int keys, tuples, bools, None), the low-rank
    subspaces ((tensor, epoch) tuples), counters with a non-finite float, torchft's own."""
    model = torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.Linear(3, 2))
    optimizer = torch.optim.AdamW(model.parameters())
    model(torch.ones(5, 4)).sum().backward()
    optimizer.step()
    return {"user": {"default": {"model": model.state_dict(), "optimizer": optimizer.state_dict(),
                                 "lowrank": {"steps": 3, "bases": {"0.weight": (torch.randn(4, 2), 1)}},
                                 "progress": {"wall_time_s": 1.5, "last_loss": float("nan"), "furthest": 7},
                                 "flags": torch.tensor([True, False]), "empty": torch.zeros(0, 3)}},
            "torchft": {"step": 7, "batches_committed": 14}}


def _same(a, b) -> bool:
    if torch.is_tensor(a):
        return torch.is_tensor(b) and a.dtype == b.dtype and a.shape == b.shape and torch.equal(a, b)
    if isinstance(a, dict):
        return isinstance(b, dict) and list(a) == list(b) and all(_same(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)):
        return type(a) is type(b) and len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b))
    if isinstance(a, float) and a != a:
        return isinstance(b, float) and b != b
    return type(a) is type(b) and a == b


def test_a_heal_between_peers_with_the_runs_token_carries_the_whole_state(pair, monkeypatch):
    """The state arrives equal (dtypes, shapes, int keys, tuples, NaN), and nothing is unpickled on either side."""
    unpickled = []
    monkeypatch.setattr(pickle, "loads", lambda *a, **k: unpickled.append(1))
    token = os.urandom(32)
    a, b = pair
    state = _state()
    sender, receiver = _transport(a, 0, token), _transport(b, 1, token)
    found = _exchange(lambda: sender.send_checkpoint([1], 7, state, TIMEOUT),
                      lambda: receiver.recv_checkpoint(0, sender.metadata(), 7, TIMEOUT))
    assert "recv_error" not in found and "send_error" not in found, found
    assert _same(state, found["state"]) and not unpickled


def test_a_peer_without_the_runs_token_is_refused_before_anything_it_sends_is_read(pair):
    """A sender with another token: the receiver reads its fixed-size proof only, refuses it (HealRefused, one line),
    and never asks for the state's document or tensors (tags 4 and up)."""
    a, b = pair
    sender, receiver = _transport(a, 0, os.urandom(32)), _transport(b, 1, os.urandom(32))
    found = _exchange(lambda: sender.send_checkpoint([1], 7, _state(), TIMEOUT),
                      lambda: receiver.recv_checkpoint(0, "", 7, TIMEOUT))
    assert isinstance(found.get("recv_error"), heal.HealRefused)
    assert "did not prove the run's token" in str(found["recv_error"]) and "\n" not in str(found["recv_error"])
    assert [tag for _, tag in b.received] == [2]  # the proof, nothing after it


def test_a_receiver_without_the_runs_token_gets_nothing_of_the_state(pair):
    """The sender checks the receiver's answer too: to a peer without the token, nothing of the state is sent."""
    a, b = pair
    lines = []
    sender = _transport(a, 0, os.urandom(32), log=lines.append)
    receiver = _transport(b, 1, os.urandom(32), timeout=timedelta(seconds=2))

    def impostor():  # answers the handshake with a MAC of its own token (the sender's proof is not checked here)
        nonce = bytes(32)
        receiver._send(torch.frombuffer(bytearray(nonce), dtype=torch.uint8), 0, 1).wait(TIMEOUT)
        receiver._recv(64, 0, 2)
        receiver._send(torch.zeros(32, dtype=torch.uint8), 0, 3).wait(TIMEOUT)

    t = threading.Thread(target=impostor)
    t.start()
    sender.send_checkpoint([1], 7, _state(), TIMEOUT)
    t.join()
    assert [tag for _, tag in a.sent] == [2] and "did not prove the run's token" in lines[0]


@pytest.mark.parametrize("made_for", [("quorum 4", 0), ("quorum 3", 2)], ids=["another quorum", "another pair"])
def test_a_proof_made_for_another_quorum_or_pair_cannot_be_relayed(pair, made_for):
    """Every MAC binds the quorum's session and the two ranks: a peer with the token whose proof was made for another
    quorum, or for another sender and receiver (as a relay between two impostors would present it), is refused."""
    a, b = pair
    token = os.urandom(32)
    session, rank = made_for
    sender, receiver = _transport(a, rank, token, session=session), _transport(b, 1, token)
    found = _exchange(lambda: sender.send_checkpoint([1], 7, _state(), TIMEOUT),
                      lambda: receiver.recv_checkpoint(0, "", 7, TIMEOUT))
    assert isinstance(found.get("recv_error"), heal.HealRefused) and "did not prove" in str(found["recv_error"])


def test_the_replicas_heal_through_this_transport_not_torchfts_pickle():
    """mecefo.ft gives torchft's Manager this transport: torchft's PGTransport (which unpickles what a peer sends) is
    not used anywhere in the library."""
    import inspect

    from mecefo import ft

    source = inspect.getsource(ft)
    assert "HealTransport(" in source and "PGTransport" not in source.replace("torchft's PGTransport", "")


class _Payload:
    def __reduce__(self):
        return (os.system, ("touch PWNED",))


def test_a_peer_speaking_torchfts_pickle_protocol_is_refused_and_nothing_is_unpickled(pair, tmp_path, monkeypatch):
    """torchft's PGTransport sending a pickle that would run code (its length on tag 1, the pickle on tag 2): the
    receiver's handshake refuses it; pickle.loads is never called and the payload never runs."""
    from torchft.checkpointing.pg_transport import PGTransport

    monkeypatch.chdir(tmp_path)
    unpickled = []
    monkeypatch.setattr(pickle, "loads", lambda *a, **k: unpickled.append(1))
    a, b = pair
    evil = PGTransport(a, timeout=timedelta(seconds=2), device=torch.device("cpu"))
    receiver = _transport(b, 1, os.urandom(32), timeout=timedelta(seconds=2))
    found = _exchange(lambda: evil.send_checkpoint([1], 7, {"x": _Payload()}, timedelta(seconds=2)),
                      lambda: receiver.recv_checkpoint(0, "", 7, timedelta(seconds=2)))
    assert isinstance(found.get("recv_error"), heal.HealRefused) and "state" not in found
    assert "did not answer the run's handshake" in str(found["recv_error"]) and "\n" not in str(found["recv_error"])
    assert not unpickled and not (tmp_path / "PWNED").exists()
    assert all(tag <= 2 for _, tag in b.received)


@pytest.mark.parametrize("bad", [{"T": 3}, {"x": 1}, {"d": [[1]]}, {"f": "1e9"}, {"d": [[{"l": []}, 1]]}])
def test_decode_accepts_encodes_forms_only(bad):
    with pytest.raises(heal.HealRefused):
        heal.decode(bad, [torch.zeros(1)])


def test_encode_refuses_what_is_not_tensors_and_plain_data():
    with pytest.raises(TypeError, match="plain data"):
        heal.encode({"x": _Payload()}, [])


def test_the_runs_token_is_the_owners_alone(tmp_path):
    """Written 0600 once, kept by a rerun; missing, readable by others or malformed: one line."""
    with pytest.raises(UsageError, match="is missing"):
        heal.read_token(tmp_path)
    path = heal.ensure_token(tmp_path)
    assert stat.S_IMODE(path.stat().st_mode) == 0o600 and len(heal.read_token(tmp_path)) == 32
    first = path.read_text()
    heal.ensure_token(tmp_path)
    assert path.read_text() == first
    path.chmod(0o644)
    with pytest.raises(UsageError, match="readable by others"):
        heal.read_token(tmp_path)
    path.chmod(0o600)
    path.write_text("not hex\n")
    with pytest.raises(UsageError, match="does not hold a token"):
        heal.read_token(tmp_path)


def test_the_transport_answers_all_of_torchfts_contract():
    """Every abstract method of torchft's CheckpointTransport (pinned torchft 0.2.0) is here: an upgrade that adds one
    fails this test, not a heal."""
    from torchft.checkpointing.transport import CheckpointTransport

    assert CheckpointTransport.__abstractmethods__ <= set(dir(heal.HealTransport))
    assert {"disallow_checkpoint", "shutdown"} <= set(vars(heal.HealTransport))
