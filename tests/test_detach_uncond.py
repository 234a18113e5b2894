"""`--detach-uncond`: CFG's unconditional half runs as a forward of its own and carries no gradient (flow_grpo's SD3
train step), in the rollouts as in the replay, so the first pass still replays the rollout exactly."""

import pytest
import torch

from diffrl.engine.spec import EngineSpec, load_family
from diffrl.models.base import Latents
from diffrl.train.engines import engine_spec
from diffrl.train.trainer import Trainer
from test_compile import needs_compiler
from test_trainer import tiny_config


def _inputs(family, batch=3, seed=0):
    g = torch.Generator().manual_seed(seed)
    latents = family.prepare_latents([torch.Generator().manual_seed(seed + i) for i in range(batch)], 64, 64)
    cond = family.encode_prompts(["a red circle", "two blue squares", "a green triangle"][:batch])
    uncond = family.encode_prompts([""] * batch)
    sigma = torch.full((batch,), 0.7)
    weights = torch.randn(latents.tokens.shape, generator=g)
    return latents, sigma, cond, uncond, weights


def _grads(family, loss) -> list[torch.Tensor]:
    params = [p for p in family.transformer.parameters() if p.requires_grad]
    return list(torch.autograd.grad(loss, params, allow_unused=True))


def test_the_velocity_is_the_same_and_only_the_conditional_half_has_a_gradient(tiny_family):
    family = tiny_family
    family.transformer.requires_grad_(True)
    latents, sigma, cond, uncond, w = _inputs(family)
    scale = 3.0
    joint = family.velocity(family.transformer, latents, sigma, cond, uncond, scale)
    family.detach_uncond = True
    apart = family.velocity(family.transformer, latents, sigma, cond, uncond, scale)
    assert torch.allclose(apart, joint, atol=1e-6, rtol=0)  # one forward of 2B rows or two of B: the same CFG
    # The gradient is the conditional half's alone, scaled by CFG: ∂(u + s·(c − u)) = s·∂c with u detached.
    got = _grads(family, (apart * w).sum())
    cond_only = family.run_transformer(family.transformer, latents, sigma.float(), cond)
    want = _grads(family, (scale * cond_only * w).sum())
    both = _grads(family, (joint * w).sum())
    assert all((a is None and b is None) or torch.allclose(a, b, atol=1e-5, rtol=1e-4) for a, b in zip(got, want))
    assert any(a is not None and not torch.allclose(a, b, atol=1e-5, rtol=1e-4) for a, b in zip(got, both))


def test_the_runs_engine_takes_the_setting(tiny_model_dir, tmp_path):
    cfg = tiny_config(tiny_model_dir, tmp_path / "run", detach_uncond=True)
    spec = engine_spec(cfg, torch.device("cpu"))
    assert spec.detach_uncond and EngineSpec.from_json(spec.to_json()).detach_uncond
    assert load_family(spec).detach_uncond  # an engine process elsewhere runs CFG's halves apart too


@pytest.mark.parametrize("use_lora", [False, True])
def test_a_run_with_detached_uncond_replays_its_rollout_exactly(tiny_model_dir, tmp_path, use_lora):
    trainer = Trainer(tiny_config(tiny_model_dir, tmp_path / "run", detach_uncond=True, use_lora=use_lora,
                                  num_steps_per_rollout=1, global_batch_size=6))
    assert trainer.policy.family.detach_uncond and trainer.engine.family is trainer.policy.family
    record = trainer.rollout_and_update(0)
    assert record["train/log_prob_mean_abs_diff"] == 0.0 and record["train/clipfrac"] == 0.0
    assert record["train/grad_norm"] > 0


@pytest.mark.slow  # inductor on 2 cores
@needs_compiler
def test_a_compiled_run_with_detached_uncond_replays_exactly(tiny_model_dir, tmp_path):
    """Compiled without checkpointing (the SD3.5 GPU recipes' way), the engine samples in the training graph in pieces
    of the micro-batch, each CFG half as its own forward as the replay runs them: the first pass is exact."""
    torch._dynamo.reset()
    trainer = Trainer(tiny_config(tiny_model_dir, tmp_path / "run", use_lora=True, compile=True, detach_uncond=True,
                                  gradient_checkpointing=False, num_steps_per_rollout=1, global_batch_size=6,
                                  micro_batch_size=4))
    assert trainer.engine.config.forward_graph == "training"
    record = trainer.rollout_and_update(0)
    assert record["train/log_prob_mean_abs_diff"] == 0.0 and record["train/first_pass_clipfrac"] == 0.0


