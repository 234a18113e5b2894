"""A prompt row's own `negative_prompt` (a .jsonl key, as the public negative-prompt sets carry): CFG's unconditional
side for that prompt in rollouts, the trainer's replay and held-out evaluation; rows without one use
`--negative-prompt`."""

import json

import pytest
import torch

from diffrl.data.prompts import load_prompts
from diffrl.evaluation.sampling import generate
from diffrl.models.checkpoint import load_model
from diffrl.models.random_checkpoints.sd3 import save_random_checkpoint
from diffrl.train.config import TrainConfig
from diffrl.train.trainer import Trainer


@pytest.fixture(scope="module")
def sd3_dir(tmp_path_factory):
    return save_random_checkpoint(tmp_path_factory.mktemp("models") / "sd3-tiny", with_t5=False)


@pytest.fixture
def prompts(tmp_path):
    path = tmp_path / "prompts.jsonl"
    path.write_text(json.dumps({"prompt": "a red cat", "negative_prompt": "blurry, dark"}) + "\n"
                    + json.dumps({"prompt": "a green dog"}) + "\n")
    return path


def test_rollouts_and_the_replay_use_each_rows_negative_prompt(sd3_dir, prompts, tmp_path, monkeypatch):
    import diffrl.engine.engine as engine_module

    seen, real = [], engine_module.Engine.plan

    def spy(self, req):
        seen.append((req.prompt, req.negative_prompt))
        return real(self, req)

    monkeypatch.setattr(engine_module.Engine, "plan", spy)
    cfg = TrainConfig.flat(
        output_dir=tmp_path / "run", model_path=sd3_dir, num_rollout=1, rollout_batch_size=2, n_samples_per_prompt=2,
        rollout_microgroup_size=2, global_batch_size=4, num_steps_per_rollout=1, micro_batch_size=2,
        diffusion_num_steps=2, diffusion_sde_window_range=(0, 2), diffusion_guidance_scale=3.0, resolution=16,
        device="cpu", use_lora=True, lora_rank=2, reward="jpeg_compressibility", prompt_data=prompts,
        eval_interval=10, negative_prompt="ugly")
    record = Trainer(cfg).rollout_and_update(0)
    assert set(seen) == {("a red cat", "blurry, dark"), ("a green dog", "ugly")}
    assert record["train/log_prob_mean_abs_diff"] == 0.0  # the replay's unconditional side is the rollout's


def test_evaluation_samples_each_image_with_its_rows_negative_prompt(sd3_dir, prompts):
    family = load_model(sd3_dir)
    kw = dict(num_steps=2, guidance_scale=3.0, resolution=16)
    both = generate(family, ["a red cat", "a green dog"], [7, 8], negative_prompt=["blurry, dark", "ugly"], **kw)
    cat = generate(family, ["a red cat"], [7], negative_prompt="blurry, dark", **kw)
    dog = generate(family, ["a green dog"], [8], negative_prompt="ugly", **kw)
    cat_default = generate(family, ["a red cat"], [7], negative_prompt="ugly", **kw)
    torch.testing.assert_close(both, torch.cat([cat, dog]), rtol=0, atol=1e-6)
    assert not torch.allclose(cat, cat_default)  # the negative prompt mattered
    with pytest.raises(ValueError, match="2 prompts but 1 negative prompts"):
        generate(family, ["a red cat", "a green dog"], [7, 8], negative_prompt=["x"], **kw)


def test_a_negative_prompt_that_is_not_a_string_is_refused_naming_the_line(tmp_path):
    path = tmp_path / "bad.jsonl"
    path.write_text(json.dumps({"prompt": "a"}) + "\n" + json.dumps({"prompt": "b", "negative_prompt": 3}) + "\n")
    with pytest.raises(ValueError, match=r"bad.jsonl:2: 'negative_prompt' must be a string, got int"):
        load_prompts(path)
