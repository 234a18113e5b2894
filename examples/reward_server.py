"""A reward server in Flow-Factory's format that scores with any diffrl reward.

    python examples/reward_server.py --reward shapes --port 8000
    diffrl train --reward remote@http://127.0.0.1:8000 …

`GET /health` answers `{"status": "ok"}`; `POST /compute` takes `{"prompt": [...], "image": [base64 PNG, ...]}`
(or `"video": [[base64 PNG frame, ...], ...]`) and answers `{"rewards": [...]}`, plus `"components"` (each term's
own values) for a `multi:` reward. `extra.metadata`, when sent, reaches the reward as its metadata. A request that
cannot be scored (no prompts, images that do not decode, a count that differs from the prompts') gets HTTP 422
naming the problem. The server binds to loopback unless `--host` says otherwise.

Replace `get_reward(args.reward)` with your own `score(images, prompts, metadata) -> list[float]` to serve a
reward that needs an environment of its own; images arrive as `[B, 3, H, W]` floats in [0, 1].
"""

from __future__ import annotations

import argparse
import base64
import binascii
import inspect
import io

import numpy as np
import torch
from fastapi import FastAPI, HTTPException
from PIL import Image, UnidentifiedImageError


def decode_png(data: str) -> np.ndarray:
    try:
        return np.asarray(Image.open(io.BytesIO(base64.b64decode(data, validate=True))).convert("RGB"))
    except (binascii.Error, UnidentifiedImageError, ValueError, TypeError) as err:
        raise HTTPException(422, f"an image is not a base64 PNG: {err}") from None


def as_tensor(pixels: list[np.ndarray]) -> torch.Tensor:
    """`[B, H, W, 3]` uint8 → `[B, 3, H, W]` floats in [0, 1]."""
    if len({p.shape for p in pixels}) != 1:
        raise HTTPException(422, "the images of one request differ in size")
    return torch.from_numpy(np.stack(pixels)).permute(0, 3, 1, 2).float() / 255


def make_app(score) -> FastAPI:
    app = FastAPI(title="diffrl reward server")

    @app.get("/health")
    def health() -> dict:
        return {"status": "ok"}

    @app.post("/compute")
    async def compute(body: dict) -> dict:
        prompts = body.get("prompt")
        if not isinstance(prompts, list) or not prompts or not all(isinstance(p, str) for p in prompts):
            raise HTTPException(422, "prompt: a non-empty list of strings")
        if body.get("image"):
            samples = as_tensor([decode_png(b) for b in body["image"]])
        elif body.get("video"):
            videos = [as_tensor([decode_png(f) for f in frames]) for frames in body["video"]]
            if len({v.shape for v in videos}) != 1:
                raise HTTPException(422, "the videos of one request differ in size or frame count")
            samples = torch.stack(videos).permute(0, 2, 1, 3, 4)  # [B, 3, F, H, W]
        else:
            raise HTTPException(422, "image or video: the samples to score")
        if samples.shape[0] != len(prompts):
            raise HTTPException(422, f"{samples.shape[0]} samples for {len(prompts)} prompts")
        metadata = (body.get("extra") or {}).get("metadata")
        values = score(samples, prompts, metadata)
        if inspect.isawaitable(values):
            values = await values
        answer = {"rewards": [float(v) for v in values]}
        if getattr(values, "terms", None):
            answer["components"] = {name: [float(v) for v in terms] for name, terms in values.terms.items()}
        return answer

    return app


def main() -> None:
    import uvicorn

    from diffrl.rewards import get_reward

    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--reward", required=True, help="any diffrl reward spec (`diffrl rewards` lists them)")
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=8000)
    parser.add_argument("--device", default=None, help="where model rewards load (default: CUDA when available)")
    args = parser.parse_args()
    uvicorn.run(make_app(get_reward(args.reward, device=args.device)), host=args.host, port=args.port)


if __name__ == "__main__":
    main()
