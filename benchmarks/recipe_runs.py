"""A published recipe end to end on a real-size random model: rollouts with the recipe's reward model,
advantages, train pairs and optimizer steps, exactly as `diffrl train --recipe NAME` runs them.

    python benchmarks/recipe_runs.py --recipe qwen-image-grpo-pickscore --checkpoint /tmp/qwen \
        --rollout-batch-size 1 --num-rollout 3 --out qwen.json
    python benchmarks/recipe_runs.py --recipe ltx23-grpo-pickscore --checkpoint /tmp/ltx2 \
        --rollout-batch-size 1 --num-frames 25 --microgroups 8 2 4 --out ltx.json

Random weights at the family's real size are built in code when `--checkpoint` is missing
(`family_rollout.REAL_SIZES`), and so is the reward's model at its published size (PickScore and HPSv2.1
are CLIP ViT-H-14: 0.99 B parameters) with a small local tokenizer: the compute is the real one, the
scores are noise. Only `--rollout-batch-size` (prompt groups per rollout), `--num-frames` and
`--height/--width` may be cut below the recipe's, to fit the time a lent GPU gives (the JSON's `cuts` lists
every setting that is not the recipe's); samples per prompt, microgroups, steps, CFG, the SDE window, LoRA and
precision stay the recipe's, and the optimizer steps per rollout too (their batch follows).

Reported per rollout: seconds of rollout and training, images/s, train pairs/s, peak GPU memory, and the
model FLOP utilization of the transformer: FLOPs counted once per forward (torch's flop counter, batch 1,
the run's size and frames and a prompt of the set; a video family's forward is one sample's, LTX-2's with
its audio stream), times the forwards the recipe runs (rollout: steps × (2 with CFG); training: per pair
`bench_train.train_forward_equivalents`: the policy's forward, its backward (≈ 1 forward with LoRA, 2 for a full
finetune), the old policy (NFT) or the reference (KL), × 2 when Flow-GRPO trains with CFG; gradient
checkpointing's recomputed forward is not counted, by MFU's convention), over the peak; and end to end, both
together over the rollout's and the training's seconds (what the issue of speed asks of FLUX 3: ≥ 55%).

`--microgroups M …`: after the main rollouts (the first of which is the warm-up; with `--num-rollout 0`, one
warm-up rollout), `--sweep-rollouts` more at each rollout microgroup size M, on the same trainer; the seconds
per sample end to end of each M (the main rollouts after the first stand for the recipe's M) and the fastest.
`--stop-by`: no rollout is started that would end after that time by the longest so far (a device call's
limit), `--sweep-stop-by` an earlier one for the sweep; the JSON is rewritten after every rollout, so what
ran is kept. `--tiny`: the family's tiny random
checkpoint and a tiny PickScore, for a CPU run of these paths.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import time
from pathlib import Path

import torch
from family_rollout import make_checkpoint
from report import emit

from diffrl.cli.bench_train import train_forward_equivalents, trains_with_cfg
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


def pickscore_checkpoint(path: Path, tiny: bool = False) -> None:
    """A random CLIP ViT-H-14 (PickScore's architecture) in transformers' format, with its processor; `tiny`: a
    CLIP of a few channels that sees 32² images."""
    from transformers import (
        CLIPConfig,
        CLIPImageProcessor,
        CLIPModel,
        CLIPProcessor,
        CLIPTokenizer,
    )

    small_clip_tokenizer(path)
    tokenizer = CLIPTokenizer(str(path / "vocab.json"), str(path / "merges.txt"))
    if tiny:
        text = {"hidden_size": 16, "intermediate_size": 32, "num_hidden_layers": 1, "num_attention_heads": 2}
        vision = {**text, "image_size": 32, "patch_size": 16}
        side, projection = 32, 16
    else:
        text = {"hidden_size": 1024, "intermediate_size": 4096, "num_hidden_layers": 24, "num_attention_heads": 16}
        vision = {"hidden_size": 1280, "intermediate_size": 5120, "num_hidden_layers": 32, "num_attention_heads": 16,
                  "image_size": 224, "patch_size": 14}
        side, projection = 224, 1024
    config = CLIPConfig(
        text_config=dict(vocab_size=49408, max_position_embeddings=77, hidden_act="gelu",
                         bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id, **text),
        vision_config=dict(hidden_act="gelu", **vision), projection_dim=projection)
    CLIPModel(config).save_pretrained(path)
    processor = CLIPProcessor(image_processor=CLIPImageProcessor(size={"shortest_edge": side},
                                                                 crop_size={"height": side, "width": side}),
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


def reward_spec(reward: str, root: Path, tiny: bool = False) -> str:
    """The recipe's reward with a local random checkpoint where it needs one (`tiny`: a tiny PickScore)."""
    if reward == "pickscore":
        path = root / ("pickscore-tiny" if tiny else "pickscore-random")
        if not path.exists():
            pickscore_checkpoint(path, tiny)
        return f"pickscore@{path}"
    if reward == "hpsv2":
        path = root / "hps-random"
        if not path.exists():
            hps_checkpoint(path)
        return f"hpsv2@{path}"
    return reward


def forward_flops(trainer: Trainer, prompt: str) -> float:
    """FLOPs of one transformer forward for one sample at the run's size (conditional branch only)."""
    from diffrl.sampling import make_generators
    from diffrl.utils.flops import flop_counter

    family, cfg = trainer.policy.family, trainer.cfg
    height, width = cfg.model.size() or family.default_size()
    frames = {"num_frames": cfg.model.num_frames} if family.generates_video else {}  # None: the family's default
    with torch.no_grad():
        cond = family.encode_prompts([prompt])
        latents = family.prepare_latents(make_generators([0], device="cpu"), height, width, **frames)
        sigma = torch.full((1,), 0.5, device=family.device)
        counter = flop_counter()
        with counter:
            family.velocity(family.transformer, latents, sigma, cond, None, 1.0)
    return float(counter.get_total_flops())


# Settings that name the run rather than change its work: never listed as cuts.
NOT_CUTS = {"reward", "num_rollout", "model_path", "prompt_data", "output_dir", "device", "eval_num_prompts"}


def cuts_from(recipe: dict, run: dict) -> dict:
    """Each setting the run does not take from the recipe: name → [the recipe's, the run's]."""
    cuts = {}
    for name in sorted(set(recipe) | set(run)):
        theirs, ours = recipe.get(name), run.get(name)
        if name not in NOT_CUTS and name in run and ours != theirs:
            cuts[name] = [list(theirs) if isinstance(theirs, tuple) else theirs,
                          list(ours) if isinstance(ours, tuple) else ours]
    return cuts


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser()
    parser.add_argument("--recipe", required=True)
    parser.add_argument("--checkpoint", type=Path, required=True)
    parser.add_argument("--work-dir", type=Path, default=Path("runs/recipe-bench"))
    parser.add_argument("--rollout-batch-size", type=int, default=None, help="prompt groups per rollout (default: the recipe's)")
    parser.add_argument("--num-frames", type=int, default=None, help="video recipes: frames per sample (default: the recipe's)")
    parser.add_argument("--height", type=int, default=None, help="with --width: the sample size (default: the recipe's)")
    parser.add_argument("--width", type=int, default=None)
    parser.add_argument("--num-rollout", type=int, default=3)
    parser.add_argument("--microgroups", type=int, nargs="*", default=[],
                        help="rollout microgroup sizes to time after the main rollouts, --sweep-rollouts each")
    parser.add_argument("--sweep-rollouts", type=int, default=2)
    parser.add_argument("--stop-by", type=float, default=None,
                        help="seconds since the epoch: no rollout starts that would end later, by the longest so far")
    parser.add_argument("--sweep-stop-by", type=float, default=None, help="the same for the sweep (default: --stop-by)")
    parser.add_argument("--reward", default=None, help="default: the recipe's, on a random real-size checkpoint")
    parser.add_argument("--device", default="cuda", help="cpu: a dry run of the script on a small checkpoint")
    parser.add_argument("--tiny", action="store_true", help="tiny random checkpoints (the family's and PickScore's)")
    parser.add_argument("--peak-tflops", type=float, default=790.0, help="dense bf16 peak (H200: 790)")
    parser.add_argument("--flags", default="{}", help="more TrainConfig fields, as JSON")
    parser.add_argument("--out", default=None)
    args = parser.parse_args(argv)
    if (args.height is None) != (args.width is None):
        parser.error("--height and --width go together")

    overrides = recipe_overrides(args.recipe, "cuda")
    family = overrides["diffusion_model_family"]
    changed = json.loads(args.flags)
    if changed.get("deterministic_mode", overrides.get("deterministic_mode")):
        # Deterministic mode's cuBLAS workspace: cuBLAS reads it once, when CUDA starts, which building the
        # checkpoint on the GPU does before the trainer could set it.
        os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
    args.work_dir.mkdir(parents=True, exist_ok=True)
    cuda = args.device == "cuda"
    if not args.checkpoint.exists():
        make_checkpoint(family, args.checkpoint, torch.device(args.device), tiny=args.tiny)
    reward = args.reward or overrides["reward"]
    prompts = args.work_dir / "prompts.txt"
    # The OCR reward scores the text a prompt quotes, so its runs draw only the prompts that quote some.
    usable = [p for p in PROMPTS if '"' in p] if reward == "ocr" else PROMPTS
    prompts.write_text("\n".join(usable) + "\n")
    run_dir = args.work_dir / f"{args.recipe}-{time.strftime('%H%M%S')}"
    if args.rollout_batch_size is not None:
        changed["rollout_batch_size"] = args.rollout_batch_size
    if args.num_frames is not None:
        changed["num_frames"] = args.num_frames
    if args.height is not None:  # a recipe's square --resolution gives way to the size asked for
        changed.update(resolution=None, height=args.height, width=args.width)
    fields = {**overrides, **changed}
    samples = fields["rollout_batch_size"] * fields["n_samples_per_prompt"]
    fields["global_batch_size"] = samples // fields["num_steps_per_rollout"]  # the optimizer steps stay the recipe's
    sweep = [m for m in dict.fromkeys(args.microgroups) if m <= fields["n_samples_per_prompt"]]
    planned = args.num_rollout + len(sweep) * args.sweep_rollouts + (1 if sweep and not args.num_rollout else 0)
    cuts = cuts_from(overrides, fields)
    fields.update(recipe=args.recipe, model_path=args.checkpoint, prompt_data=prompts, output_dir=run_dir,
                  reward=reward_spec(reward, args.work_dir, args.tiny), num_rollout=max(planned, 1),
                  eval_num_prompts=0, device=args.device)
    cfg = TrainConfig.flat(**fields)
    start = time.perf_counter()
    trainer = Trainer(cfg)
    load_s = time.perf_counter() - start
    if cuda:
        torch.cuda.reset_peak_memory_stats()
    flops = forward_flops(trainer, PROMPTS[0])
    r, m = cfg.rollout, cfg.model
    rollout_guidance = trainer.objective.request(0)["guidance_scale"]  # what the engine is asked for
    rollout_forwards = samples * r.diffusion_num_steps * (2 if rollout_guidance > 1 else 1)
    per_pair = train_forward_equivalents(cfg)
    # The SDE methods replay the rollout's CFG (both branches in one batch); the ODE methods train the conditional
    # velocity.
    per_pair *= 2 if trains_with_cfg(cfg) else 1
    peak = args.peak_tflops * 1e12
    size = m.size() or trainer.policy.family.default_size()
    results = {
        "recipe": args.recipe, "family": family, "device": torch.cuda.get_device_name() if cuda else "cpu",
        "tiny": args.tiny, "height": size[0], "width": size[1],
        "num_frames": m.num_frames if trainer.policy.family.generates_video else None,
        "rollout_batch_size": r.rollout_batch_size, "recipe_rollout_batch_size": overrides["rollout_batch_size"],
        "samples_per_rollout": samples, "rollout_microgroup_size": r.rollout_microgroup_size, "cuts": cuts,
        "load_s": load_s, "gflop_per_forward": flops / 1e9,
        "transformer_params_b": sum(p.numel() for p in trainer.policy.transformer.parameters()) / 1e9,
        "trained_params_m": sum(p.numel() for p in trainer.policy.params) / 1e6,
        "max_memory_gib": None, "rollouts": [], "stopped": None}

    def save() -> None:  # after every rollout: a call stopped at its limit keeps what ran
        results["max_memory_gib"] = torch.cuda.max_memory_allocated() / 2**30 if cuda else None
        if args.out:
            Path(args.out).write_text(json.dumps(results, indent=2))

    longest = 0.0
    sweep_stop_by = args.stop_by if args.sweep_stop_by is None else args.sweep_stop_by

    def one_rollout(microgroup: int, tag: str) -> dict | None:
        """One rollout and its update at this microgroup size, or None (and why, in `stopped`) when it would
        end after its deadline."""
        nonlocal longest
        flag, stop_by = ("--stop-by", args.stop_by) if tag == "main" else ("--sweep-stop-by", sweep_stop_by)
        if stop_by is not None and longest and time.time() + 1.1 * longest > stop_by:
            results["stopped"] = results["stopped"] or f"before {tag} rollout at microgroup {microgroup}: {flag}"
            return None
        # read per rollout by the manager; the run's configuration keeps its own microgroup size
        trainer.manager.settings = dataclasses.replace(trainer.manager.settings, rollout_microgroup_size=microgroup)
        k = trainer.rollout_index
        wall = time.perf_counter()
        record = trainer.rollout_and_update(k)
        wall = time.perf_counter() - wall
        longest = max(longest, wall)
        trainer.rollout_index = k + 1
        rollout_s, train_s, pairs = record["rollout/seconds"], record.get("train/seconds", 0.0), record.get("train/pairs", 0)
        row = {
            "rollout": k, "kind": tag, "microgroup": microgroup, "rollout_s": rollout_s, "train_s": train_s,
            "wall_s": wall, "seconds_per_sample": (rollout_s + train_s) / samples,
            "images_per_s": samples / rollout_s, "train_pairs": pairs, "train_pairs_per_s": pairs / train_s if train_s else 0.0,
            "rollout_mfu": rollout_forwards * flops / rollout_s / peak,
            "train_mfu": pairs * per_pair * flops / train_s / peak if train_s else 0.0,
            # Rollout and training together over the rollout's whole wall: what a sample costs against the peak.
            "end_to_end_mfu": (rollout_forwards + pairs * per_pair) * flops / (rollout_s + train_s) / peak,
            "peak_gib": record.get("memory/peak_gib"), "reward_mean": record["rollout/reward/raw_mean"],
            "loss": record.get("train/loss"), "log_prob_mean_abs_diff": record.get("train/log_prob_mean_abs_diff")}
        if "memory/engine_released_gib" in record:  # --colocate: what the engine's last sleep gave the device
            row["engine_released_gib"] = record["memory/engine_released_gib"]
        if "compile/uncompiled_block_kinds" in record:  # --compile: blocks that ran eager anyway (0: all compiled)
            row["uncompiled_block_kinds"] = record["compile/uncompiled_block_kinds"]
        if "compile/block_kinds_at_recompile_limit" in record:  # --compile: kinds past dynamo's cache (then eager)
            row["block_kinds_at_recompile_limit"] = record["compile/block_kinds_at_recompile_limit"]
        results["rollouts"].append(row)
        print(json.dumps(row), flush=True)
        save()
        return row

    def mean(rows: list[dict], key: str) -> float | None:
        return sum(row[key] for row in rows) / len(rows) if rows else None

    main_rows = [row for _ in range(args.num_rollout) if (row := one_rollout(r.rollout_microgroup_size, "main"))]
    timed = main_rows[1:] or main_rows  # the first pays CUDA's warm-up
    results.update({key: mean(timed, key) for key in ("seconds_per_sample", "rollout_mfu", "train_mfu", "end_to_end_mfu")})
    if sweep:
        if not main_rows:
            one_rollout(sweep[0], "warm-up")
        by_size = {r.rollout_microgroup_size: timed} if timed and r.rollout_microgroup_size not in sweep else {}
        for size_m in sweep:
            if cuda:
                torch.cuda.reset_peak_memory_stats()
            by_size[size_m] = [row for _ in range(args.sweep_rollouts) if (row := one_rollout(size_m, "sweep"))]
        results["microgroups"] = [
            {"microgroup": size_m, "rollouts": len(rows), "seconds_per_sample": mean(rows, "seconds_per_sample"),
             "peak_gib": max((row["peak_gib"] for row in rows if row["peak_gib"] is not None), default=None)}
            for size_m, rows in sorted(by_size.items()) if rows]
        measured = [entry for entry in results["microgroups"] if entry["seconds_per_sample"] is not None]
        results["fastest_microgroup"] = min(measured, key=lambda e: e["seconds_per_sample"])["microgroup"] if measured else None
    save()
    if args.out:  # the whole report is in the file; the log gets its summary
        summary = ("recipe", "cuts", "gflop_per_forward", "seconds_per_sample", "rollout_mfu", "train_mfu",
                   "end_to_end_mfu", "max_memory_gib", "microgroups", "fastest_microgroup", "stopped")
        print(json.dumps({key: results.get(key) for key in summary}), flush=True)
    else:
        emit(results, None)
    return results


if __name__ == "__main__":
    main()