# The families whose CFG pairing rewrites the unconditional half (SANA, Lumina 2 and Cosmos3 pick the negative
# prompt's own encoding) and two that batch the halves as they are, in the default run; the rest slow.
_DEFAULT_RUN = ("sana", "lumina2", "cosmos3", "sd3", "qwen_image")
_FAMILIES = ("sd3", "flux1", "qwen_image", "cosmos3", "wan2_2", "ltx2", "krea2", "flux2", "flux3_image", "z_image", "sana",
             "lumina2", "cogview4", "hidream", "chroma", "hunyuan_video15")


@pytest.mark.parametrize("name", [n if n in _DEFAULT_RUN else pytest.param(n, marks=pytest.mark.slow)
                                  for n in _FAMILIES])
def test_every_family_samples_the_same_with_the_halves_apart(name, tmp_path):
    """With the halves apart each runs with the conditioning the family's pairing gives it: the engine's samples are
    the batched CFG's (bit for bit where the family's forward is batch-invariant on the CPU)."""
    import importlib

    from diffrl.engine.engine import Engine, EngineConfig
    from diffrl.engine.protocol import RolloutRequest
    from diffrl.models.registry import resolve_family

    path = importlib.import_module(f"diffrl.models.random_checkpoints.{name}").save_random_checkpoint(
        tmp_path / f"{name}-tiny")
    family = resolve_family(None, path).load(path)
    size = dict(height=64, width=64)
    if family.generates_video:
        size["num_frames"] = 5 if name in ("cosmos3", "wan2_2") else 9
    request = RolloutRequest(**size, prompt="a red cat", negative_prompt="blurry", seed=3, num_outputs_per_prompt=2,
                             num_inference_steps=2, guidance_scale=3.0, rollout=True, rollout_sde_step_indices=[0])
    outputs = []
    for detach in (False, True):
        family.detach_uncond = detach
        outputs.append(Engine(family, EngineConfig(max_outputs_per_request=4)).generate(request))
    for joint, apart in zip(*outputs, strict=True):
        assert torch.allclose(joint.generated_output, apart.generated_output, atol=1e-5, rtol=0)
        assert torch.allclose(joint.rollout_log_probs, apart.rollout_log_probs, atol=1e-4, rtol=0)


# ---------------------------------------------------------------- the rollout's unconditional half, reused
def test_a_given_unconditional_velocity_stands_for_its_forward(tiny_family):
    family = tiny_family
    family.detach_uncond = True
    latents, sigma, cond, uncond, _ = _inputs(family)
    v, v_uncond = family.velocity_and_uncond(family.transformer, latents, sigma, cond, uncond, 3.0)
    assert torch.equal(v_uncond, family.run_transformer(family.transformer, latents, sigma, uncond))
    rows = _count_rows(family)
    again = family.velocity_and_uncond(family.transformer, latents, sigma, cond, uncond, 3.0,
                                       uncond_velocity=v_uncond)[0]
    assert torch.equal(again, v) and rows() == len(sigma)  # the conditional forward alone
    family.detach_uncond = False  # with a graph through the half, its value is not the forward's to replace
    with pytest.raises(ValueError, match="detach_uncond"):
        family.velocity_and_uncond(family.transformer, latents, sigma, cond, uncond, 3.0, uncond_velocity=v_uncond)


def _count_rows(family):
    """Counts the rows every transformer forward of `family` runs from now on; returns the reader."""
    seen, forward = [0], family.run_transformer

    def counted(transformer, latents, sigma, cond):
        seen[0] += latents.tokens.shape[0]
        return forward(transformer, latents, sigma, cond)

    family.run_transformer = counted
    return lambda: seen[0]


def _request(**fields):
    from diffrl.engine.protocol import RolloutRequest

    return RolloutRequest(**{**dict(prompt="a red circle", negative_prompt="", seed=5, num_outputs_per_prompt=3,
                                    num_inference_steps=4, guidance_scale=3.0, rollout=True, height=64, width=64,
                                    rollout_sde_step_indices=[1, 2], rollout_return_dit_trajectory=True,
                                    rollout_return_uncond_velocity=True), **fields})


