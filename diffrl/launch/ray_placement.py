"""Placement through Ray: engines, reward workers and the trainer as actors in one placement group.

`diffrl train --ray-engines N [--ray-reward-workers R] [--ray-address ADDR]` starts (or joins) a Ray
cluster, reserves one bundle per engine, per reward worker and one for the trainer
(`--ray-colocate`: PACK onto as few nodes as possible, else SPREAD across nodes), starts the actors
and runs the trainer there. The trainer reaches the engines through `RayEngineClient`
(least-loaded routing as for any engine), pushes its weights to them before every rollout, and
sends each microgroup's images to the reward workers in turn (`RayRewardPool`).
`--ray-trainer-ranks T` instead places T data-parallel trainer ranks (one bundle each,
`--ray-gpus-per-trainer`), which form a torch.distributed process group among themselves and train
as under torchrun, each rolling out on its own in-process engine. A single machine keeps working
without Ray.

What crosses an actor boundary is our own formats only: requests as JSON, outputs and weights as
msgpack + safetensors bytes (Ray's envelope around them is internal to the cluster).
"""

from __future__ import annotations

import inspect
import os
from collections.abc import Sequence

import torch

from diffrl.engine.protocol import RolloutOutput, RolloutRequest
from diffrl.engine.spec import EngineSpec, build_engine
from diffrl.serving.wire import decode_outputs, decode_weights, encode_outputs, encode_weights
from diffrl.errors import EngineUnavailable, RequestError
from diffrl.models.lora import LoraSpec
from diffrl.rewards.frames import reads_whole_videos
from diffrl.rewards.workers import FramesInWorkers, decode_batch, encode_batch, worker_scorer
from diffrl.train.config import TrainConfig
from diffrl.train.engines import engine_spec
from diffrl.train.trainer import Trainer


def _ray():
    try:
        import ray
    except ImportError:
        raise ValueError("--ray-engines / --ray-trainer-ranks need Ray: pip install 'ray==2.60.0'") from None
    return ray


class EngineActor:
    """An engine in its own process (a Ray actor), on the GPU of its bundle when it has one."""

    def __init__(self, spec_json: str):
        self.engine = build_engine(EngineSpec.from_json(spec_json))

    def generate(self, request_json: str) -> bytes:
        try:
            outputs = self.engine.generate(RolloutRequest.model_validate_json(request_json))
        except RequestError as err:  # travels as plain data, re-raised on the trainer's side
            return b"E" + f"{err.field}\n{err.message}".encode()
        return b"O" + encode_outputs(outputs)

    def update_weights(self, body: bytes, version: int) -> int:
        return self.engine.update_weights(decode_weights(body), version)

    def add_lora_adapter(self, spec_json: str) -> bool:
        return self.engine.add_lora_adapter(LoraSpec.model_validate_json(spec_json))

    def served(self) -> int:
        return self.engine.denoise_batches


class RayEngineClient:
    """The rollout manager's view of an engine actor."""

    def __init__(self, actor, name: str):
        self.actor, self.name = actor, name

    async def generate(self, request: RolloutRequest) -> list[RolloutOutput]:
        ray = _ray()
        try:
            reply = await self.actor.generate.remote(request.model_dump_json(exclude_none=True))
        except ray.exceptions.RayError as err:  # a dead or failing actor: retried on another engine
            raise EngineUnavailable(f"{self.name}: {err.__class__.__name__}: {err}") from err
        if reply[:1] == b"E":
            field, _, message = reply[1:].decode().partition("\n")
            raise RequestError(field, message)
        return decode_outputs(reply[1:])

    def push_weights(self, tensors: dict[str, torch.Tensor], version: int, token: str | None = None) -> None:
        _ray().get(self.actor.update_weights.remote(encode_weights(tensors), version))

    def add_lora_adapter(self, spec: LoraSpec, token: str | None = None) -> None:
        _ray().get(self.actor.add_lora_adapter.remote(spec.model_dump_json()))


class RewardActor:
    """A reward scorer in its own process: images arrive as safetensors bytes, prompts and metadata as JSON.
    `frames` (--reward-frames) is applied here, as in a `--reward-workers` process (`FramesInWorkers`)."""

    def __init__(self, reward: str, device: str | None = None, frames: int | None = None):
        self.score_fn, self.batches = worker_scorer(reward, device, frames), 0

    def reads_whole_videos(self) -> bool:
        return reads_whole_videos(self.score_fn)

    async def score(self, images: bytes, prompts_json: str, metadata_json: str) -> list[float]:
        rewards = self.score_fn(*decode_batch(images, prompts_json, metadata_json))
        if inspect.isawaitable(rewards):
            rewards = await rewards
        self.batches += 1
        return [float(r) for r in rewards]

    def served(self) -> int:
        return self.batches


class RayRewardPool(FramesInWorkers):
    """The rollout manager's reward function, scored by reward actors in turn (async: microgroups are
    scored in parallel while others are still being generated). `frames`: the actors' --reward-frames."""

    def __init__(self, actors: Sequence, frames: int | None = None):
        super().__init__(frames)
        self.actors, self._next = list(actors), 0

    async def __call__(self, images: torch.Tensor, prompts: list[str], metadata: list[dict] | None = None) -> list[float]:
        actor = self.actors[self._next % len(self.actors)]
        self._next += 1
        images = await self._frames_to_send(images, actor.reads_whole_videos.remote)
        return await actor.score.remote(*encode_batch(images, prompts, metadata))


