"""Named training presets. Each is a set of overrides by flag name (`TrainConfig.flat` names); flags
given after `--recipe NAME` override the preset again.

The shapes recipes run at GPU size on a CUDA machine and scale down on a CPU (the device is
`--device`, `auto` = CUDA when present); `<name>-gpu` forces the GPU size (what `JOURNAL.md`
measured). The real-model recipes follow published runs (each says which, with its numbers); give
them a local checkpoint (`--model-path`), prompts (`--prompt-data`) and, for model rewards, the
reward's checkpoint (`--reward pickscore@DIR`). docs/recipes.md lists the commands.
"""

from __future__ import annotations

from diffrl.assets import SHIPPED_EDIT_MODEL, SHIPPED_OCR_MODEL
from diffrl.data.ocr.prompts import PROMPT_DIR as OCR_PROMPTS
from diffrl.errors import AnotherFamilysCheckpoint
from diffrl.train.config import TrainConfig

_GPU_BATCH = dict(  # 32 prompts × 16 samples per rollout, 2 optimizer steps of 256 samples
    num_rollout=200, rollout_batch_size=32, n_samples_per_prompt=16, rollout_microgroup_size=16,
    global_batch_size=256, num_steps_per_rollout=2, micro_batch_size=256, engine_concurrency=32,
    engine_max_batch_outputs=512, eval_interval=10, checkpoint_interval=50,
    eval_images_per_category=64,  # 32 per category proved too noisy to tell runs apart (JOURNAL.md)
    val_images_per_category=64,  # checkpoints/best by validation on train prompts: runs peak, then fall back
    mixed_precision="no",  # fp32 + TF32: what JOURNAL.md measured; bf16 is --mixed-precision bf16
)

# Flow-GRPO on SD3.5-Medium at the published recipe's sampling settings (flow_grpo's SD3 configs;
# miles-diffusion scripts/run-diffusion-grpo-sd3-ocr-sglang.sh: 512², 10 steps, CFG 4.5, noise 0.7,
# LoRA r32/α64, clip 1e-4, every step but the last trained, 64 samples per optimizer step), the
# setting BENCHMARKS.md measured on one H200. Give it a reward (`--reward`). CFG's unconditional half is
# differentiated, as miles-diffusion's actor does; flow_grpo's train_sd3.py detaches it (`--detach-uncond`, which
# also spares its backward; not yet measured on a GPU).
_SD3_GRPO = dict(diffusion_model_family="sd3", loss_type="flow_grpo", use_lora=True, lora_rank=32, lora_alpha=64.0,
                 resolution=512, diffusion_num_steps=10, diffusion_guidance_scale=4.5, diffusion_noise_level=0.7,
                 diffusion_sde_window_range=(0, 9), diffusion_num_sde_steps=9, diffusion_clip_range=1e-4,
                 rollout_batch_size=4, n_samples_per_prompt=16, rollout_microgroup_size=16, global_batch_size=64,
                 num_steps_per_rollout=1, micro_batch_size=8, eval_images_per_category=0)

# The same on a prompt dataset with the published rewards: microgroups of 8 (the miles-diffusion
# scripts' --diffusion-microgroup-size 8), AdamW weight decay 1e-4 and β2 0.999, 40 evaluation steps,
# per-prompt mean with batch-wide std, and the KL term to the base of flow_grpo's SD3.5 configs
# (config/grpo.py: `general_ocr_sd3*` β 0.04, as miles-diffusion's SD3 OCR script; `pickscore_sd3*` β 0.01).
_SD35_GRPO = dict(_SD3_GRPO, rollout_microgroup_size=8, weight_decay=1e-4, adam_beta2=0.999, eval_num_steps=40,
                  globalize_reward_std=True, eval_interval=30, checkpoint_interval=20, num_rollout=600)

# Flow-GRPO on Qwen-Image with PickScore: flow_grpo's `pickscore_qwenimage` as miles-diffusion's
# scripts/run-diffusion-grpo-pickscore-5gpu-flowgrpo-aligned.sh runs it: 512², 10 steps (50 to
# evaluate), CFG 4 (true CFG), noise 1.2, 2 SDE steps in the window [3, 5), per-prompt mean with
# batch-wide std, 32 prompts × 16 samples = 2 optimizer steps of 256 (1,024 train pairs), microgroup 8,
# LoRA r64/α128 (Gaussian init) on attention and both MLPs, lr 3e-4, AdamW β2 0.999, weight decay 1e-4,
# clip 1e-4, fp32 masters with a bf16 forward, gradient checkpointing, 400 rollouts.
_QWEN_TARGETS = ("attn.to_q", "attn.to_k", "attn.to_v", "attn.to_out.0", "attn.add_q_proj", "attn.add_k_proj",
                 "attn.add_v_proj", "attn.to_add_out", "img_mlp.net.0.proj", "img_mlp.net.2",
                 "txt_mlp.net.0.proj", "txt_mlp.net.2")
_QWEN_GRPO = dict(diffusion_model_family="qwen_image", loss_type="flow_grpo", reward="pickscore", resolution=512,
                  use_lora=True, lora_rank=64, lora_alpha=128.0, lora_target_modules=_QWEN_TARGETS,
                  diffusion_num_steps=10, eval_num_steps=50, diffusion_guidance_scale=4.0, diffusion_noise_level=1.2,
                  diffusion_sde_window_range=(3, 5), diffusion_num_sde_steps=2, globalize_reward_std=True,
                  rollout_batch_size=32, n_samples_per_prompt=16, rollout_microgroup_size=8, global_batch_size=256,
                  num_steps_per_rollout=2, micro_batch_size=8, lr=3e-4, adam_beta2=0.999, weight_decay=1e-4,
                  diffusion_clip_range=1e-4, mixed_precision="bf16", gradient_checkpointing=True, num_rollout=400,
                  eval_interval=30, checkpoint_interval=10, engine_concurrency=4, eval_images_per_category=0)

# DiffusionNFT on FLUX 3 Image Klein with PickScore/26: 1024², 16-step ODE without CFG under the EMA old
# policy, 8 prompts × 8 samples, LoRA r32/α64, lr 3e-4, gradient checkpointing; the optimizer settings
# of miles-diffusion's scripts/run-diffusion-nft-sd3-pickscore.sh (AdamW β2 0.999, weight decay 1e-4,
# grad clip 1, NFT β 1, advantage clip 5, adaptive weighting, timestep fraction 0.99, old-policy EMA
# ramp 0.001 up to 0.5, per-prompt mean with batch-wide std). The engine denoises one microgroup at a time:
# FLUX 3 at 1024² is compute-bound from batch 1 (reported at 111-113 ms per sample for batch 1-8; not measured
# in this repository), so a larger batch buys only memory; the run's peak at batch 8 was measured
# (BENCHMARKS.md), the default 64 was not.
_FLUX3_NFT = dict(diffusion_model_family="flux3_image", loss_type="nft", reward="pickscore", resolution=1024,
                  use_lora=True, lora_rank=32, lora_alpha=64.0, diffusion_num_steps=16, diffusion_guidance_scale=1.0,
                  rollout_batch_size=8, n_samples_per_prompt=8, rollout_microgroup_size=8, global_batch_size=64,
                  num_steps_per_rollout=1, micro_batch_size=4, lr=3e-4, adam_beta2=0.999, weight_decay=1e-4,
                  grad_clip=1.0, diffusion_nft_beta=1.0, diffusion_adv_clip_max=5.0, nft_timestep_fraction=0.99,
                  nft_ema_ramp=0.001, nft_ema_max=0.5, globalize_reward_std=True, mixed_precision="bf16",
                  gradient_checkpointing=True, num_rollout=100, eval_num_steps=50, eval_interval=30,
                  checkpoint_interval=20, eval_images_per_category=0, engine_concurrency=2,
                  engine_max_batch_outputs=8)

