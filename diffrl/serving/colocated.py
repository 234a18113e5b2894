"""A colocated engine: an `Engine` in its own process on the trainer's device, started by the trainer.

The two processes talk over one `multiprocessing` pipe. Every message is a JSON header (`send_bytes`,
never pickle) followed, when the header says so, by one binary payload: a rollout request's JSON, the
outputs in the compact wire format (`wire.py`), or a weight bucket shared by torch (`weight_sync.py`:
a CUDA IPC handle or shared memory, the only thing either side unpickles). Rollout requests are
answered as they finish (several are in flight and denoised together, as in any engine); weight
buckets, the LoRA adapter, sleep and wake are answered one at a time, in order.

Sleep and wake let the engine and the trainer take turns on the GPU: asleep, the engine refuses
requests and releases its cached memory (level 1: the last batch's activations and the allocator's
cache) or also its weights (level 2: moved to pinned host memory). `wake` brings the weights back bit
for bit. The trainer wakes it before a rollout and puts it back to sleep before training. A sleep's reply
says what the device gained (`released_bytes`: its free memory after the sleep minus before).
"""

from __future__ import annotations

import asyncio
import itertools
import json
import threading
import weakref
from concurrent.futures import Future

import torch

from diffrl.engine.protocol import RolloutOutput, RolloutRequest
from diffrl.engine.spec import EngineSpec, build_engine
from diffrl.serving.weight_sync import (
    DEFAULT_BUFFER_BYTES,
    apply_bucket,
    receive_tensor,
    send_in_buckets,
    share_tensor,
)
from diffrl.serving.wire import WireFormatError, decode_outputs, encode_outputs
from diffrl.errors import EngineUnavailable, RequestError
from diffrl.models.lora import LoraSpec
from diffrl.utils import determinism
from diffrl.utils.offload import device_free_bytes, stranded_bytes
from diffrl.utils.spawned import no_named_semaphores

# What the engine process loads, and how: the engine's spec, which travels as JSON. The trainer fills it so that the
# engine computes what its in-process engine would (same dtypes, precision, compilation and batching).
EngineProcessSpec = EngineSpec


class Channel:
    """One end of the pipe. `send` may be called from any thread; one thread calls `recv`."""

    def __init__(self, connection):
        self.connection = connection
        self._lock = threading.Lock()

    def send(self, header: dict, payload: bytes | None = None) -> None:
        data = json.dumps({**header, "payload": payload is not None}).encode()
        with self._lock:  # a header and its payload go out together
            self.connection.send_bytes(data)
            if payload is not None:
                self.connection.send_bytes(payload)

    def recv(self) -> tuple[dict, bytes | None]:
        header = json.loads(self.connection.recv_bytes())
        payload = self.connection.recv_bytes() if header.pop("payload", False) else None
        return header, payload


# ---------------------------------------------------------------------------------------------- the engine side
def run_engine_process(connection, spec_json: str) -> None:
    """The engine process's main function: load, say "ready", serve until told to close or the pipe closes."""
    no_named_semaphores()  # before the model load's progress bars: a SIGKILL leaves nothing in /dev/shm
    channel = Channel(connection)
    try:
        server = _EngineServer(EngineProcessSpec.from_json(spec_json))
    except Exception as err:  # noqa: BLE001 - reported to the trainer, which raises it
        channel.send({"op": "failed", "error": f"{type(err).__name__}: {err}"})
        return
    channel.send({"op": "ready", "family": server.engine.family.name, "device": str(server.engine.family.device)})
    try:
        server.serve(channel)
    finally:
        server.loop.call_soon_threadsafe(server.loop.stop)


