"""Where a compiled engine's and a compiled trainer's forwards part: the axis behind the first-pass |Δ log p|.

    python benchmarks/compile_drift.py --family sd3 --checkpoint runs/sd3-random --resolution 512
    python benchmarks/compile_drift.py --device cpu --tiny --family sd3 --checkpoint /tmp/sd3-tiny   # a dry run

One family with a LoRA (the trainer's setup: bf16 forward, gradient checkpointing, regional compile) computes the
CFG velocity of the same `--n` latents at one σ of the schedule in the ways a Flow-GRPO run does:
- `engine`: no gradients (with `--engine-graph training`: gradients on, as `--engine-forward-graph training`
  samples), the whole microgroup in one batch (the rollout's call), first, as a rollout is;
- `trainer`: gradients on, in micro-batches of `--micro-batch` (the first pass's replay);
- `nograd_micro`: no gradients at the trainer's micro-batch (the batch shape alone);
- `grad_whole`: gradients on at the engine's batch (the grad mode alone);
- `engine_again`: the engine's call once more, after the trainer's shapes made dynamo recompile.
Each way's velocities are compared with the engine's: mean |Δv| / mean |v|, the share of samples bit-equal, and
the mean |Δ log p| of an SDE step (noise level 0.7) whose x' the engine's velocity drew, scored with the other —
the quantity Flow-GRPO clips at 1e-4. Eager runs first as the reference. `--variant NAME:SECTION.KEY=VALUE,...`
(repeatable) recompiles from scratch under those dynamo/inductor settings, e.g.
`--variant static:dynamo.automatic_dynamic_shapes=False`.
"""

from __future__ import annotations

import argparse
from dataclasses import replace

import torch
from family_rollout import add_checkpoint_arguments, make_checkpoint
from report import emit

from diffrl.models import resolve_family
from diffrl.models.base import Latents
from diffrl.models.checkpointing import enable_gradient_checkpointing
from diffrl.models.lora import LoraSpec, add_lora
from diffrl.sampling import transition
from diffrl.utils.compile_settings import _SETTINGS

PROMPTS = ["a photo of a red bicycle leaning on a brick wall", "an oil painting of a lighthouse in a storm",
           "a bowl of ramen, studio lighting", "a cat wearing a tiny wizard hat"]


