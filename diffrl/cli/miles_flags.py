"""miles-diffusion's training flags, translated into `diffrl train`'s (docs/coming-from-miles.md).

A miles-diffusion launch line (its `train_diffusion.py` arguments) works as written: each miles flag is

- mapped to the diffrl setting that means the same (stated once at start-up, so the user learns diffrl's name),
- accepted as a no-op where that is true: diffrl has no such knob because its behaviour is already what the flag
  asks for (the note says why), or
- refused in one line that says why and what to use instead.

Flags both tools share (`--lr`, `--use-lora`, `--diffusion-clip-range`, …) pass through untouched.
`translate(args)` returns diffrl's arguments and the start-up notes; a refusal is a ValueError.
"""

from __future__ import annotations

import os
import shlex
from collections.abc import Callable
from dataclasses import dataclass, field

RenameValue = Callable[[list[str]], list[str]]


@dataclass(frozen=True)
class MilesFlag:
    takes: int  # how many values follow the flag (0: a switch)
    note: str  # the start-up line's explanation (for a refusal: the error)
    to: str | None = None  # a rename: diffrl's flag, given the same values
    accept: tuple[str, ...] | None = None  # a no-op that holds only for these values (others are refused)
    refuse: bool = False  # no diffrl setting means it: refused with `note` as the reason


_SAME_RUN = "diffrl's rollout manager is that function (seeds, microgroups, least-loaded routing)"
FLAGS: dict[str, MilesFlag] = {
    # Renames: diffrl's name for the same setting.
    "--diffusion-microgroup-size": MilesFlag(1, "samples per engine request", to="--rollout-microgroup-size"),
    "--diffusion-eval-num-steps": MilesFlag(1, "denoising steps of the held-out evaluation", to="--eval-num-steps"),
    "--clip-grad": MilesFlag(1, "the gradient norm clip", to="--grad-clip"),
    "--sglang-server-concurrency": MilesFlag(1, "in-flight requests per engine (the microgroup contract's cap)",
                                             to="--engine-concurrency"),
    "--diffusion-sde-window-size": MilesFlag(1, "SDE steps per rollout", to="--diffusion-num-sde-steps"),
    "--diffusion-height": MilesFlag(1, "sample height", to="--height"),
    "--diffusion-width": MilesFlag(1, "sample width", to="--width"),
    "--save": MilesFlag(1, "the run folder (checkpoints under checkpoints/)", to="--output-dir"),
    "--save-interval": MilesFlag(1, "rollouts between checkpoints", to="--checkpoint-interval"),
    "--diffusion-log-images": MilesFlag(1, "images logged (diffrl logs held-out evaluation images, at each "
                                           "evaluation)", to="--eval-log-images"),
    # No-ops: what the flag asks for is what diffrl does.
    "--train-backend": MilesFlag(1, "diffrl shards the trained model with FSDP2 under torchrun", accept=("fsdp",)),
    "--rollout-function-path": MilesFlag(1, _SAME_RUN,
                                         accept=("miles.rollout.sglang_diffusion_rollout.generate_rollout",)),
    "--advantage-estimator": MilesFlag(1, "group-relative advantages per prompt (--globalize-reward-std for a "
                                          "batch-wide std)", accept=("grpo",)),
    "--fsdp-master-dtype": MilesFlag(1, "diffrl keeps the trained weights as fp32 masters", accept=("fp32", "float32")),
    "--fsdp-reduce-dtype": MilesFlag(1, "gradients are reduced in the masters' dtype, fp32", accept=("fp32", "float32")),
    "--diffusion-train-iter-order": MilesFlag(1, "an optimizer step's gradient is the mean over its pairs in any "
                                                 "order; each step takes whole samples, as miles's does",
                                              accept=("sample_major", "timestep_major")),
    "--diffusion-init-lora-weight": MilesFlag(1, "diffrl's LoRA adapters start Gaussian (B = 0)", accept=("gaussian",)),
    "--diffusion-task": MilesFlag(1, "text-to-image and text-to-video; an image-conditioned run (editing, image to "
                                     "video) reads each prompt row's condition images from --prompt-data instead "
                                     "(--condition-images required to insist on them)",
                                  accept=("t2i", "t2v")),
    "--diffusion-step-strategy-path": MilesFlag(
        1, "flow_grpo's SDE window is diffrl's --diffusion-sde-step-strategy window (the default)",
        accept=("miles.rollout.step_strategy_hub.sde_window",)),
    "--use-miles-router": MilesFlag(0, "diffrl routes each request to the least-loaded engine itself"),
    "--apply-sgld-monkey-patches": MilesFlag(0, "diffrl's engine runs diffusers' own modules; nothing to patch"),
    "--diffusion-debug-mode": MilesFlag(0, "diffrl logs the rollout-vs-trainer log-prob agreement every rollout "
                                           "(train/log_prob_mean_abs_diff)"),
    "--disable-wandb-random-suffix": MilesFlag(0, "diffrl names a W&B run after its run folder, with no suffix"),
    "--diffusion-log-image-interval": MilesFlag(1, "diffrl logs images at each held-out evaluation "
                                                   "(every --eval-interval rollouts)"),
    "--rollout-parser-num-workers": MilesFlag(1, "diffrl decodes each engine's answer as it streams in (compact "
                                                 "msgpack; video frames scored as they land); samples are the same"),
    "--rollout-fetch-in-parser": MilesFlag(0, "diffrl decodes each engine's answer as it streams in; samples are "
                                              "the same"),
    "--pickscore-batch-size": MilesFlag(1, "diffrl scores each microgroup as one batch"),
    "--pickscore-num-gpus-per-worker": MilesFlag(1, "a reward model runs on its process's GPU (--reward-device)"),
    # Refused: no diffrl setting means the same.
    "--rollout-patch-group": MilesFlag(0, "diffrl has no such setting: a rollout's prompt groups go to the engines as "
                                          "microgroups of --rollout-microgroup-size samples", refuse=True),
}
# Flags several miles flags decide together (`_combined`), or whose value is read.
_COMBINED = {"--micro-batch-size-sample": 1, "--micro-batch-size-tstep": 1, "--hf-checkpoint": 1,
             "--diffusion-model": 1, "--diffusion-reward": 1, "--rm-type": 1, "--pickscore-model-path": 1,
             "--pickscore-processor-path": 1, "--pickscore-num-workers": 1, "--diffusion-forward-dtype": 1,
             "--diffusion-true-cfg-scale": 1, "--skip-eval-before-train": 0, "--wandb-key": 1,
             "--actor-num-gpus-per-node": 1, "--rollout-num-gpus": 1, "--rollout-num-gpus-per-engine": 1,
             "--num-gpus-per-node": 1, "--extra-args": 1}


