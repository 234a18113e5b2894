"""A Flow-Factory run file (its YAML), translated into `diffrl train`'s flags (docs/coming-from-flow-factory.md).

`diffrl train --flow-factory-config FILE.yaml [diffrl flags …]` reads the file's sections (launch keys at the top,
`data`, `model`, `log`, `train`, `scheduler`, `eval`, `rewards`, `eval_rewards`) and turns each key into the diffrl
flags that mean the same; flags given after it win. Like the miles-diffusion translation (`miles_flags.py`), every key
is translated, accepted as a no-op with the reason printed once, or refused in one line saying what to do instead;
a key it does not know is refused by name rather than dropped. Rewards name models by their hub names there and by
local folders here, so a file with `rewards` needs `--reward` beside it.

`translate_file(path)` returns diffrl's arguments, the start-up notes and whether the file names rewards.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

TRAINERS = {"grpo": "flow_grpo", "grpo-guard": "grpo_guard", "grpo_guard": "grpo_guard", "nft": "nft", "awm": "awm",
            "dpo": "dpo", "dgpo": "dgpo", "crd": "crd"}
DYNAMICS = {"Flow-SDE": "sde", "Dance-SDE": "dance", "CPS": "cps"}
TIME_SAMPLING = {"discrete": "schedule", "discrete_with_init": "schedule_with_first",
                 "discrete_wo_init": "schedule_without_first", "uniform": "uniform", "logit_normal": "logit_normal"}
# Keys that are diffrl flags under another name, their value unchanged.
RENAMED = {
    "model.lora_rank": "--lora-rank", "model.lora_alpha": "--lora-alpha", "log.project": "--wandb-project",
    "log.run_name": "--wandb-run-name", "log.save_dir": "--output-dir",
    "train.advantage_aggregation": "--advantage-aggregation", "train.clip_range": "--diffusion-clip-range",
    "train.kl_type": "--kl-type", "train.kl_beta": "--diffusion-kl-beta",
    "train.num_inference_steps": "--diffusion-num-steps", "train.guidance_scale": "--diffusion-guidance-scale",
    "train.guidance_scale_2": "--diffusion-guidance-scale-2", "train.num_frames": "--num-frames",
    "train.per_device_batch_size": "--micro-batch-size", "train.group_size": "--n-samples-per-prompt",
    "eval.per_device_batch_size": "--eval-batch-size",
    "train.unique_sample_num_per_epoch": "--rollout-batch-size",
    "train.gradient_step_per_epoch": "--num-steps-per-rollout", "train.learning_rate": "--lr",
    "train.adam_weight_decay": "--weight-decay", "train.max_grad_norm": "--grad-clip", "train.seed": "--seed",
    "train.nft_beta": "--diffusion-nft-beta", "train.dpo_beta": "--dpo-beta",
    "scheduler.noise_level": "--diffusion-noise-level", "scheduler.num_sde_steps": "--diffusion-num-sde-steps",
    "scheduler.seed": "--rollout-seed", "scheduler.flow_shift": "--flow-shift", "eval.num_frames": "--eval-num-frames",
    "eval.num_inference_steps": "--eval-num-steps", "eval.guidance_scale": "--eval-guidance-scale",
    "eval.guidance_scale_2": "--eval-guidance-scale-2",
}
# Keys whose value diffrl has no use for: what it does instead.
IGNORED = {
    "main_process_port": "torchrun picks its own rendezvous", "data.preprocessing_batch_size": "prompts are "
    "encoded by the engine, once per request", "data.dataloader_num_workers": "prompts are read once, in order",
    "data.force_reprocess": "nothing is cached to disk", "data.cache_dir": "nothing is cached to disk",
    "data.sampler_type": "each rollout draws whole prompt groups", "log.save_model_only": "a checkpoint holds the "
    "model and the training state (--keep-last-checkpoints bounds them)", "train.offload_samples_to_cpu": "rollout "
    "samples keep only the trained steps' latents", "eval.seed": "held-out seeds are fixed (10000 + k)",
    "train.gradient_accumulation_steps": "an optimizer "
    "step accumulates its micro-batches (--micro-batch-size)", "model.model_type": "the family is read from the "
    "model folder (--diffusion-model-family names it when not)", "train.ref_param_device": "the reference stays on "
    "the GPU (--offload-reference moves a full finetune's to the host)",
}


# Keys only some methods read: under another --loss-type diffrl refuses their flags, so they are left out, saying so.
READ_BY = {
    ("scheduler.noise_level", "scheduler.num_sde_steps", "scheduler.sde_steps"): ("flow_grpo", "grpo_guard"),
    ("train.clip_range",): ("flow_grpo", "grpo_guard", "awm", "dgpo"),
    ("train.timestep_range", "train.num_train_timesteps", "train.time_sampling_strategy", "train.time_shift"):
        ("nft", "awm", "dpo", "dgpo", "crd"),
}


@dataclass
class Translation:
    args: list[str] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)
    names_rewards: bool = False


def _flatten(tree: dict, prefix: str = "") -> dict:
    flat = {}
    for key, value in tree.items():
        name = f"{prefix}{key}"
        if isinstance(value, dict) and name in ("data", "model", "log", "train", "scheduler", "eval"):
            flat.update(_flatten(value, f"{name}."))
        else:
            flat[name] = value
    return flat


def _size(value, flags: tuple[str, str, str]) -> list[str]:
    square, height, width = flags
    if isinstance(value, (list, tuple)) and len(value) == 2:
        return [height, str(value[0]), width, str(value[1])]
    return [square, str(value)]


def _condition_side(value) -> tuple[int, bool]:
    """Flow-Factory's `condition_image_size` (a side, or [height, width]: a largest area) as diffrl's
    --condition-image-size, the side of a square of that area; and whether that area is exact."""
    if isinstance(value, (list, tuple)) and len(value) == 2:
        area = int(value[0]) * int(value[1])
        side = round(area ** 0.5)
        return side, side * side == area
    return int(value), True


_OLD_POLICY_KEYS = ("train.off_policy", "train.ema_decay", "train.ema_decay_schedule", "train.flat_steps",
                    "train.ramp_rate", "train.ema_update_interval", "train.ema_device")


def _old_policy(flat: dict, path: Path, add) -> set[str]:
    """An NFT file's EMA: with `off_policy` it is DiffusionNFT's old policy (a piecewise-linear decay: flat, ramp,
    `ema_decay` as its maximum), diffrl's --nft-ema-* flags; without it NFT samples the current weights, which
    diffrl's old policy does at decay 0, and the EMA keys are the evaluation EMA's. The keys translated here."""
    if flat.get("train.trainer_type") != "nft":
        return set()
    if not flat.get("train.off_policy"):
        add("train.off_policy", "--nft-ema-max", "0", note="--nft-ema-max 0 (false: rollouts from the current "
                                                           "weights, diffrl's old policy at decay 0)")
        return {"train.off_policy"}
    schedule = flat.get("train.ema_decay_schedule", "power")
    if schedule != "piecewise_linear" or (flat.get("train.ema_update_interval") or 1) != 1:
        raise ValueError(f"{path}: an NFT old policy of ema_decay_schedule {schedule!r} updated every "
                         f"{flat.get('train.ema_update_interval') or 1} epochs: diffrl's is piecewise linear, updated "
                         "every rollout (--nft-ema-flat, --nft-ema-ramp, --nft-ema-max)")
    args = ["--nft-ema-max", str(flat.get("train.ema_decay", 0.5))]
    if flat.get("train.flat_steps") is not None:
        args += ["--nft-ema-flat", str(flat["train.flat_steps"])]
    if flat.get("train.ramp_rate") is not None:
        args += ["--nft-ema-ramp", str(flat["train.ramp_rate"])]
    add("train.off_policy", *args, note=f"{' '.join(args)} (the EMA that samples is DiffusionNFT's old policy)")
    return {k for k in _OLD_POLICY_KEYS if k in flat}


_DGPO_KEYS = ("train.clip_dsm", "train.clip_kl", "train.use_ema_ref", "train.switch_ema_ref", "train.ema_ref_max_decay",
              "train.ema_ref_ramp_rate", "train.ema_ref_device", "train.use_shared_noise", "train.kl_cfg")
# CRD's snapshot schedules by preset name or number: (start step, start value, slope, end value).
_CRD_DECAY_PRESETS = {"none": (0, 0.0, 0.0, 0.0), "slow": (0, 0.0, 0.001, 0.5), "medium": (75, 0.0, 0.0075, 0.999),
                      "offline": (0, 1.0, 0.0, 1.0), "fast": (0, 0.0, 0.02, 0.99), "moderate": (0, 0.0, 0.01, 0.5),
                      "6": (0, 0.0, 0.0075, 0.999)}
for _number, _name in enumerate(("none", "slow", "medium", "offline", "fast", "moderate")):
    _CRD_DECAY_PRESETS[str(_number)] = _CRD_DECAY_PRESETS[_name]
_CRD_KEYS = ("train.crd_beta", "train.crd_loss_type", "train.old_model_decay", "train.sampling_model_decay",
             "train.reward_adaptive_kl", "train.use_old_for_loss", "train.adaptive_logp", "train.weight_temp",
             "train.kl_cfg")


def _crd_decay(key: str, value, path: Path) -> list[str]:
    """A CRD schedule, "start-value-slope-end" or a preset, as the four numbers of --crd-*-decay."""
    text = str(value)
    if text in _CRD_DECAY_PRESETS:
        return [f"{v:g}" for v in _CRD_DECAY_PRESETS[text]]
    parts = text.split("-")
    if len(parts) == 4:
        try:
            return [f"{float(v):g}" for v in parts]
        except ValueError:
            pass
    raise ValueError(f"{path}: {key} {value!r}: expected 'start_step-start_value-slope-end_value' or one of "
                     f"{', '.join(_CRD_DECAY_PRESETS)}")


def _method_options(flat: dict, path: Path, add) -> set[str]:
    """DGPO's and CRD's own keys, read together: DGPO's defaults differ from diffrl's (its reference code clips the
    error against an old policy unless told not to), and a value diffrl does not implement stops the run. The keys
    translated here."""
    method = flat.get("train.trainer_type")
    kl_cfg = flat.get("train.kl_cfg")
    if method in ("dgpo", "crd") and kl_cfg is not None and float(kl_cfg) != 1.0:
        add("train.kl_cfg", "--kl-cfg", str(kl_cfg))  # a guided reference
    if method == "dgpo":
        if not flat.get("train.use_shared_noise", True):
            raise ValueError(f"{path}: train.use_shared_noise false: diffrl's DGPO re-noises a group with one ε")
        options = {"--dgpo-clip-dsm": flat.get("train.clip_dsm", True), "--dgpo-clip-kl": flat.get("train.clip_kl"),
                   "--dgpo-use-ema-ref": flat.get("train.use_ema_ref")}
        args = [flag for flag, on in options.items() if on]
        if args:  # the old policy exists
            args += ["--dgpo-switch-ema-ref", str(flat.get("train.switch_ema_ref", 200))]
            for key, flag in (("train.ema_ref_max_decay", "--dgpo-ema-ref-max-decay"),
                              ("train.ema_ref_ramp_rate", "--dgpo-ema-ref-ramp-rate")):
                if flat.get(key) is not None:
                    args += [flag, str(flat[key])]
        add("train.trainer_type", *args, note=f"DGPO's options: {' '.join(args) or 'no old policy'} (Flow-Factory's "
                                              "defaults for keys not given)")
        return {k for k in _DGPO_KEYS if k in flat}
    if method == "awm":
        from diffrl.algorithms.losses import AWM_WEIGHTINGS  # deferred: torch, which `train --help` does without

        args = []
        if flat.get("train.awm_weighting") is not None:
            weighting = str(flat["train.awm_weighting"]).lower()
            if weighting not in AWM_WEIGHTINGS:
                raise ValueError(f"{path}: train.awm_weighting {flat['train.awm_weighting']!r}: diffrl's are "
                                 f"{', '.join(AWM_WEIGHTINGS)}")
            args += ["--awm-weighting", weighting]
        if flat.get("train.ghuber_power") is not None:
            args += ["--awm-ghuber-power", str(flat["train.ghuber_power"])]
        if flat.get("train.ema_kl_beta"):  # a KL to the EMA, which is also the one evaluation uses
            args += ["--awm-ema-kl-beta", str(flat["train.ema_kl_beta"])]
            if flat.get("train.ema_decay") is not None:
                args += ["--awm-ema-decay", str(flat["train.ema_decay"])]
            schedule = flat.get("train.ema_decay_schedule", "power")  # Flow-Factory's default
            if schedule not in ("constant", "linear", "power"):
                raise ValueError(f"{path}: an AWM EMA of ema_decay_schedule {schedule!r}: diffrl's KL anchor decays "
                                 "constant, linear or power (--awm-ema-schedule)")
            args += ["--awm-ema-schedule", schedule]
            if schedule != "constant":  # in rollouts: its EMA steps once per epoch
                args += ["--awm-ema-warmup", str(int(flat.get("train.warmup_steps") or 10))]
        if flat.get("train.kl_weight") not in (None, "Uniform", "uniform"):
            raise ValueError(f"{path}: train.kl_weight {flat['train.kl_weight']!r}: the KL is weighted uniformly")
        add("train.trainer_type", *args, note=f"AWM's options: {' '.join(args) or 'diffrl defaults'} (the KL anchor "
                                              "steps once per rollout, as Flow-Factory's EMA once per epoch)")
        anchor = ("train.warmup_steps", "train.ema_decay_schedule") if flat.get("train.ema_kl_beta") else ()
        return {k for k in ("train.awm_weighting", "train.ghuber_power", "train.ema_kl_beta", "train.kl_weight",
                            *anchor) if k in flat}
    if method == "dpo":
        scheme = flat.get("train.weighting_scheme", "logit_normal")  # Flow-Factory's DPO defaults
        if scheme not in ("logit_normal", "uniform"):
            raise ValueError(f"{path}: train.weighting_scheme {scheme!r}: diffrl's are logit_normal and uniform")
        if (float(flat.get("train.logit_mean", 0.0)), float(flat.get("train.logit_std", 1.0))) != (0.0, 1.0):
            raise ValueError(f"{path}: train.logit_mean / logit_std {flat.get('train.logit_mean')} / "
                             f"{flat.get('train.logit_std')}: diffrl's logit-normal timesteps are the standard one's")
        args = ["--train-timestep-sampling", scheme, "--train-timestep-shift", str(flat.get("train.time_shift", 1.0))]
        if flat.get("train.num_train_timesteps") is None:
            args += ["--train-timesteps", "1"]
        if flat.get("train.beta") is not None:
            args += ["--dpo-beta", str(flat["train.beta"])]
        add("train.trainer_type", *args, note=f"DPO's options: {' '.join(args)} (Flow-Factory's defaults for keys not "
                                              "given)")
        return {k for k in ("train.beta", "train.weighting_scheme", "train.logit_mean", "train.logit_std",
                            "train.time_shift") if k in flat}
    if method == "crd":
        for key, wanted, what in (("train.use_old_for_loss", True, "the implicit reward against the old snapshot"),
                                  ("train.adaptive_logp", True, "adaptively weighted errors")):
            if flat.get(key, wanted) != wanted:
                raise ValueError(f"{path}: {key} {flat[key]}: diffrl's CRD always uses {what}")
        if float(flat.get("train.weight_temp", -1.0)) >= 0:
            raise ValueError(f"{path}: train.weight_temp {flat['train.weight_temp']}: diffrl's CRD centers each group "
                             "by its plain mean (weight_temp < 0)")
        args = []
        for key, flag in (("train.crd_beta", "--crd-beta"), ("train.crd_loss_type", "--crd-loss")):
            if flat.get(key) is not None:
                args += [flag, str(flat[key])]
        for key, flag in (("train.old_model_decay", "--crd-old-decay"),
                          ("train.sampling_model_decay", "--crd-sampling-decay")):
            if flat.get(key) is not None:
                args += [flag, *_crd_decay(key, flat[key], path)]
        if flat.get("train.reward_adaptive_kl") is not None:
            args.append("--crd-reward-adaptive-kl" if flat["train.reward_adaptive_kl"] else "--no-crd-reward-adaptive-kl")
        add("train.trainer_type", *args, note=f"CRD's options: {' '.join(args) or 'diffrl defaults'}")
        return {k for k in _CRD_KEYS if k in flat}
    return set()


# LTX-2's guidance and rate keys, in training and evaluation: the values diffrl's ltx2 adapter samples with (its
# pipeline's spatio-temporal guidance, modality isolation and guidance rescale off; the checkpoint's 24 fps; an audio
# setting left unset follows the video one); another value stops the run.
_LTX2_AS_IS = {"stg_scale": 0.0, "modality_scale": 1.0, "guidance_rescale": 0.0, "frame_rate": 24.0,
               "audio_guidance_scale": None, "audio_stg_scale": None, "audio_modality_scale": None,
               "audio_guidance_rescale": None}


def _ltx2_keys(flat: dict, path: Path, add) -> set[str]:
    """LTX-2 files' own keys: accepted with a note where their value is what the ltx2 adapter does, else refused."""
    keys = set()
    if str(flat.get("model.model_type", "")).endswith(("t2av", "i2av")):
        add("model.model_type", note="the family is read from the model folder; diffrl's ltx2 denoises the audio with "
                                     "the video but returns the video alone, so rewards score video (audio rewards "
                                     "have nothing to score)")
        keys.add("model.model_type")
    for section in ("train", "eval"):
        for name, value in _LTX2_AS_IS.items():
            key = f"{section}.{name}"
            if key not in flat:
                continue
            given = flat[key]
            if (given is None) != (value is None) or (value is not None and float(given) != value):
                raise ValueError(f"{path}: {key} {given}: diffrl's ltx2 samples with {name} "
                                 f"{'unset (the video setting)' if value is None else value}")
            add(key, note="what diffrl's ltx2 samples with")
            keys.add(key)
        key = f"{section}.prompt_enhancement_seed"
        if key in flat:
            add(key, note="not needed: diffrl encodes the prompt as given (no prompt enhancement)")
            keys.add(key)
    return keys


