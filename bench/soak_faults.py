"""The soak's faults, one every `--fault-every-s`, in rotation (`Faults.ROTATION`):

* ``kill``: SIGKILL of a worker or tokenizer (the supervisor restarts it; its requests move).
* ``oversized``: on a DEALER of its own (so our client's own check cannot stop them), GenerateRequests over
  the client limits but under the front's socket ceiling (a 3 MiB and a 9 MiB prompt, 600k token ids): each
  must end with exactly one "request_too_large" carrying its id. Then a 20 MiB frame, over the ceiling, on
  another DEALER: libzmq drops that connection unread, so no reply is expected (one is recorded if it comes).
* ``drain``: `deepinfer-launch drain NAME --run-dir RUN --timeout T --serving`, the operator's command, on a
  worker or tokenizer: it must exit 0 (drained, left, and its successor serving).
* ``malformed``: 800 garbage messages at the front from a DEALER that never said Hello (one frame, a bad type
  frame, an unknown type, random payloads): each answered by one "bad_message" with no id; plus 10 whose
  request id is readable (garbage after it, or `max_tokens` = 2**64-1): each ends with one "invalid_request".
* ``slow_client``: on a DEALER of its own with a tiny receive queue, `slow_streams` greedy streams of
  `slow_tokens` tokens that it does not read for `slow_pause_s` (every other time LONG_PAUSE times as long);
  then it reads. Together they are more deltas than the router's send queue to one client (1,000) and the
  socket buffers hold, so after the long pause the router has ended its requests ("overloaded").
  Each must end exactly once: finished, its deltas equal to its final tokens and to the undisturbed answer,
  or "overloaded" (the router ends a client's requests when it reads too slowly).
  Beside it, a stream of the shared Client whose reader pauses as long, which must simply finish.

Kills and drains pick the worker or tokenizer disturbed longest ago. A fault's requests that did not end as
expected are counted in its `lost`.
"""

from __future__ import annotations

import os
import random
import secrets
import signal
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import msgpack
import zmq

from bench.soak_load import PROMPTS, REF_TOKENS, Load, classify_error
from deepinfer import MeshError
from deepinfer.launch.supervisor import Supervisor
from deepinfer.protocol import messages as m
from deepinfer.protocol.client_session import hello
from deepinfer.protocol.framing import decode_frames, encode_frames, type_frame
from deepinfer.protocol.limits import Limits, MiB

BIG = Limits(max_payload=64 * MiB, max_frame=64 * MiB, max_total=64 * MiB, max_str_len=64 * MiB,
             max_array_len=8 * MiB)  # what the raw senders may encode: past the client limits on purpose
UNKNOWN_TYPE = b"\xfe"  # a type byte that names no message
REPLY_WAIT_S = 60.0  # how long a fault's requests get to end once it reads
NO_ID_REFUSAL = "ErrorReply('', bad_message)"  # how Ends shows the front's answer to a message without an id
LONG_PAUSE = 4  # the slow client's long pause, in short ones: long enough for ~1,500 deltas on 2 busy cores
LINGER_S = 1.0  # read on this long after the last expected end, to catch a second end of a request


@dataclass
class FaultRecord:
    t: float  # seconds since the load started
    kind: str
    target: str = ""
    ok: bool | None = None  # None while it runs; False when anything was not as expected
    lost: int = 0  # its requests that did not end exactly once as expected
    detail: dict[str, Any] = field(default_factory=dict)


class RawFront:
    """A bare DEALER on the router's client front: sends frames as given, decodes what comes back."""

    def __init__(self, endpoint: str, rcvhwm: int = 1000, rcvbuf: int = -1) -> None:
        self.ctx = zmq.Context()
        self.sock = self.ctx.socket(zmq.DEALER)
        self.sock.setsockopt(zmq.IDENTITY, f"soak-{secrets.token_hex(4)}".encode())
        self.sock.setsockopt(zmq.RCVHWM, rcvhwm)
        self.sock.setsockopt(zmq.RCVBUF, rcvbuf)
        self.sock.setsockopt(zmq.LINGER, 0)
        self.sock.setsockopt(zmq.SNDTIMEO, 30_000)
        self.sock.connect(endpoint)

    def send(self, frames: list[Any]) -> None:
        self.sock.send_multipart(frames, copy=False)

    def recv(self, timeout_s: float) -> Any | None:
        if not self.sock.poll(int(max(0.0, timeout_s) * 1000)):
            return None
        return decode_frames(self.sock.recv_multipart())

    def greet(self) -> None:
        self.send(encode_frames(hello()))
        reply = self.recv(30.0)
        if not isinstance(reply, m.Welcome) or not reply.accepted:
            raise RuntimeError(f"the router did not welcome a raw client: {reply!r}")

    def close(self) -> None:
        self.sock.close(linger=0)
        self.ctx.term()


