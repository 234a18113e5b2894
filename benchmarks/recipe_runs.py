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

Image-conditioned recipes (editing, image to video: `condition_images="required"`) run on their family's
image-conditioned checkpoint where the weights differ (`VARIANTS`: Wan2.2 I2V A14B, FLUX.1 Kontext,
Qwen-Image-Edit Plus, FLUX.2 [dev]), kept under its own folder name (`checkpoint_name`), and on a `prompts.jsonl`
whose rows each name one generated condition image (rendered scenes at the run's size, one per prompt).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import time
from pathlib import Path

import torch
from family_rollout import REAL_SIZES, RealSize, make_checkpoint
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
# Editing recipes' rows: an instruction beside its source image.
EDIT_PROMPTS = ["make the sky a sunset orange", 'add a sign that says "OPEN LATE" above the door',
                "turn the scene into an oil painting", "remove the red shape", "make it snow",
                "replace the circle with a sleeping fox", "change the season to autumn", "make it night, lit by a lamp"]


@dataclasses.dataclass(frozen=True)
class Variant:
    """The image-conditioned checkpoint an image-conditioned recipe needs: what its random checkpoint adds to the
    family's `REAL_SIZES` entry (`save` keywords, at --tiny too; `real` ones replace the family's), and the pipeline
    class its model_index.json names (a checkpoint already at --checkpoint is checked against it)."""

    name: str  # the checkpoint folder's part after the family: runs/<family>-<name>-random
    pipeline: str
    save: dict = dataclasses.field(default_factory=dict)
    real: dict = dataclasses.field(default_factory=dict)
    disk_gb: float | None = None  # None: the family's

    def size(self, family: str) -> RealSize:
        base = REAL_SIZES[family]
        return RealSize({**base.real, **self.real}, {**base.save, **self.save}, self.disk_gb or base.disk_gb)


# Image-conditioned recipes by name (their -gpu/-cpu aliases alike). One that requires condition images and is absent
# here runs on its family's own checkpoint: LTX-2.3's weights do text and image to video alike (the run's
# condition_images="required" makes it image to video), and FLUX 3 Klein's reference mode is in its one transformer.
VARIANTS = {
    # Wan2.2 I2V A14B: the transformer also takes the first-frame mask and the image's latents (36 input channels).
    "wan22-i2v-grpo-pickscore": Variant("i2v", "WanImageToVideoPipeline", save={"image_to_video": True}),
    "flux1-kontext-grpo-pickscore": Variant("kontext", "FluxKontextPipeline", save={"kontext": True}),
    # Qwen-Image-Edit Plus (2509), the recipe's model; its vision tower reads the sources at the pipeline's own areas.
    "qwen-image-edit-grpo-pickscore": Variant("edit-plus", "QwenImageEditPlusPipeline",
                                              save={"edit": "QwenImageEditPlusPipeline"}),
    # FLUX.2 [dev]: the 32.2 B transformer and a 3-layer text encoder of Mistral Small's width, about 66 GB on disk.
    "flux2-dev-edit-grpo-pickscore": Variant("dev", "Flux2Pipeline", real={"model": "dev"}, disk_gb=66),
}
# Text-only recipes of a family's other model (the same folder as its image-conditioned recipe where they share one):
# FLUX.2 [dev] generates and edits with one transformer, where the family's REAL_SIZES is FLUX.2 [klein] 4B.
VARIANTS["flux2-dev-grpo-pickscore"] = VARIANTS["flux2-dev-edit-grpo-pickscore"]


def recipe_variant(recipe: str) -> Variant | None:
    """The image-conditioned checkpoint `recipe` needs, or None: the family's own (`REAL_SIZES`)."""
    for suffix in ("-gpu", "-cpu"):
        recipe = recipe.removesuffix(suffix)
    return VARIANTS.get(recipe)


def checkpoint_name(recipe: str, depth: int | None = None, weightless: bool = False) -> str:
    """The random checkpoint's folder name for `recipe` (scripts/device/bench_recipes.sh keeps them in runs/):
    `<family>-random`, or `<family>-<variant>-random` for an image-conditioned variant, so that a text-only
    checkpoint of the family is never taken for it, nor it for one; `-depth<N>` before `-random` for a shallow one,
    `-weightless` for one whose transformer is drawn at load."""
    family = recipe_overrides(recipe, "cuda")["diffusion_model_family"]
    variant = recipe_variant(recipe)
    name = f"{family}-{variant.name}" if variant else family
    name = f"{name}-depth{depth}" if depth is not None else name
    return f"{name}-weightless-random" if weightless else f"{name}-random"


def weightless_checkpoint(path: Path) -> bool:
    """Whether the checkpoint's transformer is drawn at load (`--weightless`)."""
    from diffrl.models.components import RANDOM_INIT_FILE

    return (path / "transformer" / RANDOM_INIT_FILE).is_file()


def check_variant(path: Path, variant: Variant) -> None:
    """A checkpoint already at --checkpoint is the image-conditioned one the recipe needs (its model index's class)."""
    index = path / "model_index.json"
    found = json.loads(index.read_text()).get("_class_name") if index.exists() else None
    if found != variant.pipeline:
        raise SystemExit(f"--checkpoint {path} holds a {found} checkpoint; this recipe needs a {variant.pipeline} one "
                         "(name a missing folder and it is built)")


def scene_png(seed: int, height: int, width: int) -> bytes:
    """A rendered scene drawn from `seed` (sky and ground gradients, a sun, a few shapes) as PNG: a condition image
    with edges and flat areas, as a photo has, rather than noise."""
    import io

    import numpy as np
    from PIL import Image, ImageDraw

    rng = np.random.default_rng(seed)
    horizon = int(height * rng.uniform(0.45, 0.7))
    sky, ground = rng.integers(40, 230, (2, 3))
    rows = np.linspace(0.0, 1.0, height)[:, None, None]
    pixels = np.where(np.arange(height)[:, None, None] < horizon, sky * (1.1 - 0.4 * rows), ground * (0.6 + 0.4 * rows))
    image = Image.fromarray(np.broadcast_to(pixels, (height, width, 3)).clip(0, 255).astype(np.uint8))
    draw = ImageDraw.Draw(image)
    side = min(height, width)
    r = max(int(side * rng.uniform(0.05, 0.12)), 1)
    x, y = int(width * rng.uniform(0.1, 0.9)), int(horizon * rng.uniform(0.15, 0.6))
    draw.ellipse((x - r, y - r, x + r, y + r), fill=(250, 220, 120))
    for _ in range(int(rng.integers(2, 5))):
        w, h = (max(int(side * f), 1) for f in rng.uniform(0.1, 0.35, 2))
        x0 = int(rng.integers(0, max(width - w, 1)))
        y0 = int(rng.integers(max(horizon - h // 2, 0), max(height - h, horizon) + 1))
        shape = draw.rectangle if rng.random() < 0.5 else draw.ellipse
        shape((x0, y0, x0 + w, y0 + h), fill=tuple(int(c) for c in rng.integers(0, 256, 3)))
    buffer = io.BytesIO()
    image.save(buffer, format="PNG")
    return buffer.getvalue()


def write_conditioned_prompts(folder: Path, prompts: list[str], height: int, width: int) -> Path:
    """`prompts.jsonl` in `folder`: one row per prompt naming its own condition image under `image` (a path from the
    file's folder), each a distinct rendered scene of `height × width`."""
    (folder / "images").mkdir(parents=True, exist_ok=True)
    rows = []
    for i, prompt in enumerate(prompts):
        name = f"images/condition_{i}.png"
        (folder / name).write_bytes(scene_png(i, height, width))
        rows.append({"prompt": prompt, "image": name})
    path = folder / "prompts.jsonl"
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))
    return path


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


def forward_flops(trainer: Trainer, prompt: str, image: torch.Tensor | None = None) -> float:
    """FLOPs of one transformer forward for one sample at the run's size (conditional branch only); `image`
    (`uint8 [3, H, W]`): with this condition image folded into the conditioning as the engine folds it (an editing
    family's reference tokens lengthen the sequence)."""
    from diffrl.models.lora import lora_unfolded
    from diffrl.sampling import make_generators
    from diffrl.utils.flops import flop_counter

    family, cfg = trainer.policy.family, trainer.cfg
    height, width = cfg.model.size() or family.default_size()
    frames = {"num_frames": cfg.model.num_frames} if family.generates_video else {}  # None: the family's default
    # An offloaded text encoder (the recipe's --offload-text-encoder) visits the device for the encode, as the engine
    # brings it for a batch that encodes.
    with torch.no_grad(), family.text_encoders_on_device():
        if image is None:
            cond = family.encode_prompts([prompt])
        else:
            size = (dict(height=height, width=width, num_frames=cfg.model.num_frames)
                    if family.condition_images_need_size else {})
            encoded = family.encode_condition_images([image], **size)
            cond = (family.encode_prompts_with_images([prompt], encoded) if family.prompt_sees_images
                    else family.condition_on_images(family.encode_prompts([prompt]), encoded))
    with torch.no_grad():
        if family.latents_need_conditioning and image is not None:
            frames["cond"] = cond  # LTX-2 image to video: the first frame's tokens leave the state
        latents = family.prepare_latents(make_generators([0], device="cpu"), height, width, **frames)
        sigma = torch.full((1,), 0.5, device=family.device)
        counter = flop_counter()
        with counter, lora_unfolded(family.transformer):  # the model's work, folded or not (--fold-lora-without-grad)
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
    parser.add_argument("--depth", type=int, default=None,
                        help="a missing checkpoint is built with the real widths and this many blocks of each kind: "
                             "the real model's compiled graphs (first-pass exactness), not its cost")
    parser.add_argument("--weightless", action="store_true",
                        help="a missing checkpoint's transformer is drawn at load instead of stored (no disk: for the "
                             "cost of models whose checkpoint would not fit it, not for exactness)")
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
    variant = recipe_variant(args.recipe)
    if not args.checkpoint.exists():
        make_checkpoint(family, args.checkpoint, torch.device(args.device), tiny=args.tiny,
                        size=variant.size(family) if variant else None, depth=args.depth, weightless=args.weightless)
    elif variant:
        check_variant(args.checkpoint, variant)
    reward = args.reward or overrides["reward"]
    run_dir = args.work_dir / f"{args.recipe}-{time.strftime('%H%M%S')}"
    if args.rollout_batch_size is not None:
        changed["rollout_batch_size"] = args.rollout_batch_size
    if args.num_frames is not None:
        changed["num_frames"] = args.num_frames
    if args.height is not None:  # a recipe's square --resolution gives way to the size asked for
        changed.update(resolution=None, height=args.height, width=args.width)
    fields = {**overrides, **changed}
    conditioned = fields.get("condition_images") == "required"
    if conditioned:  # each row names its own source (editing) or first frame (image to video), at the run's size
        usable = PROMPTS if family == "ltx2" or "i2v" in args.recipe else EDIT_PROMPTS
        side = fields.get("resolution") or 512  # a fallback only: every such recipe names its size
        image_size = (fields.get("height") or side, fields.get("width") or side)
        prompts = write_conditioned_prompts(args.work_dir, usable, *image_size)
    else:
        # The OCR reward scores the text a prompt quotes, so its runs draw only the prompts that quote some.
        usable = [p for p in PROMPTS if '"' in p] if reward == "ocr" else PROMPTS
        prompts = args.work_dir / "prompts.txt"
        prompts.write_text("\n".join(usable) + "\n")
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
    first_image = None
    if conditioned:
        from diffrl.data.condition_images import decode_image

        first_image = decode_image((args.work_dir / "images" / "condition_0.png").read_bytes(), "condition image")
    flops = forward_flops(trainer, usable[0], first_image)
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
        "tiny": args.tiny, "depth": args.depth,  # None: the real model's blocks; N: N of each kind (shallow)
        "weightless": weightless_checkpoint(args.checkpoint),
        "height": size[0], "width": size[1],
        "num_frames": m.num_frames if trainer.policy.family.generates_video else None,
        "rollout_batch_size": r.rollout_batch_size, "recipe_rollout_batch_size": overrides["rollout_batch_size"],
        "samples_per_rollout": samples, "rollout_microgroup_size": r.rollout_microgroup_size, "cuts": cuts,
        "load_s": load_s, "gflop_per_forward": flops / 1e9,
        "transformer_params_b": sum(p.numel() for p in trainer.policy.transformer.parameters()) / 1e9,
        "trained_params_m": sum(p.numel() for p in trainer.policy.params) / 1e6,
        # The random checkpoint's text encoders are shallow: a real one's size less this is what the peak lacks.
        "text_encoder_params_b": sum(p.numel() for module in trainer.policy.family.text_encoder_modules()
                                     for p in module.parameters()) / 1e9,
        "max_memory_gib": None, "rollouts": [], "stopped": None,
        # The image-conditioned checkpoint built for the recipe (None: the family's own), and the prompt set's
        # condition images: per row, distinct in all, and their size.
        "checkpoint_variant": dataclasses.asdict(variant) if variant else None,
        "condition_images_per_row": 1 if conditioned else 0, "condition_images": len(usable) if conditioned else 0,
        "condition_image_size": list(image_size) if conditioned else None}

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
            "loss": record.get("train/loss"), "log_prob_mean_abs_diff": record.get("train/log_prob_mean_abs_diff"),
            "first_pass_clipfrac": record.get("train/first_pass_clipfrac")}
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
