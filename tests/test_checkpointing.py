"""Selective activation checkpointing (`--gradient-checkpointing-interval N`): one block in every N recomputes its
activations in the backward pass, the gradients stay those of the plain forward, and the memory kept falls between
no checkpointing and every block's."""

import importlib

import pytest
import torch

from diffrl.models.base import repeated_blocks
from diffrl.models.checkpointing import block_of, checkpointed_blocks, enable_gradient_checkpointing
from diffrl.models.registry import resolve_family
from diffrl.sampling import make_generators
from diffrl.train.config import TrainConfig
from test_compile import needs_compiler

# Families whose forward reaches the checkpointing hook differently: diffusers' blocks called as `(block, *args)`
# (sd3, flux3_image's three block lists), a function of the block first (cosmos3), two experts behind one
# wrapper (wan2_2).
FAMILIES = ["sd3", "flux3_image", "cosmos3", "wan2_2"]


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    root = tmp_path_factory.mktemp("models")
    return {name: importlib.import_module(f"diffrl.models.random_checkpoints.{name}").save_random_checkpoint(
        root / f"{name}-tiny") for name in FAMILIES}


def _gradients_and_saved_bytes(name: str, model_dir, interval: int | None, keep: str = "inputs"
                               ) -> tuple[dict, int, list]:
    """One CFG velocity and its backward on a freshly loaded model, with checkpointing off (None) or one block in
    `interval`: the transformer's parameter gradients, the bytes autograd kept for the backward, and the model's
    repeated blocks."""
    family = resolve_family(name, model_dir).load(model_dir)
    transformer = family.transformer
    if interval is not None:
        enable_gradient_checkpointing(transformer, family.block_lists, interval, keep=keep)
    transformer.train().requires_grad_(True)
    if family.generates_video:  # two latent frames of a few tokens (the video families' test size)
        latents = family.prepare_latents(make_generators([1, 2]), 16, 32, num_frames=5)
    else:
        latents = family.prepare_latents(make_generators([1, 2]), *family.default_size())
    cond, uncond = family.encode_prompts(["a red circle", "a blue square"]), family.encode_prompts(["", ""])
    saved = []

    def keep(t):
        saved.append(t.numel() * t.element_size())
        return t

    with torch.autograd.graph.saved_tensors_hooks(keep, lambda t: t):
        v = family.velocity(transformer, latents, torch.tensor(0.6), cond, uncond, 2.0)
    v.square().mean().backward()
    grads = {n: p.grad.clone() for n, p in transformer.named_parameters() if p.grad is not None}
    return grads, sum(saved), repeated_blocks(transformer, family.block_lists)


@pytest.mark.parametrize("name", FAMILIES)
def test_every_other_block_checkpointed_gives_the_same_gradients_in_less_memory(checkpoints, name, monkeypatch):
    calls = []
    real_checkpoint = torch.utils.checkpoint.checkpoint

    def counting(fn, *args, **kwargs):
        calls.append(block_of(fn, args))
        return real_checkpoint(fn, *args, **kwargs)

    def checkpointed(blocks) -> set[int]:  # the positions of the blocks checkpointed since the last call
        ids = [id(b) for b in blocks]
        positions = {ids.index(id(b)) for b in calls}
        calls.clear()
        return positions

    monkeypatch.setattr(torch.utils.checkpoint, "checkpoint", counting)
    plain, plain_bytes, _ = _gradients_and_saved_bytes(name, checkpoints[name], None)
    assert not calls
    every, every_bytes, blocks = _gradients_and_saved_bytes(name, checkpoints[name], 1)
    ran = checkpointed(blocks)
    half, half_bytes, blocks = _gradients_and_saved_bytes(name, checkpoints[name], 2)
    assert plain and plain.keys() == every.keys() == half.keys()
    for n in plain:
        torch.testing.assert_close(every[n], plain[n], rtol=1e-5, atol=1e-7)
        torch.testing.assert_close(half[n], plain[n], rtol=1e-5, atol=1e-7)
    # With interval 1 every block the forward runs is checkpointed; with 2 those of them at even positions (a
    # family's lists may hold blocks a text-to-image forward never runs, e.g. FLUX 3's image-conditioning ones).
    assert checkpointed(blocks) == {i for i in ran if i % 2 == 0}
    assert 0 < len({i for i in ran if i % 2 == 0}) < len(ran)
    assert every_bytes < half_bytes < plain_bytes


