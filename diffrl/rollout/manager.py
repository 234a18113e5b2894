"""The rollout manager: prompt groups → microgroup requests → scored samples, in group order.

Every microgroup of every group is its own asyncio task. A global semaphore caps in-flight
requests at `engine_concurrency × number_of_engines`; each request goes to the engine with the
fewest in-flight requests (ties: the first listed). The reward of a microgroup is computed as
soon as it lands, while other microgroups are still generating (the semaphore is released first,
so scoring never holds an engine slot). Videos from a client that streams a response's outputs
(`HttpEngineClient`) are scored one by one as each arrives, while the rest of the response is still on
the wire (`stream_scoring`). A failed engine costs a retry elsewhere, not a sample: the seeds fix the
result.
"""

from __future__ import annotations

import asyncio
import inspect
import time
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass

import torch

from diffrl.data.condition_images import with_condition_images
from diffrl.data.prompts import NEGATIVE_PROMPT_KEY
from diffrl.engine.protocol import RolloutOutput, RolloutRequest
from diffrl.errors import RequestError
from diffrl.rewards import checked_rewards
from diffrl.rollout.clients import EngineClient, EngineUnavailable
from diffrl.rollout.layout import group_seed_base, microgroups
from diffrl.rollout.settings import RolloutSettings

# score(images [B,C,H,W] in [0,1], prompts, metadata) -> one float per image; sync or async.
RewardFn = Callable[[torch.Tensor, list[str], list[dict]], "list[float] | Awaitable[list[float]]"]


@dataclass
class Sample:
    prompt: str
    group_index: int
    sample_index: int  # k within its group
    seed: int
    output: RolloutOutput
    engine: str
    reward: float | None = None
    reward_terms: dict[str, float] | None = None  # a multi: reward's terms, each unweighted (GDPO reads them)


@dataclass
class RolloutStats:
    seconds: float = 0.0
    requests: int = 0
    retries: int = 0
    images_per_s: float = 0.0


