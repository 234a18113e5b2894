"""The in-process engine: encode once, per-output seeds, outputs reproducible across microgroup
sizes, and every bad input refused by name with the engine still serving."""

import asyncio

import pytest
import torch

from diffrl.engine.engine import Engine, EngineConfig
from diffrl.engine.protocol import RolloutRequest
from diffrl.errors import RequestError
from diffrl.rollout import InProcessEngineClient, RolloutManager, RolloutSettings

ROLLOUT = dict(num_inference_steps=4, guidance_scale=3.0, rollout=True, rollout_sde_type="sde",
               rollout_noise_level=0.7, rollout_sde_step_indices=[1, 2], rollout_return_dit_trajectory=True)


@pytest.fixture
def engine(tiny_family):
    return Engine(tiny_family, EngineConfig(max_outputs_per_request=16))


def test_generate_returns_one_record_per_output(engine):
    engine.weight_version = 7
    outs = engine.generate(RolloutRequest(prompt="a red circle", seed=100, num_outputs_per_prompt=3,
                                          rollout_return_denoising_env=True, **ROLLOUT))
    assert [o.seed for o in outs] == [100, 101, 102]
    assert all(o.weight_version == 7 for o in outs)
    first = outs[0]
    assert first.generated_output.shape == (3, 64, 64)
    assert first.rollout_log_probs.shape == (2,)
    traj = first.dit_trajectory
    assert traj.latent_step_indices.tolist() == [1, 2, 3]  # each SDE step and the one after
    assert traj.latents.shape == (3, 256, 48) and traj.sigmas.shape == (5,)
    torch.testing.assert_close(traj.timesteps, traj.sigmas[[1, 2, 3]])
    # Conditioning travels once per request, unexpanded.
    assert first.denoising_env["prompt_embeds"].shape[0] == 1
    assert "negative_prompt_embeds" in first.denoising_env
    assert all(o.denoising_env is None for o in outs[1:])
    assert not torch.equal(outs[0].generated_output, outs[1].generated_output)


def test_prompt_is_encoded_once_per_request(tiny_family, monkeypatch):
    engine = Engine(tiny_family, EngineConfig(max_outputs_per_request=8, prompt_cache_bytes=0))
    calls = []
    original = engine.family.encode_prompts
    monkeypatch.setattr(engine.family, "encode_prompts", lambda prompts: calls.append(list(prompts)) or original(prompts))
    engine.generate(RolloutRequest(prompt="two squares", num_outputs_per_prompt=8, negative_prompt="blurry", **ROLLOUT))
    assert calls == [["two squares"], ["blurry"]]
    calls.clear()
    engine.generate(RolloutRequest(prompt="two squares", num_outputs_per_prompt=8, num_inference_steps=2, guidance_scale=1.0))
    assert calls == [["two squares"]]  # CFG off: no negative branch at all


def test_encoded_prompts_are_kept_for_later_requests_of_the_same_weights(tiny_family, monkeypatch):
    """A rollout sends a prompt's microgroups one after another (and a video family's M = 1 requests one
    sample each): the engine encodes the prompt once per weight version, within its byte budget, and the
    samples are those of an engine that encodes every time."""
    def counting(engine):
        calls = []
        original = engine.family.encode_prompts
        monkeypatch.setattr(engine.family, "encode_prompts",
                            lambda prompts: calls.append(prompts[0]) or original(prompts))
        return calls

    def request(prompt, seed):
        return RolloutRequest(prompt=prompt, seed=seed, num_outputs_per_prompt=2, negative_prompt="blurry",
                              rollout_return_denoising_env=True, **ROLLOUT)

    uncached = Engine(tiny_family, EngineConfig(max_outputs_per_request=8, prompt_cache_bytes=0))
    expected = [uncached.generate(request("a red circle", s)) for s in (0, 2)]
    engine = Engine(tiny_family, EngineConfig(max_outputs_per_request=8))
    calls = counting(engine)
    got = [engine.generate(request("a red circle", s)) for s in (0, 2)]
    assert calls == ["a red circle", "blurry"] and engine.prompt_encodes == 2
    # A caller changing a response's conditioning in place does not reach the cached encoding.
    env = got[0][0].denoising_env
    for key in ("prompt_embeds", "negative_prompt_embeds"):
        env[key].mul_(0.0)
    again = engine.generate(request("a red circle", 2))
    assert engine.prompt_encodes == 2 and all(torch.equal(a.generated_output, b.generated_output)
                                              for a, b in zip(again, expected[1], strict=True))
    for outs, want in zip(got, expected, strict=True):
        assert all(torch.equal(a.generated_output, b.generated_output) and torch.equal(a.rollout_log_probs,
                   b.rollout_log_probs) for a, b in zip(outs, want, strict=True))
    # New weights: encoded again (only the transformer changes, but no encoding outlives a version).
    name, param = next(iter(engine.family.transformer.named_parameters()))
    engine.update_weights({name: param.detach().clone()})
    engine.generate(request("a red circle", 4))
    assert calls[2:] == ["a red circle", "blurry"]
    # A budget of one encoding: the older one goes first.
    one = Engine(tiny_family, EngineConfig(max_outputs_per_request=8))._encode(["a red circle"])[0]
    size = sum(t.numel() * t.element_size() for t in (one.embeds, one.ids))
    small = Engine(tiny_family, EngineConfig(max_outputs_per_request=8, prompt_cache_bytes=size))
    small._encode(["a red circle"]), small._encode(["two squares"]), small._encode(["two squares"])
    assert small.prompt_encodes == 2
    small._encode(["a red circle"])
    assert small.prompt_encodes == 3
    small.clear_prompt_cache()
    small._encode(["a red circle"])
    assert small.prompt_encodes == 4


