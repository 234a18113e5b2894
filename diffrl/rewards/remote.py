"""`remote@URL`: a reward scored by a server of its own, in Flow-Factory's reward-server format.

A reward model that needs another environment (its own dependencies, its own GPU, a GenEval or UnifiedReward
server) runs as a server, and diffrl sends it the samples to score:

- `GET /health` answers when the server is up (asked once, when the reward is built, so a server that is down
  stops the run before any model loads);
- `POST /compute` with JSON `{"prompt": [...], "image": [base64 PNG, ...] | null, "video": [[base64 PNG frame,
  ...], ...] | null, "condition_images": [[base64 PNG, ...], ...] | null, "condition_videos": null, "extra":
  {"metadata": [...]}}` answered
  by `{"rewards": [one number per sample]}`. An answer may add `"components": {"name": [one number per sample]}`:
  the reward's own terms, which GDPO's per-reward normalization reads (`--advantage-aggregation gdpo`).
  `condition_images` holds each sample's condition images (an edit's source: the metadata's `condition_images`),
  null when no sample has any.

Images go as 8-bit PNG, rounded as every diffrl reward rounds them (`utils.images.to_uint8`), so a server
scoring with a diffrl reward gives the in-process values to the bit. Samples go in requests of at most `batch`,
`concurrency` of them in flight. A connection error, a timeout, HTTP 429 or 5xx is retried with exponential
backoff (0.5 s doubling, at most 10 s apart) up to `retries` times: a server that restarts costs a wait, not the
run. An answer that cannot be right (not JSON, the wrong count, a value that is not a finite number) is not
retried: it stops the run with one line naming the server. `examples/reward_server.py` serves any diffrl reward
in this format.

Spec: `remote@http://HOST:PORT[,timeout=SECONDS][,retries=N][,batch=N][,concurrency=N]`; the URL holds no comma.
"""

from __future__ import annotations

import asyncio
import base64
import io
import math
from dataclasses import dataclass

import httpx
import torch
from PIL import Image

from diffrl.data.condition_images import CONDITION_IMAGES_KEY
from diffrl.errors import RewardUnavailable  # with the other errors: the CLI catches it without importing rewards
from diffrl.rewards.registry import TermScores
from diffrl.utils.images import to_uint8

OPTIONS = ("timeout", "retries", "batch", "concurrency")
_RETRIED_STATUS = frozenset({429, 500, 502, 503, 504})


class RewardServerError(ValueError):
    """A reward server's answer that cannot be right, or a request it refuses (HTTP 4xx): retrying cannot help."""


def png_base64(pixels) -> str:
    """One `[H, W, 3]` uint8 array as a base64 PNG (lossless: the server reads back these exact pixels)."""
    buffer = io.BytesIO()
    Image.fromarray(pixels).save(buffer, format="PNG")
    return base64.b64encode(buffer.getvalue()).decode("ascii")


def encode_samples(images: torch.Tensor) -> dict:
    """The `image` (or `video`) field of a request for `[B, C, H, W]` images or `[B, C, F, H, W]` videos in [0, 1]."""
    if images.dim() == 5:  # a video: its frames, each a PNG
        frames = to_uint8(images.permute(0, 2, 1, 3, 4).flatten(0, 1)).reshape(
            images.shape[0], images.shape[2], *images.shape[3:], 3)
        return {"image": None, "video": [[png_base64(frame) for frame in video] for video in frames]}
    return {"image": [png_base64(pixels) for pixels in to_uint8(images)], "video": None}


def _json_metadata(metadata) -> list[dict] | None:
    """Each sample's metadata with the values JSON can carry (numbers, strings, booleans, None, and lists of them)."""
    def plain(value) -> bool:
        if isinstance(value, list | tuple):
            return all(plain(v) for v in value)
        return value is None or isinstance(value, bool | int | float | str)

    if not metadata:
        return None
    return [{k: v for k, v in (m or {}).items() if isinstance(k, str) and plain(v)} for m in metadata]


def condition_images(metadata) -> list[list[str]] | None:
    """Each sample's condition images (metadata `condition_images`: float [3, H, W] in [0, 1]) as base64 PNGs, in
    Flow-Factory's `condition_images` field; None when no sample has any."""
    per_sample = [list((m or {}).get(CONDITION_IMAGES_KEY) or ()) for m in (metadata or ())]
    if not any(per_sample):
        return None
    return [[png_base64(to_uint8(image[None])[0]) for image in images] for images in per_sample]


