"""The published Flow-GRPO recipe for SD3, done the way its public code does it, on diffusers' own pipeline:
the baseline diffrl's `--recipe sd3-grpo` is timed against, on the same weights, in the same call.

    python benchmarks/flow_grpo_baseline.py --checkpoint runs/sd35m-random --out baseline.json

Nothing here comes from diffrl. What it follows (flow_grpo at ac4c86e: scripts/train_sd3.py with
config/grpo.py's 4-GPU SD3.5 configs, flow_grpo/diffusers_patch/*):
- `StableDiffusion3Pipeline`; text encoders in the low-precision dtype, VAE in fp32, the transformer's
  weights in fp32 with a peft LoRA (r32, α64, Gaussian init) on its attention projections, forwards under
  autocast (what accelerate's mixed precision does to a prepared model), TF32 matmuls on.
- Rollout: batches of `--rollout-batch` images from a Python loop over the pipeline's parts: prompts
  encoded by its `encode_prompt` (77 CLIP + 128 T5 tokens), CFG as one forward over uncond + cond, the
  SDE step with its log-prob in fp32 on all 10 steps, the VAE decode, a JPEG-size reward in a thread pool.
- Advantages: per-prompt mean over the rollout, std over the whole rollout (`global_std`).
- Training: the rollout shuffled into micro-batches of `--train-batch` samples; for each of the first
  9 steps (timestep fraction 0.99) a CFG forward (the uncond half detached), the log-prob of the rollout's
  next latent, the clipped ratio loss; gradients accumulated so that a rollout makes `--optimizer-steps`
  AdamW steps (the published configs: two), each after clipping the gradient norm to 1.

It reports, after `--warmup` iterations: seconds per rollout image, ms per train pair (a pair is one
sample at one trained step), seconds per sample (its rollout and its 9 trained steps), peak GPU memory,
and how far the trainer's first recomputation of the log-probs is from the rollout's.
"""

from __future__ import annotations

import argparse
import contextlib
import io
import json
import math
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np
import torch
from PIL import Image

LORA_TARGETS = ["attn.add_k_proj", "attn.add_q_proj", "attn.add_v_proj", "attn.to_add_out",
                "attn.to_k", "attn.to_out.0", "attn.to_q", "attn.to_v"]
PROMPTS = ["a red bicycle leaning on a brick wall", "a bowl of lemons on a wooden table",
           "a lighthouse at dusk", "two cats asleep on a sofa", "a sign that reads open late",
           "a snowy mountain above a lake", "a blue teapot and a white cup", "a street market in the rain"]
