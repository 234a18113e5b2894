"""`--lora-components`: the adapter on chosen parts of a model made of several (Wan2.2's experts), as published Wan2.2
runs put it on the high-noise expert alone. The other part samples as loaded, with no adapter, and stays out of the
checkpoint; the trainer, an engine given the spec and a loaded checkpoint all agree on where the adapter is."""

import pytest
import torch

from diffrl.errors import RequestError
from diffrl.models.checkpoint import load_model
from diffrl.models.lora import LoraSpec, add_lora, check_lora, current_lora, remove_lora
from diffrl.models.random_checkpoints.wan2_2 import save_random_checkpoint
from family_checks import run_training

HEIGHT, FRAMES = 16, 5


@pytest.fixture(scope="module")
def wan_dir(tmp_path_factory):
    return save_random_checkpoint(tmp_path_factory.mktemp("models") / "wan2.2-tiny")


def _lora_names(transformer) -> set[str]:
    return {n for n, _ in transformer.named_parameters() if "lora_" in n}


def test_the_adapter_goes_on_the_chosen_expert_only(wan_dir):
    family = load_model(wan_dir)
    targets = list(family.lora_target_modules)
    spec = LoraSpec(rank=2, alpha=4.0, target_modules=targets, components=["transformer"])
    check_lora(family.transformer, spec, max_rank=64)
    with pytest.raises(RequestError, match="components: 'transformer_3' is no part of this transformer"):
        check_lora(family.transformer, LoraSpec(rank=2, alpha=4.0, target_modules=targets,
                                                components=["transformer_3"]), max_rank=64)
    add_lora(family.transformer, spec)
    names = _lora_names(family.transformer)
    assert names and all(n.startswith("transformer.") for n in names)
    assert current_lora(family.transformer) == spec  # what an engine compares a pushed spec with
    remove_lora(family.transformer)
    add_lora(family.transformer, LoraSpec(rank=2, alpha=4.0, target_modules=targets))
    both = _lora_names(family.transformer)
    assert {n.split(".")[0] for n in both} == {"transformer", "transformer_2"} and names < both
    assert current_lora(family.transformer).components == []


def test_a_run_trains_the_high_noise_experts_adapter_and_saves_it_alone(wan_dir, tmp_path):
    run_training(wan_dir, tmp_path / "run", "flow_grpo", True, guidance=4.5,
                 video=dict(resolution=HEIGHT, num_frames=FRAMES), extra_flags=("--lora-components", "transformer"))
    checkpoint = tmp_path / "run" / "checkpoints" / "rollout-00001"
    assert (checkpoint / "lora" / "transformer").is_dir() and not (checkpoint / "lora" / "transformer_2").exists()
    weights = load_model(wan_dir, checkpoint).transformer.state_dict()
    lora = [n for n in weights if "lora_" in n]
    assert lora and all(n.startswith("transformer.") for n in lora)
    assert any("lora_B" in n and weights[n].abs().max() > 0 for n in lora)
    base = load_model(wan_dir).transformer.state_dict()
    low_noise = [n for n in base if n.startswith("transformer_2.")]
    assert low_noise and all(torch.equal(weights[n], base[n]) for n in low_noise)  # untouched, no adapter


def test_bad_components_are_refused_naming_the_flag(wan_dir, tmp_path, tiny_model_dir):
    from diffrl.train.config import TrainConfig
    from diffrl.train.trainer import Trainer

    with pytest.raises(ValueError, match="--lora-components transformer_3: the wan2_2 model's parts are transformer, "
                                         "transformer_2"):
        Trainer(TrainConfig.flat(model_path=wan_dir, output_dir=tmp_path / "a", resolution=HEIGHT, num_frames=FRAMES,
                                 eval_images_per_category=0, lora_components=("transformer_3",)))
    with pytest.raises(ValueError, match="--lora-components transformer: the demo model's parts are none"):
        Trainer(TrainConfig.flat(model_path=tiny_model_dir, output_dir=tmp_path / "b", lora_components=("transformer",)))
    with pytest.raises(ValueError, match="a full finetune \\(--no-use-lora\\) trains every part"):
        TrainConfig.flat(use_lora=False, lora_components=("transformer",)).check()


def test_an_engine_given_the_spec_hosts_the_same_adapter_as_the_trainer(wan_dir):
    """A remote engine receives the trainer's `LoraSpec` as JSON (`POST /lora_adapter`): its adapter has the trainer's
    parameter names, so weight updates carrying the high-noise expert's tensors land; the same spec again is a no-op
    and another one is refused."""
    from diffrl.engine.engine import Engine

    trainer_side = load_model(wan_dir)
    spec = LoraSpec(rank=2, alpha=4.0, target_modules=list(trainer_side.lora_target_modules), components=["transformer"])
    add_lora(trainer_side.transformer, spec)
    engine = Engine(load_model(wan_dir))
    assert engine.add_lora_adapter(LoraSpec.model_validate_json(spec.model_dump_json()))
    assert _lora_names(engine.family.transformer) == _lora_names(trainer_side.transformer)
    assert not engine.add_lora_adapter(spec)
    with pytest.raises(RequestError, match="already has a different LoRA adapter"):
        engine.add_lora_adapter(spec.model_copy(update={"components": []}))
