"""Heals that trust only the run: torchft's checkpoint transport (its `checkpoint_transport` argument) replaced by one
of our own that carries tensors and JSON, never a pickle, and that a peer must open with proof of the run's token.

torchft's PGTransport sends a healing replica the pickled layout of the state and unpickles whatever its peer sends,
so anything that can register a replica with the lighthouse and claim to be ahead runs code in every replica that
heals from it. Here:
  - the run's token: 32 random bytes in OUT/run.token, written with mode 0600 by mecefo.launch (also --prepare) and
    read by every replica (one readable by others is refused); a rerun keeps it;
  - the handshake, over the quorum's process group (the same sockets PGTransport uses), before any byte of the state:
      receiver -> sender  nonce_r (32 random bytes)
      sender -> receiver  nonce_s, HMAC-SHA256(token, "send" | nonce_r | step)      the receiver checks it: a peer
                          without the token is refused here, before anything else it sends is read
      receiver -> sender  HMAC-SHA256(token, "recv" | nonce_s | step)               the sender checks it: nothing of
                          the state goes to a peer without the token
    The token itself never travels; a nonce is never reused, so a recorded handshake cannot be replayed;
  - the state: its length, then one JSON document (the tree of dicts, lists, tuples, numbers, strings and None, each
    tensor a reference to its dtype and shape; non-finite floats named), then each tensor's bytes, received into a
    buffer of exactly the size the document gives. Decoding accepts those forms only.
What stays open (README, "Threat model"): the lighthouse, the manager servers and the stores accept anyone (denial of
service), and a peer holding the token is trusted.
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
        tmp = path.with_name(f".{TOKEN}.{os.getpid()}")
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
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
        raise UsageError(f"{path} is readable by others (mode {stat.S_IMODE(mode):o}): chmod 600 {path}")
    try:
        token = bytes.fromhex(text)
    except ValueError:
        token = b""
    if len(token) != 32:
        raise UsageError(f"{path} does not hold a token (64 hex digits); delete it and run mecefo.launch --prepare")
    return token


def _mac(token: bytes, what: bytes, nonce: bytes, step: int) -> bytes:
    return hmac.new(token, what + nonce + int(step).to_bytes(8, "little", signed=True), hashlib.sha256).digest()


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

    def __init__(self, pg, timeout: timedelta, device: torch.device, token: bytes, log=print):
        self._pg, self._timeout, self._device, self._token, self._log = pg, timeout, device, token, log

    def metadata(self) -> str:
        return "mecefo-heal"  # (what the peer's manager server answers; not read: everything goes over the pg)

    def disallow_checkpoint(self) -> None:
        pass

    def shutdown(self, wait: bool = True) -> None:
        pass

    def _send(self, t: torch.Tensor, dst: int, tag: int):
        return self._pg.send([t.to(self._device)], dst, tag)

    def _recv(self, nbytes: int, src: int, tag: int) -> torch.Tensor:
        buf = torch.empty(nbytes, dtype=torch.uint8, device=self._device)
        self._pg.recv([buf], src, tag).wait(self._timeout)
        return buf.cpu()

    def send_checkpoint(self, dst_ranks: list[int], step: int, state_dict, timeout: timedelta) -> None:
        """To each peer that proves the run's token: the state's JSON document, then its tensors."""
        tensors: list[torch.Tensor] = []
        header = json.dumps({"step": step, "tree": encode(state_dict, tensors),
                             "tensors": [_layout(t) for t in tensors]}).encode()
        trusted = []
        for dst in dst_ranks:  # the handshake with each, before anything of the state leaves
            nonce_r = bytes(self._recv(NONCE_BYTES, dst, 1).numpy())
            nonce_s = secrets.token_bytes(NONCE_BYTES)
            proof = torch.frombuffer(bytearray(nonce_s + _mac(self._token, b"send", nonce_r, step)), dtype=torch.uint8)
            self._send(proof, dst, 2).wait(timeout)
            answer = bytes(self._recv(MAC_BYTES, dst, 3).numpy())
            if hmac.compare_digest(answer, _mac(self._token, b"recv", nonce_s, step)):
                trusted.append(dst)
            else:
                self._log(f"heal: replica rank {dst} of the quorum did not prove the run's token; nothing sent to it")
        work = []
        length = _as_bytes(torch.tensor([len(header)], dtype=torch.int64))
        body = torch.frombuffer(bytearray(header), dtype=torch.uint8)
        for dst in trusted:
            work += [self._send(length, dst, 4), self._send(body, dst, 5)]
        for i, t in enumerate(tensors):
            if t.numel():
                data = _as_bytes(t)
                work += [self._send(data, dst, 6 + i) for dst in trusted]
                if data.device.type == "cpu":  # (free each copy before the next, as PGTransport does)
                    for w in work:
                        w.wait(timeout)
                    work = []
        for w in work:
            w.wait(timeout)

    def recv_checkpoint(self, src_rank: int, metadata: str, step: int, timeout: timedelta):
        """The state from src_rank, once it has proved the run's token (HealRefused before anything else it sends is
        read, if not)."""
        nonce_r = secrets.token_bytes(NONCE_BYTES)
        try:
            self._send(torch.frombuffer(bytearray(nonce_r), dtype=torch.uint8), src_rank, 1).wait(timeout)
            proof = bytes(self._recv(NONCE_BYTES + MAC_BYTES, src_rank, 2).numpy())
        except RuntimeError as e:  # (a peer that speaks another protocol: torchft's PGTransport sends a pickle's length)
            first = str(e).strip().splitlines()[0][:160] if str(e).strip() else type(e).__name__
            raise HealRefused(f"the peer healing this replica (quorum rank {src_rank}) did not answer the run's handshake "
                              f"({first}): refused before anything it sent was read") from None
        nonce_s, mac = proof[:NONCE_BYTES], proof[NONCE_BYTES:]
        if not hmac.compare_digest(mac, _mac(self._token, b"send", nonce_r, step)):
            raise HealRefused(f"the peer healing this replica (quorum rank {src_rank}) did not prove the run's token: "
                              "refused before anything it sent was read")
        answer = torch.frombuffer(bytearray(_mac(self._token, b"recv", nonce_s, step)), dtype=torch.uint8)
        self._send(answer, src_rank, 3).wait(timeout)
        length = int(self._recv(8, src_rank, 4).view(torch.int64).item())
        if not 0 < length <= MAX_HEADER_BYTES:
            raise HealRefused(f"a heal's document of {length} bytes")
        try:
            header = json.loads(bytes(self._recv(length, src_rank, 5).numpy()))
            layouts = header["tensors"]
            shapes = [(DTYPES[x["dtype"]], [int(n) for n in x["shape"]]) for x in layouts]
            if any(n < 0 for _, shape in shapes for n in shape):
                raise ValueError("a negative size")
        except (ValueError, KeyError, TypeError) as e:
            raise HealRefused(f"a heal's document is not one ({type(e).__name__})") from None
        if header.get("step") != step:
            raise HealRefused(f"a heal of step {header.get('step')} where step {step} was asked for")
        tensors = []
        for i, (dtype, shape) in enumerate(shapes):
            t = torch.empty(shape, dtype=dtype)
            if t.numel():
                t = self._recv(t.numel() * t.element_size(), src_rank, 6 + i).view(dtype).reshape(shape)
            tensors.append(t)
        return decode(header["tree"], tensors)