MAX_T5_TOKENS = 128  # the published code encodes prompts with this T5 length
DTYPES = {"bfloat16": torch.bfloat16, "float32": torch.float32}


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--checkpoint", type=Path, required=True, help="a diffusers SD3 checkpoint directory")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--dtype", choices=sorted(DTYPES), default="bfloat16",
                        help="mixed-precision dtype (text encoders, transformer autocast); float32: no autocast")
    parser.add_argument("--prompts", type=int, default=4, help="B: prompts per rollout")
    parser.add_argument("--samples-per-prompt", type=int, default=16, help="K: samples per prompt")
    parser.add_argument("--rollout-batch", type=int, default=8, help="images per pipeline call")
    parser.add_argument("--train-batch", type=int, default=8, help="samples per training micro-batch")
    parser.add_argument("--optimizer-steps", type=int, default=2, help="AdamW steps per rollout")
    parser.add_argument("--resolution", type=int, default=512)
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--guidance-scale", type=float, default=4.5)
    parser.add_argument("--noise-level", type=float, default=0.7)
    parser.add_argument("--timestep-fraction", type=float, default=0.99)
    parser.add_argument("--clip-range", type=float, default=1e-4)
    parser.add_argument("--adv-clip-max", type=float, default=5.0)
    parser.add_argument("--kl-beta", type=float, default=0.0,
                        help="> 0 adds the KL term against the adapter-free model (one more forward per pair)")
    parser.add_argument("--lr", type=float, default=3e-4)
    parser.add_argument("--lora-rank", type=int, default=32)
    parser.add_argument("--lora-alpha", type=float, default=64.0)
    parser.add_argument("--iterations", type=int, default=2, help="measured iterations, after the warm-up")
    parser.add_argument("--warmup", type=int, default=1)
    parser.add_argument("--seed", type=int, default=42)
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args(argv)
    samples = args.prompts * args.samples_per_prompt
    if samples % args.rollout_batch or samples % args.train_batch:
        parser.error(f"--rollout-batch and --train-batch must divide B×K = {samples}")
    if (samples // args.train_batch) % args.optimizer_steps:
        parser.error(f"--optimizer-steps must divide the {samples // args.train_batch} micro-batches of a rollout")
    return args


# ------------------------------------------------------------------ model
def load_pipeline(checkpoint: Path, device: str, dtype: torch.dtype):
    """The pipeline from the checkpoint's folders (it may have no model_index.json, and no T5)."""
    from diffusers import (
        AutoencoderKL,
        FlowMatchEulerDiscreteScheduler,
        SD3Transformer2DModel,
        StableDiffusion3Pipeline,
    )
    from transformers import AutoTokenizer, CLIPTextModelWithProjection, T5EncoderModel

    has_t5 = (checkpoint / "text_encoder_3").is_dir()
    if (checkpoint / "model_index.json").is_file():
        # diffusers wants a checkpoint without T5 opened with text_encoder_3=None passed explicitly.
        no_t5 = {} if has_t5 else {"text_encoder_3": None, "tokenizer_3": None}
        pipe = StableDiffusion3Pipeline.from_pretrained(checkpoint, torch_dtype=torch.float32, local_files_only=True,
                                                        **no_t5)
    else:
        pipe = StableDiffusion3Pipeline(
            transformer=SD3Transformer2DModel.from_pretrained(checkpoint / "transformer", torch_dtype=torch.float32),
            scheduler=FlowMatchEulerDiscreteScheduler.from_pretrained(checkpoint / "scheduler"),
            vae=AutoencoderKL.from_pretrained(checkpoint / "vae", torch_dtype=torch.float32),
            text_encoder=CLIPTextModelWithProjection.from_pretrained(checkpoint / "text_encoder"),
            tokenizer=AutoTokenizer.from_pretrained(checkpoint / "tokenizer"),
            text_encoder_2=CLIPTextModelWithProjection.from_pretrained(checkpoint / "text_encoder_2"),
            tokenizer_2=AutoTokenizer.from_pretrained(checkpoint / "tokenizer_2"),
            text_encoder_3=T5EncoderModel.from_pretrained(checkpoint / "text_encoder_3") if has_t5 else None,
            tokenizer_3=AutoTokenizer.from_pretrained(checkpoint / "tokenizer_3") if has_t5 else None)
    # Only the adapter trains; the encoders run in the low-precision dtype, the VAE and the
    # transformer's weights stay fp32 (the forward is autocast), as the published script sets them.
    for module in (pipe.vae, pipe.text_encoder, pipe.text_encoder_2, pipe.text_encoder_3, pipe.transformer):
        if module is not None:
            module.requires_grad_(False)
    for encoder in (pipe.text_encoder, pipe.text_encoder_2, pipe.text_encoder_3):
        if encoder is not None:
            encoder.to(device, dtype=dtype)
    pipe.vae.to(device, dtype=torch.float32)
    pipe.transformer.to(device)
    pipe.set_progress_bar_config(disable=True)
    return pipe


def add_lora(pipe, rank: int, alpha: float):
    from peft import LoraConfig, get_peft_model

    config = LoraConfig(r=rank, lora_alpha=alpha, init_lora_weights="gaussian", target_modules=LORA_TARGETS)
    pipe.transformer = get_peft_model(pipe.transformer, config)
    return pipe.transformer


def forward(transformer, latents, timesteps, embeds, pooled, dtype: torch.dtype):
    """One transformer call; low-precision autocast and an fp32 output, as a mixed-precision model gives."""
    autocast = (torch.autocast(latents.device.type, dtype=dtype) if dtype != torch.float32
                else contextlib.nullcontext())
    with autocast:
        out = transformer(hidden_states=latents, timestep=timesteps, encoder_hidden_states=embeds,
                          pooled_projections=pooled, return_dict=False)[0]
    return out.float()


# ----------------------------------------------- the SDE step (docs/architecture.md, "Sampling math")
def sde_step_with_log_prob(scheduler, velocity, timesteps, x, noise_level, next_x=None):
    """Flow-GRPO's SDE step x_σ → x_σ' in fp32: draws x' (or scores the given one) and returns
    (x', log p(x' | x) averaged over each sample's elements, the mean, std_t).

    `timesteps` holds one timestep for the batch or one per sample; each is looked up in the
    scheduler's schedule, as the published code does."""
    velocity, x = velocity.float(), x.float()
    index = torch.tensor([scheduler.index_for_timestep(t) for t in timesteps])
    sigma = scheduler.sigmas[index].to(x.device).view(-1, 1, 1, 1)
    sigma_next = scheduler.sigmas[index + 1].to(x.device).view(-1, 1, 1, 1)
    dt = sigma_next - sigma  # < 0
    # std_t is singular at σ = 1: the schedule's second sigma stands in for it there.
    sigma_tilde = torch.where(sigma == 1, scheduler.sigmas[1].item(), sigma)
    std_t = noise_level * torch.sqrt(sigma / (1 - sigma_tilde))
    mean = x * (1 + std_t**2 / (2 * sigma) * dt) + velocity * (1 + std_t**2 * (1 - sigma) / (2 * sigma)) * dt
    std = std_t * torch.sqrt(-dt)
    if next_x is None:
        next_x = mean + std * torch.randn_like(mean)
    next_x = next_x.float()
    log_prob = -((next_x.detach() - mean) ** 2) / (2 * std**2) - torch.log(std) - math.log(math.sqrt(2 * math.pi))
    return next_x, log_prob.mean(dim=tuple(range(1, log_prob.ndim))), mean, std_t


# ------------------------------------------------------------------ rollout
def jpeg_compressibility(images: torch.Tensor) -> np.ndarray:
    """Minus the kB of each image saved as JPEG at quality 95."""
    pixels = (images * 255).round().clamp(0, 255).to(torch.uint8).cpu().numpy().transpose(0, 2, 3, 1)
    sizes = []
    for image in pixels:
        buffer = io.BytesIO()
        Image.fromarray(image).save(buffer, format="JPEG", quality=95)
        sizes.append(buffer.tell() / 1000)
    return -np.array(sizes)


@torch.no_grad()
def encode(pipe, prompts: list[str], device: str):
    embeds, _, pooled, _ = pipe.encode_prompt(prompt=prompts, prompt_2=None, prompt_3=None, device=device,
                                              do_classifier_free_guidance=False,
                                              max_sequence_length=MAX_T5_TOKENS)
    return embeds, pooled


@torch.no_grad()
def sample_batch(pipe, transformer, embeds, pooled, negative, args, dtype):
    """One pipeline call's worth of images, step by step, keeping every latent and log-prob."""
    n, device = len(embeds), embeds.device
    cond = torch.cat([negative[0].expand(n, -1, -1), embeds])
    cond_pooled = torch.cat([negative[1].expand(n, -1), pooled])
    latents = pipe.prepare_latents(n, transformer.config.in_channels, args.resolution, args.resolution,
                                   embeds.dtype, device, None)
    pipe.scheduler.set_timesteps(args.steps, device=device)
    trajectory, log_probs = [latents], []
    for t in pipe.scheduler.timesteps:
        v = forward(transformer, torch.cat([latents] * 2), t.expand(2 * n), cond, cond_pooled, dtype)
        # The pipeline casts the model's output to the embeddings' dtype before the guidance sum.
        uncond, text = v.to(embeds.dtype).chunk(2)
        v = uncond + args.guidance_scale * (text - uncond)
        next_x, log_prob, _, _ = sde_step_with_log_prob(pipe.scheduler, v, t.unsqueeze(0), latents,
                                                        args.noise_level)
        trajectory.append(next_x)  # kept in fp32; the loop goes on in the embeddings' dtype
        log_probs.append(log_prob)
        latents = next_x.to(embeds.dtype)
    latents = latents / pipe.vae.config.scaling_factor + pipe.vae.config.shift_factor
    images = pipe.vae.decode(latents.to(pipe.vae.dtype), return_dict=False)[0]
    images = pipe.image_processor.postprocess(images, output_type="pt")
    return images, torch.stack(trajectory, dim=1), torch.stack(log_probs, dim=1)


def rollout(pipe, transformer, prompts, negative, args, dtype, pool):
    transformer.eval()
    batches, rewards = [], []
    for start in range(0, len(prompts), args.rollout_batch):
        chunk = prompts[start:start + args.rollout_batch]
        embeds, pooled = encode(pipe, chunk, args.device)
        images, trajectory, log_probs = sample_batch(pipe, transformer, embeds, pooled, negative, args, dtype)
        rewards.append(pool.submit(jpeg_compressibility, images))  # scored while the next batch samples
        batches.append({"embeds": embeds, "pooled": pooled, "latents": trajectory[:, :-1],
                        "next_latents": trajectory[:, 1:], "log_probs": log_probs,
                        "timesteps": pipe.scheduler.timesteps.repeat(len(chunk), 1)})
    samples = {key: torch.cat([b[key] for b in batches]) for key in batches[0]}
    return samples, np.concatenate([r.result() for r in rewards])


def advantages(prompts: list[str], rewards: np.ndarray) -> np.ndarray:
    """Each prompt's mean subtracted, divided by the std of the whole rollout."""
    names = np.array(prompts)
    out = np.zeros_like(rewards, dtype=np.float64)
    std = rewards.std() + 1e-4
    for name in np.unique(names):
        out[names == name] = (rewards[names == name] - rewards[names == name].mean()) / std
    return out


# ------------------------------------------------------------------ training
def recompute(pipe, transformer, batch, j, negative, args, dtype):
    """The log-prob of the rollout's step j under the current weights, with CFG in one forward."""
    n, x, t = len(batch["embeds"]), batch["latents"][:, j], batch["timesteps"][:, j]
    cond = torch.cat([negative[0].expand(n, -1, -1), batch["embeds"]])
    cond_pooled = torch.cat([negative[1].expand(n, -1), batch["pooled"]])
    uncond, text = forward(transformer, torch.cat([x, x]), torch.cat([t, t]), cond, cond_pooled, dtype).chunk(2)
    uncond = uncond.detach()  # the published train step backpropagates through the conditional half only
    v = uncond + args.guidance_scale * (text - uncond)
    return sde_step_with_log_prob(pipe.scheduler, v, t, x, args.noise_level, next_x=batch["next_latents"][:, j])


def train(pipe, transformer, optimizer, samples, negative, args, dtype):
    transformer.train()
    trained_steps = int(args.steps * args.timestep_fraction)
    total = len(samples["embeds"])
    perm = torch.randperm(total, device=samples["embeds"].device)
    batches = [{k: v[perm[i:i + args.train_batch]] for k, v in samples.items()}
               for i in range(0, total, args.train_batch)]
    # One optimizer step per `accumulate` backward calls, the loss scaled as accelerate scales it.
    accumulate = len(batches) // args.optimizer_steps * trained_steps
    calls, first_pass, stats = 0, True, {"first_abs_diff": [], "first_clipped": [], "approx_kl": []}
    for batch in batches:
        for j in range(trained_steps):
            _, log_prob, mean, std_t = recompute(pipe, transformer, batch, j, negative, args, dtype)
            advantage = batch["advantages"][:, j].clamp(-args.adv_clip_max, args.adv_clip_max)
            diff = log_prob - batch["log_probs"][:, j]
            ratio = torch.exp(diff)
            clipped = ratio.clamp(1 - args.clip_range, 1 + args.clip_range)
            loss = torch.maximum(-advantage * ratio, -advantage * clipped).mean()
            if args.kl_beta > 0:
                with torch.no_grad(), transformer.disable_adapter():
                    _, _, ref_mean, _ = recompute(pipe, transformer, batch, j, negative, args, dtype)
                kl = ((mean - ref_mean) ** 2).mean(dim=(1, 2, 3), keepdim=True) / (2 * std_t**2)
                loss = loss + args.kl_beta * kl.mean()
            (loss / accumulate).backward()
            # Kept as tensors: reading them now would add a GPU sync per micro-step.
            stats["approx_kl"].append(0.5 * (diff.detach() ** 2).mean())
            if first_pass:
                stats["first_abs_diff"].append(diff.detach().abs())
                stats["first_clipped"].append(((ratio.detach() - 1).abs() > args.clip_range).float())
            calls += 1
            if calls % accumulate == 0:
                torch.nn.utils.clip_grad_norm_(transformer.parameters(), 1.0)
                optimizer.step()
                optimizer.zero_grad()
                first_pass = False
    first_abs_diff = torch.cat(stats["first_abs_diff"])
    return {"pairs": total * trained_steps, "optimizer_steps": calls // accumulate,
            "first_pass_log_prob_abs_diff": first_abs_diff.mean().item(),
            "first_pass_log_prob_abs_diff_max": first_abs_diff.max().item(),
            "first_pass_clipfrac": torch.cat(stats["first_clipped"]).mean().item(),
            "approx_kl": torch.stack(stats["approx_kl"]).mean().item()}


# ------------------------------------------------------------------ the run
def sync(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.synchronize()


def run(args: argparse.Namespace, pipe=None) -> dict:
    """Warm-up and measured iterations of rollout + training; `pipe` (with its LoRA) may be given."""
    dtype = DTYPES[args.dtype]
    torch.manual_seed(args.seed)
    if args.device.startswith("cuda"):
        torch.backends.cuda.matmul.allow_tf32 = True  # the published config turns it on
        torch.cuda.reset_peak_memory_stats()
    if pipe is None:
        pipe = load_pipeline(args.checkpoint, args.device, dtype)
        add_lora(pipe, args.lora_rank, args.lora_alpha)
    transformer = pipe.transformer
    params = [p for p in transformer.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(params, lr=args.lr, betas=(0.9, 0.999), weight_decay=1e-4, eps=1e-8)
    negative = encode(pipe, [""], args.device)
    trained_steps = int(args.steps * args.timestep_fraction)
    pool = ThreadPoolExecutor(max_workers=8)
    records = []
    for iteration in range(args.warmup + args.iterations):
        # B prompts × K samples, shuffled so that a pipeline call mixes prompts, as the published sampler does.
        groups = [PROMPTS[(iteration * args.prompts + g) % len(PROMPTS)] + f" #{g}" for g in range(args.prompts)]
        order = torch.randperm(args.prompts * args.samples_per_prompt).tolist()
        prompts = [groups[i // args.samples_per_prompt] for i in order]
        sync(args.device)
        start = time.perf_counter()
        samples, rewards = rollout(pipe, transformer, prompts, negative, args, dtype, pool)
        adv = torch.as_tensor(advantages(prompts, rewards), dtype=torch.float32, device=samples["embeds"].device)
        samples["advantages"] = adv[:, None].repeat(1, args.steps)
        sync(args.device)
        rolled = time.perf_counter()
        info = train(pipe, transformer, optimizer, samples, negative, args, dtype)
        sync(args.device)
        trained = time.perf_counter()
        n = len(prompts)
        record = {"iteration": iteration, "warmup": iteration < args.warmup, "samples": n,
                  "rollout_s": rolled - start, "train_s": trained - rolled,
                  "s_per_rollout_image": (rolled - start) / n,
                  "ms_per_train_pair": 1000 * (trained - rolled) / info["pairs"],
                  "s_per_sample": (trained - start) / n, "reward_mean": float(rewards.mean()), **info}
        records.append(record)
        print(f"iteration {iteration}{' (warm-up)' if record['warmup'] else ''}: rollout {record['rollout_s']:.2f} s, "
              f"train {record['train_s']:.2f} s, |Δlog p| {record['first_pass_log_prob_abs_diff']:.2e}", flush=True)
    pool.shutdown()
    measured = [r for r in records if not r["warmup"]] or records

    def mean(key):
        return float(np.mean([r[key] for r in measured]))

    cuda = args.device.startswith("cuda")
    return {
        "what": "flow_grpo's SD3 recipe on diffusers' StableDiffusion3Pipeline, structured as its public code",
        "checkpoint": str(args.checkpoint), "device": args.device,
        "device_name": torch.cuda.get_device_name() if cuda else "cpu",
        "torch": torch.__version__, "diffusers": __import__("diffusers").__version__,
        "settings": {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()},
        "trained_steps": trained_steps, "lora_parameters": sum(p.numel() for p in params),
        "measured_iterations": len(measured),
        "s_per_rollout_image": mean("s_per_rollout_image"), "ms_per_train_pair": mean("ms_per_train_pair"),
        "s_per_sample": mean("s_per_sample"),
        "first_pass_log_prob_abs_diff": mean("first_pass_log_prob_abs_diff"),
        "first_pass_clipfrac": mean("first_pass_clipfrac"),
        "peak_gib_allocated": torch.cuda.max_memory_allocated() / 2**30 if cuda else None,
        "peak_gib_reserved": torch.cuda.max_memory_reserved() / 2**30 if cuda else None,
        "iterations": records,
    }


def print_table(results: dict) -> None:
    rows = [("rollout image", f"{results['s_per_rollout_image']:.3f} s"),
            ("train pair", f"{results['ms_per_train_pair']:.1f} ms"),
            (f"sample (rollout + {results['trained_steps']} trained steps)", f"{results['s_per_sample']:.3f} s"),
            ("peak GPU memory (allocated / reserved)",
             "—" if results["peak_gib_allocated"] is None
             else f"{results['peak_gib_allocated']:.1f} / {results['peak_gib_reserved']:.1f} GiB"),
            ("first-pass mean |Δlog p|", f"{results['first_pass_log_prob_abs_diff']:.2e}"),
            ("first-pass clipfrac", f"{results['first_pass_clipfrac']:.2f}")]
    width = max(len(name) for name, _ in rows)
    print(f"flow_grpo baseline on {results['device_name']}, mean of {results['measured_iterations']} iteration(s)")
    for name, value in rows:
        print(f"  {name:<{width}}  {value}")


def main(argv=None, pipe=None) -> dict:
    args = parse_args(argv)
    results = run(args, pipe)
    print_table(results)
    if args.out:
        args.out.write_text(json.dumps(results, indent=2) + "\n")
    return results


if __name__ == "__main__":
    main()
