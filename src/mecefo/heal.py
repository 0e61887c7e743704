"""Heals that trust only the run: torchft's checkpoint transport (its `checkpoint_transport` argument) replaced by one
of our own that carries tensors and JSON, never a pickle, and that a peer must open with proof of the run's token.

torchft's PGTransport sends a healing replica the pickled layout of the state and unpickles whatever its peer sends,
so anything that can register a replica with the lighthouse and claim to be ahead runs code in every replica that
heals from it. Here:
  - the run's token: 32 random bytes in OUT/run.token, written with mode 0600 by mecefo.launch (also --prepare) and
    read by every replica (one readable by others is refused); a rerun keeps it;
  - the handshake, over the quorum's process group (the same sockets PGTransport uses), before any byte of the state;
    every MAC binds the quorum (its session: the process group's identity, the same in every member), the sender's
    and the receiver's ranks in it and the step, so that a proof made for one pair cannot be relayed to another:
      receiver -> sender  nonce_r (32 random bytes)
      sender -> receiver  nonce_s, HMAC-SHA256(token, "send" | session | src | dst | step | nonce_r)   the receiver
                          checks it: a peer without the token is refused here, before anything else it sends is read
      receiver -> sender  HMAC-SHA256(token, "recv" | session | src | dst | step | nonce_s)   the sender checks it:
                          nothing of the state goes to a peer without the token
    The token itself never travels; nonces are fresh, so a recorded handshake cannot be replayed;
  - the state: its length and HMAC-SHA256(K, document) with the session key K = HMAC-SHA256(token, "key" | session |
    src | dst | step | nonce_r | nonce_s), then the document, checked against that MAC before it is parsed: one JSON
    document (the tree of dicts, lists, tuples, numbers, strings and None, each tensor a reference to its dtype and
    shape; non-finite floats named), then each tensor's bytes, received into a buffer of exactly the size the
    document gives. Decoding accepts those forms only.
What stays open (docs/gpus.md, "Threat model"): the lighthouse, the manager servers and the stores accept anyone (denial of
service); a peer holding the token is trusted; the tensors' bytes follow the authenticated document on the same
connection without a MAC of their own (one who can inject into an established connection between two replicas is
outside this model).
"""

from __future__ import annotations

import hashlib
import hmac
import json
import math
import numbers
import os
import secrets
import stat
from datetime import timedelta
from pathlib import Path

import torch

from .errors import UsageError

TOKEN = "run.token"  # in the run folder
NONCE_BYTES = MAC_BYTES = 32
MAX_HEADER_BYTES = 1 << 28  # the JSON document of a heal (a 7B model's layout is a few MB)
DTYPES = {str(d).removeprefix("torch."): d for d in (
    torch.float64, torch.float32, torch.float16, torch.bfloat16, torch.int64, torch.int32, torch.int16, torch.int8,
    torch.uint8, torch.bool, torch.complex64, torch.complex128)}


class HealRefused(RuntimeError):
    """A heal refused: the peer did not prove the run's token, or sent something that is not a heal."""


# ------------------------------------------------------------------ the token

def ensure_token(out: Path) -> Path:
    """OUT/run.token: created (32 random bytes, hex, mode 0600) if absent, kept if present (a resume, a rerun)."""
    path = Path(out) / TOKEN
    if not path.exists():
        tmp = path.with_name(f".{TOKEN}.{os.getpid()}.{secrets.token_hex(4)}")
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600)  # (a new file: mode 0600)
        with os.fdopen(fd, "w") as f:
            f.write(secrets.token_hex(32) + "\n")
        os.replace(tmp, path)
    read_token(out)  # (refuses one readable by others)
    return path


def read_token(out: Path) -> bytes:
    """The run's token, or a one-line UsageError: missing (started without mecefo.launch or --prepare), readable by
    others than its owner, or not 32 bytes of hex."""
    path = Path(out) / TOKEN
    try:
        mode = path.stat().st_mode
        text = path.read_text().strip()
    except OSError:
        raise UsageError(f"{path} is missing: replicas start after `python -m mecefo.launch` or its --prepare, "
                         "which write it") from None
    if mode & (stat.S_IRWXG | stat.S_IRWXO):
        raise UsageError(f"{path} is readable by others (mode {stat.S_IMODE(mode):o}), so no longer the run's secret: "
                         "delete it and run mecefo.launch (or its --prepare) again, which writes a new one")
    try:
        token = bytes.fromhex(text)
    except ValueError:
        token = b""
    if len(token) != 32:
        raise UsageError(f"{path} does not hold a token (64 hex digits); delete it and run mecefo.launch --prepare")
    return token


def _mac(key: bytes, what: str, session: str, src: int, dst: int, step: int, *nonces: bytes) -> bytes:
    head = f"mecefo-heal|{what}|{session}|{src}|{dst}|{step}|".encode()
    return hmac.new(key, head + b"".join(nonces), hashlib.sha256).digest()