def test_plain_generation_is_ode_without_log_probs(engine):
    out = engine.generate(RolloutRequest(prompt="a red circle", num_inference_steps=3))[0]
    assert out.rollout_log_probs is None and out.dit_trajectory is None and out.denoising_env is None


def _group_through_manager(engine, microgroup_size, n=16):
    settings = RolloutSettings(n_samples_per_prompt=n, rollout_microgroup_size=microgroup_size, rollout_seed=31)
    manager = RolloutManager([InProcessEngineClient(engine)], settings, engine_concurrency=2)
    return asyncio.run(manager.rollout(["a blue square to the left of a yellow circle"], ROLLOUT, first_group_index=3))[0]


def test_sample_k_is_bit_identical_for_every_microgroup_size(engine):
    reference = _group_through_manager(engine, 16)
    assert [s.seed for s in reference] == [31 + 3 * 16 + k for k in range(16)]
    for m in (1, 2, 4, 8, 5):
        group = _group_through_manager(engine, m)
        for ref, sample in zip(reference, group, strict=True):
            assert sample.seed == ref.seed and sample.sample_index == ref.sample_index
            assert torch.equal(sample.output.generated_output, ref.output.generated_output), (m, sample.sample_index)
            assert torch.equal(sample.output.rollout_log_probs, ref.output.rollout_log_probs)
            assert torch.equal(sample.output.dit_trajectory.latents, ref.output.dit_trajectory.latents)


@pytest.mark.parametrize("fields,field", [
    (dict(num_outputs_per_prompt=0), "num_outputs_per_prompt"),
    (dict(num_outputs_per_prompt=17), "num_outputs_per_prompt"),
    (dict(height=48), "height"),
    (dict(width=1024), "width"),
    (dict(image="data:image/png;base64,AAAA"), "image"),
    (dict(input_reference="ref.png"), "input_reference"),
    (dict(num_frames=9), "num_frames"),
    (dict(true_cfg_scale=4.0, guidance_scale=0.5), "guidance_scale"),  # CFG switched on at a scale below 1
    (dict(rollout=True, rollout_sde_step_indices=[0, 10]), "rollout_sde_step_indices"),
    (dict(rollout=True, rollout_sde_step_indices=[1, 1]), "rollout_sde_step_indices"),
    (dict(rollout=True, rollout_return_step_indices=[11]), "rollout_return_step_indices"),
])
def test_bad_requests_are_refused_by_name_and_the_engine_keeps_serving(engine, fields, field):
    with pytest.raises(RequestError) as err:
        engine.generate(RolloutRequest(prompt="a red circle", num_inference_steps=10, **fields))
    assert err.value.field == field
    assert engine.in_flight == 0
    assert len(engine.generate(RolloutRequest(prompt="a red circle", num_inference_steps=1))) == 1


def test_schema_refuses_unknown_fields_and_types():
    from pydantic import ValidationError

    for bad in (dict(prompt="x", rollout_sde_type="euler"), dict(prompt="x", bogus=1), dict(prompt="x", seed=-1)):
        with pytest.raises(ValidationError):
            RolloutRequest(**bad)


