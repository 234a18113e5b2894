"""`--kl-cfg S` (DGPO and CRD): the base model's velocity their KL term compares with is guided, uncond + S·(cond −
uncond), as Flow-Factory's kl_cfg (CRD's published OCR setting distills CFG 4.5 into a policy that samples without
it). Rollouts without CFG then return the negative prompt's conditioning (`rollout_return_negative_env`)."""

import math

import pytest
import torch

from diffrl.cli.main import main as cli_main
from diffrl.cli.main import parse
from diffrl.engine.engine import Engine, EngineConfig
from diffrl.engine.protocol import RolloutRequest
from diffrl.models.base import Latents, PromptEmbeds
from diffrl.train.trainer import Trainer

SMALL = ["--rollout-batch-size", "2", "--n-samples-per-prompt", "4", "--rollout-microgroup-size", "4",
         "--global-batch-size", "8", "--num-steps-per-rollout", "1", "--micro-batch-size", "8",
         "--diffusion-num-steps", "4", "--diffusion-guidance-scale", "1.0", "--eval-images-per-category", "0",
         "--val-images-per-category", "0", "--reward", "rewards_for_tests:darkness", "--category-sampling", "uniform",
         "--device", "cpu", "--lr", "1e-3"]


def test_an_unguided_request_can_return_its_negative_conditioning_without_changing_its_samples(tiny_family):
    engine = Engine(tiny_family, EngineConfig(max_outputs_per_request=4))
    common = dict(prompt="a red circle", negative_prompt="blue", seed=5, num_outputs_per_prompt=2,
                  num_inference_steps=3, guidance_scale=1.0, rollout_return_denoising_env=True)
    plain = engine.generate(RolloutRequest(**common))
    with_negative = engine.generate(RolloutRequest(**common, rollout_return_negative_env=True))
    assert "negative_prompt_embeds" not in plain[0].denoising_env
    env = with_negative[0].denoising_env
    assert torch.equal(env["negative_prompt_embeds"], tiny_family.encode_prompts(["blue"]).embeds)
    for a, b in zip(plain, with_negative):
        assert torch.equal(a.generated_output, b.generated_output)  # sampled without CFG all the same


@pytest.mark.parametrize("loss_type", ["crd", "dgpo"])
def test_the_reference_is_the_guided_base_velocity_and_the_run_trains(loss_type, tiny_model_dir, tmp_path):
    trainer = Trainer(parse(["train", "--loss-type", loss_type, *SMALL, "--kl-cfg", "4.5", "--diffusion-kl-beta",
                             "0.1", "--model-path", str(tiny_model_dir), "--output-dir", str(tmp_path / "run")]))
    seen = []
    reference = trainer.objective.reference_velocity

    def spy(x0, noise, t, cond, uncond, env):
        out = reference(x0, noise, t, cond, uncond, env)
        seen.append((x0, noise, t, cond, uncond, env, out))
        return out

    trainer.objective.reference_velocity = spy
    records = [trainer.rollout_and_update(k) for k in range(2)]
    assert all(math.isfinite(r["train/loss"]) for r in records) and records[1]["train/kl_loss"] > 0
    x0, noise, t, cond, uncond, env, out = seen[0]
    family = trainer.policy.family
    # The negative conditioning is the encoded negative prompt (here ""), row for row with the prompts'.
    assert uncond is not None and torch.equal(uncond[0], family.encode_prompts([""]).embeds[0].to(uncond))
    with torch.no_grad(), trainer.policy.base_model():
        x_t = (1 - t.view(-1, 1, 1)) * x0 + t.view(-1, 1, 1) * noise
        ids = env["text_ids"]
        v_cond = family.velocity(family.transformer, Latents(x_t, env["image_ids"]), t, PromptEmbeds(cond, ids),
                                 None, 1.0)
        v_uncond = family.velocity(family.transformer, Latents(x_t, env["image_ids"]), t,
                                   PromptEmbeds(uncond, env["negative_text_ids"]), None, 1.0)
    torch.testing.assert_close(out, v_uncond + 4.5 * (v_cond - v_uncond), rtol=1e-5, atol=1e-5)


def test_kl_cfg_is_refused_where_no_method_reads_it_and_below_one(tiny_model_dir, tmp_path, capsys):
    for flags, message in ((["--loss-type", "nft", "--kl-cfg", "4.5"], "--kl-cfg sets the guided KL reference"),
                           (["--loss-type", "crd", "--kl-cfg", "0.5"], "--kl-cfg must be >= 1")):
        assert cli_main(["train", *flags, "--model-path", str(tiny_model_dir), "--device", "cpu",
                         "--output-dir", str(tmp_path / "r")]) == 2
        assert message in capsys.readouterr().err
    assert not (tmp_path / "r").exists()


def test_the_negative_conditioning_of_an_unguided_request_crosses_both_wire_formats(tiny_family):
    """A trainer with a guided reference behind `diffrl serve`: the env's negative half arrives over sglang's JSON
    (as `neg_cond_kwargs`) and the compact msgpack alike, equal to the in-process one."""
    import asyncio

    from diffrl.rollout import HttpEngineClient
    from diffrl.serving.server import create_app, serving_in_thread

    engine = Engine(tiny_family, EngineConfig(max_outputs_per_request=4))
    request = RolloutRequest(prompt="a red circle", negative_prompt="blue", seed=3, num_outputs_per_prompt=2,
                             num_inference_steps=3, guidance_scale=1.0, rollout_return_denoising_env=True,
                             rollout_return_negative_env=True, rollout_return_dit_trajectory=True)
    in_process = engine.generate(request)[0].denoising_env
    with serving_in_thread(create_app(engine)) as url:
        for wire in ("compact", "sglang"):
            client = HttpEngineClient(url, **({"wire_format": "sglang"} if wire == "sglang" else {}))
            try:
                env = asyncio.run(client.generate(request))[0].denoising_env
            finally:
                client.close()
            assert torch.equal(env["negative_prompt_embeds"], in_process["negative_prompt_embeds"]), wire


def test_a_rollout_without_the_negative_conditioning_is_refused_not_read_as_zeros(tiny_model_dir, tmp_path):
    """An engine that drops the extension (an sglang server does, without a word) would leave the negative half zeros."""
    trainer = Trainer(parse(["train", "--loss-type", "crd", *SMALL, "--kl-cfg", "4.5", "--diffusion-kl-beta", "0.1",
                             "--model-path", str(tiny_model_dir), "--output-dir", str(tmp_path / "run")]))
    request = trainer.objective.request
    trainer.objective.request = lambda k: {**request(k), "rollout_return_negative_env": False}
    with pytest.raises(RuntimeError, match="returned no negative conditioning"):
        trainer.rollout_and_update(0)