# ------------------------------------------------------------------ the state as JSON and tensors

def encode(tree, tensors: list[torch.Tensor]):
    """tree as JSON-able data, its tensors appended to `tensors` (each {"T": index}); dict keys may be any encodable
    value (the optimizer's are ints). Anything but tensors and plain data is refused (TypeError)."""
    if tree is None or isinstance(tree, (bool, str)):
        return tree
    if isinstance(tree, numbers.Integral):
        return int(tree)
    if isinstance(tree, numbers.Real):
        return float(tree) if math.isfinite(tree) else {"f": repr(float(tree))}
    if torch.is_tensor(tree):
        if type(tree) is not torch.Tensor:
            raise TypeError(f"a heal carries plain tensors, not {type(tree).__name__}")
        tensors.append(tree)
        return {"T": len(tensors) - 1}
    if isinstance(tree, dict):
        return {"d": [[encode(k, tensors), encode(v, tensors)] for k, v in tree.items()]}
    if isinstance(tree, tuple):
        return {"t": [encode(v, tensors) for v in tree]}
    if isinstance(tree, list):
        return {"l": [encode(v, tensors) for v in tree]}
    raise TypeError(f"a heal carries tensors and plain data only, not {type(tree).__name__}")


def decode(tree, tensors: list[torch.Tensor]):
    """encode's inverse, accepting its forms only (HealRefused otherwise)."""
    if tree is None or isinstance(tree, (bool, int, float, str)):
        return tree
    if isinstance(tree, dict) and len(tree) == 1:
        (kind, value), = tree.items()
        if kind == "T" and isinstance(value, int) and 0 <= value < len(tensors):
            return tensors[value]
        if kind == "f" and value in ("nan", "inf", "-inf"):
            return float(value)
        if kind in ("l", "t") and isinstance(value, list):
            items = [decode(v, tensors) for v in value]
            return items if kind == "l" else tuple(items)
        if kind == "d" and isinstance(value, list) and all(isinstance(kv, list) and len(kv) == 2 for kv in value):
            out = {}
            for k, v in value:
                key = decode(k, tensors)
                if isinstance(key, (dict, list)):
                    raise HealRefused("a heal's dict key is not hashable")
                out[key] = decode(v, tensors)
            return out
    raise HealRefused(f"a heal holds an unknown form ({str(tree)[:60]})")


def _layout(t: torch.Tensor) -> dict:
    return {"dtype": str(t.dtype).removeprefix("torch."), "shape": list(t.shape)}


def _as_bytes(t: torch.Tensor) -> torch.Tensor:
    return t.detach().contiguous().reshape(-1).view(torch.uint8)


# ------------------------------------------------------------------ the transport