def _backward_matmuls(name: str, model_dir, interval: int | None, keep: str = "inputs") -> tuple[dict, int]:
    """One CFG velocity and its backward as above; the parameter gradients and how many matmuls the backward ran
    (a checkpointed block's recompute of its forward adds its own)."""
    from torch.utils._python_dispatch import TorchDispatchMode

    matmuls = {torch.ops.aten.mm.default, torch.ops.aten.addmm.default, torch.ops.aten.bmm.default}

    class CountMatmuls(TorchDispatchMode):
        count = 0

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            CountMatmuls.count += func in matmuls
            return func(*args, **(kwargs or {}))

    family = resolve_family(name, model_dir).load(model_dir)
    transformer = family.transformer
    if interval is not None:
        enable_gradient_checkpointing(transformer, family.block_lists, interval, keep=keep)
    transformer.train().requires_grad_(True)
    latents = family.prepare_latents(make_generators([1, 2]), *family.default_size())
    cond, uncond = family.encode_prompts(["a red circle", "a blue square"]), family.encode_prompts(["", ""])
    v = family.velocity(transformer, latents, torch.tensor(0.6), cond, uncond, 2.0)
    with CountMatmuls():
        v.square().mean().backward()
    return {n: p.grad.clone() for n, p in transformer.named_parameters() if p.grad is not None}, CountMatmuls.count


@pytest.mark.parametrize("name", ["sd3", "flux3_image"])
def test_blocks_keeping_their_matmuls_recompute_none_and_give_the_same_gradients(checkpoints, name):
    """`--gradient-checkpointing-keeps matmuls`: every block checkpointed, each keeping its matmuls' and attention's
    outputs: the plain forward's gradients, and the backward runs the plain backward's matmuls and no more (only the
    elementwise and norm work is recomputed), where keeping inputs alone recomputes every block's matmuls."""
    plain, plain_mm = _backward_matmuls(name, checkpoints[name], None)
    _, inputs_mm = _backward_matmuls(name, checkpoints[name], 1)
    kept, kept_mm = _backward_matmuls(name, checkpoints[name], 1, keep="matmuls")
    assert plain.keys() == kept.keys()
    for n in plain:
        torch.testing.assert_close(kept[n], plain[n], rtol=1e-5, atol=1e-7)
    assert kept_mm == plain_mm < inputs_mm


def test_an_unknown_keep_and_keeping_matmuls_without_checkpointing_are_refused(tmp_path):
    with pytest.raises(ValueError, match="--gradient-checkpointing-keeps must be one of inputs, matmuls"):
        enable_gradient_checkpointing(torch.nn.Module(), [], 1, keep="everything")
    with pytest.raises(ValueError, match="--gradient-checkpointing-keeps matmuls needs --gradient-checkpointing"):
        TrainConfig.flat(gradient_checkpointing_keeps="matmuls", output_dir=tmp_path).check()


def test_the_chosen_blocks_are_the_first_and_then_one_in_n():
    blocks = [torch.nn.Linear(1, 1) for _ in range(7)]
    assert checkpointed_blocks(blocks, 1) == blocks
    assert checkpointed_blocks(blocks, 3) == [blocks[0], blocks[3], blocks[6]]
    with pytest.raises(ValueError, match="--gradient-checkpointing-interval must be >= 1"):
        checkpointed_blocks(blocks, 0)


def test_an_interval_below_one_is_refused_by_the_config(tmp_path):
    with pytest.raises(ValueError, match="--gradient-checkpointing-interval must be >= 1"):
        TrainConfig.flat(gradient_checkpointing=True, gradient_checkpointing_interval=0, output_dir=tmp_path).check()


