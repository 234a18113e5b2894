"""One `EngineSpec` makes every kind of engine, and they all denoise a request to the same bits on a CPU: the
in-process engine (`build_engine`), the colocated engine process, the served engine behind HTTP (`diffrl serve`'s
builder) and the Ray engine actor's constructor (called here without Ray: it is a plain class Ray wraps)."""

import ast
import asyncio
import dataclasses
from pathlib import Path

import pytest
import torch

from diffrl.serving.colocated import ColocatedEngineClient
from diffrl.engine.protocol import RolloutRequest
from diffrl.serving.server import ServeConfig, create_app, engine_spec, serving_in_thread
from diffrl.engine.spec import EngineSpec, build_engine
from diffrl.launch.ray_placement import EngineActor
from diffrl.models.demo import SHIPPED_DEMO_MODEL
from diffrl.rollout.clients import HttpEngineClient
from diffrl.train.config import TrainConfig
from diffrl.train.engines import engine_spec as train_engine_spec

REQUEST = RolloutRequest(prompt="a red circle", seed=7, num_outputs_per_prompt=2, num_inference_steps=3,
                         guidance_scale=2.0, rollout=True, rollout_sde_step_indices=[0, 1],
                         rollout_return_dit_trajectory=True)
SPEC = EngineSpec(model_path=str(SHIPPED_DEMO_MODEL), family="demo", max_outputs_per_request=8, max_batch_outputs=8)


def _same_bits(a, b):
    assert len(a) == len(b) == REQUEST.num_outputs_per_prompt
    for x, y in zip(a, b, strict=True):
        assert x.seed == y.seed
        assert torch.equal(x.generated_output, y.generated_output)
        assert torch.equal(x.rollout_log_probs, y.rollout_log_probs)
        assert torch.equal(x.dit_trajectory.latents, y.dit_trajectory.latents)


@pytest.fixture(scope="module")
def reference():
    return build_engine(SPEC).generate(REQUEST)


def test_the_spec_round_trips_through_json():
    spec = dataclasses.replace(SPEC, compile=True, limits={"max_prompt_chars": 100}, autocast_dtype="bfloat16")
    assert EngineSpec.from_json(spec.to_json()) == spec
    assert spec.engine_config().max_prompt_chars == 100


def test_colocated_engine_process_denoises_the_same_bits(reference):
    client = ColocatedEngineClient(SPEC, buffer_bytes=2**20)
    try:
        _same_bits(asyncio.run(client.generate(REQUEST)), reference)
    finally:
        client.close()


def test_served_engine_denoises_the_same_bits(reference):
    spec = engine_spec(ServeConfig(diffusion_model_family="demo", device="cpu", max_outputs_per_request=8,
                                   max_batch_outputs=8))
    assert dataclasses.replace(spec, limits={}) == SPEC  # what `diffrl serve` builds: the same engine, bounded
    engine = build_engine(spec)
    assert engine.config.max_prompt_chars == ServeConfig().max_prompt_chars

    async def over_http(url):
        client = HttpEngineClient(url)
        try:
            return await client.generate(REQUEST)
        finally:
            client.close()

    with serving_in_thread(create_app(engine)) as url:
        _same_bits(asyncio.run(over_http(url)), reference)


def test_ray_engine_actor_denoises_the_same_bits(reference):
    actor = EngineActor(SPEC.to_json())
    _same_bits(actor.engine.generate(REQUEST), reference)


def test_a_training_run_gives_every_engine_its_dtypes_speed_options_and_batching():
    """The Ray actors and the engine process get what the in-process engine has (Ray's used to drop the dtype,
    speed options, compilation and the deterministic batch size)."""
    cfg = TrainConfig().replace(use_lora=False, mixed_precision="bf16", compile=True, fuse_qkv=True,
                                deterministic_mode=True, engine_max_batch_outputs=512)
    spec = train_engine_spec(cfg, torch.device("cpu"), "demo")
    assert (spec.dtype, spec.autocast_dtype, spec.transformer_dtype) == ("bfloat16", "bfloat16", "float32")
    assert spec.compile and spec.fuse_qkv and spec.deterministic
    assert spec.max_batch_outputs == 1  # deterministic mode: each request denoised alone
    assert EngineSpec.from_json(spec.to_json()) == spec


def _engine_constructions(path: Path) -> list[int]:
    """Lines of `path` that call the Engine class (by any name it is imported as, or as `module.Engine`)."""
    tree = ast.parse(path.read_text(), filename=str(path))
    names = {"Engine"} | {alias.asname for node in ast.walk(tree) if isinstance(node, ast.ImportFrom)
                          for alias in node.names if alias.name == "Engine" and alias.asname}
    return [node.lineno for node in ast.walk(tree) if isinstance(node, ast.Call) and (
        (isinstance(node.func, ast.Name) and node.func.id in names)
        or (isinstance(node.func, ast.Attribute) and node.func.attr == "Engine"))]


def test_build_engine_is_the_only_way_the_package_makes_an_engine():
    """Product code builds every engine from an `EngineSpec` (`build_engine`); tests of the Engine class itself and
    benchmarks may construct one directly."""
    root = Path(__file__).resolve().parents[1]
    builder = root / "diffrl" / "engine" / "spec.py"
    assert _engine_constructions(builder), "the scan no longer sees build_engine's own Engine(...)"
    direct = [f"{path.relative_to(root)}:{line}" for path in sorted((root / "diffrl").rglob("*.py")) if path != builder
              for line in _engine_constructions(path)]
    assert not direct, "engines made without EngineSpec/build_engine (diffrl.engine.spec):\n  " + "\n  ".join(direct)


def test_an_engine_around_a_loaded_model_needs_no_model_path():
    family = build_engine(SPEC).family
    spec = EngineSpec(family="demo", max_outputs_per_request=4, max_batch_outputs=2, limits={"max_prompt_chars": 50})
    engine = build_engine(spec, family=family)
    assert engine.family is family and engine.config.max_batch_outputs == 2 and engine.config.max_prompt_chars == 50
    with pytest.raises(ValueError, match="build_engine\\(spec, family=...\\)"):
        build_engine(spec)
