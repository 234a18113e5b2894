"""A published recipe end to end on a real-size random model: rollouts with the recipe's reward model,
advantages, train pairs and optimizer steps, exactly as `diffrl train --recipe NAME` runs them.

    python benchmarks/recipe_runs.py --recipe qwen-image-grpo-pickscore --checkpoint /tmp/qwen \
        --rollout-batch-size 1 --num-rollout 3 --out qwen.json

Random weights at the family's real size are built in code when `--checkpoint` is missing
(`family_rollout.REAL_SIZES`), and so is the reward's model at its published size (PickScore and HPSv2.1
are CLIP ViT-H-14: 0.99 B parameters) with a small local tokenizer: the compute is the real one, the
scores are noise. Only `--rollout-batch-size` (prompt groups per rollout) may be cut below the recipe's,
to fit the time a lent GPU gives; samples per prompt, microgroups, steps, size and frames, CFG, the SDE window,
LoRA and precision stay the recipe's, and the optimizer steps per rollout too (their batch follows).

Reported per rollout: seconds of rollout and training, images/s, train pairs/s, peak GPU memory, and the
model FLOP utilization of the transformer: FLOPs counted once per forward (torch's flop counter, batch 1,
the recipe's size and frames and a prompt of the set), times the forwards the recipe runs (rollout: steps ×
(2 with CFG); training: per pair the policy's forward and backward (×3), the recomputed forward with
gradient checkpointing (×1), the old policy (NFT) or the reference (KL) (×1 each)), over the peak.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import torch
from family_rollout import make_checkpoint
from report import emit

from diffrl.recipes import recipe_overrides
from diffrl.rewards.hps import VIT_H_14
from diffrl.train.config import TrainConfig
from diffrl.train.trainer import Trainer

PROMPTS = ['a neon sign that says "OPEN LATE" above a diner door', "a red fox sleeping in fresh snow, golden hour",
           'a chalkboard menu reading "soup of the day"', "an astronaut riding a horse on the moon, film photo",
           "a bowl of ramen with a soft egg, overhead shot", 'a coffee mug printed with "diffrl"',
           "a lighthouse on a cliff during a storm, oil painting", "two cats playing chess in a library"]


def small_clip_tokenizer(path: Path) -> None:
    """CLIP's BPE format with a letters-only vocabulary (ids < CLIP's 49,408): no download."""
    from transformers import CLIPTokenizer

    path.mkdir(parents=True, exist_ok=True)
    vocab = {}
    for code in range(97, 123):
        vocab[chr(code)] = len(vocab)
        vocab[chr(code) + "</w>"] = len(vocab)
    vocab["<|startoftext|>"], vocab["<|endoftext|>"] = len(vocab), len(vocab) + 1
    (path / "vocab.json").write_text(json.dumps(vocab))
    (path / "merges.txt").write_text("#version: 0.2\n")
    CLIPTokenizer(str(path / "vocab.json"), str(path / "merges.txt")).save_pretrained(path)


def pickscore_checkpoint(path: Path) -> None:
    """A random CLIP ViT-H-14 (PickScore's architecture) in transformers' format, with its processor."""
    from transformers import CLIPConfig, CLIPImageProcessor, CLIPModel, CLIPProcessor, CLIPTokenizer

    small_clip_tokenizer(path)
    tokenizer = CLIPTokenizer(str(path / "vocab.json"), str(path / "merges.txt"))
    config = CLIPConfig(
        text_config=dict(vocab_size=49408, hidden_size=1024, intermediate_size=4096, num_hidden_layers=24,
                         num_attention_heads=16, max_position_embeddings=77, hidden_act="gelu",
                         bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id),
        vision_config=dict(hidden_size=1280, intermediate_size=5120, num_hidden_layers=32, num_attention_heads=16,
                           image_size=224, patch_size=14, hidden_act="gelu"),
        projection_dim=1024)
    CLIPModel(config).save_pretrained(path)
    processor = CLIPProcessor(image_processor=CLIPImageProcessor(size={"shortest_edge": 224},
                                                                 crop_size={"height": 224, "width": 224}),
                              tokenizer=tokenizer)
    processor.save_pretrained(path)


def hps_checkpoint(path: Path) -> None:
    """Random parameters under open_clip's ViT-H-14 names and shapes (HPSv2.1's file layout), in safetensors."""
    from safetensors.torch import save_file

    small_clip_tokenizer(path)
    vc, tc, e = VIT_H_14["vision_cfg"], VIT_H_14["text_cfg"], VIT_H_14["embed_dim"]
    w, p, grid, tw = vc["width"], vc["patch_size"], vc["image_size"] // vc["patch_size"], tc["width"]
    shapes = {"visual.conv1.weight": (w, 3, p, p), "visual.class_embedding": (w,),
              "visual.positional_embedding": (grid * grid + 1, w), "visual.proj": (w, e),
              "token_embedding.weight": (tc["vocab_size"], tw), "positional_embedding": (tc["context_length"], tw),
              "text_projection": (tw, e), "logit_scale": ()}
    for name, width in (("visual.ln_pre", w), ("visual.ln_post", w), ("ln_final", tw)):
        shapes |= {f"{name}.weight": (width,), f"{name}.bias": (width,)}
    for prefix, width, layers in (("visual.", w, vc["layers"]), ("", tw, tc["layers"])):
        for i in range(layers):
            block = f"{prefix}transformer.resblocks.{i}."
            shapes |= {block + k: s for k, s in {
                "ln_1.weight": (width,), "ln_1.bias": (width,), "attn.in_proj_weight": (3 * width, width),
                "attn.in_proj_bias": (3 * width,), "attn.out_proj.weight": (width, width), "attn.out_proj.bias": (width,),
                "ln_2.weight": (width,), "ln_2.bias": (width,), "mlp.c_fc.weight": (4 * width, width),
                "mlp.c_fc.bias": (4 * width,), "mlp.c_proj.weight": (width, 4 * width),
                "mlp.c_proj.bias": (width,)}.items()}
    g = torch.Generator().manual_seed(0)
    def init(name, shape):  # layer norms as initialized, everything else small and random
        if "ln_" in name:
            return torch.ones(shape) if name.endswith("weight") else torch.zeros(shape)
        return torch.randn(shape, generator=g) * 0.02

    state = {k: init(k, s).to(torch.bfloat16) for k, s in shapes.items()}
    save_file(state, str(path / "hps_v2.1_random.safetensors"))


def reward_spec(reward: str, root: Path) -> str:
    """The recipe's reward with a local random checkpoint where it needs one."""
    if reward == "pickscore":
        path = root / "pickscore-random"
        if not path.exists():
            pickscore_checkpoint(path)
        return f"pickscore@{path}"
    if reward == "hpsv2":
        path = root / "hps-random"
        if not path.exists():
            hps_checkpoint(path)
        return f"hpsv2@{path}"
    return reward


