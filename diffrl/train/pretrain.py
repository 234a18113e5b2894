"""`diffrl pretrain`: flow-matching SFT of a demo model on rendered scenes of its world: shapes scenes (the
shipped model), or, with `--world ocr`, renders of generated prompts' quoted texts (the OCR world's model,
48×256 pixels, its quoted text tokenized by character: docs/ocr-world.md), or, with `--world shapes-edit`, the
editing world's (source, instruction, target) triples of its train split (the editing demo model:
docs/editing-world.md): the source rendered scene goes in as the condition image through the demo family's
reference mode, the path the engine takes (`encode_condition_images`, `condition_on_images`), and the loss is on the
target's tokens, the only ones the transformer predicts. From a text-to-image shapes model (`--init-from
diffrl/assets/demo-shapes`), `adapt_for_editing` first appends the edit verbs to its tokenizer and starts the
transformer's reference-mode parts from its image mode's.

x_t = (1 − t)·x0 + t·ε with t drawn logit-normal and then shifted like the sampling schedule,
target velocity ε − x0, MSE. The text encoder trains with the transformer; 10% of prompts are
dropped to "" so classifier-free guidance works. An EMA of the weights is what gets saved.

Run folder: config.json, metrics.jsonl, samples/step-N.png, checkpoints/step-N/{model/, train_state.pt},
and final/ (the EMA model in the demo family's diffusers layout).
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import time
from pathlib import Path

import torch
from torch.utils.data import DataLoader, default_collate
from diffrl.utils.progress import tqdm

from diffrl.algorithms.losses import sft_loss
from diffrl.data.ocr.scenes import RenderedTexts
from diffrl.data.scenes import RenderedEdits, RenderedScenes
from diffrl.evaluation import ocr as ocr_eval
from diffrl.evaluation import shapes_edit as edit_eval
from diffrl.evaluation.shapes import sample_grid
from diffrl.models.base import Latents
from diffrl.models.demo import DemoConfig, DemoFamily, patchify
from diffrl.models.random_checkpoints.demo import EDIT_VERBS, random_family, tokenizer_for
from diffrl.sampling import noised
from diffrl.train.ema import ParameterEMA
from diffrl.train.pretrain_config import PretrainConfig
from diffrl.utils.device import autocast, resolve_device
from diffrl.utils.folders import check_output_dir
from diffrl.utils.step_profile import StepProfile

PROFILE_AFTER_STEPS = 20  # --profile-steps: compilation and the render workers' start come first


def sample_training_sigmas(batch: int, shift: float, generator: torch.Generator, device) -> torch.Tensor:
    """Logit-normal t, then the schedule's shift, so training sees noise levels where sampling spends time."""
    t = torch.sigmoid(torch.randn(batch, generator=generator, device=device))
    return shift * t / (1 + (shift - 1) * t)


def flow_matching_loss(family: DemoFamily, transformer, x0, cond, sigma, noise) -> torch.Tensor:
    x_t = noised(x0, noise, sigma)
    ids = family.prepare_ids(x0.device)
    v = family.velocity(transformer, Latents(x_t, ids), sigma, cond, None, 1.0)
    return sft_loss(v, x0, noise)


def training_autocast_dtype(device: torch.device, bf16: bool) -> torch.dtype | None:
    """The transformer's forward precision (`FamilyAdapter.autocast_dtype`): bf16 with --bf16 on CUDA, else the
    weights' fp32. It must be set on the family: `velocity` runs the transformer in the family's own precision
    context, which replaces an autocast around it (without this, a --bf16 run computes every matmul in fp32)."""
    return torch.bfloat16 if bf16 and device.type == "cuda" else None


def _lr_factor(step: int, warmup: int, progress: float) -> float:
    """Linear warm-up, then cosine from 1 to 0.1 over `progress` ∈ [0, 1]."""
    if step < warmup:
        return (step + 1) / warmup
    return 0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * min(1.0, progress)))


def _latest_checkpoint(output_dir: Path) -> Path | None:
    ckpts = sorted((output_dir / "checkpoints").glob("step-*"))
    return ckpts[-1] if ckpts else None


# Size flags and where a DemoConfig keeps each: (flag, field, config part, key).
_SIZE_FLAGS = (("--num-attention-heads", "num_attention_heads", "transformer", "num_attention_heads"),
               ("--attention-head-dim", "attention_head_dim", "transformer", "attention_head_dim"),
               ("--num-layers", "num_layers", "transformer", "num_layers"),
               ("--num-single-layers", "num_single_layers", "transformer", "num_single_layers"),
               ("--text-d-model", "text_d_model", "text_encoder", "d_model"),
               ("--rope-theta", "rope_theta", "transformer", "rope_theta"))