# DiffusionNFT on Krea-2 (Raw): radixark/miles_diffusion's scripts/run_diffusion_nft_krea2.py, OCR by default and
# PickScore as its alternative: 1024², a 10-step ODE without CFG under the EMA old policy (ramp 0.001 up to 0.5, no
# flat steps), 8 prompts × 8 samples in one optimizer step, microgroups of 1, NFT β 1, timestep fraction 0.99,
# per-prompt mean with batch-wide std, LoRA r32/α64 (Gaussian init), lr 3e-4, AdamW β2 0.999, weight decay 1e-4,
# grad clip 1, bf16 forward, gradient checkpointing, micro-batches of 2, deterministic mode, 100 rollouts, 52
# evaluation steps every 30 rollouts, a checkpoint every 20. The LoRA targets are the family's defaults (the script
# names none), the advantage clip ours (5, as the other NFT recipes).
_KREA2_NFT = dict(diffusion_model_family="krea2", loss_type="nft", reward="ocr", resolution=1024, use_lora=True,
                  lora_rank=32, lora_alpha=64.0, diffusion_num_steps=10, diffusion_guidance_scale=1.0,
                  rollout_batch_size=8, n_samples_per_prompt=8, rollout_microgroup_size=1, global_batch_size=64,
                  num_steps_per_rollout=1, micro_batch_size=2, lr=3e-4, adam_beta2=0.999, weight_decay=1e-4,
                  grad_clip=1.0, diffusion_nft_beta=1.0, nft_timestep_fraction=0.99, nft_ema_ramp=0.001,
                  nft_ema_max=0.5, nft_ema_flat=0, globalize_reward_std=True, mixed_precision="bf16",
                  gradient_checkpointing=True, deterministic_mode=True, num_rollout=100, eval_num_steps=52,
                  eval_interval=30, checkpoint_interval=20, eval_images_per_category=0)

# Flow-GRPO on FLUX 3 Image Klein with HPSv2.1, a full finetune: 1024², fp32 masters with a bf16
# forward, lr 1e-5, 10 steps, CFG 3.5 in rollout and trainer, noise 0.7, one SDE step per rollout drawn
# from steps 1-2, clip 1e-4, no KL, 16 prompts × 16 samples, 200 rollouts; two optimizer steps of 128
# samples per rollout (our choice: the published setting gives the rollout size, not the split).
# The engine denoises one microgroup (16 outputs, 32 rows with CFG) at a time: on one H200 with the fp32
# masters and AdamW moments resident, a batch of 16 peaked at 109 GiB and one of 32 at 130 GiB, slower per
# image (BENCHMARKS.md), so the default batch of 64 outputs would not fit; two in flight let the reward score
# one microgroup while the next denoises.
_FLUX3_GRPO = dict(diffusion_model_family="flux3_image", loss_type="flow_grpo", reward="hpsv2", resolution=1024,
                   use_lora=False, lr=1e-5, diffusion_num_steps=10, diffusion_guidance_scale=3.5,
                   diffusion_noise_level=0.7, diffusion_sde_window_range=(1, 3), diffusion_num_sde_steps=1,
                   diffusion_clip_range=1e-4, diffusion_kl_beta=0.0, rollout_batch_size=16, n_samples_per_prompt=16,
                   rollout_microgroup_size=16, global_batch_size=128, num_steps_per_rollout=2, micro_batch_size=2,
                   mixed_precision="bf16", gradient_checkpointing=True, num_rollout=200, eval_interval=20,
                   checkpoint_interval=20, eval_images_per_category=0, engine_concurrency=2,
                   engine_max_batch_outputs=16)

# Flow-GRPO on Wan2.2-T2V-A14B with PickScore, one frame at 480²: miles-diffusion's
# scripts/run-diffusion-grpo-wan22-pickscore-4gpu.sh (branch feat/wan): 10 steps, CFG 4.0 for the
# high-noise expert and 3.0 for the low-noise one, noise 0.9, one SDE step drawn from steps 1-3 (the
# high-noise expert's), 8 prompts × 16 samples in 2 optimizer steps, LoRA r64/α128 (Gaussian init) on
# self-attention, cross-attention and the FFN, lr 1e-4, AdamW β2 0.999, weight decay 1e-4, clip 1e-4,
# fp32 masters with a bf16 forward, micro-batches of one sample, 28 evaluation steps. Microgroups of 8
# as the published multi-GPU Wan2.2 runs use (the script's default in one version was 1, in a later one 8).
_WAN_TARGETS = ("attn1.to_q", "attn1.to_k", "attn1.to_v", "attn1.to_out.0", "attn2.to_q", "attn2.to_k",
                "attn2.to_v", "attn2.to_out.0", "ffn.net.0.proj", "ffn.net.2")
_WAN22_GRPO = dict(diffusion_model_family="wan2_2", loss_type="flow_grpo", reward="pickscore", resolution=480,
                   num_frames=1, use_lora=True, lora_rank=64, lora_alpha=128.0, lora_target_modules=_WAN_TARGETS,
                   diffusion_num_steps=10, eval_num_steps=28, diffusion_guidance_scale=4.0,
                   diffusion_guidance_scale_2=3.0, diffusion_noise_level=0.9, diffusion_sde_window_range=(1, 4),
                   diffusion_num_sde_steps=1, rollout_batch_size=8, n_samples_per_prompt=16,
                   rollout_microgroup_size=8, global_batch_size=64, num_steps_per_rollout=2, micro_batch_size=1,
                   lr=1e-4, adam_beta2=0.999, weight_decay=1e-4, diffusion_clip_range=1e-4,
                   mixed_precision="bf16", num_rollout=1000, eval_interval=20, checkpoint_interval=10,
                   eval_images_per_category=0)

# Flow-GRPO on LTX-2.3 (dev) with PickScore: radixark/miles_diffusion's run_diffusion_grpo_ltx23_sglang.py
# (run-diffusion-grpo-ltx23-sglang.sh): 57 frames of 512 × 768 (24 fps, the checkpoint's frame rate), 24 steps, CPS
# at noise 0.8 (log-probs without constants, as our CPS step computes them), 3 SDE steps per rollout drawn anywhere
# in steps 0-9 (not necessarily adjacent), CFG 1 with no negative prompt, 8 prompts × 8 samples in 2 optimizer
# steps, microgroup 1, per-prompt mean with batch-wide std, clip 1e-5 (what the script passes; its header says
# 1e-4), no KL, lr 2e-4, AdamW β2 0.999, weight decay 1e-4, LoRA r64/α128 (Gaussian init) on the family's default
# targets (ours: the settings we follow name none), PickScore on 3 evenly spaced frames, bf16 with gradient
# checkpointing, micro-batches of one sample, deterministic mode, 200 rollouts. Unlike the published run, the audio
# stream is denoised beside the video (the pipeline's joint model; see models/ltx2.py). Evaluation and checkpoint
# intervals are ours.
_LTX23_GRPO = dict(diffusion_model_family="ltx2", loss_type="flow_grpo", reward="pickscore", reward_frames=3,
                   height=512, width=768, num_frames=57, use_lora=True, lora_rank=64, lora_alpha=128.0,
                   diffusion_num_steps=24, diffusion_guidance_scale=1.0, diffusion_sde_type="cps",
                   diffusion_noise_level=0.8, diffusion_sde_window_range=(0, 10), diffusion_num_sde_steps=3,
                   diffusion_sde_step_strategy="random", globalize_reward_std=True, rollout_batch_size=8,
                   n_samples_per_prompt=8, rollout_microgroup_size=1, global_batch_size=32, num_steps_per_rollout=2,
                   micro_batch_size=1, lr=2e-4, adam_beta2=0.999, weight_decay=1e-4, diffusion_clip_range=1e-5,
                   diffusion_kl_beta=0.0, mixed_precision="bf16", gradient_checkpointing=True, deterministic_mode=True,
                   num_rollout=200, eval_interval=20, checkpoint_interval=10, eval_images_per_category=0)