def forward_flops(trainer: Trainer, prompt: str) -> float:
    """FLOPs of one transformer forward for one sample at the run's size (conditional branch only)."""
    from torch.utils.flop_counter import FlopCounterMode

    from diffrl.sampling import make_generators

    family, cfg = trainer.policy.family, trainer.cfg
    height, width = cfg.model.size() or family.default_size()
    frames = {"num_frames": cfg.model.num_frames} if family.generates_video else {}  # None: the family's default
    with torch.no_grad():
        cond = family.encode_prompts([prompt])
        latents = family.prepare_latents(make_generators([0], device="cpu"), height, width, **frames)
        sigma = torch.full((1,), 0.5, device=family.device)
        counter = FlopCounterMode(display=False)
        with counter:
            family.velocity(family.transformer, latents, sigma, cond, None, 1.0)
    return float(counter.get_total_flops())


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--recipe", required=True)
    parser.add_argument("--checkpoint", type=Path, required=True)
    parser.add_argument("--work-dir", type=Path, default=Path("runs/recipe-bench"))
    parser.add_argument("--rollout-batch-size", type=int, default=None, help="prompt groups per rollout (default: the recipe's)")
    parser.add_argument("--num-rollout", type=int, default=3)
    parser.add_argument("--reward", default=None, help="default: the recipe's, on a random real-size checkpoint")
    parser.add_argument("--device", default="cuda", help="cpu: a dry run of the script on a small checkpoint")
    parser.add_argument("--peak-tflops", type=float, default=790.0, help="dense bf16 peak (H200: 790)")
    parser.add_argument("--flags", default="{}", help="more TrainConfig fields, as JSON")
    parser.add_argument("--out", default=None)
    args = parser.parse_args()

    overrides = recipe_overrides(args.recipe, "cuda")
    family = overrides["diffusion_model_family"]
    args.work_dir.mkdir(parents=True, exist_ok=True)
    cuda = args.device == "cuda"
    if not args.checkpoint.exists():
        make_checkpoint(family, args.checkpoint, torch.device(args.device))
    groups = args.rollout_batch_size or overrides["rollout_batch_size"]
    samples = groups * overrides["n_samples_per_prompt"]
    steps = overrides["num_steps_per_rollout"]
    reward = args.reward or overrides["reward"]
    prompts = args.work_dir / "prompts.txt"
    # The OCR reward scores the text a prompt quotes, so its runs draw only the prompts that quote some.
    usable = [p for p in PROMPTS if '"' in p] if reward == "ocr" else PROMPTS
    prompts.write_text("\n".join(usable) + "\n")
    run_dir = args.work_dir / f"{args.recipe}-{time.strftime('%H%M%S')}"
    fields = dict(overrides, recipe=args.recipe, model_path=args.checkpoint, prompt_data=prompts,
                  reward=reward_spec(reward, args.work_dir), output_dir=run_dir,
                  rollout_batch_size=groups, global_batch_size=samples // steps, num_rollout=args.num_rollout,
                  eval_num_prompts=0, device=args.device, **json.loads(args.flags))
    cfg = TrainConfig.flat(**fields)
    start = time.perf_counter()
    trainer = Trainer(cfg)
    load_s = time.perf_counter() - start
    if cuda:
        torch.cuda.reset_peak_memory_stats()
    flops = forward_flops(trainer, PROMPTS[0])
    r, a, m = cfg.rollout, cfg.algorithm, cfg.model
    nft = a.loss_type == "nft"
    rollout_guidance = trainer.objective.request(0)["guidance_scale"]  # what the engine is asked for
    rollout_forwards = samples * r.diffusion_num_steps * (2 if rollout_guidance > 1 else 1)
    per_pair = (3 + (1 if m.gradient_checkpointing else 0) + (1 if nft else 0) + (1 if a.diffusion_kl_beta > 0 else 0))
    # Flow-GRPO replays the rollout's CFG (both branches in one batch); NFT and SFT train the conditional velocity.
    per_pair *= 2 if a.loss_type == "flow_grpo" and r.diffusion_guidance_scale > 1 else 1

    records = []
    for k in range(args.num_rollout):
        record = trainer.rollout_and_update(k)
        trainer.rollout_index = k + 1
        rollout_s, train_s, pairs = record["rollout/seconds"], record.get("train/seconds", 0.0), record.get("train/pairs", 0)
        peak = args.peak_tflops * 1e12
        records.append({
            "rollout": k, "rollout_s": rollout_s, "train_s": train_s, "seconds_per_sample": (rollout_s + train_s) / samples,
            "images_per_s": samples / rollout_s, "train_pairs": pairs, "train_pairs_per_s": pairs / train_s if train_s else 0.0,
            "rollout_mfu": rollout_forwards * flops / rollout_s / peak,
            "train_mfu": pairs * per_pair * flops / train_s / peak if train_s else 0.0,
            "peak_gib": record.get("memory/peak_gib"), "reward_mean": record["rollout/reward/raw_mean"],
            "loss": record.get("train/loss"), "log_prob_mean_abs_diff": record.get("train/log_prob_mean_abs_diff")})
        print(json.dumps(records[-1]), flush=True)
    emit({"recipe": args.recipe, "family": family, "device": torch.cuda.get_device_name() if cuda else "cpu",
          "rollout_batch_size": groups, "recipe_rollout_batch_size": overrides["rollout_batch_size"],
          "samples_per_rollout": samples, "load_s": load_s, "gflop_per_forward": flops / 1e9,
          "transformer_params_b": sum(p.numel() for p in trainer.policy.transformer.parameters()) / 1e9,
          "trained_params_m": sum(p.numel() for p in trainer.policy.params) / 1e6,
          "max_memory_gib": torch.cuda.max_memory_allocated() / 2**30 if cuda else None, "rollouts": records}, args.out)


if __name__ == "__main__":
    main()