def test_waiting_requests_share_one_batch_and_give_the_same_samples(tiny_family):
    """Requests that queue while the model is busy are denoised together when their settings agree;
    each output is still exactly what its request alone would give (per-output generators)."""
    import threading

    fields = {**ROLLOUT, "rollout_return_denoising_env": True}
    requests = [RolloutRequest(prompt="a red circle", seed=5, num_outputs_per_prompt=2, **fields),
                RolloutRequest(prompt="two blue squares", seed=40, num_outputs_per_prompt=3, negative_prompt="x", **fields),
                RolloutRequest(prompt="a red circle", seed=5, num_outputs_per_prompt=2, **{**fields, "guidance_scale": 1.0})]
    alone = Engine(tiny_family, EngineConfig(max_outputs_per_request=8))
    expected = [alone.generate(r) for r in requests]
    assert alone.denoise_batches == 3

    engine = Engine(tiny_family, EngineConfig(max_outputs_per_request=8, max_batch_outputs=8))
    results: dict[int, list] = {}
    with engine._model_lock:  # the model is "busy": all three requests queue up
        threads = [threading.Thread(target=lambda k=k: results.update({k: engine.generate(requests[k])}))
                   for k in range(3)]
        for t in threads:
            t.start()
        while len(engine._waiting) < 3:
            threading.Event().wait(0.01)
    for t in threads:
        t.join()
    assert engine.denoise_batches == 2  # the two CFG-3 requests together, the CFG-1 one alone
    for k in range(3):
        for got, want in zip(results[k], expected[k], strict=True):
            assert got.seed == want.seed
            assert torch.equal(got.generated_output, want.generated_output)
            assert torch.equal(got.rollout_log_probs, want.rollout_log_probs)
            assert torch.equal(got.dit_trajectory.latents, want.dit_trajectory.latents)
        assert results[k][0].denoising_env["prompt_embeds"].shape[0] == 1  # still once per request


def test_an_idle_engine_gathers_a_rollouts_requests_into_one_batch(tiny_family):
    """A rollout's microgroups arrive within milliseconds: the first no longer takes the idle model
    alone (`batch_wait_s`). Samples are the same with the wait off."""
    import asyncio

    settings = RolloutSettings(n_samples_per_prompt=4, rollout_microgroup_size=2)
    request = {**ROLLOUT, "guidance_scale": 1.0}
    images, batches = {}, {}
    # A wait far longer than thread start-up, so the count is not a race on a loaded CI machine.
    for wait in (0.0, 0.5):
        engine = Engine(tiny_family, EngineConfig(max_outputs_per_request=8, max_batch_outputs=8, batch_wait_s=wait))
        manager = RolloutManager([InProcessEngineClient(engine)], settings, engine_concurrency=8)
        groups = asyncio.run(manager.rollout(["a red circle", "two circles"], request))
        images[wait] = torch.stack([s.output.generated_output for g in groups for s in g])
        batches[wait] = engine.denoise_batches
    assert batches[0.5] == 1  # 4 requests of 2 outputs, one batch of 8 (without the wait: 2, the first alone)
    assert torch.equal(images[0.0], images[0.5])


def test_a_batch_encodes_each_distinct_prompt_once(tiny_family, monkeypatch):
    """M = 1 makes one request per sample; gathered into one batch, a group's requests share one encoding
    of the prompt and one of the negative prompt, and give the samples each request gives alone."""
    import asyncio

    settings = RolloutSettings(n_samples_per_prompt=4, rollout_microgroup_size=1)
    request = {**ROLLOUT, "negative_prompt": "blurry"}
    alone = Engine(tiny_family, EngineConfig(max_outputs_per_request=8))
    expected = [alone.generate(RolloutRequest(prompt="a red circle", seed=s, num_outputs_per_prompt=1, **request))[0]
                for s in range(4)]
    engine = Engine(tiny_family, EngineConfig(max_outputs_per_request=8, max_batch_outputs=8, batch_wait_s=0.5,
                                              prompt_cache_bytes=0))  # shared within the batch, not kept
    calls = []
    original = engine.family.encode_prompts
    monkeypatch.setattr(engine.family, "encode_prompts", lambda prompts: calls.append(list(prompts)) or original(prompts))
    groups = asyncio.run(RolloutManager([InProcessEngineClient(engine)], settings, engine_concurrency=8).rollout(
        ["a red circle"], request))
    assert engine.denoise_batches == 1
    assert calls == [["a red circle"], ["blurry"]]  # not once per request (4 + 4)
    assert engine.prompt_encodes == 2
    for got, want in zip(groups[0], expected, strict=True):
        assert got.seed == want.seed
        assert torch.equal(got.output.generated_output, want.generated_output)
        assert torch.equal(got.output.rollout_log_probs, want.rollout_log_probs)