def refuse_other_size(cfg: PretrainConfig, config: DemoConfig, source: str) -> None:
    """A ValueError naming the first size flag set (away from its default) to another value than the model that
    `source` loads has: the flag would be ignored."""
    defaults = PretrainConfig()
    for flag, name, part, key in _SIZE_FLAGS:
        value = getattr(cfg, name)
        has = getattr(config, part).get(key, getattr(defaults, name))  # a model saved without it has the default
        if value != getattr(defaults, name) and value != has:
            raise ValueError(f"{flag} {value}: {source} has {has}, and its size is the model's; drop {flag}")
    if cfg.patch_size is not None and cfg.patch_size != config.patch_size:
        raise ValueError(f"--patch-size {cfg.patch_size}: {source} has {config.patch_size}, and its size is the "
                         "model's; drop --patch-size")
    if cfg.shift is not None and cfg.shift != config.shift:
        raise ValueError(f"--shift {cfg.shift}: {source} has {config.shift}, and its schedule is the model's; "
                         "drop --shift")
    if cfg.prediction is not None and cfg.prediction != config.prediction:
        raise ValueError(f"--prediction {cfg.prediction}: {source} predicts {config.prediction}, and its output is "
                         "the model's; drop --prediction")
    if cfg.glyph_grid and not config.glyph_grid:
        raise ValueError(f"--glyph-grid: {source} was pretrained without the glyph grid, and its layout is the "
                         "model's; drop --glyph-grid")


def model_world(family: DemoFamily) -> str:
    """The world a demo model was made for: ocr (wide), shapes-edit (its tokenizer knows the edit verbs), shapes."""
    if family.config.image_width:
        return "ocr"
    vocab = family.tokenizer.get_vocab()
    return "shapes-edit" if all(verb in vocab for verb in EDIT_VERBS) else "shapes"


def refuse_other_world(world: str, family: DemoFamily, source: str) -> None:
    """A loaded model of another world (an OCR model is wide, a shapes model square, an editing model's tokenizer
    knows the edit verbs) is refused naming --world; a shapes model may start a shapes-edit pretraining."""
    has = model_world(family)
    if has != world and (world, has) != ("shapes-edit", "shapes"):
        raise ValueError(f"--world {world}: {source} is a model of the {has} world; pass --world {has}")


# The transformer's parts for the reference images (FLUX 3's `image_cond` mode) and the image mode's they start from.
REFERENCE_PARTS = ("x_embedders", "mode_blocks", "early_stream_modulations", "single_stream_modulations")


def adapt_for_editing(family: DemoFamily) -> None:
    """A text-to-image shapes model made ready for the editing world, in place: (1) its tokenizer gains the edit
    verbs (`EDIT_VERBS`, after its own words, whose ids stay) and the text encoder an embedding row for each, a
    copy of the `<unk>` row the verbs mapped to until now; (2) the transformer's reference-mode parts
    (`REFERENCE_PARTS`' `image_cond` entries: the reference tokens' input projection, their per-mode blocks and both
    modulation heads) start as copies of the image mode's. A text-to-image model never ran those parts, so they
    hold their random initialisation; the copy lets the joint blocks read a clean source the way they read the image
    being denoised near t = 0 (the reference tokens are modulated at timestep 0)."""
    old = family.tokenizer
    new = tokenizer_for("shapes-edit", family.config.max_text_len)
    old_vocab, new_vocab = old.get_vocab(), new.get_vocab()
    if any(new_vocab.get(word) != i for word, i in old_vocab.items()):
        raise ValueError("the model's tokenizer is not the shapes world's word tokenizer; it cannot be extended")
    encoder = family.text_encoder
    unk = encoder.get_input_embeddings().weight[old.unk_token_id].detach().clone()
    encoder.resize_token_embeddings(len(new), mean_resizing=False)
    with torch.no_grad():
        encoder.get_input_embeddings().weight[len(old_vocab):] = unk
    family.tokenizer = new
    state = family.transformer.state_dict()
    with torch.no_grad():
        for part in REFERENCE_PARTS:
            for name, value in state.items():
                if name.startswith(f"{part}.image_cond."):
                    value.copy_(state[name.replace(".image_cond.", ".image.", 1)])


def training_stream(world: str, seed: int, config: DemoConfig):
    """The world's endless (prompt, uint8 image) pairs at the model's size; the editing world's (instruction,
    target, source) triples."""
    if world == "shapes-edit":
        return RenderedEdits(seed=seed, image_size=config.image_size)
    if world == "ocr":
        return RenderedTexts(seed=seed, height=config.height, width=config.width, glyph_grid=config.glyph_grid)
    return RenderedScenes(seed=seed, image_size=config.image_size)