class RolloutManager:
    """Rolls out prompt groups on `clients` as `settings` (the training configuration's rollout section) says: its
    group size, microgroup size and rollout seed (read at each rollout).

    engine_concurrency: in-flight requests per engine; the manager's global cap is this × number of engines.
    max_retries: how many times a request that failed on one engine is sent to another.
    reward_name: how an error about the reward's values names it (the trainer: `--reward SPEC`).
    stream_scoring: videos arriving one by one from a client that streams them are each scored alone as soon as
    they arrive (the reward batch is then always 1 video, whatever the timing). Images, other clients and False:
    one reward batch per microgroup once all of it is in."""

    def __init__(self, clients: Sequence[EngineClient], settings: RolloutSettings, reward_fn: RewardFn | None = None,
                 *, engine_concurrency: int = 2, max_retries: int = 2, reward_name: str = "the reward",
                 stream_scoring: bool = True):
        if not clients:
            raise ValueError("the rollout manager needs at least one engine")
        if engine_concurrency < 1:
            raise ValueError(f"--engine-concurrency must be >= 1, got {engine_concurrency}")
        microgroups(settings.n_samples_per_prompt, settings.rollout_microgroup_size)  # validates both sizes
        self.clients = list(clients)
        self.settings = settings
        self.engine_concurrency, self.max_retries = engine_concurrency, max_retries
        self.reward_name, self.stream_scoring = reward_name, stream_scoring
        self.reward_fn = reward_fn
        self._in_flight = [0] * len(self.clients)
        self._slots: asyncio.Semaphore | None = None  # made per rollout: a semaphore belongs to one event loop
        self.last_stats = RolloutStats()

    def in_flight(self) -> list[int]:
        return list(self._in_flight)

    async def rollout(self, prompts: Sequence[str], request: dict | None = None, first_group_index: int = 0,
                      metadata: Sequence[dict] | None = None,
                      images: Sequence[Sequence[bytes]] | None = None) -> list[list[Sample]]:
        """One group per prompt, group j with index `first_group_index + j` (its seeds follow from it;
        the caller keeps the index monotonic across a run). `request`: the fields copied into every
        `RolloutRequest` (steps, guidance, sde type, …); `metadata[j]` reaches the reward with group j's
        samples; `images[j]`: prompt j's condition images (encoded files), sent with each of its requests
        (`image_path`) and handed to the reward decoded, in its metadata's `condition_images` (float
        `[3, H, W]` in [0, 1]). Returns the groups in order, each with its samples in order."""
        cfg = self.settings
        start, stats = time.perf_counter(), RolloutStats()
        self._slots = asyncio.Semaphore(self.engine_concurrency * len(self.clients))
        first = first_group_index
        metadata = list(metadata) if metadata is not None else [{}] * len(prompts)
        if len(metadata) != len(prompts):
            raise ValueError(f"{len(prompts)} prompts but {len(metadata)} metadata records")
        images = [tuple(i) for i in images] if images is not None else [()] * len(prompts)
        if len(images) != len(prompts):
            raise ValueError(f"{len(prompts)} prompts but {len(images)} condition image lists")
        metadata = [with_condition_images(meta, pictures) for meta, pictures in zip(metadata, images, strict=True)]
        tasks = []
        whole_groups = getattr(self.reward_fn, "scores_groups", False)  # a group reward (rewards/groups.py)
        for offset, (prompt, meta, pictures) in enumerate(zip(prompts, metadata, images)):
            base = group_seed_base(cfg.rollout_seed, first + offset, cfg.n_samples_per_prompt)
            fields = {**(request or {}), **({"image_path": list(pictures)} if pictures else {})}
            if isinstance(meta.get(NEGATIVE_PROMPT_KEY), str):  # the row's own unconditional prompt
                fields["negative_prompt"] = meta[NEGATIVE_PROMPT_KEY]
            parts = [self._microgroup(prompt, meta, fields, first + offset, idx, size, base + idx, stats,
                                      score=not whole_groups)
                     for idx, size in microgroups(cfg.n_samples_per_prompt, cfg.rollout_microgroup_size)]
            tasks.extend([self._scored_group(prompt, meta, first + offset, parts)] if whole_groups else parts)
        results = await asyncio.gather(*tasks)
        groups: list[list[Sample]] = [[] for _ in prompts]
        for samples in results:  # gather keeps task order: group by group, microgroup by microgroup
            groups[samples[0].group_index - first].extend(samples)
        stats.seconds = time.perf_counter() - start
        stats.images_per_s = len(prompts) * cfg.n_samples_per_prompt / stats.seconds
        self.last_stats = stats
        return groups

    async def _scored_group(self, prompt, prompt_meta, group_index, parts) -> list[Sample]:
        """A group reward's group: its microgroups generated (concurrently), then every sample scored in one call,
        while other groups still generate."""
        samples = [s for part in await asyncio.gather(*parts) for s in part]
        scorer = _Scorer(self.reward_fn, prompt, prompt_meta, group_index, 0, self.reward_name)
        _, rewards, terms = await scorer.finish([s.output for s in samples])
        for sample, reward, term in zip(samples, rewards, terms, strict=True):
            sample.reward, sample.reward_terms = reward, term
        return samples

    async def _microgroup(self, prompt, prompt_meta, fields, group_index, idx, size, seed, stats,
                          score: bool = True) -> list[Sample]:
        request = RolloutRequest(prompt=prompt, seed=seed, num_outputs_per_prompt=size, **fields)
        scorer = None if self.reward_fn is None or not score else _Scorer(self.reward_fn, prompt, prompt_meta, group_index, idx,
                                                             self.reward_name)
        try:
            outputs, engine = await self._dispatch(
                request, stats, scorer.arrived if scorer is not None and self.stream_scoring else None)
            rewards = terms = None
            if scorer is not None:  # streamed: scored now, while other microgroups generate
                outputs, rewards, terms = await scorer.finish(outputs)
        finally:
            if scorer is not None:
                scorer.cancel()  # a failed microgroup's scoring
        samples = [Sample(prompt, group_index, idx + i, o.seed, o, engine) for i, o in enumerate(outputs)]
        for sample, reward, term in zip(samples, rewards or [None] * len(samples), terms or [None] * len(samples),
                                        strict=True):
            sample.reward, sample.reward_terms = reward, term
        return samples

    async def _dispatch(self, request: RolloutRequest, stats: RolloutStats,
                        on_output=None) -> tuple[list[RolloutOutput], str]:
        failed: set[int] = set()
        async with self._slots:
            for attempt in range(self.max_retries + 1):
                k = self._least_loaded(exclude=failed)
                self._in_flight[k] += 1
                stats.requests += 1
                client = self.clients[k]
                try:
                    if on_output is not None and getattr(client, "streams_outputs", False):
                        outputs = await client.generate(request, on_output=on_output)
                    else:
                        outputs = await client.generate(request)
                except RequestError:
                    raise
                except EngineUnavailable as err:
                    failed.add(k)
                    if attempt == self.max_retries:
                        raise EngineUnavailable(f"request seed={request.seed} failed {attempt + 1} times; last: {err}")
                    stats.retries += 1
                    continue
                finally:
                    self._in_flight[k] -= 1
                if len(outputs) != request.num_outputs_per_prompt:
                    raise EngineUnavailable(f"{self.clients[k].name} returned {len(outputs)} outputs for "
                                            f"{request.num_outputs_per_prompt} requested")
                return outputs, self.clients[k].name
        raise AssertionError("unreachable")

    def _least_loaded(self, exclude: set[int]) -> int:
        candidates = [k for k in range(len(self.clients)) if k not in exclude] or list(range(len(self.clients)))
        return min(candidates, key=lambda k: self._in_flight[k])


