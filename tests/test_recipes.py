"""Every recipe resolves to the published settings it cites, satisfies the batch invariant, and yields
to flags given after it."""

import pytest

from diffrl.cli.main import parse
from diffrl.recipes import recipe_config, recipe_names

# recipe → (family, loss, LoRA rank/alpha or None for a full finetune, height × width, steps, CFG,
#           SDE window and steps (GRPO), prompts × samples, optimizer steps per rollout, microgroup, reward)
TABLE = {
    "flux3-klein-nft-pickscore": ("flux3_image", "nft", (32, 64.0), (1024, 1024), 16, 1.0, None, (8, 8), 1, 8,
                                  "pickscore"),
    "flux3-klein-grpo-hps": ("flux3_image", "flow_grpo", None, (1024, 1024), 10, 3.5, ((1, 3), 1), (16, 16), 2, 16,
                             "hpsv2"),
    "qwen-image-grpo-pickscore": ("qwen_image", "flow_grpo", (64, 128.0), (512, 512), 10, 4.0, ((3, 5), 2), (32, 16),
                                  2, 8, "pickscore"),
    "sd35-grpo-ocr": ("sd3", "flow_grpo", (32, 64.0), (512, 512), 10, 4.5, ((0, 9), 9), (4, 16), 1, 8, "ocr"),
    "sd35-grpo-pickscore": ("sd3", "flow_grpo", (32, 64.0), (512, 512), 10, 4.5, ((0, 9), 9), (4, 16), 1, 8,
                            "pickscore"),
    "krea2-nft-ocr": ("krea2", "nft", (32, 64.0), (1024, 1024), 10, 1.0, None, (8, 8), 1, 1, "ocr"),
    "krea2-nft-pickscore": ("krea2", "nft", (32, 64.0), (1024, 1024), 10, 1.0, None, (8, 8), 1, 1, "pickscore"),
    "wan22-grpo-pickscore": ("wan2_2", "flow_grpo", (64, 128.0), (480, 480), 10, 4.0, ((1, 4), 1), (8, 16), 2, 8,
                             "pickscore"),
    "ltx23-grpo-pickscore": ("ltx2", "flow_grpo", (64, 128.0), (512, 768), 24, 1.0, ((0, 10), 3), (8, 8), 2, 1,
                             "pickscore"),
    "cosmos3-grpo": ("cosmos3", "flow_grpo", (64, 128.0), (480, 832), 16, 4.0, ((8, 12), 2), (48, 16), 1, 1,
                     "pickscore"),
}
# What a recipe changes on a GPU where it was measured faster (BENCHMARKS.md): how the work is batched and compiled,
# never the algorithm's settings above.
GPU_SPEED = {
    "ltx23-grpo-pickscore": {"rollout_microgroup_size": 8, "micro_batch_size": 4, "compile": True},
    "cosmos3-grpo": {"micro_batch_size": 16, "compile": True},
    # compiled: each one's first pass clipped nothing on an H100 (real-width blocks, two of each kind)
    "krea2-nft-ocr": {"compile": True},
    "krea2-nft-pickscore": {"compile": True},
    "wan22-grpo-pickscore": {"compile": True},
    "qwen-image-grpo-pickscore": {"compile": True},
    "flux3-klein-nft-pickscore": {"compile": True},
    "flux3-klein-grpo-hps": {"compile": True},
    # compiled without checkpointing, CFG's unconditional half without gradients: micro-batches of 16 pairs fit
    "sd35-grpo-ocr": {"compile": True, "micro_batch_size": 16},
    "sd35-grpo-pickscore": {"compile": True, "micro_batch_size": 16},
}
# video recipe → (frames, SDE type, noise level, SDE step strategy, frames the reward sees)
VIDEO = {
    "wan22-grpo-pickscore": (1, "sde", 0.9, "window", None),
    "ltx23-grpo-pickscore": (57, "cps", 0.8, "random", 3),
    "cosmos3-grpo": (1, "sde", 0.7, "random", None),
}