class TokenizedBatches:
    """The render workers' collate: the batch as torch's default collate makes it, then its prompts' token ids and
    mask, so that the training loop does not tokenize (a glyph-grid batch of 256 takes about 55 ms on one core:
    a large share of a small model's step, spent in the one process that feeds the GPU)."""

    def __init__(self, tokenize):
        self.tokenize = tokenize

    def __call__(self, rows):
        prompts, *tensors = default_collate(rows)
        return (prompts, *tensors, *self.tokenize(prompts))


def cfg_dropped(input_ids, attention_mask, keep, empty_ids, empty_mask) -> tuple[torch.Tensor, torch.Tensor]:
    """The batch's tokens with each row where `keep` is False replaced by the empty prompt's (`[1, L]`): what
    tokenizing the prompts with the dropped ones made "" gives, without tokenizing again."""
    keep = keep[:, None]
    return torch.where(keep, input_ids, empty_ids), torch.where(keep, attention_mask, empty_mask)


def condition_on_sources(family: DemoFamily, cond, sources: torch.Tensor):
    """Each row's conditioning with its source image (`uint8 [B, 3, H, W]`) as its one condition image: the engine's
    path (the family's `encode_condition_images`, then `condition_on_images`) with the batch's tokens made at once,
    the same tensors as row by row (tests/test_pretrain_edit.py)."""
    _, ids = family.encode_condition_images(sources[:1])  # one condition image's ids (and its size checked)
    tokens = patchify(sources.float() / 255 * 2 - 1, family.config.patch_size)  # every row's, as that call makes them
    return family.condition_on_images(cond, (tokens, ids))


def step_budget(cfg: PretrainConfig) -> int | None:
    """--steps, else 2,000, except that a time-boxed run (--max-minutes) without --steps has none."""
    if cfg.steps is not None:
        return cfg.steps
    return None if cfg.max_minutes else 2000