# Image to video: --prompt-data rows name each prompt's first frame under `image` (or `images`), Flow-Factory's
# layout (a path relative to the .jsonl or its images/ folder); a row without one is refused on an image-to-video
# checkpoint, a first frame on a text-to-video-only one (Wan2.2 T2V): each in one line.
#
# Flow-GRPO image to video on Wan2.2-I2V-A14B with PickScore, the mean over every frame (as Flow-Factory's video
# PickScore and wan22-grpo-pickscore score video): X-GenGroup/Flow-Factory's examples/grpo/lora/wan22/i2v.yaml: 5
# frames of 480², 8 steps (28 to evaluate) with CFG 3.5 for both experts, SDE at noise 0.9 on step 1, 48 prompts
# × 16 samples in 2 optimizer steps, per-prompt mean and std, no KL, clip 1e-4, advantage clip 5, LoRA r64/α128,
# bf16 forward, lr 1e-4, AdamW β2 0.999, weight decay 1e-4, grad clip 1, micro-batches of one sample, evaluations and
# checkpoints every 20 rollouts, 21-frame 720² evaluations, adapters on the high-noise expert alone (the one that
# takes the trained step 1). Not expressed here: its EMA for evaluation. Microgroups of 8 (as wan22-grpo-pickscore)
# and the 300 rollouts are ours.
_WAN22_I2V_GRPO = dict(_WAN22_GRPO, num_frames=5, diffusion_num_steps=8, eval_num_steps=28,
                       diffusion_guidance_scale=3.5, diffusion_guidance_scale_2=None, diffusion_noise_level=0.9,
                       diffusion_sde_window_range=(1, 2), diffusion_num_sde_steps=1, globalize_reward_std=False,
                       diffusion_adv_clip_max=5.0, diffusion_kl_beta=0.0, rollout_batch_size=48,
                       n_samples_per_prompt=16, rollout_microgroup_size=8, global_batch_size=384,
                       num_steps_per_rollout=2, micro_batch_size=1, lr=1e-4, grad_clip=1.0, num_rollout=300,
                       eval_interval=20, checkpoint_interval=20, eval_resolution=720, eval_num_frames=21,
                       lora_components=("transformer",), condition_images="required")
# Flow-GRPO image to video on LTX-2.3 with PickScore: ltx23-grpo-pickscore's settings (miles_diffusion's LTX-2.3
# run, above: 57 frames of 512 × 768, 24 steps, CPS at noise 0.8 on 3 steps drawn from steps 0-9, CFG 1, 8 × 8,
# microgroup 1, PickScore on 3 frames), the first frame from each row: on LTX2ImageToVideoPipeline's checkpoint or
# LTX2Pipeline's (the same weights do both; there a row without a first frame would be text to video). Flow-Factory's image-to-video LTX example
# (examples/grpo/lora/ltx2/i2av.yaml) is not followed: it trains LTX-2 (not 2.3) on audio rewards (CLAP, ImageBind)
# rather than PickScore, with Flow-SDE steps, and its authors mark it not fully tested. On a GPU as published too: the
# text-to-video recipe's GPU batching and compilation (8 videos per request, micro-batches of 4, compiled) are
# measured for text to video only; `--rollout-microgroup-size 8 --micro-batch-size 4 --compile` asks for them.
_LTX23_I2V_GRPO = dict(_LTX23_GRPO, condition_images="required")
# LTX-2.3's GPU shape, text and image to video alike (the recipes' comments below say what it measured).
_LTX23_GPU = dict(rollout_microgroup_size=8, micro_batch_size=4, compile=True, offload_text_encoder=True)

# Flow-GRPO on Cosmos3 with PickScore, text-to-image: radixark/miles_diffusion's
# scripts/run_diffusion_grpo_cosmos3_pickscore_t2i_4gpu.py (Cosmos3-Nano, LoRA on the generation tower): one frame
# of 480 × 832, 16 steps with CFG 4.0, SDE at noise 0.7 on 2 steps drawn per rollout from steps 8-11 (the
# checkpoint's sigma grid spends steps 1-7 above σ 0.96, where a step trains nothing), 48 prompts × 16 samples in
# one optimizer step, microgroups of 1 (the family's packed forward takes one sample), micro-batches of one sample,
# LoRA r64/α128 (Gaussian init), lr 1e-4, AdamW β2 0.999, weight decay 1e-4, clip 1e-3, no KL, per-prompt mean with
# batch-wide std, fp32 masters with a bf16 forward, 35 evaluation steps every 30 rollouts, a checkpoint every 10.
# Ours: gradient checkpointing; 10 000 rollouts is that script's default. A video run sets --num-frames (4k + 1)
# and --reward-frames.
_COSMOS3_GRPO = dict(diffusion_model_family="cosmos3", loss_type="flow_grpo", reward="pickscore", height=480,
                     width=832, num_frames=1, use_lora=True, lora_rank=64, lora_alpha=128.0, diffusion_num_steps=16,
                     eval_num_steps=35, diffusion_guidance_scale=4.0, diffusion_sde_type="sde",
                     diffusion_noise_level=0.7, diffusion_sde_window_range=(8, 12), diffusion_num_sde_steps=2,
                     diffusion_sde_step_strategy="random", globalize_reward_std=True, rollout_batch_size=48,
                     n_samples_per_prompt=16, rollout_microgroup_size=1, global_batch_size=768,
                     num_steps_per_rollout=1, micro_batch_size=1, lr=1e-4, adam_beta2=0.999, weight_decay=1e-4,
                     diffusion_clip_range=1e-3, diffusion_kl_beta=0.0, mixed_precision="bf16",
                     gradient_checkpointing=True, num_rollout=10000, eval_interval=30, checkpoint_interval=10,
                     eval_images_per_category=0)

# Flow-GRPO on FLUX.1 [dev] with PickScore: yifan123/flow_grpo's `pickscore_flux` (config/grpo.py) as its
# scripts/train_flux.py runs it: 512², 6 steps (28 to evaluate) with the embedded guidance 3.5 and no true CFG, SDE
# at noise 0.9 on every step and 5 of the 6 trained (timestep fraction 0.99), 48 prompts × 24 samples in 2 optimizer
# steps, per-prompt mean with batch-wide std, no KL, clip 1e-4, LoRA r64/α128 (Gaussian init) on the family's
# default targets (that script's list), lr 3e-4, AdamW β2 0.999, weight decay 1e-4, grad clip 1, bf16, micro-batches
# of 3 samples. Not expressed here: flow_grpo encodes 128 T5 tokens (a checkpoint setting: `max_sequence_length` in
# the `diffrl` block of model_index.json; the family's default is the pipeline's 512) and keeps an EMA for its
# evaluations. Microgroups of 8, gradient checkpointing and the intervals are ours.
_FLUX1_GRPO = dict(diffusion_model_family="flux1", loss_type="flow_grpo", reward="pickscore", resolution=512,
                   use_lora=True, lora_rank=64, lora_alpha=128.0, diffusion_num_steps=6, eval_num_steps=28,
                   diffusion_guidance_scale=1.0, diffusion_noise_level=0.9, diffusion_sde_window_range=(0, 5),
                   diffusion_num_sde_steps=5, diffusion_clip_range=1e-4, diffusion_kl_beta=0.0,
                   globalize_reward_std=True, rollout_batch_size=48, n_samples_per_prompt=24,
                   rollout_microgroup_size=8, global_batch_size=576, num_steps_per_rollout=2, micro_batch_size=3,
                   lr=3e-4, adam_beta2=0.999, weight_decay=1e-4, grad_clip=1.0, mixed_precision="bf16",
                   gradient_checkpointing=True, num_rollout=300, eval_interval=30, checkpoint_interval=30,
                   eval_images_per_category=0)