def test_a_training_run_with_every_other_block_checkpointed_updates_as_without(tiny_model_dir, tmp_path):
    """`--gradient-checkpointing --gradient-checkpointing-interval 2` through the trainer: the hook is installed
    on the demo model's blocks and one rollout and update lands on the weights a run without checkpointing gets."""
    from diffrl.train.trainer import Trainer
    from test_trainer import tiny_config

    params = {}
    for flags in ({}, {"gradient_checkpointing": True, "gradient_checkpointing_interval": 2}):
        trainer = Trainer(tiny_config(tiny_model_dir, tmp_path / str(len(params)), eval_interval=10, **flags))
        hook = trainer.policy.family.transformer._gradient_checkpointing_func
        assert (hook is not None and hook.__name__ == "checkpoint_chosen") is bool(flags)
        trainer.rollout_and_update(0)
        params[bool(flags)] = [p.detach().clone() for p in trainer.policy.params]
    for a, b in zip(params[False], params[True], strict=True):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-7)


class _ReadsSharedTimestep(torch.nn.Module):
    """A block whose path depends on `rows_share_one_timestep`, as a row-wise modulation layer's does; it records
    the state each time it runs."""

    def __init__(self):
        super().__init__()
        self.linear, self.seen = torch.nn.Linear(4, 4), []

    def forward(self, x):
        from diffrl.models.batch_invariance import shared_timestep

        self.seen.append(shared_timestep())
        return self.linear(x) * 2 if shared_timestep() else self.linear(x)


class _Stack(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.blocks = torch.nn.ModuleList([_ReadsSharedTimestep(), _ReadsSharedTimestep()])
        self.gradient_checkpointing, self._gradient_checkpointing_func = False, None

    def enable_gradient_checkpointing(self, gradient_checkpointing_func=None):
        self.gradient_checkpointing, self._gradient_checkpointing_func = True, gradient_checkpointing_func

    def forward(self, x):
        for block in self.blocks:
            x = self._gradient_checkpointing_func(block, x) if self.gradient_checkpointing else block(x)
        return x


@pytest.mark.parametrize("keep", ["inputs", "matmuls"])
def test_a_blocks_recomputation_runs_under_its_forwards_shared_timestep_state(keep):
    """The backward runs after `rows_share_one_timestep` is left; a checkpointed block recomputes under the state its
    forward ran in, so it takes the same path (compiled, another path is another graph, whose saved tensors torch's
    checkpoint refuses: compiled tiny Qwen-Image on a CPU)."""
    from diffrl.models.batch_invariance import rows_share_one_timestep

    stack = _Stack()
    enable_gradient_checkpointing(stack, ["blocks"], keep=keep)
    x = torch.randn(3, 4, requires_grad=True)
    with rows_share_one_timestep(True):
        out = stack(x)
    out.sum().backward()
    assert [b.seen for b in stack.blocks] == [[True, True], [True, True]]  # forward, then recomputation


@pytest.mark.slow  # inductor on 2 cores
@needs_compiler
def test_compiled_checkpointed_qwen_image_replays_its_rollout(tmp_path):
    """Tiny Qwen-Image (row-wise modulations on a CPU), compiled and checkpointed: its update stopped on torch's
    checkpoint check before the recomputation took the forward's state; now the first pass replays exactly."""
    from diffrl.models.random_checkpoints.qwen_image import save_random_checkpoint
    from diffrl.train.trainer import Trainer

    torch._dynamo.reset()
    cfg = TrainConfig.flat(
        model_path=save_random_checkpoint(tmp_path / "qwen-image-tiny"), loss_type="flow_grpo", num_rollout=1,
        rollout_batch_size=1, n_samples_per_prompt=2, rollout_microgroup_size=2, global_batch_size=2,
        num_steps_per_rollout=1, micro_batch_size=2, diffusion_num_steps=3, diffusion_sde_window_range=(0, 2),
        diffusion_num_sde_steps=1, diffusion_guidance_scale=4.0, eval_images_per_category=0, device="cpu",
        use_lora=True, lora_rank=2, reward="rewards_for_tests:darkness", output_dir=tmp_path / "run", resolution=32,
        compile=True, gradient_checkpointing=True)
    record = Trainer(cfg).rollout_and_update(0)
    assert record["train/log_prob_mean_abs_diff"] == 0.0 and record["compile/uncompiled_block_kinds"] == 0