class _EngineServer:
    def __init__(self, spec: EngineProcessSpec):
        if spec.num_threads:
            torch.set_num_threads(spec.num_threads)
        torch.set_float32_matmul_precision(spec.float32_matmul_precision)
        device = torch.device(spec.device)
        if spec.deterministic:  # the trainer's settings (the cuBLAS one is inherited, set before CUDA starts)
            determinism.enable(device)
        if device.type == "cuda" and device.index is not None:
            torch.cuda.set_device(device)
        self.engine = build_engine(spec)
        self.device = self.engine.family.device
        self.bucket_buffer: torch.Tensor | None = None  # the trainer's weight buffer during a sync
        # Rollout requests wait in the engine's queue on this loop (no thread each) while its workers denoise.
        self.loop = asyncio.new_event_loop()
        threading.Thread(target=self.loop.run_forever, name="engine-requests", daemon=True).start()

    def serve(self, channel: Channel) -> None:
        while True:
            try:
                header, payload = channel.recv()
            except (EOFError, OSError):
                return  # the trainer is gone
            op = header.get("op")
            if op == "close":
                return
            if op == "generate":
                asyncio.run_coroutine_threadsafe(self._generate(channel, header.get("id"), payload), self.loop)
                continue
            try:
                reply = self._control(op, header, payload)
            except RequestError as err:
                reply = {"error": {"kind": "request", "field": err.field, "message": err.message}}
            except Exception as err:  # noqa: BLE001 - the trainer hears of it; the engine keeps serving
                reply = {"error": {"kind": "engine", "message": f"{type(err).__name__}: {err}"}}
            channel.send({"id": header.get("id"), **reply})

    async def _generate(self, channel: Channel, request_id, payload: bytes | None) -> None:
        try:
            if self.engine.asleep:
                raise RuntimeError("the engine is asleep (wake it first)")
            outputs = await self.engine.agenerate(RolloutRequest.model_validate_json(payload or b""))
            body = await asyncio.to_thread(encode_outputs, outputs)
        except RequestError as err:
            channel.send({"id": request_id, "error": {"kind": "request", "field": err.field, "message": err.message}})
        except Exception as err:  # noqa: BLE001 - answered, so the trainer can retry elsewhere
            channel.send({"id": request_id, "error": {"kind": "engine", "message": f"{type(err).__name__}: {err}"}})
        else:
            channel.send({"id": request_id}, body)

    def _control(self, op: str, header: dict, payload: bytes | None) -> dict:
        if op == "update_weights":
            return self._update_weights(header, payload)
        if op == "add_lora":
            self._require_awake("lora")
            return {"added": self.engine.add_lora_adapter(LoraSpec.model_validate(header.get("lora")))}
        if op == "sleep":
            return self._sleep(header.get("level"))
        if op == "wake":
            return self._wake()
        if op == "memory":
            return self._memory(reset_peak=bool(header.get("reset_peak")))
        if op == "health":
            return {"weight_version": self.engine.weight_version, "in_flight": self.engine.in_flight,
                    "asleep": self.engine.asleep}
        raise RequestError("op", f"unknown operation {str(op)[:50]!r}")

    def _update_weights(self, header: dict, payload: bytes | None) -> dict:
        """One bucket. The first of a sync carries the shared buffer, which is kept (mapped, not copied)
        until the sync ends: its last bucket, or a refusal, which stops it."""
        last = bool(header.get("last"))
        try:
            self._require_awake("weights")
            if payload is not None:
                self.bucket_buffer = receive_tensor(payload)
            return apply_bucket(self.engine, self.bucket_buffer, header.get("layout"), header.get("version"), last)
        except Exception:
            last = True
            raise
        finally:
            if last:  # released before the answer: the trainer frees the buffer once the sync is over
                self.bucket_buffer = None

    def _require_awake(self, field: str) -> None:
        if self.engine.asleep:
            raise RequestError(field, "the engine is asleep (wake it first)")

    def _sleep(self, level) -> dict:
        """Sleep at `level`; the reply holds the bytes moved, this process's memory before and after, and what the
        device gained: `released_bytes`, its free memory after minus before (cudaMemGetInfo; 0 on a CPU), and
        `stranded_bytes`, what stays cached in segments that still hold a live block (empty_cache keeps those)."""
        before = self._memory()
        free_before = device_free_bytes(self.device)
        moved = self.engine.sleep(level)  # refused while requests are in flight; gives its cache back to the driver
        after = self._memory()
        return {"level": self.engine.asleep, "moved_bytes": moved, "before": before, "after": after,
                "released_bytes": device_free_bytes(self.device) - free_before,
                "stranded_bytes": stranded_bytes(self.device)}

    def _wake(self) -> dict:
        before = self._memory()
        moved = self.engine.wake()
        return {"moved_bytes": moved, "before": before, "after": self._memory()}

    def _memory(self, reset_peak: bool = False) -> dict:
        """The engine process's device memory in bytes (None on a CPU)."""
        if self.device.type != "cuda":
            return {"allocated": None, "reserved": None, "peak_allocated": None}
        stats = {"allocated": torch.cuda.memory_allocated(self.device),
                 "reserved": torch.cuda.memory_reserved(self.device),
                 "peak_allocated": torch.cuda.max_memory_allocated(self.device)}
        if reset_peak:
            torch.cuda.reset_peak_memory_stats(self.device)
        return stats