# Flow-GRPO on Qwen-Image-Edit Plus (Qwen-Image-Edit-2509; --prompt-data rows name each edit's sources under `image` /
# `images`) with PickScore: X-GenGroup/Flow-Factory's examples/grpo/lora/qwen_image_edit_plus/default.yaml: 384²
# outputs, 10 steps with true CFG 4, SDE at noise 1.0 on one step drawn per rollout from steps 1-3, 48 prompts × 16
# samples in 2 optimizer steps, per-prompt mean and std, no KL, clip 1e-4, advantage clip 5, LoRA r64/α128 on both
# streams' attention and MLPs (its default targets), bf16 forward, lr 3e-4, AdamW β2 0.999, weight decay 1e-4, grad
# clip 1, micro-batches of one sample; 384² reference images while training (--condition-image-size; the pipelines'
# area is 1024²); 40-step evaluations at 1024² with 1024² references, one image at a time. Not expressed here: its
# GDPO aggregation (one reward here) and its EMA for evaluation. Microgroups of 16, gradient checkpointing and the
# intervals are ours, and so is the engine's bound of one microgroup per batch (two in flight,
# so that one is scored while the next denoises): with 1024² references one batch of 16 (32 rows with CFG, 4.7 k
# tokens each) peaked at 69.9 GiB on an 80 GB H100 (BENCHMARKS.md), where the default bound would batch four.
_QWEN_EDIT_GRPO = dict(_QWEN_GRPO, resolution=384, diffusion_noise_level=1.0, diffusion_sde_window_range=(1, 4),
                       diffusion_num_sde_steps=1, globalize_reward_std=False, diffusion_adv_clip_max=5.0,
                       diffusion_kl_beta=0.0, rollout_batch_size=48, n_samples_per_prompt=16,
                       rollout_microgroup_size=16, global_batch_size=384, micro_batch_size=1, grad_clip=1.0,
                       eval_num_steps=40, eval_resolution=1024, num_rollout=300, eval_interval=30,
                       checkpoint_interval=30, condition_image_size=384, eval_condition_image_size=1024,
                       eval_batch_size=1, engine_concurrency=2,
                       engine_max_batch_outputs=16, condition_images="required")

# Flow-GRPO on FLUX.1 Kontext (instruction editing; --prompt-data rows name each edit's source under `image`) with
# PickScore: X-GenGroup/Flow-Factory's examples/grpo/lora/flux1_kontext/default.yaml: 384² outputs from sources of at
# most 384² of area (--condition-image-size; 512² to evaluate), 10 steps without true CFG, SDE at noise 0.9 on one
# step drawn per rollout from steps 1-3, 48 prompts × 16 samples in 2 optimizer steps, per-prompt mean and std, no KL,
# clip 1e-4, advantage clip 5, LoRA r64/α128, bf16 forward, lr 3e-4, AdamW β2 0.999, weight decay 1e-4, grad clip 1,
# micro-batches of one sample; 20-step evaluations at 512². Not expressed here: its embedded guidance 2.5 (a
# checkpoint setting here: `"diffrl": {"guidance": 2.5}` in model_index.json; 3.5 otherwise) and its EMA for
# evaluation. Microgroups of 16, gradient checkpointing and the intervals are ours.
_FLUX1_KONTEXT_GRPO = dict(diffusion_model_family="flux1", loss_type="flow_grpo", reward="pickscore", resolution=384,
                           use_lora=True, lora_rank=64, lora_alpha=128.0, diffusion_num_steps=10, eval_num_steps=20,
                           eval_resolution=512,
                           diffusion_guidance_scale=1.0, diffusion_noise_level=0.9, diffusion_sde_window_range=(1, 4),
                           diffusion_num_sde_steps=1, diffusion_clip_range=1e-4, diffusion_adv_clip_max=5.0,
                           diffusion_kl_beta=0.0, rollout_batch_size=48, n_samples_per_prompt=16,
                           rollout_microgroup_size=16, global_batch_size=384, num_steps_per_rollout=2,
                           micro_batch_size=1, lr=3e-4, adam_beta2=0.999, weight_decay=1e-4, grad_clip=1.0,
                           mixed_precision="bf16", gradient_checkpointing=True, num_rollout=300, eval_interval=30,
                           checkpoint_interval=30, eval_images_per_category=0, condition_image_size=384,
                           eval_condition_image_size=512, condition_images="required")

# Flow-GRPO on Z-Image with PickScore: X-GenGroup/Flow-Factory's examples/grpo/lora/z_image/default.yaml: 512², 10
# steps with CFG g = 4 in Z-Image's form (our scale s = g + 1 = 5), SDE at noise 0.7 on one step drawn per rollout
# from steps 1-3, 48 prompts × 16 samples in 2 optimizer steps, per-prompt mean and std, no KL, clip 1e-4, advantage
# clip 5, LoRA r64/α128 on the family's default targets (that file's default list), fp32 masters with a bf16
# forward, lr 3e-4, AdamW β2 0.999, weight decay 1e-4, grad clip 1, micro-batches of one sample; 40-step evaluations
# at 1024². Not expressed here: its GDPO aggregation of several rewards (one reward here) and its EMA for
# evaluation. Microgroups of 16 (one request per prompt), gradient checkpointing and the intervals are ours.
_Z_IMAGE_GRPO = dict(diffusion_model_family="z_image", loss_type="flow_grpo", reward="pickscore", resolution=512,
                     use_lora=True, lora_rank=64, lora_alpha=128.0, diffusion_num_steps=10, eval_num_steps=40,
                     eval_resolution=1024, diffusion_guidance_scale=5.0, diffusion_noise_level=0.7, diffusion_sde_window_range=(1, 4),
                     diffusion_num_sde_steps=1, diffusion_clip_range=1e-4, diffusion_adv_clip_max=5.0,
                     diffusion_kl_beta=0.0, rollout_batch_size=48, n_samples_per_prompt=16,
                     rollout_microgroup_size=16, global_batch_size=384, num_steps_per_rollout=2, micro_batch_size=1,
                     lr=3e-4, adam_beta2=0.999, weight_decay=1e-4, grad_clip=1.0, mixed_precision="bf16",
                     gradient_checkpointing=True, num_rollout=300, eval_interval=40, checkpoint_interval=40,
                     eval_images_per_category=0)
# The same on Z-Image-Turbo: the same file for the turbo checkpoint (examples/grpo/lora/z_image_turbo): 6 steps
# without CFG (g = 0), 10 to evaluate at the rollouts' 512²; the SDE step, batch and optimizer as above.
_Z_IMAGE_TURBO_GRPO = dict(_Z_IMAGE_GRPO, diffusion_num_steps=6, eval_num_steps=10, eval_resolution=None,
                           diffusion_guidance_scale=1.0)

