"""miles-diffusion's weight sync over CUDA IPC against `diffrl serve`'s /update_weights_from_tensor, on a GPU.

The server (this process): a tiny demo engine on cuda:0 behind `create_app(..., tensor_updates=True)`, no token, on
127.0.0.1. The sender (a child process, `--send URL`): what miles' `DiffusionUpdateWeightFromTensor` does, with
sglang's pieces written out (sglang is not installed): `monkey_patch_torch_reductions` here (the device travels as
its UUID, through `sglang.srt.utils.patch_torch._rebuild_cuda_tensor_modified`), `FlattenedTensorBucket` per dtype
and the request body by `diffrl.serving.tensor_bucket` (the tests' builder too), `MultiprocessingSerializer`
(ForkingPickler, base64), a plain POST without a token. It also sends payloads that must
be refused on a real GPU (a storage offset beyond the allocation, an unknown device UUID), then a good one again.
The server process then checks its weights against a direct load of the same tensors. Exit status 0: all held.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import urllib.error
import urllib.request

import torch

from diffrl.serving import tensor_bucket


def _post(url: str, payload: dict) -> tuple[int, dict]:
    request = urllib.request.Request(url + "/update_weights_from_tensor", data=json.dumps(payload).encode(),
                                     headers={"content-type": "application/json"})
    try:
        with urllib.request.urlopen(request, timeout=120) as response:
            return response.status, json.loads(response.read())
    except urllib.error.HTTPError as err:
        return err.code, json.loads(err.read())


def _sglang_patch():
    """sglang's patch_torch functions by name (for `tensor_bucket.sglang_modules`) and its
    monkey_patch_torch_reductions."""
    from torch.multiprocessing import reductions

    def _device_from_maybe_uuid(device):
        if isinstance(device, int):
            return device
        for index in range(torch.cuda.device_count()):
            if str(torch.cuda.get_device_properties(index).uuid) == device:
                return index
        raise Exception("Invalid device_uuid=" + device)

    def _reduce_tensor_modified(*args, **kwargs):
        fn, out = reductions._reduce_tensor_original(*args, **kwargs)
        return fn, (*out[:6], str(torch.cuda.get_device_properties(out[6]).uuid), *out[7:])

    def _rebuild_cuda_tensor_modified(*args):
        return reductions._rebuild_cuda_tensor_original(*args[:6], _device_from_maybe_uuid(args[6]), *args[7:])

    def monkey_patch_torch_reductions():
        if hasattr(reductions, "_reduce_tensor_original"):
            return
        reductions._reduce_tensor_original = reductions.reduce_tensor
        reductions._rebuild_cuda_tensor_original = reductions.rebuild_cuda_tensor
        reductions.reduce_tensor = _reduce_tensor_modified
        reductions.rebuild_cuda_tensor = _rebuild_cuda_tensor_modified
        reductions.init_reductions()

    functions = {fn.__name__: fn for fn in (_reduce_tensor_modified, _rebuild_cuda_tensor_modified)}
    return functions, monkey_patch_torch_reductions


def named_update() -> list[tuple[str, torch.Tensor]]:
    """The update both sides know: seed 1's tiny demo transformer, every other tensor in bfloat16 (two dtypes,
    so two requests, as miles sends one per dtype)."""
    from diffrl.models.random_checkpoints import demo as random_demo

    state = random_demo.random_family(random_demo.tiny(), seed=1).transformer.state_dict()
    return [(n, t.to(torch.bfloat16) if i % 2 else t) for i, (n, t) in enumerate(state.items())]


def send(url: str) -> int:
    functions, monkey_patch_torch_reductions = _sglang_patch()
    with tensor_bucket.sglang_modules(**functions):  # pickle writes sglang's names
        return _send(url, monkey_patch_torch_reductions)


def _send(url: str, monkey_patch_torch_reductions) -> int:
    from multiprocessing.reduction import ForkingPickler

    import torch.multiprocessing  # noqa: F401  registers torch's reductions, as sglang's import does
    from torch.multiprocessing import reductions

    monkey_patch_torch_reductions()  # miles' update_bucket_weights calls it first
    buckets = tensor_bucket.flattened_buckets((name, tensor.cuda()) for name, tensor in named_update())

    def request(obj, version: int) -> dict:  # MultiprocessingSerializer.serialize(obj, output_str=True), posted
        return tensor_bucket.request_body(ForkingPickler.dumps(obj), version)

    failures = 0
    fn, args = reductions.reduce_tensor(buckets[0]["transformer"]["flattened_tensor"])
    print(f"sender: reduction {fn.__module__}.{fn.__qualname__}, device {args[6]!r}, handle {len(args[7])} bytes "
          f"(version {args[7][0]}, type {chr(args[7][1])!r}), storage {args[8]} bytes at {args[9]}, ref counter "
          f"{args[11]!r}[{args[12]}] ({os.stat('/dev/shm' + args[11].decode()).st_size} bytes in /dev/shm), "
          f"event_sync {args[13] and len(args[13])} bytes / {args[14]}")

    class Tampered:
        def __init__(self, index, value):
            self.index, self.value = index, value

        def __reduce__(self):
            fn, args = reductions.reduce_tensor(buckets[0]["transformer"]["flattened_tensor"])
            return fn, (*args[:self.index], self.value(args[self.index]), *args[self.index + 1:])

    hostile = {"storage offset beyond the allocation": Tampered(9, lambda offset: offset + (1 << 34)),
               "storage larger than the allocation": Tampered(8, lambda size: size + (1 << 34)),
               "unknown device UUID": Tampered(6, lambda _: "GPU-00000000-0000-0000-0000-000000000000"),
               "device index out of range": Tampered(6, lambda _: 7)}
    for what, shared in hostile.items():
        payload = {"transformer": {**buckets[0]["transformer"], "flattened_tensor": shared}}
        status, answer = _post(url, request(payload, 99))
        ok = 400 <= status < 500
        failures += not ok
        print(f"sender: {what}: {status} {answer.get('message', answer)[:200]}{'' if ok else '  <-- expected 4xx'}")
    for bucket in buckets:
        status, answer = _post(url, request(bucket, 5))
        failures += status != 200
        print(f"sender: bucket of {len(bucket['transformer']['metadata'])} tensors, "
              f"{bucket['transformer']['flattened_tensor'].numel()} bytes: {status} {answer}")
    return failures


def serve_and_check() -> int:
    from diffrl.engine.engine import Engine
    from diffrl.models.random_checkpoints import demo as random_demo
    from diffrl.serving.http_errors import ServerLimits
    from diffrl.serving.server import create_app, serving_in_thread

    print(f"torch {torch.__version__}, {torch.cuda.get_device_name(0)}, uuid {torch.cuda.get_device_properties(0).uuid}")
    family = random_demo.random_family(random_demo.tiny(), seed=0)
    family.transformer.to("cuda")
    engine = Engine(family)
    app = create_app(engine, limits=ServerLimits(tensor_updates=True))
    with serving_in_thread(app) as url:
        sender = subprocess.run([sys.executable, __file__, "--send", url], timeout=300)
    expected = Engine(random_demo.random_family(random_demo.tiny(), seed=0))
    expected.update_weights(dict(named_update()))
    got = {n: t.cpu() for n, t in engine.family.transformer.state_dict().items()}
    same = all(torch.equal(got[n], t) for n, t in expected.family.transformer.state_dict().items())
    print(f"server: weight version {engine.weight_version}, weights equal to a direct load: {same}")
    return 0 if sender.returncode == 0 and same and engine.weight_version == 5 else 1


if __name__ == "__main__":
    if sys.argv[1:2] == ["--send"]:
        sys.exit(1 if send(sys.argv[2]) else 0)
    sys.exit(serve_and_check())