def pretrain(cfg: PretrainConfig) -> Path:
    """Train; returns the path of the final EMA model."""
    cfg.check()
    device = resolve_device(cfg.device)
    out = cfg.output_dir
    check_output_dir(out)
    if out.exists() and any(out.iterdir()) and not cfg.resume:
        raise FileExistsError(f"{out} is not empty; pass --resume to continue it or choose another --output-dir")

    ckpt = _latest_checkpoint(out) if cfg.resume else None
    # A resumed run keeps its checkpoint's size, --init-from its model's: size flags that say otherwise are refused.
    source, flag = (ckpt / "model", f"--resume ({ckpt})") if ckpt else (cfg.init_from, f"--init-from {cfg.init_from}")
    if source is not None:
        family = DemoFamily.load(source, batch_invariant=False)
        refuse_other_size(cfg, family.config, flag)
        refuse_other_world(cfg.world, family, flag)
        if ckpt is None:
            print(f"initialized from {cfg.init_from}")
        if cfg.world == "shapes-edit" and model_world(family) == "shapes":
            adapt_for_editing(family)
            print("a text-to-image model: edit verbs added to its tokenizer, reference-mode blocks copied from the "
                  "image mode's")
    else:
        family = random_family(cfg.demo_config(), seed=cfg.seed, batch_invariant=False, world=cfg.world)
    out.mkdir(parents=True, exist_ok=True)  # after every refusal: a refused command leaves no folder behind
    (out / "config.json").write_text(json.dumps(dataclasses.asdict(cfg), default=str, indent=2) + "\n")
    family.transformer.to(device).train().requires_grad_(True)
    family.autocast_dtype = training_autocast_dtype(device, cfg.bf16)
    if device.type == "cuda":
        torch.set_float32_matmul_precision("high")  # what stays fp32 under autocast takes TF32
    family.text_encoder.to(device).train().requires_grad_(True)
    modules = [family.transformer, family.text_encoder]
    params = [p for m in modules for p in m.parameters()]
    optimizer = torch.optim.AdamW(params, lr=cfg.lr, weight_decay=cfg.weight_decay, betas=(0.9, 0.99))
    ema = ParameterEMA(params)
    step = 0
    if ckpt is not None:
        state = torch.load(ckpt / "train_state.pt", map_location=device, weights_only=True)
        family.transformer.load_state_dict(state["transformer"])
        family.text_encoder.load_state_dict(state["text_encoder"])
        optimizer.load_state_dict(state["optimizer"])
        ema.load_state_dict(state["ema"])
        step = state["step"]
        print(f"resumed from {ckpt} at step {step}")

    workers = cfg.num_workers if cfg.num_workers >= 0 else max(0, (os.cpu_count() or 1) - 1)
    loader = DataLoader(
        training_stream(cfg.world, cfg.seed + step, family.config),
        batch_size=cfg.batch_size, num_workers=workers, pin_memory=device.type == "cuda",
        persistent_workers=workers > 0, prefetch_factor=8 if workers > 0 else None,
        collate_fn=TokenizedBatches(family.prompt_tokenizer()),
    )
    empty_ids, empty_mask = (t.to(device) for t in family.tokenize([""]))  # a CFG-dropped prompt's tokens
    gen = torch.Generator(device=device).manual_seed(cfg.seed + 1_000_003 * step)
    train_transformer = family.transformer
    if cfg.compile:
        torch._dynamo.config.suppress_errors = True
        train_transformer = torch.compile(family.transformer)
    n_params = sum(p.numel() for p in family.transformer.parameters())
    print(f"demo model: transformer {n_params / 1e6:.2f}M params, device {device}, {workers} render workers")

    def save_checkpoint() -> Path:
        path = out / "checkpoints" / f"step-{step:07d}"
        with ema.swapped_in():
            family.save(path / "model")
        torch.save(
            {"transformer": family.transformer.state_dict(), "text_encoder": family.text_encoder.state_dict(),
             "optimizer": optimizer.state_dict(), "ema": ema.state_dict(), "step": step},
            path / "train_state.pt",
        )
        grid = {"ocr": ocr_eval.sample_grid, "shapes-edit": edit_eval.sample_grid}.get(cfg.world, sample_grid)
        size = {"per_kind": cfg.sample_edits_per_kind} if cfg.world == "shapes-edit" else {}
        with ema.swapped_in():
            shown = grid(family, out / "samples" / f"step-{step:07d}.png",
                         num_steps=cfg.sample_steps, guidance_scale=cfg.sample_guidance_scale, **size)
        if cfg.world == "shapes-edit":  # the grid's held-out edits, strictly verified
            metrics.write(json.dumps({"step": step, "guidance_scale": cfg.sample_guidance_scale, **shown}) + "\n")
            metrics.flush()
        return path

    metrics = (out / "metrics.jsonl").open("a")
    start = time.monotonic()
    total_steps = step_budget(cfg)
    bar = tqdm(total=total_steps, initial=step, desc="pretrain", dynamic_ncols=True)
    last_log = time.monotonic()
    profile = StepProfile(device) if cfg.profile_steps else None
    for prompts, images, *sources, input_ids, attention_mask in loader:
        if profile is not None and step == PROFILE_AFTER_STEPS:
            profile.start()
        # Progress is by steps or, with --max-minutes, by wall clock, whichever is further along:
        # a time-boxed run still finishes its learning-rate decay.
        progress = step / total_steps if total_steps else 0.0
        if cfg.max_minutes:
            progress = max(progress, (time.monotonic() - start) / (60 * cfg.max_minutes))
        if progress >= 1.0:
            break
        images = images.to(device, non_blocking=True).float() / 255.0
        keep = torch.rand(len(prompts), generator=gen, device=device) >= cfg.cfg_dropout
        tokens = cfg_dropped(input_ids.to(device, non_blocking=True), attention_mask.to(device, non_blocking=True),
                             keep, empty_ids, empty_mask)
        for group in optimizer.param_groups:
            group["lr"] = cfg.lr * _lr_factor(step, cfg.warmup_steps, progress)
        with autocast(device, cfg.bf16):
            x0 = family.encode_images(images)
            cond = family.encode_tokens(*tokens)
            if sources:  # the editing world: the text dropped for CFG, the source kept (as the engine's uncond)
                cond = condition_on_sources(family, cond, sources[0].to(device, non_blocking=True))
            sigma = sample_training_sigmas(len(prompts), family.config.shift, gen, device)
            noise = torch.randn(x0.shape, generator=gen, device=device)
            loss = flow_matching_loss(family, train_transformer, x0, cond, sigma, noise)
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        grad_norm = torch.nn.utils.clip_grad_norm_(params, cfg.grad_clip)
        optimizer.step()
        ema.update(min(cfg.ema_decay, (1 + step) / (10 + step)))  # short warm-up: early EMAs not stale
        step += 1
        bar.update(1)
        if profile is not None and step == PROFILE_AFTER_STEPS + cfg.profile_steps:
            profile.stop(out / "profile.txt", cfg.profile_steps)
            profile = None
        if step % cfg.log_every == 0:
            now = time.monotonic()
            record = {"step": step, "loss": loss.item(), "grad_norm": float(grad_norm),
                      "lr": optimizer.param_groups[0]["lr"], "samples_per_s": cfg.log_every * cfg.batch_size / (now - last_log),
                      "elapsed_s": now - start}
            last_log = now
            metrics.write(json.dumps(record) + "\n")
            metrics.flush()
            bar.set_postfix(loss=f"{record['loss']:.4f}", sps=f"{record['samples_per_s']:.0f}")
        if step % cfg.checkpoint_every == 0:
            save_checkpoint()
    bar.close()
    ckpt = save_checkpoint()
    final = out / "final"
    with ema.swapped_in():
        family.save(final)
    print(f"trained {step} steps in {(time.monotonic() - start) / 60:.1f} min; EMA model in {final}, last checkpoint {ckpt}")
    return final