# Flow-GRPO on FLUX.2 [klein] (the step-distilled 4B / 9B) with PickScore: X-GenGroup/Flow-Factory's
# examples/grpo/lora/flux2_klein/default.yaml: 384², the distilled 4 steps (10 to evaluate) without CFG, SDE at noise
# 0.5 on one step drawn per rollout from steps 1-2, 48 prompts × 16 samples in 2 optimizer steps, per-prompt mean and
# std, no KL, clip 1e-4, advantage clip 5, LoRA r64/α128 on the family's default targets (that model's default list),
# fp32 masters with a bf16 forward, lr 3e-4, AdamW β2 0.999, weight decay 1e-4, grad clip 1, micro-batches of one
# sample; evaluations at 1024². Not expressed here: its EMA for evaluation. Microgroups of 16 (one request per
# prompt), gradient checkpointing and the intervals are ours.
_FLUX2_KLEIN_GRPO = dict(diffusion_model_family="flux2", loss_type="flow_grpo", reward="pickscore", resolution=384,
                         use_lora=True, lora_rank=64, lora_alpha=128.0, diffusion_num_steps=4, eval_num_steps=10,
                         eval_resolution=1024,
                         diffusion_guidance_scale=1.0, diffusion_noise_level=0.5, diffusion_sde_window_range=(1, 3),
                         diffusion_num_sde_steps=1, diffusion_clip_range=1e-4, diffusion_adv_clip_max=5.0,
                         diffusion_kl_beta=0.0, rollout_batch_size=48, n_samples_per_prompt=16,
                         rollout_microgroup_size=16, global_batch_size=384, num_steps_per_rollout=2,
                         micro_batch_size=1, lr=3e-4, adam_beta2=0.999, weight_decay=1e-4, grad_clip=1.0,
                         mixed_precision="bf16", gradient_checkpointing=True, num_rollout=300, eval_interval=20,
                         checkpoint_interval=20, eval_images_per_category=0)
# The same on FLUX.2 [klein] base (examples/grpo/lora/flux2_klein_base/default.yaml): 8 steps with CFG 4 (28 to
# evaluate), noise 0.7 on one step drawn from steps 1-3; the batch and optimizer as above.
_FLUX2_KLEIN_BASE_GRPO = dict(_FLUX2_KLEIN_GRPO, diffusion_num_steps=8, eval_num_steps=28, diffusion_guidance_scale=4.0,
                              diffusion_noise_level=0.7, diffusion_sde_window_range=(1, 4))
# Flow-GRPO on FLUX.2 [dev] (examples/grpo/lora/flux2/t2i.yaml): 512², 8 steps (28 to evaluate at 1024²) with the
# embedded guidance 4 (the family's default checkpoint setting) and no true CFG, noise 1.0 on one step drawn from steps 1-3;
# the batch and optimizer as above. Not expressed here: that file's reward is a CLIP text-alignment term (weight 1)
# beside PickScore (0.5) aggregated by GDPO: `--reward multi:clipscore@DIR=1,pickscore@DIR=0.5
# --advantage-aggregation gdpo` gives it. 32 B parameters and a 24 B text encoder: an H200 with
# --offload-text-encoder, or several GPUs.
_FLUX2_DEV_GRPO = dict(_FLUX2_KLEIN_GRPO, resolution=512, diffusion_num_steps=8, eval_num_steps=28,
                       diffusion_noise_level=1.0, diffusion_sde_window_range=(1, 4))
# Flow-GRPO editing on FLUX.2 [dev] (--prompt-data rows name each edit's references under `image`/`images`):
# examples/grpo/lora/flux2/i2i.yaml: 384² outputs, 10 steps (28 to evaluate) with the embedded guidance 4, PickScore
# alone; everything else as the t2i recipe above; its sources sized to at most 384² of area (--condition-image-size;
# the pipeline's cap is 1024²), 512² to evaluate.
# Flow-Factory has no FLUX.2 [klein] editing example: the klein recipes apply to an editing prompt set as they are.
_FLUX2_DEV_EDIT_GRPO = dict(_FLUX2_DEV_GRPO, resolution=384, diffusion_num_steps=10, eval_num_steps=28,
                            eval_resolution=512, condition_image_size=384, eval_condition_image_size=512,
                            condition_images="required")
# DiffusionNFT on FLUX.2 [klein] base with PickScore (examples/nft/lora/flux2_klein_base/default.yaml): 384², 8-step
# ODE rollouts with CFG 4 under the EMA old policy (ramp 0.001 up to 0.5, no flat rollouts), NFT β 0.1, advantage
# clip 5, 48 prompts × 16 samples in one optimizer step, LoRA r64/α128, lr 1e-4, AdamW β2 0.999, weight decay 1e-4,
# grad clip 1, bf16 forward, micro-batches of one sample, 28-step evaluations at 1024², 2 timesteps per sample drawn
# from the steps of σ ≥ 0.5 (its timestep_range 0.5; there stratified over them, here 2 of a shuffle). Microgroups of
# 16, gradient checkpointing and the intervals are ours.
_FLUX2_KLEIN_BASE_NFT = dict(diffusion_model_family="flux2", loss_type="nft", reward="pickscore", resolution=384,
                             use_lora=True, lora_rank=64, lora_alpha=128.0, diffusion_num_steps=8, eval_num_steps=28,
                             eval_resolution=1024,
                             diffusion_guidance_scale=1.0, nft_rollout_guidance_scale=4.0, diffusion_nft_beta=0.1,
                             train_timesteps=2, train_timestep_range=(0.0, 0.5), nft_ema_ramp=0.001,
                             nft_ema_max=0.5, nft_ema_flat=0,
                             diffusion_adv_clip_max=5.0, rollout_batch_size=48, n_samples_per_prompt=16,
                             rollout_microgroup_size=16, global_batch_size=768, num_steps_per_rollout=1,
                             micro_batch_size=1, lr=1e-4, adam_beta2=0.999, weight_decay=1e-4, grad_clip=1.0,
                             mixed_precision="bf16", gradient_checkpointing=True, num_rollout=300, eval_interval=20,
                             checkpoint_interval=20, eval_images_per_category=0)

# The OCR world (docs/ocr-world.md): the OCR demo model (48x256, pretrained here on renders of generated texts),
# the generated training prompts and the published held-out test split, the ocr reward (PP-OCR) and the tesseract
# judge beside it in every evaluation (eval/judge, eval/hacking_gap_sd). Starting points taken from the shapes
# recipes; measured on this world so far: ocr-nft's CPU size (16 rollouts in 7.3 minutes on 2 cores). The GPU sizes
# score OCR in 12 reward worker processes (about 0.1 s of CPU per image), the CPU sizes follow `make demo`'s.
_OCR = dict(model_path=SHIPPED_OCR_MODEL, prompt_data=OCR_PROMPTS, reward="ocr", eval_reward="tesseract",
            use_lora=False, eval_images_per_category=0)
# 4 steps on the GPU too: at 10 the base already draws the letters it knows crisply and 25 rollouts of DiffusionNFT
# raised the held-out reward by 0.09 / 0.01 (two seeds); at 4 the same budget buys 0.23-0.31 (docs/ocr-world.md).
_OCR_GPU = dict(_OCR, num_rollout=60, diffusion_num_steps=4, rollout_batch_size=32, n_samples_per_prompt=16,
                rollout_microgroup_size=16, global_batch_size=256, num_steps_per_rollout=2, engine_concurrency=32,
                engine_max_batch_outputs=512, eval_interval=30, checkpoint_interval=20, eval_num_prompts=256,
                reward_workers=12, mixed_precision="no", lr_schedule="cosine", lr_min_ratio=0.1)
_OCR_CPU = dict(_OCR, diffusion_num_steps=4, num_rollout=16, rollout_batch_size=6, n_samples_per_prompt=8,
                rollout_microgroup_size=8, global_batch_size=48, num_steps_per_rollout=1, micro_batch_size=48,
                eval_interval=10, eval_num_prompts=24, checkpoint_interval=10)

