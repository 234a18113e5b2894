"""What a user does with a run's checkpoint outside diffrl: diffusers' own loaders open the tiny random
checkpoint as a pipeline and put a LoRA checkpoint into it (`pipe.load_lora_weights`), to the same weights
as PEFT's loader."""

import pytest
import torch

from diffrl.models.random_checkpoints.sd3 import save_random_checkpoint


@pytest.fixture(scope="module")
def sd3_dir(tmp_path_factory):
    return save_random_checkpoint(tmp_path_factory.mktemp("models") / "sd3-tiny")


def test_random_sd3_checkpoint_opens_as_a_diffusers_pipeline(sd3_dir):
    """A diffusers-format checkpoint has a model_index.json: without it from_pretrained refused the folder."""
    from diffusers import StableDiffusion3Pipeline

    pipe = StableDiffusion3Pipeline.from_pretrained(sd3_dir)
    assert pipe.transformer is not None and pipe.text_encoder_3 is not None


def test_random_sd3_checkpoint_without_t5_opens_as_a_diffusers_pipeline(tmp_path):
    from diffusers import StableDiffusion3Pipeline

    pipe = StableDiffusion3Pipeline.from_pretrained(save_random_checkpoint(tmp_path / "sd3", with_t5=False),
                                                    text_encoder_3=None, tokenizer_3=None)
    assert pipe.text_encoder_3 is None and pipe.tokenizer_3 is None


def test_lora_checkpoint_loads_with_pipe_load_lora_weights(sd3_dir, tmp_path):
    """`pipe.load_lora_weights(RUN/checkpoints/rollout-N/lora)` gives the trained weights, scale α/r included
    (it found no key under its `transformer.` prefix, warned and left the base model)."""
    from diffusers import StableDiffusion3Pipeline
    from peft import PeftModel

    from diffrl.train.config import TrainConfig
    from diffrl.train.trainer import Trainer

    def reward(images, prompts, metadata=None):
        return [1.0 - float(image.mean()) for image in images]

    out = tmp_path / "run"
    Trainer(TrainConfig.flat(
        output_dir=out, model_path=sd3_dir, num_rollout=1, rollout_batch_size=1, n_samples_per_prompt=2,
        rollout_microgroup_size=2, global_batch_size=2, num_steps_per_rollout=1, micro_batch_size=2,
        diffusion_num_steps=2, diffusion_sde_window_range=(0, 2), resolution=16, device="cpu", use_lora=True,
        lora_rank=4, lora_alpha=16.0, lr=1e-2, eval_images_per_category=0, eval_interval=10, checkpoint_interval=1),
        reward_fn=reward).train()
    lora = out / "checkpoints" / "rollout-00001" / "lora"

    base = StableDiffusion3Pipeline.from_pretrained(sd3_dir).transformer.state_dict()
    want = PeftModel.from_pretrained(StableDiffusion3Pipeline.from_pretrained(sd3_dir).transformer,
                                     str(lora)).merge_and_unload().state_dict()
    assert any(not torch.equal(want[k], base[k]) for k in base)  # the update is in the adapter

    pipe = StableDiffusion3Pipeline.from_pretrained(sd3_dir)
    pipe.load_lora_weights(str(lora))
    pipe.fuse_lora()
    pipe.unload_lora_weights()
    got = pipe.transformer.state_dict()
    assert got.keys() == want.keys()
    for key in want:
        torch.testing.assert_close(got[key], want[key], rtol=0, atol=1e-6, msg=key)