def test_the_engine_returns_the_unconditional_velocity_of_each_sde_step(tiny_family):
    from diffrl.engine.engine import Engine
    from diffrl.serving.wire import decode_outputs, encode_outputs

    family = tiny_family
    family.detach_uncond = True
    outputs = Engine(family).generate(_request())
    uncond = family.encode_prompts([""] * 3)
    ids = family.prepare_latents([torch.Generator()], 64, 64).ids
    trajectory = outputs[0].dit_trajectory
    assert all(out.uncond_velocities.shape == (2, *trajectory.latents.shape[1:]) for out in outputs)
    for k, step in enumerate([1, 2]):  # the forward of the latents entering the step, the request's 3 rows as one batch
        x = torch.stack([out.dit_trajectory.latents[trajectory.latent_step_indices.tolist().index(step)]
                         for out in outputs])
        with torch.no_grad():
            want = family.run_transformer(family.transformer, Latents(x, ids), trajectory.sigmas[step].expand(3), uncond)
        assert torch.equal(torch.stack([out.uncond_velocities[k] for out in outputs]), want.float())
    # The compact wire carries them bit for bit.
    back = decode_outputs(encode_outputs(outputs))
    assert all(torch.equal(a.uncond_velocities, b.uncond_velocities) for a, b in zip(outputs, back))


@pytest.mark.parametrize("fields,detach", [({}, False), ({"guidance_scale": 1.0}, True),
                                           ({"rollout_return_uncond_velocity": False}, True)])
def test_no_unconditional_velocity_comes_back_where_there_is_none_to_give(tiny_family, fields, detach):
    from diffrl.engine.engine import Engine

    tiny_family.detach_uncond = detach
    assert all(out.uncond_velocities is None for out in Engine(tiny_family).generate(_request(**fields)))


@pytest.mark.parametrize("steps_per_rollout", [1, 2])
def test_reusing_the_rollouts_half_trains_exactly_as_computing_it(tiny_model_dir, tmp_path, steps_per_rollout):
    """The same rollout trained with the half taken from the rollout and with it computed: the same records and the
    same weights, bit for bit where the replay's micro-batches are the rollout's batches (one step per rollout here;
    with two, micro-batches of 2 and 1 replay batches of 3, and the CPU's kernels round a row by its batch: within
    rounding). The reuse runs one forward of the half fewer per pair of the first optimizer step (the later steps
    hold new weights and compute it)."""
    results = []
    for reuse in (True, False):
        trainer = Trainer(tiny_config(tiny_model_dir, tmp_path / f"run-{reuse}", detach_uncond=True,
                                      reuse_rollout_uncond=reuse, num_steps_per_rollout=steps_per_rollout,
                                      global_batch_size=6 // steps_per_rollout))
        rows = _count_rows(trainer.policy.family)
        record = trainer.rollout_and_update(0)
        results.append((record, [p.detach().clone() for p in trainer.policy.params], rows()))
    (reused, weights, rows_reused), (computed, weights_computed, rows_computed) = results
    assert reused["train/log_prob_mean_abs_diff"] == 0.0 and reused["train/first_pass_clipfrac"] == 0.0
    same = torch.equal if steps_per_rollout == 1 else lambda a, b: torch.allclose(a, b, rtol=1e-5, atol=1e-7)
    for key in ("train/loss", "train/grad_norm", "train/approx_kl", "train/clipfrac"):
        assert same(torch.tensor(reused[key]), torch.tensor(computed[key])), key
    assert all(same(a, b) for a, b in zip(weights, weights_computed, strict=True))
    first_step_pairs = reused["train/pairs"] // steps_per_rollout
    assert rows_computed - rows_reused == first_step_pairs


def test_a_replayed_or_remote_rollout_computes_the_half(tiny_model_dir, tmp_path):
    trainer = Trainer(tiny_config(tiny_model_dir, tmp_path / "run", detach_uncond=True))
    assert trainer.objective.request(0)["rollout_return_uncond_velocity"]
    trainer.policy.remote_engines = [object()]  # outputs from engines elsewhere: their numbers are not this graph's
    assert "rollout_return_uncond_velocity" not in trainer.objective.request(1)
    trainer.policy.remote_engines = []
    off = Trainer(tiny_config(tiny_model_dir, tmp_path / "off", detach_uncond=True, reuse_rollout_uncond=False))
    assert "rollout_return_uncond_velocity" not in off.objective.request(0)


def test_no_family_changes_velocity_itself():
    """The engine calls `velocity_and_uncond`; a family that overrode `velocity` would sample one way in the trainer's
    plain calls and another in the engine's: each family changes `velocity_and_uncond` instead."""
    from diffrl.models.base import FamilyAdapter
    from diffrl.models.registry import family_names, get_family

    names = family_names()
    assert "ltx2" in names and "sd3" in names
    assert [n for n in names if get_family(n).velocity is not FamilyAdapter.velocity] == []