def translate_file(path: str | Path) -> Translation:
    import yaml  # a dependency of the config loader already (`--config FILE.yaml`)

    path = Path(path)
    try:
        tree = yaml.safe_load(path.read_text(encoding="utf-8")) or {}
    except OSError as err:
        raise ValueError(f"--flow-factory-config {path}: {err.strerror or err}") from None
    except yaml.YAMLError as err:
        raise ValueError(f"--flow-factory-config {path}: not valid YAML ({err})") from None
    if not isinstance(tree, dict):
        raise ValueError(f"--flow-factory-config {path}: expected a mapping of sections, got {type(tree).__name__}")
    flat, out = _flatten(tree), Translation()
    unknown = []

    def add(key: str, *args: str, note: str | None = None) -> None:
        out.args.extend(args)
        out.notes.append(f"{key}: {note}" if note else f"{key} → {' '.join(args)}")

    steps_per_rollout = flat.get("train.gradient_step_per_epoch") or 1
    old_policy = _old_policy(flat, path, add)  # the EMA keys when they are NFT's old policy, already translated
    old_policy |= _method_options(flat, path, add)  # DGPO's and CRD's own keys, likewise
    old_policy |= _ltx2_keys(flat, path, add)
    loss_type = TRAINERS.get(flat.get("train.trainer_type", "grpo"), "flow_grpo")
    for key, value in flat.items():
        if value is None or key in old_policy:
            continue  # Flow-Factory's "unset": diffrl's default
        readers = next((methods for keys, methods in READ_BY.items() if key in keys), None)
        if readers is not None and loss_type not in readers:
            add(key, note=f"not read by --loss-type {loss_type}")
            continue
        if key in ("log.project", "log.run_name") and flat.get("log.logging_backend") == "swanlab":
            add(key, "--swanlab-project" if key == "log.project" else "--swanlab-run-name", str(value))
        elif key == "train.dpo_beta" and loss_type == "dgpo":
            add(key, "--dgpo-beta", str(value))  # one key for both methods' β
        elif key in RENAMED:
            add(key, RENAMED[key], str(value))
        elif key in IGNORED:
            add(key, note=f"not needed: {IGNORED[key]}")
        elif key in ("launcher", "num_processes", "config_file"):
            add(key, note="run several GPUs as `torchrun --nproc-per-node N -m diffrl.cli.main train …` (FSDP2)")
        elif key == "mixed_precision":
            if value not in ("bf16", "no"):
                raise ValueError(f"{path}: mixed_precision {value!r}: diffrl runs bf16 or no (fp32)")
            add(key, "--mixed-precision", value)
        elif key == "data.dataset_dir":
            folder = Path(value).expanduser()
            train, test = folder / "train.jsonl", folder / "test.jsonl"
            add(key, "--prompt-data", str(train if train.is_file() else folder),
                *(["--eval-prompt-data", str(test)] if train.is_file() and test.is_file() else []))
        elif key == "data.max_dataset_size":
            add(key, "--train-num-prompts", str(value), "--eval-num-prompts", str(value))
        elif key == "model.finetune_type":
            add(key, "--use-lora" if value == "lora" else "--no-use-lora")
        elif key == "model.target_modules":
            if value == "default":
                add(key, note="the family's own targets, diffrl's default too")
            elif isinstance(value, str) and value.endswith(".default"):
                component = value.removesuffix(".default")  # the family's own targets, on that component alone
                add(key, "--lora-components", component)
            elif isinstance(value, list):
                add(key, "--lora-target-modules", *map(str, value))
            else:
                raise ValueError(f"{path}: model.target_modules {value!r}: name the modules (a list), or 'default'")
        elif key == "model.target_components" and str(flat.get("model.target_modules", "")).endswith(".default"):
            add(key, note="the components sharded together; the adapter goes where target_modules names")
        elif key == "model.target_components":
            add(key, "--lora-components", *([value] if isinstance(value, str) else map(str, value)))
        elif key == "model.model_name_or_path":
            add(key, "--model-path", str(value), note=f"--model-path {value} (a local diffusers folder: diffrl "
                                                      "downloads nothing)")
        elif key == "model.resume_path":
            kind = flat.get("model.resume_type")
            if kind == "state":
                raise ValueError(f"{path}: model.resume_type state continues a Flow-Factory run; a diffrl run "
                                 "continues its own folder with --resume")
            add(key, "--init-from", str(value))
        elif key == "model.resume_type":
            continue  # read with resume_path
        elif key == "log.logging_backend":
            tracked = {"wandb": ["--use-wandb"], "swanlab": ["--use-swanlab"]}.get(value, [])
            add(key, *tracked, note=None if tracked else "TensorBoard files are always written")
        elif key == "log.save_freq":
            add(key, "--checkpoint-interval", str(value if value > 0 else 10**9))
        elif key == "train.trainer_type":
            if value not in TRAINERS:
                raise ValueError(f"{path}: train.trainer_type {value!r}: diffrl's methods are "
                                 f"{', '.join(sorted(TRAINERS))} (docs/algorithms.md)")
            add(key, "--loss-type", TRAINERS[value])
        elif key == "train.adv_clip_range":
            bound = value
            if isinstance(value, (list, tuple)):
                if len(value) != 2 or value[0] != -value[1]:
                    raise ValueError(f"{path}: train.adv_clip_range {value}: diffrl clips advantages symmetrically")
                bound = value[1]
            add(key, "--diffusion-adv-clip-max", str(bound))
        elif key == "train.resolution":
            add(key, *_size(value, ("--resolution", "--height", "--width")))
        elif key in ("train.condition_image_size", "eval.condition_image_size"):
            side, exact = _condition_side(value)
            flag = "--condition-image-size" if key.startswith("train.") else "--eval-condition-image-size"
            add(key, flag, str(side), note=None if exact else f"{flag} {side} (the side of the area {value} holds)")
        elif key == "train.global_std":
            add(key, "--globalize-reward-std" if value else "--no-globalize-reward-std")
        elif key == "train.adam_betas":
            add(key, "--adam-beta1", str(value[0]), "--adam-beta2", str(value[1]))
        elif key == "train.adam_epsilon":
            if float(value) != 1e-8:
                raise ValueError(f"{path}: train.adam_epsilon {value}: diffrl's AdamW keeps torch's 1e-8")
            add(key, note="torch's default, 1e-8, as diffrl's")
        elif key == "train.ema_decay":
            add(key, *(["--use-ema", "--ema-decay", str(value)] if value > 0 else []),
                note=None if value > 0 else "0: no EMA")
        elif key == "train.ema_update_interval":
            if flat.get("train.ema_decay"):
                add(key, "--ema-update-interval", str(int(value) * int(steps_per_rollout)),
                    note=f"--ema-update-interval {int(value) * int(steps_per_rollout)} (optimizer steps: {value} "
                         f"rollouts of {steps_per_rollout})")
        elif key in ("train.ema_device", "train.ema_decay_schedule"):
            add(key, note="not expressed: the EMA lives on the GPU, its decay constant (--ema-warmup adds diffusers' "
                          "warm-up, counted in updates)")
        elif key == "train.enable_gradient_checkpointing":
            add(key, "--gradient-checkpointing" if value else "--no-gradient-checkpointing")
        elif key == "train.timestep_range":
            start, end = (value if isinstance(value, (list, tuple)) else (0.0, value))
            add(key, "--train-timestep-range", str(start), str(end))
        elif key == "train.num_train_timesteps":
            if value:
                add(key, "--train-timesteps", str(value))
        elif key == "train.time_sampling_strategy":
            if value not in TIME_SAMPLING:
                raise ValueError(f"{path}: train.time_sampling_strategy {value!r}: diffrl draws "
                                 f"{', '.join(TIME_SAMPLING)}")
            add(key, "--train-timestep-sampling", TIME_SAMPLING[value])
        elif key == "train.time_shift":
            if not flat.get("train.time_sampling_strategy", "discrete").startswith("discrete"):
                add(key, "--train-timestep-shift", str(value))
            else:
                add(key, note="used by continuous sampling only")
        elif key == "scheduler.dynamics_type":
            if value == "ODE":
                add(key, note="ODE rollouts come with the method (nft, awm, dpo, dgpo, crd)")
            elif value in DYNAMICS:
                add(key, "--diffusion-sde-type", DYNAMICS[value])
            else:
                raise ValueError(f"{path}: scheduler.dynamics_type {value!r}: diffrl's are "
                                 f"{', '.join([*DYNAMICS, 'ODE'])}")
        elif key == "scheduler.sde_steps":
            steps = sorted(int(s) for s in value)
            add(key, "--diffusion-sde-window-range", f"{steps[0]},{steps[-1] + 1}",
                "--diffusion-sde-step-strategy", "random")
        elif key == "eval.resolution":
            add(key, *_size(value, ("--eval-resolution", "--eval-height", "--eval-width")))
        elif key == "eval.eval_freq":
            add(key, *(["--eval-interval", str(value)] if value > 0 else ["--eval-num-prompts", "0"]))
        elif key == "train.num_inner_epochs":
            if value != 1:
                raise ValueError(f"{path}: train.num_inner_epochs {value}: diffrl passes over a rollout's pairs once "
                                 "(--num-steps-per-rollout sets its optimizer steps)")
            add(key, note="one pass over a rollout's pairs, as diffrl's")
        elif key == "model.master_weight_dtype":
            if str(value) not in ("fp32", "float32"):
                raise ValueError(f"{path}: model.master_weight_dtype {value}: diffrl keeps fp32 masters")
            add(key, note="diffrl keeps the trained weights in fp32")
        elif key in ("train.auto_resize", "eval.auto_resize"):
            add(key, note="the engine takes a source at its own size: resize the sources beforehand")
        elif key == "data.enable_preprocess":
            add(key, note="not needed: prompts are encoded by the engine, once per request")
        elif key in ("train.strength", "eval.strength"):
            raise ValueError(f"{path}: {key} {value}: video-to-video (sampling from a noised input video) is not a mode "
                             "diffrl has; its Wan models take text, or a first frame (image to video)")
        elif key == "train.off_policy" and not value:
            add(key, note="rollouts from the current weights, as diffrl's")
        elif key == "train.off_policy":
            raise ValueError(f"{path}: train.off_policy with --loss-type "
                             f"{TRAINERS.get(flat.get('train.trainer_type'), '?')}: diffrl samples the current weights "
                             "there (DiffusionNFT's old policy: --loss-type nft)")
        elif key in ("rewards", "eval_rewards"):
            out.names_rewards = out.names_rewards or key == "rewards"
            names = ", ".join(str(r.get("reward_model", r.get("name"))) for r in value if isinstance(r, dict))
            flag = "--reward" if key == "rewards" else "--eval-reward"
            add(key, note=f"{names}: pass {flag} with local models (e.g. multi:pickscore@DIR=1,clipscore@DIR=0.5; "
                          "docs/rewards.md)")
        else:
            unknown.append(key)
    if unknown:
        raise ValueError(f"{path}: no diffrl setting for {', '.join(unknown)} (docs/coming-from-flow-factory.md); "
                         "remove the key or set the diffrl flag yourself")
    samples = flat.get("train.unique_sample_num_per_epoch"), flat.get("train.group_size")
    if all(samples):
        total = samples[0] * samples[1]
        out.args += ["--global-batch-size", str(total // int(steps_per_rollout))]
    return out