@pytest.mark.parametrize("name", sorted(TABLE))
def test_recipe_has_the_published_settings(name):
    family, loss, lora, size, steps, cfg_scale, sde, batch, opt_steps, micro, reward = TABLE[name]
    for device in ("cpu", "cuda"):  # a real checkpoint's recipe has one size
        cfg = recipe_config(name, device)
        cfg.check()
        m, r, a, o = cfg.model, cfg.rollout, cfg.algorithm, cfg.optim
        assert (m.diffusion_model_family, a.loss_type, m.size()) == (family, loss, size)
        assert (m.lora_rank, m.lora_alpha) == lora if lora else not m.use_lora
        assert (r.diffusion_num_steps, r.diffusion_guidance_scale) == (steps, cfg_scale)
        if sde:
            assert (r.diffusion_sde_window_range, r.diffusion_num_sde_steps) == sde
        assert (r.rollout_batch_size, r.n_samples_per_prompt) == batch
        if device == "cuda":
            micro = GPU_SPEED.get(name, {}).get("rollout_microgroup_size", micro)
        assert (o.num_steps_per_rollout, r.rollout_microgroup_size, cfg.task.reward) == (opt_steps, micro, reward)
        if name in VIDEO:
            assert (m.num_frames, r.diffusion_sde_type, r.diffusion_noise_level, r.diffusion_sde_step_strategy,
                    cfg.task.reward_frames) == VIDEO[name]


@pytest.mark.parametrize("name", sorted(TABLE))
def test_recipes_batch_and_compile_for_speed_on_a_gpu_only(name):
    """Compiled and batched where it was measured faster (an H200; BENCHMARKS.md); a CPU run of the recipe keeps the
    published batching, eager; flags after the recipe still win."""
    gpu, cpu = recipe_config(name, "cuda"), recipe_config(name, "cpu")
    expected = {"rollout_microgroup_size": cpu.rollout.rollout_microgroup_size,
                "micro_batch_size": cpu.optim.micro_batch_size, "compile": False, **GPU_SPEED.get(name, {})}
    assert {"rollout_microgroup_size": gpu.rollout.rollout_microgroup_size, "micro_batch_size": gpu.optim.micro_batch_size,
            "compile": gpu.model.compile} == expected
    assert not cpu.model.compile
    gpu.check()
    flags = parse(["train", "--recipe", name, "--device", "cuda", "--no-compile", "--micro-batch-size", "1"])
    assert not flags.model.compile and flags.optim.micro_batch_size == 1


def test_recipe_details_the_table_names():
    qwen = recipe_config("qwen-image-grpo-pickscore")
    assert qwen.algorithm.globalize_reward_std and not qwen.algorithm.globalize_reward_mean  # per-prompt mean, batch std
    assert qwen.optim.adam_beta2 == 0.999 and qwen.optim.global_batch_size == 256
    assert {"img_mlp.net.0.proj", "txt_mlp.net.2", "attn.to_q"} <= set(qwen.model.lora_target_modules)
    grpo_hps = recipe_config("flux3-klein-grpo-hps")
    assert grpo_hps.optim.lr == 1e-5 and grpo_hps.model.mixed_precision == "bf16" and grpo_hps.algorithm.diffusion_kl_beta == 0
    assert grpo_hps.rollout.num_rollout == 200 and grpo_hps.rollout.diffusion_noise_level == 0.7
    wan = recipe_config("wan22-grpo-pickscore")
    assert wan.rollout.diffusion_guidance_scale_2 == 3.0 and wan.model.num_frames == 1
    assert wan.rollout.diffusion_noise_level == 0.9 and wan.optim.lr == 1e-4 and wan.optim.global_batch_size == 64
    assert {"attn1.to_q", "attn2.to_out.0", "ffn.net.2"} <= set(wan.model.lora_target_modules)
    ltx = recipe_config("ltx23-grpo-pickscore")
    o, a = ltx.optim, ltx.algorithm
    assert (o.lr, o.adam_beta2, o.weight_decay, o.micro_batch_size) == (2e-4, 0.999, 1e-4, 1)
    assert (a.diffusion_clip_range, a.diffusion_kl_beta, a.globalize_reward_std) == (1e-5, 0.0, True)
    assert ltx.model.mixed_precision == "bf16" and ltx.model.gradient_checkpointing and ltx.deterministic_mode
    assert ltx.rollout.negative_prompt == "" and ltx.rollout.num_rollout == 200
    cosmos = recipe_config("cosmos3-grpo")  # miles-diffusion's Cosmos3 text-to-image script
    o, a = cosmos.optim, cosmos.algorithm
    assert (o.lr, o.adam_beta2, o.weight_decay, o.micro_batch_size, o.global_batch_size) == (1e-4, 0.999, 1e-4, 1, 768)
    assert (a.diffusion_clip_range, a.diffusion_kl_beta, a.globalize_reward_std) == (1e-3, 0.0, True)
    assert cosmos.eval.eval_num_steps == 35 and cosmos.model.mixed_precision == "bf16"
    for sd35, kl_beta in (("sd35-grpo-ocr", 0.04), ("sd35-grpo-pickscore", 0.01)):  # flow_grpo's SD3.5 configs
        a = recipe_config(sd35).algorithm
        assert (a.diffusion_kl_beta, a.globalize_reward_std, a.globalize_reward_mean) == (kl_beta, True, False)
    assert recipe_config("sd3-grpo").algorithm.diffusion_kl_beta == 0  # the benchmark setting stays KL-free
    krea = recipe_config("krea2-nft-ocr")  # miles-diffusion's run_diffusion_nft_krea2.py
    o, a = krea.optim, krea.algorithm
    assert (o.lr, o.adam_beta2, o.weight_decay, o.grad_clip, o.micro_batch_size) == (3e-4, 0.999, 1e-4, 1.0, 2)
    assert (a.diffusion_nft_beta, a.nft_timestep_fraction, a.nft_ema_ramp, a.nft_ema_max) == (1.0, 0.99, 0.001, 0.5)
    assert krea.deterministic_mode and krea.model.gradient_checkpointing and krea.eval.eval_num_steps == 52
    nft = recipe_config("flux3-klein-nft-pickscore")
    assert nft.optim.lr == 3e-4 and nft.model.gradient_checkpointing and nft.algorithm.nft_rollout_guidance_scale == 1.0