# The editing world (docs/editing-world.md): the editing demo model (pretrained here from the shipped one on the
# world's train split, `diffrl pretrain --world shapes-edit`), each prompt an edit instruction with its rendered
# source as the condition image, the shapes_edit reward (partial credit) in training and the strict verifier in
# evaluation (eval/strict over eval_images_per_category held-out edits of each kind). Hyperparameters taken from the
# shapes recipes; a rollout carries the source's tokens beside the image's, so the GPU sizes train in micro-batches
# of 256. shapes-edit-nft on one H100: held-out strict 0.707 → 0.816 in 40 rollouts, 335 s (docs/editing-world.md);
# both CPU sizes are measured there; shapes-edit-grpo's GPU size is not measured yet.
_EDIT = dict(model_path=SHIPPED_EDIT_MODEL, world="shapes-edit", reward="shapes_edit", use_lora=False,
             val_images_per_category=0)
_EDIT_GPU = dict(_EDIT, **{**_GPU_BATCH, "val_images_per_category": 0}, lr_schedule="cosine", lr_min_ratio=0.1)
_EDIT_CPU = dict(_EDIT, diffusion_num_steps=4, num_rollout=22, rollout_batch_size=6, n_samples_per_prompt=8,
                 rollout_microgroup_size=8, global_batch_size=48, num_steps_per_rollout=1, micro_batch_size=48,
                 eval_interval=22, eval_images_per_category=8, checkpoint_interval=11)

# On a GPU the SD3.5 recipes compile their blocks and the in-process engine samples in the trainer's own compiled
# graph (--engine-forward-graph auto → training), in pieces of the trainer's micro-batch since nothing is
# checkpointed. CFG's unconditional half runs without gradients in the rollout and the replay alike
# (--detach-uncond: the published code's own gradient), which lets a micro-batch hold 16 pairs in the memory 8
# took, and the replay takes that half from the rollout instead of computing it again (--reuse-rollout-uncond, one
# optimizer step per rollout): on one H100, 0.286 s per sample against the published code's 0.812 in the same call,
# first-pass |Δ log p| 0 and clipfrac 0, 56.1 GiB (BENCHMARKS.md, "One compiled graph for the rollout and its
# replay").
# --gradient-checkpointing trades speed for memory; --no-compile gives eager back (0.83 s).
_SD3_GPU = dict(compile=True, gradient_checkpointing=False, detach_uncond=True, micro_batch_size=16)