@dataclass
class Translation:
    args: list[str] = field(default_factory=list)  # diffrl's arguments
    notes: list[str] = field(default_factory=list)  # one line per miles flag translated

    def mapped(self, miles: str, diffrl: list[str], why: str) -> None:
        self.args += diffrl
        self.notes.append(f"{miles} → {' '.join(diffrl)} ({why})")

    def noop(self, miles: str, why: str) -> None:
        self.notes.append(f"{miles}: nothing to set ({why})")


def _refuse(flag: str, why: str) -> ValueError:
    return ValueError(f"{flag} (miles-diffusion): {why}")


def _values(args: list[str], i: int, flag: str, count: int) -> list[str]:
    values = args[i + 1:i + 1 + count]
    flags_inside = flag == "--extra-args"  # its one value is a string of flags
    if len(values) < count or (not flags_inside and any(v.startswith("--") for v in values)):
        raise _refuse(flag, f"expects {count} value{'s' if count > 1 else ''}")
    return values


def translate(args: list[str]) -> Translation:
    """diffrl's arguments for a command line that may hold miles-diffusion's flags (the rest pass through)."""
    out, found = Translation(), {}
    i = 0
    while i < len(args):
        flag, eq, inline = args[i].partition("=")
        reward_colocate = flag.startswith("--") and flag.endswith("-reward-colocate") and flag != "--reward-colocate"
        if flag not in FLAGS and flag not in _COMBINED and not reward_colocate:
            out.args.append(args[i])
            i += 1
            continue
        takes = 0 if reward_colocate else FLAGS[flag].takes if flag in FLAGS else _COMBINED[flag]
        values = [inline] if eq and takes == 1 else _values(args, i, flag, takes)
        i += 1 + (0 if eq else takes)
        if reward_colocate:  # --pickscore-reward-colocate: diffrl moves every model reward off the GPU together
            if "--reward-colocate" not in out.args:
                out.mapped(flag, ["--reward-colocate"], "model rewards leave the GPU while the trainer trains")
            continue
        if flag in FLAGS:
            spec = FLAGS[flag]
            if spec.refuse:
                raise _refuse(flag, spec.note)
            if spec.to is not None:
                out.mapped(f"{flag} {' '.join(values)}".strip(), [spec.to, *values], spec.note)
            elif spec.accept is not None and values[0] not in spec.accept:
                raise _refuse(f"{flag} {values[0]}", f"diffrl accepts {', '.join(spec.accept)} here ({spec.note})")
            else:
                out.noop(f"{flag} {' '.join(values)}".strip(), spec.note)
            continue
        found[flag] = values[0] if values else True
    _combined(found, out)
    if out.notes and _value_of(out.args, "--global-batch-size") is None:
        _global_batch(out)
    return out