class HealTransport:
    """torchft's CheckpointTransport (torchft.checkpointing.transport: metadata, send_checkpoint, disallow_checkpoint,
    recv_checkpoint, shutdown; not subclassed, so that importing this module does not import torchft; a test checks
    that every abstract method is here) over the quorum's process group (pg: torchft's, reconfigured at each quorum),
    with the handshake and the JSON-and-tensors format above (the module's docstring)."""

    def __init__(self, pg, timeout: timedelta, device: torch.device, token: bytes, identity, log=print):
        """identity() -> (session, rank): the quorum's identity, the same in every member of its process group, and
        this replica's rank in it (mecefo.liveness's process group records both at each configure)."""
        self._pg, self._timeout, self._device, self._token, self._log = pg, timeout, device, token, log
        self._identity, self._held = identity, []

    def metadata(self) -> str:
        return "mecefo-heal"  # (what the peer's manager server answers; not read: everything goes over the pg)

    def disallow_checkpoint(self) -> None:
        pass

    def shutdown(self, wait: bool = True) -> None:
        pass

    def _send(self, t: torch.Tensor, dst: int, tag: int):
        t = t.to(self._device)
        self._held.append(t)  # (alive until the send's work is waited for: send_checkpoint's end)
        return self._pg.send([t], dst, tag)

    def _recv(self, nbytes: int, src: int, tag: int, host: bool = True) -> torch.Tensor:
        """nbytes from src (host: brought to the CPU, where the handshake and the document are read)."""
        buf = torch.empty(nbytes, dtype=torch.uint8, device=self._device)
        self._pg.recv([buf], src, tag).wait(self._timeout)
        return buf.cpu() if host else buf

    def send_checkpoint(self, dst_ranks: list[int], step: int, state_dict, timeout: timedelta) -> None:
        """To each peer that proves the run's token: the state's JSON document, then its tensors."""
        tensors: list[torch.Tensor] = []
        header = json.dumps({"step": step, "tree": encode(state_dict, tensors),
                             "tensors": [_layout(t) for t in tensors]}).encode()
        session, me = self._identity()
        keys = {}
        for dst in dst_ranks:  # the handshake with each, before anything of the state leaves
            nonce_r = bytes(self._recv(NONCE_BYTES, dst, 1).numpy())
            nonce_s = secrets.token_bytes(NONCE_BYTES)
            proof = nonce_s + _mac(self._token, "send", session, me, dst, step, nonce_r)
            self._send(torch.frombuffer(bytearray(proof), dtype=torch.uint8), dst, 2).wait(timeout)
            answer = bytes(self._recv(MAC_BYTES, dst, 3).numpy())
            if hmac.compare_digest(answer, _mac(self._token, "recv", session, me, dst, step, nonce_s)):
                keys[dst] = _mac(self._token, "key", session, me, dst, step, nonce_r, nonce_s)
            else:
                self._log(f"heal: replica rank {dst} of the quorum did not prove the run's token; nothing sent to it")
        work = []
        length = bytes(_as_bytes(torch.tensor([len(header)], dtype=torch.int64)).numpy())
        body = torch.frombuffer(bytearray(header), dtype=torch.uint8)
        for dst, key in keys.items():
            sealed = length + hmac.new(key, header, hashlib.sha256).digest()
            work += [self._send(torch.frombuffer(bytearray(sealed), dtype=torch.uint8), dst, 4), self._send(body, dst, 5)]
        trusted = list(keys)
        for i, t in enumerate(tensors):
            if t.numel():
                data = _as_bytes(t)
                work += [self._send(data, dst, 6 + i) for dst in trusted]
                if data.device.type == "cpu":  # (free each copy before the next, as PGTransport does)
                    for w in work:
                        w.wait(timeout)
                    work, self._held = [], []
        for w in work:
            w.wait(timeout)
        self._held = []

    def recv_checkpoint(self, src_rank: int, metadata: str, step: int, timeout: timedelta):
        """The state from src_rank, once it has proved the run's token (HealRefused before anything else it sends is
        read, if not)."""
        session, me = self._identity()
        self._held = []
        nonce_r = secrets.token_bytes(NONCE_BYTES)
        try:
            self._send(torch.frombuffer(bytearray(nonce_r), dtype=torch.uint8), src_rank, 1).wait(timeout)
            proof = bytes(self._recv(NONCE_BYTES + MAC_BYTES, src_rank, 2).numpy())
        except RuntimeError as e:  # (a peer that speaks another protocol: torchft's PGTransport sends a pickle's length)
            first = str(e).strip().splitlines()[0][:160] if str(e).strip() else type(e).__name__
            raise HealRefused(f"the peer healing this replica (quorum rank {src_rank}) did not answer the run's handshake "
                              f"({first}): refused before anything it sent was read") from None
        nonce_s, mac = proof[:NONCE_BYTES], proof[NONCE_BYTES:]
        if not hmac.compare_digest(mac, _mac(self._token, "send", session, src_rank, me, step, nonce_r)):
            raise HealRefused(f"the peer healing this replica (quorum rank {src_rank}) did not prove the run's token: "
                              "refused before anything it sent was read")
        key = _mac(self._token, "key", session, src_rank, me, step, nonce_r, nonce_s)
        answer = torch.frombuffer(bytearray(_mac(self._token, "recv", session, src_rank, me, step, nonce_s)),
                                  dtype=torch.uint8)
        self._send(answer, src_rank, 3).wait(timeout)
        sealed = bytes(self._recv(8 + MAC_BYTES, src_rank, 4).numpy())
        length = int.from_bytes(sealed[:8], "little", signed=True)
        if not 0 < length <= MAX_HEADER_BYTES:
            raise HealRefused(f"a heal's document of {length} bytes")
        document = bytes(self._recv(length, src_rank, 5).numpy())
        if not hmac.compare_digest(sealed[8:], hmac.new(key, document, hashlib.sha256).digest()):
            raise HealRefused(f"a heal's document from quorum rank {src_rank} does not match its MAC: refused unread")
        try:
            header = json.loads(document)
            layouts = header["tensors"]
            shapes = [(DTYPES[x["dtype"]], [int(n) for n in x["shape"]]) for x in layouts]
            if any(n < 0 for _, shape in shapes for n in shape):
                raise ValueError("a negative size")
        except (ValueError, KeyError, TypeError, RecursionError) as e:
            raise HealRefused(f"a heal's document is not one ({type(e).__name__})") from None
        if header.get("step") != step:
            raise HealRefused(f"a heal of step {header.get('step')} where step {step} was asked for")
        tensors = []
        for i, (dtype, shape) in enumerate(shapes):
            nbytes = math.prod(shape) * dtype.itemsize
            if nbytes:  # (kept on the device the transport receives on: no copy through the host)
                tensors.append(self._recv(nbytes, src_rank, 6 + i, host=False).view(dtype).reshape(shape))
            else:
                tensors.append(torch.empty(shape, dtype=dtype, device=self._device))
        try:
            return decode(header["tree"], tensors)
        except RecursionError:
            raise HealRefused("a heal's document nests deeper than Python can decode") from None