# ---------------------------------------------------------------------------------------------- the trainer side
class ColocatedEngineClient:
    """Starts the engine process (spawn) and is the rollout manager's client for it; the trainer's policy
    also pushes weights (`push_weights`, in buckets of `buffer_bytes`), hosts its LoRA adapter, and
    puts the engine to sleep and wakes it."""

    def __init__(self, spec: EngineProcessSpec, *, buffer_bytes: int = DEFAULT_BUFFER_BYTES,
                 name: str = "colocated", start_timeout_s: float = 900.0):
        if buffer_bytes < 1:
            raise ValueError(f"--update-weight-buffer-size must be >= 1 byte, got {buffer_bytes}")
        context = torch.multiprocessing.get_context("spawn")  # CUDA cannot be used in a forked child
        ours, theirs = context.Pipe()
        self.process = context.Process(target=run_engine_process, args=(theirs, spec.to_json()),
                                       name=f"diffrl-{name}", daemon=True)
        self.process.start()
        theirs.close()
        self.name, self.buffer_bytes = name, buffer_bytes
        self._channel = Channel(ours)
        self._stop = weakref.finalize(self, _stop_process, self.process, self._channel)
        self._pending: dict[int, Future] = {}
        self._lock = threading.Lock()
        self._ids = itertools.count()
        self._gone: str | None = None  # why the process cannot be reached any more
        self.released_bytes: int | None = None  # the device memory the last sleep gave back (`sleep`)
        self.info = self._wait_until_ready(ours, start_timeout_s)
        threading.Thread(target=self._read, name=f"{name}-replies", daemon=True).start()

    def _wait_until_ready(self, connection, timeout_s: float) -> dict:
        waited = 0.0
        while not connection.poll(0.5):
            waited += 0.5
            if not self.process.is_alive() or waited > timeout_s:
                self.close()
                raise EngineUnavailable(f"{self.name}: the engine process did not start (exit code "
                                        f"{self.process.exitcode}, {waited:.0f} s)")
        try:
            header, _ = self._channel.recv()
        except (EOFError, OSError):
            header = {"error": f"it exited with code {self.process.join(5) or self.process.exitcode}"}
        if header.get("op") != "ready":
            self.close()
            raise EngineUnavailable(f"{self.name}: the engine process failed to load: {header.get('error')}")
        return header

    def _read(self) -> None:
        reason = "the engine process ended"
        try:
            while True:
                header, payload = self._channel.recv()
                with self._lock:
                    future = self._pending.pop(header.get("id"), None)
                if future is not None:
                    future.set_result((header, payload))
        except (EOFError, OSError) as err:
            reason = f"the engine process ended ({type(err).__name__})"
        finally:
            with self._lock:
                self._gone = self._gone or reason
                pending, self._pending = self._pending, {}
            for future in pending.values():
                future.set_exception(EngineUnavailable(f"{self.name}: {self._gone}"))

    def _call(self, header: dict, payload: bytes | None = None) -> Future:
        future: Future = Future()
        with self._lock:
            if self._gone is not None:
                future.set_exception(EngineUnavailable(f"{self.name}: {self._gone}"))
                return future
            request_id = next(self._ids)
            self._pending[request_id] = future
        try:
            self._channel.send({**header, "id": request_id}, payload)
        except (OSError, ValueError) as err:
            with self._lock:
                self._pending.pop(request_id, None)
            future.set_exception(EngineUnavailable(f"{self.name}: {type(err).__name__}: {err}"))
        return future

    def _request(self, header: dict, payload: bytes | None = None, what: str = "") -> dict:
        reply, _ = self._call(header, payload).result()
        if "error" in reply:
            raise self._error(reply["error"], what)
        reply.pop("id", None)
        return reply

    def _error(self, error: dict, what: str = "") -> Exception:
        if error.get("kind") == "request" and not what:
            return RequestError(error.get("field", "request"), error.get("message", ""))
        detail = f"{error.get('field')}: {error.get('message')}" if error.get("kind") == "request" else error.get("message")
        return EngineUnavailable(f"{self.name}: {what}{detail}")

    async def generate(self, request: RolloutRequest) -> list[RolloutOutput]:
        future = self._call({"op": "generate"}, request.model_dump_json(exclude_none=True).encode())
        reply, payload = await asyncio.wrap_future(future)
        if "error" in reply:
            raise self._error(reply["error"])
        try:
            return decode_outputs(payload or b"")
        except WireFormatError as err:
            raise EngineUnavailable(f"{self.name}: malformed response: {err}") from err

    def push_weights(self, tensors: dict[str, torch.Tensor], version: int, token: str | None = None) -> int:
        """Named transformer tensors into the engine, bucket by bucket (one in flight); the engine takes
        `version` with the last one. A refused bucket raises `EngineUnavailable` naming it and stops the
        sync. `token` is unused: the pipe reaches no one else. Returns the number of buckets."""

        def send(layout: list[dict], buffer: torch.Tensor | None, index: int, count: int) -> None:
            header = {"op": "update_weights", "layout": layout, "version": version, "last": index == count - 1}
            self._request(header, share_tensor(buffer) if buffer is not None and index == 0 else None,
                          what=f"weight bucket {index + 1}/{count} refused: ")

        count = send_in_buckets(tensors, self.buffer_bytes, send)
        if any(t.is_cuda for t in tensors.values()):
            torch.cuda.ipc_collect()
            torch.cuda.empty_cache()  # the bucket buffer's memory is the engine's to use while it samples
        return count

    def add_lora_adapter(self, spec: LoraSpec, token: str | None = None) -> bool:
        """Have the engine host the trainer's LoRA adapter unmerged (idempotent; a different one is refused)."""
        return self._request({"op": "add_lora", "lora": spec.model_dump()}, what="LoRA adapter refused: ")["added"]

    def sleep(self, level: int = 1) -> dict:
        """Level 1: release cached memory; 2: also move the weights to host memory. Returns the bytes moved,
        the engine's device memory before and after, and `released_bytes`: the device's free memory the sleep
        gained (0 on a CPU), also kept as `self.released_bytes` until the next sleep."""
        self.released_bytes = None
        reply = self._request({"op": "sleep", "level": level}, what="sleep refused: ")
        self.released_bytes = reply.get("released_bytes")
        return reply

    def wake(self) -> dict:
        return self._request({"op": "wake"}, what="wake failed: ")

    def memory(self, reset_peak: bool = False) -> dict:
        """The engine process's device memory (bytes: allocated, reserved, peak allocated; None on a CPU)."""
        return self._request({"op": "memory", "reset_peak": reset_peak})

    def health(self) -> dict:
        return self._request({"op": "health"})

    def close(self) -> None:
        """Stop the engine process (also done at exit)."""
        self._stop()


def _stop_process(process, channel: Channel) -> None:
    try:
        channel.send({"op": "close"})
    except (OSError, ValueError):
        pass
    process.join(timeout=30)
    if process.is_alive():
        process.terminate()
        process.join(timeout=10)
    channel.connection.close()