class TrainerActor:
    """The trainer in its own process, rolling out on the engine actors (scoring on reward actors)."""

    def __init__(self, cfg: TrainConfig, engines: Sequence, names: Sequence[str], reward_actors: Sequence = ()):
        self.trainer = Trainer(cfg, extra_engines=[RayEngineClient(a, n) for a, n in zip(engines, names, strict=True)],
                               reward_fn=RayRewardPool(reward_actors, cfg.task.reward_frames)
                               if reward_actors else None)

    def train(self) -> dict:
        return self.trainer.train()


class TrainerRankActor:
    """One data-parallel trainer rank: the process group comes from the environment torchrun would
    set, so the trainer runs exactly as under torchrun (FSDP2, its share of each rollout on its
    in-process engine, rank 0 writing the run folder)."""

    def rendezvous(self) -> tuple[str, int]:
        """This node's address and a free port, for rank 0 to host the process group."""
        import socket

        import ray

        address = ray.util.get_node_ip_address()
        with socket.socket() as sock:
            sock.bind((address, 0))
            return address, sock.getsockname()[1]

    def setup(self, cfg: TrainConfig, rank: int, world_size: int, address: str, port: int,
              reward_actors: Sequence = ()) -> None:
        # Ray shows each actor only its own GPUs, so the rank's device is local index 0.
        os.environ.update(RANK=str(rank), WORLD_SIZE=str(world_size), LOCAL_RANK="0", MASTER_ADDR=address,
                          MASTER_PORT=str(port))
        self.trainer = Trainer(cfg, reward_fn=RayRewardPool(reward_actors, cfg.task.reward_frames)
                               if reward_actors else None)

    def train(self) -> dict:
        return {**self.trainer.train(), "ray/world_size": self.trainer.parallel.world_size}


def launch(cfg: TrainConfig) -> dict:
    """Place the engines, reward workers and trainer rank(s) in one placement group and train there."""
    ray = _ray()
    from ray.util.placement_group import placement_group, remove_placement_group
    from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

    gpus, trainer_gpus, ranks = cfg.placement.ray_gpus_per_engine, cfg.placement.ray_gpus_per_trainer, cfg.placement.ray_trainer_ranks
    bundles = ([{"CPU": 1, **({"GPU": gpus} if gpus else {})} for _ in range(cfg.placement.ray_engines)]
               + [{"CPU": 1}] * cfg.placement.ray_reward_workers
               + [{"CPU": 1, **({"GPU": trainer_gpus} if trainer_gpus else {})} for _ in range(ranks)])
    if not ray.is_initialized():
        # A local cluster gets a logical CPU per bundle even on a small machine (actors mostly wait).
        local = {} if cfg.placement.ray_address else {"num_cpus": max(len(bundles), os.cpu_count() or 1)}
        ray.init(address=cfg.placement.ray_address, include_dashboard=False, **local)
    group = placement_group(bundles, strategy="PACK" if cfg.placement.ray_colocate else "SPREAD")
    try:
        ray.get(group.ready(), timeout=cfg.placement.ray_placement_timeout_s)
    except ray.exceptions.GetTimeoutError:
        remove_placement_group(group)
        raise ValueError(f"Ray could not place {len(bundles)} bundles {bundles} within "
                         f"{cfg.placement.ray_placement_timeout_s} s; cluster resources: {ray.cluster_resources()}") from None
    try:
        def in_bundle(i):
            return PlacementGroupSchedulingStrategy(placement_group=group, placement_group_bundle_index=i)

        engine_cls = ray.remote(EngineActor)
        # Threaded actors: requests waiting at an engine can share its denoising batches.
        engines = [engine_cls.options(num_cpus=1, num_gpus=gpus, max_concurrency=max(1, cfg.engine.engine_concurrency),
                                      scheduling_strategy=in_bundle(i)).remote(
            engine_spec(cfg, torch.device("cuda" if gpus else "cpu")).to_json()) for i in range(cfg.placement.ray_engines)]
        names = [f"ray-engine-{i}" for i in range(cfg.placement.ray_engines)]
        rewards = [ray.remote(RewardActor).options(num_cpus=1, max_concurrency=8,
                                                   scheduling_strategy=in_bundle(cfg.placement.ray_engines + i)).remote(
            cfg.task.reward, cfg.task.reward_device, cfg.task.reward_frames)
                   for i in range(cfg.placement.ray_reward_workers)]
        # The trainer actors run the plain loop: their own config no longer asks for Ray.
        trainer_cfg = cfg.replace(ray_engines=0, ray_reward_workers=0, ray_trainer_ranks=1)
        first_trainer = len(bundles) - ranks
        if ranks == 1:
            trainer = ray.remote(TrainerActor).options(num_cpus=1, num_gpus=trainer_gpus,
                                                       scheduling_strategy=in_bundle(first_trainer)).remote(
                trainer_cfg, engines, names, rewards)
            last = ray.get(trainer.train.remote())
        else:
            rank_cls = ray.remote(TrainerRankActor)
            trainers = [rank_cls.options(num_cpus=1, num_gpus=trainer_gpus,
                                         scheduling_strategy=in_bundle(first_trainer + r)).remote() for r in range(ranks)]
            address, port = ray.get(trainers[0].rendezvous.remote())
            # Every rank joins the process group in its setup, so they start together.
            ray.get([t.setup.remote(trainer_cfg, r, ranks, address, port, rewards) for r, t in enumerate(trainers)])
            last = ray.get([t.train.remote() for t in trainers])[0]  # rank 0's record
        last["ray/engine_batches"] = ray.get([e.served.remote() for e in engines])
        last["ray/reward_batches"] = ray.get([r.served.remote() for r in rewards])
        return last
    finally:
        remove_placement_group(group)