def test_flags_after_a_recipe_override_it():
    cfg = parse(["train", "--recipe", "qwen-image-grpo-pickscore", "--reward", "pickscore@/m/PickScore_v1",
                 "--lora-target-modules", "attn.to_q", "attn.to_v", "--n-samples-per-prompt", "8",
                 "--global-batch-size", "128"])
    assert cfg.task.reward == "pickscore@/m/PickScore_v1" and cfg.model.lora_target_modules == ("attn.to_q", "attn.to_v")
    assert cfg.rollout.n_samples_per_prompt == 8 and cfg.rollout.diffusion_num_steps == 10
    cfg.check()


def test_a_size_flag_replaces_the_recipes_size_of_the_other_kind():
    """--height/--width after a recipe sized by --resolution (wan22-grpo-pickscore: 480) give the size, and
    --resolution after one sized by --height/--width (ltx23-grpo-pickscore) does: both were refused as "give one
    kind, not both", naming a --resolution the user never gave. Both kinds on the command line still are."""
    cfg = parse(["train", "--recipe", "wan22-grpo-pickscore", "--height", "32", "--width", "48"])
    assert (cfg.model.resolution, cfg.model.size()) == (None, (32, 48))
    cfg = parse(["train", "--recipe", "ltx23-grpo-pickscore", "--resolution=64"])
    assert (cfg.model.height, cfg.model.width, cfg.model.size()) == (None, None, (64, 64))
    with pytest.raises(ValueError, match="give one kind, not both"):
        parse(["train", "--recipe", "ltx23-grpo-pickscore", "--resolution", "64", "--height", "32"]).model.size()


def test_every_recipe_name_resolves():
    for name in recipe_names():
        recipe_config(name, "cpu").check()


@pytest.mark.parametrize("name", ["sd3-grpo", "sd35-grpo-ocr", "sd35-grpo-pickscore"])
def test_the_sd35_gpu_recipes_detach_cfgs_unconditional_half_as_the_published_code(name):
    """On a GPU the SD3.5 recipes take the published train step's gradient (CFG's unconditional half detached), run
    in the rollout too so that the replay stays exact; the CPU size keeps the full CFG gradient."""
    gpu, cpu = recipe_config(name, "cuda"), recipe_config(name, "cpu")
    assert gpu.algorithm.detach_uncond and not gpu.model.gradient_checkpointing and gpu.optim.micro_batch_size == 16
    assert not cpu.algorithm.detach_uncond


def test_every_real_model_recipe_compiles_on_a_gpu():
    """Each recipe of a published model compiles on a GPU, its compiled first pass measured there (clipfrac 0,
    BENCHMARKS.md "Every recipe's first pass, compiled"). The demo-world recipes (tiny models, a few ms per forward)
    stay eager."""
    from diffrl.recipes import recipe_names

    eager = {n for n in recipe_names() if not n.endswith("-gpu") and not recipe_config(n, "cuda").model.compile}
    demo = {n for n in eager if n.startswith(("shapes-", "ocr-"))}
    assert eager - demo == set() and demo