SIZED: dict[str, dict[str, dict]] = {
    "sd3-grpo": {"gpu": dict(_SD3_GRPO, **_SD3_GPU), "cpu": _SD3_GRPO},  # a real checkpoint has no CPU size
    "sd35-grpo-ocr": {"gpu": dict(_ocr := dict(_SD35_GRPO, reward="ocr", diffusion_kl_beta=0.04), **_SD3_GPU),
                      "cpu": _ocr},
    "sd35-grpo-pickscore": {"gpu": dict(_pick := dict(_SD35_GRPO, reward="pickscore", diffusion_kl_beta=0.01),
                                        **_SD3_GPU), "cpu": _pick},
    # Compiled on a GPU: 1.19 s per sample against 1.79 eager on one H200, first-pass |Δ log p| 1.5e-6 (eager 1e-6 to
    # 1.4e-5); the first two rollouts pay the compilation, the second for the prompts' new text length
    # (BENCHMARKS.md, "Qwen-Image, LTX-2.3 and Cosmos3: compiled and larger micro-batches").
    "qwen-image-grpo-pickscore": {"gpu": dict(_QWEN_GRPO, compile=True), "cpu": _QWEN_GRPO},
    # Compiled on a GPU (--no-compile turns it off): on one H200 the GRPO full finetune 2.17 s per sample against
    # 2.95 eager, first-pass |Δ log p| 3.7e-7; NFT 6.93 s against 10.4 (BENCHMARKS.md, "FLUX 3 Klein at 1024²,
    # compiled"). The first rollout pays the compilation (about a minute). NFT on a GPU also trains without
    # checkpointing: compiled it peaks at 73.1 GiB, inside an 80 GB card, at 6.05 s per sample on one H100 (53.6% MFU
    # end to end) against 7.11 s checkpointed; eager it would need 103.8 GiB, so --no-compile on an 80 GB card needs
    # --gradient-checkpointing back. That peak held the random checkpoint's 8-layer text encoder (0.43 B); a real one
    # (Qwen3-VL-4B, 4.44 B) adds 7.5 GiB (benchmarks/text_encoder_sizes.py), past an 80 GB card, so on a GPU it stays in
    # host memory between encodes (--offload-text-encoder: one pinned copy in per batch that encodes, nothing back;
    # its cost is not measured yet).
    "flux3-klein-nft-pickscore": {"gpu": dict(_FLUX3_NFT, compile=True, gradient_checkpointing=False,
                                              offload_text_encoder=True),
                                  "cpu": _FLUX3_NFT},
    # FLUX 3 Image Klein's own editing mode (its transformer's reference images): the family's NFT recipe above on a
    # prompt set whose rows name their sources (`image`/`images`); no peer publishes FLUX 3 editing settings. The
    # peers' NFT editing run (Flow-Factory's examples/nft/lora/flux1_kontext/rational_rewards_edit.yaml) judges edits
    # with a VLM: pass --reward vlm@URL for that; PickScore judges the output alone, not whether the edit was done.
    "flux3-klein-edit-nft-pickscore": {"gpu": dict(_FLUX3_NFT, compile=True, condition_images="required"),
                                       "cpu": dict(_FLUX3_NFT, condition_images="required")},
    "flux3-klein-grpo-hps": {"gpu": dict(_FLUX3_GRPO, compile=True), "cpu": _FLUX3_GRPO},
    # Compiled on a GPU (--no-compile turns it off): on one H100 1.02 s per sample, rollout MFU 61%, first-pass
    # clipfrac 0 at clip 1e-4 (|Δ log p| 0.8-3.7e-6); Z-Image 0.82 s once its third rollout is compiled, clipfrac 0
    # (|Δ log p| 1.5e-8 on the first rollout, 2.6-3.1e-5 after an update) (BENCHMARKS.md, "FLUX.1 [dev] and Z-Image").
    "flux1-grpo-pickscore": {"gpu": dict(_FLUX1_GRPO, compile=True), "cpu": _FLUX1_GRPO},
    # Compiled on a GPU as well, these and the FLUX.2, Krea-2, Wan2.2 I2V, LTX-2.3 I2V and Cosmos3 recipes below: on
    # one H100, each recipe's first rollout with real-width blocks (two of each kind) clipped none of its first pass at
    # clip 1e-4 (|Δ log p| 0 to 2.1e-6), and its NFT runs compiled every block (BENCHMARKS.md, "Every recipe's first
    # pass, compiled").
    "flux1-kontext-grpo-pickscore": {"gpu": dict(_FLUX1_KONTEXT_GRPO, compile=True), "cpu": _FLUX1_KONTEXT_GRPO},
    "qwen-image-edit-grpo-pickscore": {"gpu": dict(_QWEN_EDIT_GRPO, compile=True), "cpu": _QWEN_EDIT_GRPO},
    "krea2-nft-ocr": {"gpu": dict(_KREA2_NFT, compile=True), "cpu": _KREA2_NFT},
    "krea2-nft-pickscore": {"gpu": dict(_krea_pick := dict(_KREA2_NFT, reward="pickscore"), compile=True),
                            "cpu": _krea_pick},
    "wan22-grpo-pickscore": {"gpu": dict(_WAN22_GRPO, compile=True), "cpu": _WAN22_GRPO},
    "z-image-grpo-pickscore": {"gpu": dict(_Z_IMAGE_GRPO, compile=True), "cpu": _Z_IMAGE_GRPO},
    "z-image-turbo-grpo-pickscore": {"gpu": dict(_Z_IMAGE_TURBO_GRPO, compile=True), "cpu": _Z_IMAGE_TURBO_GRPO},
    "flux2-klein-grpo-pickscore": {"gpu": dict(_FLUX2_KLEIN_GRPO, compile=True), "cpu": _FLUX2_KLEIN_GRPO},
    "flux2-klein-base-grpo-pickscore": {"gpu": dict(_FLUX2_KLEIN_BASE_GRPO, compile=True),
                                        "cpu": _FLUX2_KLEIN_BASE_GRPO},
    "flux2-klein-base-nft-pickscore": {"gpu": dict(_FLUX2_KLEIN_BASE_NFT, compile=True), "cpu": _FLUX2_KLEIN_BASE_NFT},
    "flux2-dev-grpo-pickscore": {"gpu": dict(_FLUX2_DEV_GRPO, compile=True), "cpu": _FLUX2_DEV_GRPO},
    "flux2-dev-edit-grpo-pickscore": {"gpu": dict(_FLUX2_DEV_EDIT_GRPO, compile=True), "cpu": _FLUX2_DEV_EDIT_GRPO},
    # On a GPU (_LTX23_GPU): one request per prompt's 8 videos (denoised as one batch), training micro-batches of 4
    # pairs and compiled blocks: 8.25 s per sample on one H200 against 29.2 s with the published microgroup 1 and
    # micro-batch 1, eager. The same samples (seeds fix them) and the same gradient (micro-batches are weighted by their
    # share of the step) up to batch-dependent rounding; first-pass |Δ log p| 6.7e-7 (BENCHMARKS.md, as above).
    # Its 63.8 GiB peak there held a 2-layer text encoder (0.45 B); LTX-2.3's real Gemma 3 12B adds 21.9 GiB
    # (benchmarks/text_encoder_sizes.py), so on a GPU it stays in host memory between encodes (--offload-text-encoder;
    # not measured yet), as in the I2V one.
    "ltx23-grpo-pickscore": {"gpu": dict(_LTX23_GRPO, **_LTX23_GPU), "cpu": _LTX23_GRPO},
    "wan22-i2v-grpo-pickscore": {"gpu": dict(_WAN22_I2V_GRPO, compile=True), "cpu": _WAN22_I2V_GRPO},
    # Text to video's GPU shape. Compiled, at real widths with two blocks of each kind, its first rollout on one H100
    # clipped none of its first pass (|Δ log p| 0), measured at microgroup 1 and micro-batch 1; at this shape the
    # image-to-video first pass is not measured yet (text to video's was 6.7e-7 at real size).
    "ltx23-i2v-grpo-pickscore": {"gpu": dict(_LTX23_I2V_GRPO, **_LTX23_GPU), "cpu": _LTX23_I2V_GRPO},
    # On a GPU micro-batches of 16 pairs (one prompt's rows batched): 0.78 s per sample against 2.32 at micro-batch 1.
    "cosmos3-grpo": {"gpu": dict(_COSMOS3_GRPO, micro_batch_size=16, compile=True), "cpu": _COSMOS3_GRPO},
    "shapes-nft": {
        # DiffusionNFT: CFG-free ODE rollouts under the EMA old policy, full finetune.
        # Cosine decay over 60 rollouts: at a constant rate, or over more rollouts, the held-out
        # accuracy fell after its peak (from the shipped model it peaks at rollouts 40-60 of a
        # 100-rollout cosine; over 60 the last checkpoint keeps the peak: JOURNAL.md).
        # Adaptive category sampling (more groups for the categories with lower training reward) and
        # an optimizer step in two micro-batches (the demo model is launch-bound; 30 GiB of GPU memory)
        # gave the best held-out accuracy (JOURNAL.md).
        "gpu": dict(loss_type="nft", use_lora=False, lr=1e-4,
                    **{**_GPU_BATCH, "num_rollout": 60, "micro_batch_size": 1152},
                    lr_schedule="cosine", lr_min_ratio=0.1, category_sampling="adaptive"),
        # The CPU main command (`make demo`, about 4 minutes on 2 cores): 4 steps, one group per
        # category per rollout, one optimizer step of 48 samples × 3 timesteps. lr 5e-5: on the hardened
        # verifier 1e-4 left the train reward without a trend (2e-4 collapsed; JOURNAL.md).
        # Figures: docs/demo-model.md.
        "cpu": dict(loss_type="nft", use_lora=False, lr=5e-5, diffusion_num_steps=4, num_rollout=22,
                    rollout_batch_size=6, n_samples_per_prompt=8, rollout_microgroup_size=8, global_batch_size=48,
                    num_steps_per_rollout=1, micro_batch_size=48, eval_interval=22, eval_images_per_category=8,
                    checkpoint_interval=11),
    },
    # GPU lr 4e-5 (two optimizer steps of 256 per rollout; the CPU size's one step of 48 came apart at 5e-5): held-out
    # PP-OCR 0.284 -> 0.598 / 0.509, Tesseract 0.327 -> 0.594 / 0.454 in 49 rollouts, two seeds, one H100 (3e-5: +0.25 / +0.15
    # in 26 rollouts with a third run on the card).
    "ocr-nft": {"gpu": dict(_OCR_GPU, loss_type="nft", lr=4e-5, micro_batch_size=256),
                # lr 5e-5 rose as fast, then its loss climbed and the reward fell back by rollout 16; 2e-5 held
                # (docs/ocr-world.md, "RL").
                "cpu": dict(_OCR_CPU, loss_type="nft", lr=2e-5)},
    # GPU: CFG 3 and the SDE on steps 0-1 of the 4: held-out PP-OCR 0.449 -> 0.639, Tesseract 0.437 -> 0.619 in 28 rollouts
    # at lr 3e-5, one seed, one H100 sharing the card with two other runs (docs/ocr-world.md).
    "ocr-grpo": {"gpu": dict(_OCR_GPU, loss_type="flow_grpo", lr=3e-5, diffusion_guidance_scale=3.0,
                             diffusion_clip_range=1e-3, diffusion_sde_window_range=(0, 2), micro_batch_size=256),
                 # The shapes CPU sizes' lesson (lr 1e-4 with the SDE anywhere wore their backgrounds off): lr 1e-5 and
                 # the SDE on the first half of the 4 steps. Measured here: 16 rollouts barely move it; at 3e-5 the
                 # reward rose and the judge did not (docs/ocr-world.md).
                 "cpu": dict(_OCR_CPU, loss_type="flow_grpo", lr=1e-5, diffusion_sde_window_range=(0, 2))},
    "shapes-edit-nft": {"gpu": dict(_EDIT_GPU, loss_type="nft", lr=1e-4, num_rollout=40),
                        "cpu": dict(_EDIT_CPU, loss_type="nft", lr=5e-5)},
    "shapes-edit-grpo": {"gpu": dict(_EDIT_GPU, loss_type="flow_grpo", lr=1e-5, num_rollout=250,
                                     diffusion_guidance_scale=3.0, diffusion_clip_range=1e-3,
                                     diffusion_sde_window_range=(0, 4)),
                         # lr 1e-5 on a CPU too: at 1e-4 the 22 rollouts left every held-out edit with a speckled
                         # background (strict 0.594 → 0.000); at 1e-5 0.594 → 0.531 (32 edits), clean (2-core CPU,
                         # 2026-12-06; docs/editing-world.md).
                         "cpu": dict(_EDIT_CPU, loss_type="flow_grpo", lr=1e-5)},
    "shapes-grpo": {
        # Flow-GRPO with CFG 3 and 2 SDE steps per rollout inside the first 4 of 10 steps, clip 1e-3,
        # cosine decay over 250 rollouts and adaptive categories (JOURNAL.md). lr 1e-5: on the hardened
        # verifier 1e-4 and 3e-5 drift into dithered fills and collapse, 1e-5 climbs with clean images
        # (0.876 -> 0.921 held-out in 334 s on an H200 shared by three runs: docs/results.md).
        # One optimizer step's 512 pairs in one micro-batch.
        "gpu": dict(loss_type="flow_grpo", use_lora=False, lr=1e-5, diffusion_guidance_scale=3.0,
                    **{**_GPU_BATCH, "num_rollout": 250, "micro_batch_size": 512},
                    diffusion_clip_range=1e-3, diffusion_sde_window_range=(0, 4),
                    lr_schedule="cosine", lr_min_ratio=0.1, category_sampling="adaptive"),
        # At CPU scale (CFG off: one forward per step) its reward does not rise yet, but it keeps the model: the GPU
        # size's lr and SDE window. At lr 1e-4 with the SDE anywhere in the 10 steps, 12 rollouts tinted every held-out
        # background off-white (strict 0.771 → 0.000); with these 0.771 → 0.792, training reward flat at 0.93
        # (2-core CPU, 2026-12-06; docs/results.md).
        "cpu": dict(loss_type="flow_grpo", use_lora=False, lr=1e-5, diffusion_sde_window_range=(0, 4)),
    },
}
# A recipe's CPU size evaluates at its rollouts' size and frame count: the published evaluation sizes (1024², 21
# frames of 720²) are for the real model on a GPU; a tiny model (tests, a recipe tried on a CPU) cannot always make
# them, and a CPU takes long to.
_EVAL_SIZE_FLAGS = ("eval_resolution", "eval_height", "eval_width", "eval_num_frames")
for _sizes in SIZED.values():
    _sizes["cpu"] = {k: v for k, v in _sizes["cpu"].items() if k not in _EVAL_SIZE_FLAGS}