@dataclass(frozen=True)
class RemoteReward:
    """`score(images, prompts, metadata)` by a reward server; async, so scoring overlaps generation."""

    url: str
    timeout: float = 60.0
    retries: int = 5
    batch: int = 64
    concurrency: int = 4

    def __post_init__(self):
        if not self.url.startswith(("http://", "https://")):
            raise ValueError(f"reward remote@{self.url}: the server's URL starts with http:// or https://")
        if self.timeout <= 0 or self.retries < 0 or self.batch < 1 or self.concurrency < 1:
            raise ValueError(f"reward remote@{self.url}: timeout > 0, retries >= 0, batch >= 1 and concurrency >= 1 "
                             f"(got {self.timeout}, {self.retries}, {self.batch}, {self.concurrency})")

    @property
    def base(self) -> str:
        return self.url.rstrip("/")

    def check_health(self) -> None:
        """Raise RewardUnavailable naming the server unless `GET /health` answers 2xx."""
        try:
            answer = httpx.get(f"{self.base}/health", timeout=min(self.timeout, 10.0))
        except httpx.HTTPError as err:
            raise RewardUnavailable(f"reward server {self.base} does not answer GET /health ({err}); start it "
                                    "(e.g. python examples/reward_server.py --reward NAME --port PORT) or fix the "
                                    "URL") from None
        if not answer.is_success:
            raise RewardUnavailable(f"reward server {self.base} answered GET /health with HTTP {answer.status_code}")

    async def __call__(self, images: torch.Tensor, prompts, metadata=None) -> list[float]:
        prompts, meta, sources = list(prompts), _json_metadata(metadata), condition_images(metadata)
        slots = asyncio.Semaphore(self.concurrency)
        async with httpx.AsyncClient(timeout=self.timeout) as client:
            async def one(start: int) -> dict:
                end = min(start + self.batch, len(prompts))
                body = {"prompt": prompts[start:end], **encode_samples(images[start:end]),
                        "condition_images": sources[start:end] if sources else None, "condition_videos": None,
                        "extra": {"metadata": meta[start:end]} if meta else {}}
                async with slots:
                    return await self._post(client, body, end - start)

            answers = await asyncio.gather(*(one(s) for s in range(0, len(prompts), self.batch)))
        rewards = [v for a in answers for v in a["rewards"]]
        names = list(answers[0].get("components") or {}) if answers else []
        if not names:
            return rewards
        if any(list(a.get("components") or {}) != names for a in answers):
            raise RewardServerError(f"reward server {self.base}: the answers name different components")
        return TermScores(rewards, {n: [v for a in answers for v in a["components"][n]] for n in names})

    async def _post(self, client: httpx.AsyncClient, body: dict, count: int) -> dict:
        delay, last = 0.5, ""
        for attempt in range(self.retries + 1):
            if attempt:
                await asyncio.sleep(delay)
                delay = min(2 * delay, 10.0)
            try:
                answer = await client.post(f"{self.base}/compute", json=body)
            except httpx.HTTPError as err:  # refused, reset, timed out: the server may be restarting
                last = f"{type(err).__name__}: {err}"
                continue
            if answer.status_code in _RETRIED_STATUS:
                last = f"HTTP {answer.status_code}"
                continue
            if not answer.is_success:
                raise RewardServerError(f"reward server {self.base} refused POST /compute with HTTP "
                                        f"{answer.status_code}: {answer.text[:200]}")
            return self._checked(answer, count)
        raise RewardUnavailable(f"reward server {self.base}: no answer to POST /compute after {self.retries + 1} "
                                f"attempts (last: {last})")

    def _checked(self, answer: httpx.Response, count: int) -> dict:
        try:
            data = answer.json()
        except ValueError:
            raise RewardServerError(f"reward server {self.base} answered POST /compute with something that is not "
                                    f"JSON: {answer.text[:200]!r}") from None
        if not isinstance(data, dict) or not isinstance(data.get("rewards"), list):
            raise RewardServerError(f"reward server {self.base} answered without a list 'rewards': {str(data)[:200]}")
        components = data.get("components") or {}
        if not isinstance(components, dict):
            raise RewardServerError(f"reward server {self.base}: 'components' is not an object of lists")
        out = {"rewards": self._numbers(data["rewards"], count, "rewards")}
        if components:
            out["components"] = {str(k): self._numbers(v, count, f"components.{k}") for k, v in components.items()}
        return out

    def _numbers(self, values, count: int, field: str) -> list[float]:
        if not isinstance(values, list) or len(values) != count:
            got = len(values) if isinstance(values, list) else type(values).__name__
            raise RewardServerError(f"reward server {self.base} answered {got} {field} for {count} samples")
        for i, value in enumerate(values):
            if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value):
                raise RewardServerError(f"reward server {self.base} answered {value!r} as {field}[{i}]; a reward is "
                                        "a finite number")
        return [float(v) for v in values]


def remote_reward(url: str, options: dict[str, str], check: bool = True) -> RemoteReward:
    """The reward of a `remote@URL,OPTION=VALUE…` spec; `check`: ask the server's /health first."""
    kinds = {"timeout": float, "retries": int, "batch": int, "concurrency": int}
    values = {}
    for key, value in options.items():
        try:
            values[key] = kinds[key](value)
        except ValueError:
            raise ValueError(f"reward remote@{url}: {key}={value!r} is not a {kinds[key].__name__}") from None
    reward = RemoteReward(url, **values)
    if check:
        reward.check_health()
    return reward