class _Scorer:
    """The rewards of one microgroup: each video handed to `arrived(i, output)` is scored alone at once (a
    task, so the client's next output is not held up); `finish(outputs)` scores what is left in one batch and
    returns the outputs scored (for an index that arrived twice, e.g. from a retry after a broken response:
    the first) with their rewards."""

    def __init__(self, reward_fn: RewardFn, prompt: str, prompt_meta: dict, group_index: int, first_index: int,
                 reward_name: str = "the reward"):
        self.reward_fn, self.prompt, self.prompt_meta, self.reward_name = reward_fn, prompt, prompt_meta, reward_name
        self.group_index, self.first_index = group_index, first_index
        self.outputs: dict[int, RolloutOutput] = {}
        self.rewards: dict[int, float] = {}
        self.terms: dict[int, dict[str, float]] = {}  # a multi: reward's terms per index
        self.tasks: list[asyncio.Task] = []

    def arrived(self, i: int, output: RolloutOutput) -> None:
        image = output.generated_output
        if i in self.outputs or not (image.dim() == 4 and image.shape[1] > 1):  # images: one batch at the end
            return
        self.outputs[i] = output
        self.tasks.append(asyncio.ensure_future(self._score([i])))

    async def finish(self, outputs: list[RolloutOutput]) -> tuple[list[RolloutOutput], list[float], list[dict | None]]:
        rest = [i for i in range(len(outputs)) if i not in self.outputs]
        for i in rest:
            self.outputs[i] = outputs[i]
        if rest:
            await self._score(rest)
        await asyncio.gather(*self.tasks)
        return ([self.outputs[i] for i in range(len(outputs))], [self.rewards[i] for i in range(len(outputs))],
                [self.terms.get(i) for i in range(len(outputs))])

    async def _score(self, indices: list[int]) -> None:
        outputs = [self.outputs[i] for i in indices]
        images = torch.stack([o.generated_output for o in outputs])
        # The keys data/prompts.py's SAMPLE_KEYS lists (a prompt file may not use them).
        meta = [{**self.prompt_meta, "seed": o.seed, "group_index": self.group_index,
                 "sample_index": self.first_index + i} for i, o in zip(indices, outputs)]
        rewards = self.reward_fn(images, [self.prompt] * len(indices), meta)
        if inspect.isawaitable(rewards):
            rewards = await rewards
        prompts = [self.prompt] * len(indices)
        values = checked_rewards(rewards, len(indices), self.reward_name, prompts)
        self.rewards.update(zip(indices, values))
        terms = {name: checked_rewards(v, len(indices), f"{self.reward_name}'s term {name}", prompts)
                 for name, v in (getattr(rewards, "terms", None) or {}).items()}
        if terms:
            self.terms.update((i, {name: v[j] for name, v in terms.items()}) for j, i in enumerate(indices))

    def cancel(self) -> None:
        for task in self.tasks:
            if not task.done():
                task.cancel()
            elif not task.cancelled():
                task.exception()  # retrieved: a failed microgroup raises its own error