class Ends:
    """What came back for each request id a fault sent: its end(s), and its stream deltas."""

    def __init__(self, ids: list[str]) -> None:
        self.ends: dict[str, list[Any]] = {rid: [] for rid in ids}
        self.deltas: dict[str, list[m.StreamDelta]] = {rid: [] for rid in ids}
        self.stray: list[str] = []  # replies for ids it never sent

    def take(self, msg: Any) -> None:
        rid = getattr(msg, "request_id", None)
        if rid not in self.ends:
            code = f", {msg.code}" if isinstance(msg, m.ErrorReply) else ""
            self.stray.append(f"{type(msg).__name__}({rid!r}{code})")
        elif isinstance(msg, m.StreamDelta):
            self.deltas[rid].append(msg)
        else:
            self.ends[rid].append(msg)

    def read(self, front: RawFront, deadline: float) -> None:
        """Read until every id has ended (then LINGER_S more) or `deadline` (monotonic)."""
        settle = None
        while (now := time.monotonic()) < (settle or deadline):
            msg = front.recv(min(0.5, (settle or deadline) - now))
            if msg is not None:
                self.take(msg)
            if settle is None and all(self.ends.values()):
                settle = time.monotonic() + LINGER_S


class Faults:
    ROTATION = ("kill", "oversized", "drain", "malformed", "slow_client")

    def __init__(self, sup: Supervisor, frontend: str, run_dir: Path, load: Load, seed: int,
                 drain_timeout_s: float = 10.0, slow_pause_s: float = 10.0, rotation: tuple[str, ...] = ROTATION,
                 slow_streams: int = 6, slow_tokens: int = 320) -> None:
        self.sup, self.frontend, self.run_dir, self.load = sup, frontend, run_dir, load
        self.rotation, self.slow_streams, self.slow_tokens = rotation, slow_streams, slow_tokens
        self.rng = random.Random(seed)
        self.drain_timeout_s, self.slow_pause_s = drain_timeout_s, slow_pause_s
        self.records: list[FaultRecord] = []
        self.threads: list[threading.Thread] = []
        self.victims = [c.name for c in sup.children if c.role in ("worker", "tokenizer")]
        self.disturbed = {name: -1.0 for name in self.victims}  # when each was last killed or drained
        self._turn = 0
        self._slow_turn = 0

    def inject(self, t: float) -> FaultRecord:
        """Start the next fault of the rotation at `t` (seconds since the load started)."""
        kind = self.rotation[self._turn % len(self.rotation)]
        self._turn += 1
        rec = FaultRecord(t, kind)
        if any(r.kind == kind for r in self.running()):
            rec.detail["overlaps"] = "the previous fault of this kind still runs"
        self.records.append(rec)
        if kind == "kill":
            self._kill(rec)
            return rec
        if kind == "drain":
            rec.target = self._pick_victim(t)
        thread = threading.Thread(target=self._guarded, args=(getattr(self, f"_{kind}"), rec), daemon=True,
                                  name=f"fault-{kind}")
        self.threads.append(thread)
        thread.start()
        return rec

    def running(self) -> list[FaultRecord]:
        return [r for r in self.records if r.ok is None]

    def join(self, timeout_s: float) -> None:
        deadline = time.monotonic() + timeout_s
        for thread in self.threads:
            thread.join(timeout=max(0.0, deadline - time.monotonic()))

    def _pick_victim(self, t: float) -> str:
        alive = [n for n in self.victims if (p := self.sup.child(n).proc) is not None and p.poll() is None]
        pool = alive or self.victims
        oldest = min(self.disturbed[n] for n in pool)
        name = self.rng.choice([n for n in pool if self.disturbed[n] == oldest])
        self.disturbed[name] = t
        return name

    @staticmethod
    def _guarded(fn: Any, rec: FaultRecord) -> None:
        try:
            fn(rec)
        except Exception as exc:  # a fault that could not run is a failed fault, never a dead soak
            rec.detail["error"] = f"{type(exc).__name__}: {exc}"
            rec.ok = False

    # -- the faults ----------------------------------------------------------------------------------

    def _kill(self, rec: FaultRecord) -> None:
        rec.target = self._pick_victim(rec.t)
        proc = self.sup.child(rec.target).proc
        if proc is not None and proc.poll() is None:
            os.kill(proc.pid, signal.SIGKILL)
            rec.detail["pid"] = proc.pid
            rec.ok = True
        else:
            rec.detail["skipped"] = "not running (restarting)"
            rec.ok = True

    def _drain(self, rec: FaultRecord) -> None:
        cmd = [sys.executable, "-m", "deepinfer.launch.cli", "drain", rec.target, "--run-dir", str(self.run_dir),
               "--timeout", f"{self.drain_timeout_s:g}", "--serving"]
        started = time.monotonic()
        done = subprocess.run(cmd, capture_output=True, text=True, timeout=self.drain_timeout_s + 600)
        rec.detail.update({"rc": done.returncode, "took_s": round(time.monotonic() - started, 1),
                           "output": (done.stdout + done.stderr).strip().splitlines()[-6:]})
        rec.ok = done.returncode == 0

    def _oversized(self, rec: FaultRecord) -> None:
        rec.target = "front"
        reqs = [m.GenerateRequest(f"soak-big-{secrets.token_hex(3)}", prompt="x" * (3 * MiB)),
                m.GenerateRequest(f"soak-big-{secrets.token_hex(3)}", prompt="y" * (9 * MiB)),
                m.GenerateRequest(f"soak-big-{secrets.token_hex(3)}", prompt_token_ids=[7] * 600_000)]
        front = RawFront(self.frontend)
        try:
            front.greet()
            ends = Ends([r.request_id for r in reqs])
            for r in reqs:
                front.send(encode_frames(r, BIG))
            ends.read(front, time.monotonic() + REPLY_WAIT_S)
        finally:
            front.close()
        rec.lost = sum(not _one_error(e, "request_too_large") for e in ends.ends.values())
        rec.detail["ends"] = {rid: _show(e) for rid, e in ends.ends.items()}
        # Over the socket ceiling: libzmq drops the connection unread; nothing must come back.
        over = RawFront(self.frontend)
        try:
            over.greet()
            over.send(encode_frames(m.GenerateRequest(f"soak-huge-{secrets.token_hex(3)}", prompt="z" * (20 * MiB)),
                                    BIG))
            reply = over.recv(5.0)
        finally:
            over.close()
        rec.detail["over_ceiling_reply"] = None if reply is None else repr(reply)[:120]
        rec.ok = rec.lost == 0 and not ends.stray

    def _malformed(self, rec: FaultRecord) -> None:
        rec.target = "front"
        rng = random.Random(self.rng.random())
        junk = lambda n: rng.randbytes(rng.randrange(1, n))  # noqa: E731
        garbage: list[list[bytes]] = []
        for _ in range(200):
            garbage += [[junk(200)], [b"abc", junk(200)], [UNKNOWN_TYPE, junk(200)],
                        [type_frame(m.GenerateRequest), junk(400)]]
        with_ids: list[tuple[str, list[bytes]]] = []
        for k in range(5):
            rid = f"soak-bad-{secrets.token_hex(3)}"  # readable id, then a byte msgpack never uses
            payload = b"\x89" + msgpack.packb("request_id") + msgpack.packb(rid) + b"\xc1" + junk(50)
            with_ids.append((rid, [type_frame(m.GenerateRequest), payload]))
            rid = f"soak-int-{secrets.token_hex(3)}"  # well formed, but max_tokens does not fit an int64
            body = msgpack.unpackb(bytes(encode_frames(m.GenerateRequest(rid, prompt_token_ids=PROMPTS[k]))[1]))
            body["params"]["max_tokens"] = 2**64 - 1
            with_ids.append((rid, [type_frame(m.GenerateRequest), msgpack.packb(body)]))
        messages = garbage + [frames for _, frames in with_ids]
        rng.shuffle(messages)
        front = RawFront(self.frontend, rcvhwm=100_000)
        try:
            ends = Ends([rid for rid, _ in with_ids])
            for frames in messages:
                front.send(frames)
            ends.read(front, time.monotonic() + REPLY_WAIT_S)
            # the id-less answers may still be arriving: read until a quiet second
            while (msg := front.recv(1.0)) is not None:
                ends.take(msg)
        finally:
            front.close()
        bad = sum(s == NO_ID_REFUSAL for s in ends.stray)
        rec.lost = sum(not _one_error(e, "invalid_request") for e in ends.ends.values())
        rec.detail.update({"sent_garbage": len(garbage), "bad_message_replies": bad,
                           "other_replies": [s for s in ends.stray if s != NO_ID_REFUSAL][:10],
                           "with_ids": {rid: _show(e) for rid, e in ends.ends.items()}})
        rec.ok = rec.lost == 0 and bad == len(garbage) and len(ends.stray) == bad

    def _slow_client(self, rec: FaultRecord) -> None:
        rec.target = "front"
        paused = threading.Thread(target=self._paused_shared_stream, args=(rec,), daemon=True)
        paused.start()
        prompts = {f"soak-slow-{secrets.token_hex(3)}": self.rng.randrange(len(PROMPTS))
                   for _ in range(self.slow_streams)}
        front = RawFront(self.frontend, rcvhwm=1, rcvbuf=4096)
        try:
            front.greet()
            ends = Ends(list(prompts))
            for rid, i in prompts.items():
                params = m.SamplingParamsWire(max_tokens=self.slow_tokens, ignore_eos=True)
                front.send(encode_frames(m.GenerateRequest(rid, prompt_token_ids=PROMPTS[i], params=params,
                                                           stream=True)))
            # Every other time it stops reading long enough for the router to give up on it ("overloaded").
            pause_s = self.slow_pause_s * (1 if self._slow_turn % 2 == 0 else LONG_PAUSE)
            self._slow_turn += 1
            rec.detail["pause_s"] = pause_s
            time.sleep(pause_s)  # the reader stops reading
            ends.read(front, time.monotonic() + REPLY_WAIT_S + 120)
        finally:
            front.close()
        results = {rid: self._judge_stream(rec.t, i, ends.ends[rid], ends.deltas[rid]) for rid, i in prompts.items()}
        paused.join(timeout=300)  # before counting: it adds its own loss
        rec.lost += sum(r.startswith("lost") for r in results.values())
        rec.detail["raw_streams"] = results
        rec.detail["deltas_received"] = sum(map(len, ends.deltas.values()))
        rec.ok = rec.lost == 0 and not ends.stray and not rec.detail.get("shared", "").startswith("lost")

    def _judge_stream(self, t: float, i: int, ends: list[Any], deltas: list[m.StreamDelta]) -> str:
        if len(ends) != 1:
            return f"lost: {len(ends)} ends {_show(ends)}"
        end = ends[0]
        if isinstance(end, m.ErrorReply):
            return f"overloaded ({len(deltas)} deltas before)" if end.code == "overloaded" else f"lost: {_show(ends)}"
        tokens = [tok for d in deltas for tok in d.token_ids]
        offsets_ok = all(d.offset == sum(len(e.token_ids) for e in deltas[:k]) for k, d in enumerate(deltas))
        if tokens != list(end.token_ids) or not offsets_ok:
            return f"lost: deltas ({len(tokens)} tokens) differ from the final {len(end.token_ids)}"
        same = self.load.check_tokens(i, tokens[:REF_TOKENS], t, "slow raw stream")
        return f"finished {len(tokens)} tokens in {len(deltas)} deltas" + ("" if same else ", greedy mismatch")

    def _paused_shared_stream(self, rec: FaultRecord) -> None:
        """A shared-Client stream whose reader pauses slow_pause_s after its first token."""
        i = self.rng.randrange(len(PROMPTS))
        tokens: list[int] = []
        try:
            stream = self.load.client.stream(prompt_token_ids=PROMPTS[i], max_tokens=64, ignore_eos=True)
            for msg in stream:
                if isinstance(msg, m.StreamDelta):
                    if not tokens:
                        time.sleep(self.slow_pause_s)
                    tokens += msg.token_ids
                elif isinstance(msg, m.RequestFinished):
                    ok = list(msg.token_ids) == tokens and self.load.check_tokens(i, tokens, rec.t, "paused stream")
                    rec.detail["shared"] = "finished" if ok else "finished, tokens differ"
                    return
            rec.detail["shared"] = "lost: the stream ended without RequestFinished"
        except MeshError as exc:
            outcome = classify_error(exc, set())
            rec.detail["shared"] = f"{outcome}: {exc}"
        if rec.detail["shared"].startswith("lost"):
            rec.lost += 1


def _one_error(ends: list[Any], code: str) -> bool:
    return len(ends) == 1 and isinstance(ends[0], m.ErrorReply) and ends[0].code == code


def _show(ends: list[Any]) -> list[str]:
    return [f"{e.code}: {e.message[:80]}" if isinstance(e, m.ErrorReply) else type(e).__name__ for e in ends]