# One line each for `diffrl recipes`.
RECIPE_SUMMARIES = {
    "sd3-grpo": "Flow-GRPO on SD3.5-Medium at the published sampling settings (give it --reward)",
    "sd35-grpo-ocr": "Flow-GRPO on SD3.5-Medium with the OCR reward (flow_grpo's general_ocr_sd3)",
    "sd35-grpo-pickscore": "Flow-GRPO on SD3.5-Medium with PickScore (flow_grpo's pickscore_sd3)",
    "qwen-image-grpo-pickscore": "Flow-GRPO on Qwen-Image with PickScore (flow_grpo's pickscore_qwenimage)",
    "flux3-klein-nft-pickscore": "DiffusionNFT on FLUX 3 Klein with PickScore",
    "flux3-klein-grpo-hps": "Flow-GRPO on FLUX 3 Klein with HPSv2",
    "flux3-klein-edit-nft-pickscore": "DiffusionNFT editing on FLUX 3 Image Klein's reference mode with PickScore "
                                      "(the family's NFT recipe; rows name their sources)",
    "flux1-grpo-pickscore": "Flow-GRPO on FLUX.1 [dev] with PickScore (flow_grpo's pickscore_flux)",
    "flux1-kontext-grpo-pickscore": "Flow-GRPO editing on FLUX.1 Kontext with PickScore (Flow-Factory's example)",
    "qwen-image-edit-grpo-pickscore": "Flow-GRPO editing on Qwen-Image-Edit Plus with PickScore (Flow-Factory's example)",
    "krea2-nft-ocr": "DiffusionNFT on Krea 2 with the OCR reward",
    "krea2-nft-pickscore": "DiffusionNFT on Krea 2 with PickScore",
    "wan22-grpo-pickscore": "Flow-GRPO on Wan2.2 video with PickScore",
    "z-image-grpo-pickscore": "Flow-GRPO on Z-Image with PickScore (Flow-Factory's z_image example)",
    "z-image-turbo-grpo-pickscore": "Flow-GRPO on Z-Image-Turbo's few steps with PickScore (Flow-Factory's example)",
    "flux2-klein-grpo-pickscore": "Flow-GRPO on FLUX.2 [klein]'s 4 distilled steps with PickScore (Flow-Factory's)",
    "flux2-klein-base-grpo-pickscore": "Flow-GRPO on FLUX.2 [klein] base with PickScore (Flow-Factory's example)",
    "flux2-klein-base-nft-pickscore": "DiffusionNFT on FLUX.2 [klein] base with PickScore (Flow-Factory's example)",
    "flux2-dev-grpo-pickscore": "Flow-GRPO on FLUX.2 [dev] with PickScore (Flow-Factory's flux2 t2i example)",
    "flux2-dev-edit-grpo-pickscore": "Flow-GRPO editing on FLUX.2 [dev] with PickScore (Flow-Factory's flux2 i2i)",
    "ltx23-grpo-pickscore": "Flow-GRPO on LTX-2.3 video with PickScore",
    "wan22-i2v-grpo-pickscore": "Flow-GRPO image to video on Wan2.2 I2V A14B with PickScore (Flow-Factory's wan22 "
                                "i2v; rows name a first frame)",
    "ltx23-i2v-grpo-pickscore": "Flow-GRPO image to video on LTX-2.3 with PickScore (ltx23-grpo-pickscore's settings; "
                                "rows name a first frame)",
    "cosmos3-grpo": "Flow-GRPO on Cosmos3",
    "shapes-nft": "DiffusionNFT on the shipped demo model and the shapes world (make demo; CPU-sized on a CPU)",
    "shapes-grpo": "Flow-GRPO on the shipped demo model and the shapes world (CPU-sized on a CPU)",
    "shapes-edit-nft": "DiffusionNFT on the editing demo model, shapes_edit reward, strict edit verifier "
                       "(docs/editing-world.md; CPU-sized on a CPU)",
    "shapes-edit-grpo": "Flow-GRPO on the editing demo model, shapes_edit reward, strict edit verifier "
                        "(docs/editing-world.md; CPU-sized on a CPU)",
    "ocr-nft": "DiffusionNFT on the OCR demo model, ocr reward, tesseract judge (docs/ocr-world.md; CPU-sized on a CPU)",
    "ocr-grpo": "Flow-GRPO on the OCR demo model, ocr reward, tesseract judge (docs/ocr-world.md; CPU-sized on a CPU)",
}


def recipe_names() -> list[str]:
    return sorted([*SIZED, *(f"{name}-gpu" for name in SIZED)])


def recipe_overrides(name: str, device: str = "auto") -> dict:
    """The recipe's flag values, sized for `device`."""
    base, size = (name.removesuffix("-gpu"), "gpu") if name.endswith("-gpu") else (name, None)
    if base not in SIZED:
        raise ValueError(f"unknown recipe {name!r}; known: {', '.join(recipe_names())}")
    if size is None:
        import torch  # deferred: `diffrl train --help` (no recipe) builds its parser without torch

        cuda = device.startswith("cuda") or (device == "auto" and torch.cuda.is_available())
        size = "gpu" if cuda else "cpu"
    return dict(SIZED[base][size])


def recipe_config(name: str | None, device: str = "auto") -> TrainConfig:
    """The recipe's values on top of `TrainConfig`'s defaults, sized for `device`."""
    if name is None:
        return TrainConfig()
    return TrainConfig.flat(recipe=name, **recipe_overrides(name, device))


def family_recipes(family: str) -> list[str]:
    """The published recipes that train `family`; the shapes recipes train the demo model."""
    return [name for name, sizes in SIZED.items() if sizes["gpu"].get("diffusion_model_family", "demo") == family]


def another_familys_message(err: AnotherFamilysCheckpoint) -> str:
    """A refused checkpoint of another family, with the fix a command-line user acts on: a recipe of the
    checkpoint's family, or the family flag."""
    names = " or ".join(err.families)
    recipes = [r for name in err.families for r in family_recipes(name)]
    fix = (f"pass a recipe of the {names} family ({', '.join(recipes)}) or --diffusion-model-family {names}"
           if recipes else f"pass --diffusion-model-family {names} (no recipe of that family yet)")
    return f"{err.what}: {fix}"