def _global_batch(out: Translation) -> None:
    """miles derives the samples per optimizer step from the rollout; diffrl asks for it (and checks the two agree)."""
    prompts, samples = _value_of(out.args, "--rollout-batch-size"), _value_of(out.args, "--n-samples-per-prompt")
    steps = _value_of(out.args, "--num-steps-per-rollout") or "1"
    if prompts is None or samples is None:
        return
    total = int(prompts) * int(samples)
    if total % int(steps):
        raise _refuse("--num-steps-per-rollout", f"{steps} does not divide the rollout's {total} samples")
    out.mapped(f"(rollout {prompts} × {samples} ÷ {steps} steps)", ["--global-batch-size", str(total // int(steps))],
               "samples per optimizer step, which miles derives and diffrl takes as a flag")


def _combined(found: dict, out: Translation) -> None:
    get = found.get
    if "--extra-args" in found:  # miles' catch-all: its words are read as flags too
        extra = translate(shlex.split(found["--extra-args"]))
        out.args += extra.args
        out.notes += extra.notes
    model = get("--hf-checkpoint") or get("--diffusion-model")
    if get("--hf-checkpoint") and get("--diffusion-model") and get("--hf-checkpoint") != get("--diffusion-model"):
        raise _refuse("--diffusion-model", f"{get('--diffusion-model')} differs from --hf-checkpoint "
                                           f"{get('--hf-checkpoint')}: diffrl's engines sample the model it trains")
    if model:
        out.mapped("--hf-checkpoint" if get("--hf-checkpoint") else "--diffusion-model", ["--model-path", model],
                   "a local diffusers-format directory; diffrl downloads nothing")
    if get("--hf-checkpoint") and get("--diffusion-model"):
        out.noop(f"--diffusion-model {model}", "the checkpoint of --hf-checkpoint: diffrl's engines sample the model "
                                               "it trains")
    if "--micro-batch-size-sample" in found or "--micro-batch-size-tstep" in found:
        sample = int(get("--micro-batch-size-sample") or 1)
        tstep = int(get("--micro-batch-size-tstep") or 1)
        out.mapped(f"--micro-batch-size-sample {sample} --micro-batch-size-tstep {tstep}",
                   ["--micro-batch-size", str(sample * tstep)],
                   "train pairs per forward: samples × SDE steps")
    dtype = get("--diffusion-forward-dtype")
    if dtype is not None:
        precision = {"bf16": "bf16", "bfloat16": "bf16", "fp32": "no", "float32": "no"}.get(dtype)
        if precision is None:
            raise _refuse(f"--diffusion-forward-dtype {dtype}", "diffrl's forward runs in bf16 or fp32")
        out.mapped(f"--diffusion-forward-dtype {dtype}", ["--mixed-precision", precision], "the transformer's forward")
    if "--diffusion-reward" in found:
        given = " ".join(f"{f} {found[f]}" for f in ("--diffusion-reward", "--pickscore-model-path",
                                                     "--pickscore-processor-path") if f in found)
        out.mapped(given, ["--reward", _reward_spec(found)], "diffrl's reward spec")
        if "--rm-type" in found:
            out.noop(f"--rm-type {get('--rm-type')}", "the reward --diffusion-reward names")
    elif "--rm-type" in found:
        out.mapped(f"--rm-type {get('--rm-type')}", ["--reward", _reward_spec({"--diffusion-reward": get('--rm-type'),
                                                                               **found})], "diffrl's reward spec")
    workers = get("--pickscore-num-workers")
    if workers is not None:
        if int(workers) > 1:
            out.mapped(f"--pickscore-num-workers {workers}", ["--reward-workers", workers], "reward scoring processes")
        else:
            out.noop(f"--pickscore-num-workers {workers}", "one scorer: diffrl scores in the trainer's process")
    true_cfg = get("--diffusion-true-cfg-scale")
    if true_cfg is not None:
        guidance = _value_of(out.args, "--diffusion-guidance-scale")
        if guidance is None:
            out.mapped(f"--diffusion-true-cfg-scale {true_cfg}", ["--diffusion-guidance-scale", true_cfg],
                       "the CFG scale, true CFG on the families that have it")
        elif float(guidance) != float(true_cfg):
            raise _refuse(f"--diffusion-true-cfg-scale {true_cfg}", f"differs from --diffusion-guidance-scale {guidance}"
                          "; diffrl trains with one CFG scale (--diffusion-guidance-scale)")
        else:
            out.noop(f"--diffusion-true-cfg-scale {true_cfg}", "the same as --diffusion-guidance-scale")
    if get("--skip-eval-before-train"):
        out.mapped("--skip-eval-before-train", ["--no-eval-before-train"], "no held-out evaluation before training")
    if "--wandb-key" in found:
        if get("--wandb-key") != os.environ.get("WANDB_API_KEY"):
            raise _refuse("--wandb-key", "diffrl takes no key on the command line: set WANDB_API_KEY or run `wandb "
                                         "login`")
        out.noop("--wandb-key", "the same key as WANDB_API_KEY, which diffrl reads")
    _layout(found, out)


def _value_of(args: list[str], flag: str) -> str | None:
    """The flag's last value on the command line (the one that counts), or None."""
    value = None
    for i, arg in enumerate(args):
        if arg == flag and i + 1 < len(args):
            value = args[i + 1]
        elif arg.startswith(flag + "="):
            value = arg.split("=", 1)[1]
    return value


def _reward_spec(found: dict) -> str:
    """miles' `--diffusion-reward NAME:W[,NAME:W…]` (with `--pickscore-model-path`/`--pickscore-processor-path`) as
    diffrl's `--reward` spec: one reward alone, several as `multi:NAME=W,…`."""
    parts = []
    for entry in str(found["--diffusion-reward"]).split(","):
        name, _, weight = entry.strip().partition(":")
        if name == "pickscore" and found.get("--pickscore-model-path"):
            name = f"pickscore@{found['--pickscore-model-path']}"
            if found.get("--pickscore-processor-path"):
                name += f",processor={found['--pickscore-processor-path']}"
        parts.append((name, weight or "1"))
    rm_type = found.get("--rm-type")
    names = [p[0].partition("@")[0] for p in parts]
    if rm_type and rm_type not in names:
        raise _refuse(f"--rm-type {rm_type}", f"names no reward of --diffusion-reward {found['--diffusion-reward']}")
    if len(parts) == 1 and float(parts[0][1]) == 1.0:
        return parts[0][0]
    return "multi:" + ",".join(f"{name}={weight}" for name, weight in parts)


def _layout(found: dict, out: Translation) -> None:
    """miles' GPU layout flags. One GPU (or a torchrun world of the trainer's size) is diffrl's own layout."""
    flags = ("--actor-num-gpus-per-node", "--rollout-num-gpus", "--rollout-num-gpus-per-engine", "--num-gpus-per-node")
    given = {f: int(found[f]) for f in flags if f in found}
    if not given:
        return
    trainers = given.get("--actor-num-gpus-per-node", 1)
    world = int(os.environ.get("WORLD_SIZE", "1"))
    line = " ".join(f"{f} {v}" for f, v in given.items())
    if max(given.values()) <= 1 or trainers == world:
        out.noop(line, f"{world} trainer process{'es' if world > 1 else ''}, each rolling out on its own GPU's engine")
        if world > 1 and "--colocate" in out.args:  # under torchrun each rank's engine is in its process already
            out.args.remove("--colocate")
            out.noop("--colocate", "under torchrun each rank's engine shares its process and GPU")
            size = _value_of(out.args, "--update-weight-buffer-size")
            if size is not None:  # no engine process to send weight buckets to
                i = out.args.index("--update-weight-buffer-size")
                del out.args[i:i + 2]
                out.noop(f"--update-weight-buffer-size {size}", "each rank's engine reads the weights it trains")
        return
    raise _refuse(line.split(" ")[0], f"a layout of {trainers} trainer GPUs: launch it as `torchrun --nproc-per-node "
                  f"{trainers} -m diffrl.cli.main train …` (each rank trains its shard and rolls out on its own "
                  "GPU), or on one GPU drop the layout flags")