def parse_variant(text: str) -> tuple[str, dict]:
    name, _, body = text.partition(":")
    settings: dict = {"dynamo": {}, "inductor": {}}
    for item in filter(None, body.split(",")):
        key, _, value = item.partition("=")
        section, _, field = key.partition(".")
        settings[section][field] = {"True": True, "False": False}.get(value, int(value) if value.isdigit() else value)
    return name, settings


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser()
    add_checkpoint_arguments(parser)
    parser.add_argument("--n", type=int, default=16, help="samples in the engine's microgroup")
    parser.add_argument("--micro-batch", type=int, default=4, help="the trainer's pairs per forward")
    parser.add_argument("--step", type=int, default=3, help="the schedule's step whose σ is used")
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--guidance-scale", type=float, default=4.5)
    parser.add_argument("--lora-rank", type=int, default=32)
    parser.add_argument("--no-gradient-checkpointing", action="store_true")
    parser.add_argument("--engine-graph", choices=["inference", "training"], default="inference",
                        help="the engine's calls without gradients, or in the trainer's graph (--engine-forward-graph)")
    parser.add_argument("--dynamic", action="store_true",
                        help="blocks compiled for symbolic sizes from their first call (as --engine-forward-graph training)")
    parser.add_argument("--variant", action="append", default=[], help="NAME:SECTION.KEY=VALUE,...")
    parser.add_argument("--tiny", action="store_true", help="tiny random weights (a dry run)")
    parser.add_argument("--out", default=None)
    args = parser.parse_args(argv)
    device = torch.device(args.device)
    if not args.checkpoint.exists():
        make_checkpoint(args.family, args.checkpoint, device, tiny=args.tiny)
    family = resolve_family(args.family, args.checkpoint).load(args.checkpoint, device=device,
                                                               dtype=getattr(torch, args.dtype))
    family.autocast_dtype = torch.bfloat16
    transformer = family.transformer
    if not args.no_gradient_checkpointing:
        enable_gradient_checkpointing(transformer, family.block_lists)
    add_lora(transformer, LoraSpec(rank=args.lora_rank, alpha=2 * args.lora_rank,
                                   target_modules=list(family.lora_target_modules)))
    generator = torch.Generator().manual_seed(0)
    for name, p in transformer.named_parameters():  # a trained adapter's B is not zero: make the LoRA path count
        p.requires_grad_("lora_" in name)
        if "lora_B" in name:
            p.data.copy_(torch.randn(p.shape, generator=generator) * 1e-3)

    height, width = (args.resolution,) * 2 if args.resolution else family.default_size()
    prompts = [PROMPTS[i % len(PROMPTS)] for i in range(args.n)]
    with torch.no_grad():
        cond, uncond = family.encode_prompts(prompts), family.encode_prompts([""] * args.n)
        latents = family.prepare_latents([torch.Generator(device).manual_seed(i) for i in range(args.n)], height, width)
        sigmas = family.sigmas(args.steps, height, width).to(device)
    sigma, sigma_next = sigmas[args.step], sigmas[args.step + 1]

    def rows(embeds, i, j):
        return replace(embeds, embeds=embeds.embeds[i:j])

    def velocity(batch: int, grad: bool) -> torch.Tensor:
        out = []
        for i in range(0, args.n, batch):
            j = min(i + batch, args.n)
            x = Latents(latents.tokens[i:j], latents.ids)
            with torch.enable_grad() if grad else torch.no_grad():
                v = family.velocity(transformer, x, sigma.expand(j - i), rows(cond, i, j), rows(uncond, i, j),
                                    args.guidance_scale)
            out.append(v.detach().float())
        return torch.cat(out)

    def step(v, next_latents=None):
        generators = [torch.Generator(device).manual_seed(100 + i) for i in range(args.n)]
        return transition("sde", latents.tokens.float(), v, sigma.expand(args.n), sigma_next.expand(args.n), 0.7,
                          sigma_max=float(sigmas[1]), generators=generators, next_latents=next_latents)

    def ways() -> dict:
        in_training_graph = args.engine_graph == "training"
        engine = velocity(args.n, grad=in_training_graph)
        drawn = step(engine)
        results = {}
        for way, (batch, grad) in {"trainer": (args.micro_batch, True), "nograd_micro": (args.micro_batch, False),
                                   "grad_whole": (args.n, True), "engine_again": (args.n, in_training_graph)}.items():
            v = velocity(batch, grad)
            replay = step(v, next_latents=drawn.next_latents)
            results[way] = {
                "relative_velocity_diff": ((v - engine).abs().mean() / engine.abs().mean()).item(),
                "samples_bit_equal": sum(bool(torch.equal(a, b)) for a, b in zip(v, engine)) / args.n,
                "log_prob_mean_abs_diff": (replay.log_prob - drawn.log_prob).abs().mean().item(),
            }
            print(f"  {way:13s} |Δv|/|v| {results[way]['relative_velocity_diff']:.2e}  bit-equal "
                  f"{results[way]['samples_bit_equal']:.2f}  |Δlogp| {results[way]['log_prob_mean_abs_diff']:.2e}",
                  flush=True)
        return results

    report = {"family": args.family, "n": args.n, "micro_batch": args.micro_batch, "size": [height, width],
              "engine_graph": args.engine_graph, "dynamic": args.dynamic,
              "gradient_checkpointing": not args.no_gradient_checkpointing, "ways": {}}
    print("eager", flush=True)
    report["ways"]["eager"] = ways()
    family.compile(dynamic=args.dynamic)  # the family's own settings (eager's bf16 roundings), recorded for every thread
    baseline = {section: dict(values) for section, values in _SETTINGS.items()}
    for name, settings in [("compiled", {"dynamo": {}, "inductor": {}}), *map(parse_variant, args.variant)]:
        torch._dynamo.reset()  # every variant compiles from scratch, under the baseline plus its own settings
        for section in _SETTINGS:
            _SETTINGS[section].clear()
            _SETTINGS[section].update(baseline[section], **settings[section])
        print(f"{name} {settings}", flush=True)
        report["ways"][name] = ways()
    emit(report, args.out)
    return report


if __name__ == "__main__":
    main()
