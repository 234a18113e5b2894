"""Entry point: `diffrl <subcommand> [--flags]`; every flag is a field of a typed config.

`diffrl train --recipe NAME [--flags]` loads the recipe's values as defaults, then applies the flags.
"""

from __future__ import annotations

import dataclasses
import importlib
import inspect
import json
import os
import sys
from pathlib import Path

from diffrl.cli.flow_factory_config import translate_file
from diffrl.cli.miles_flags import translate
from diffrl.errors import AnotherFamilysCheckpoint, EngineUnavailable, ModelLoadError, RewardUnavailable

# The subcommands' modules (torch, diffusers, …) load only when a subcommand runs: `diffrl --help`,
# `diffrl recipes` and `diffrl rewards` answer without them.
SUBCOMMAND_SUMMARIES = {
    "train": "RL post-training of a model (a recipe, a --config file or flags); writes a run folder",
    "pretrain": "flow-matching fine-tuning (SFT) of the demo model on rendered shapes scenes (--world ocr: text renders; shapes-edit: edits)",
    "evaluate": "held-out evaluation of a run folder, a checkpoint or a model (shapes accuracy or a reward)",
    "compare": "a trained run against its base model on the same images, with standard errors and a verdict",
    "serve": "an HTTP engine (sglang-compatible rollout API) for a model or a trained --checkpoint",
    "bench": "what a rollout costs on this machine for a checkpoint (transformer, VAE, engine), before a run",
    "bench-train": "what the training loop costs: a few rollouts of train's own flags, timed per sample",
    "recipes": "list the training recipes (diffrl train --recipe NAME)",
    "rewards": "list the rewards (diffrl train --reward SPEC)",
}

TRAIN_DESCRIPTION = """Train a flow-matching model with RL (GRPO-style or DiffusionNFT-style objectives).

Defaults come from, in order: the built-in defaults, --recipe NAME (`diffrl recipes` lists them), --config FILE (a
run's config.json, or YAML/JSON of the same tree or flat names), then the flags given. `--resume --output-dir RUN`
continues RUN with its own config.json (flags given still override). --print-config prints the resolved
configuration as JSON (usable as --config) and exits. --flow-factory-config FILE.yaml reads a Flow-Factory run file
as flags placed before the ones given (docs/coming-from-flow-factory.md); miles-diffusion's flags are translated as
they come (docs/coming-from-miles.md)."""



# Each subcommand's flags: the dataclass and its module. Those modules import no torch (nor fastapi), so
# `diffrl SUBCOMMAND --help` parses without it; the modules that run a subcommand load in `run`.
_CONFIGS = {"train": ("diffrl.train.config", "TrainConfig"), "pretrain": ("diffrl.train.pretrain_config", "PretrainConfig"),
            "evaluate": ("diffrl.cli.configs", "EvaluateConfig"), "compare": ("diffrl.cli.configs", "CompareConfig"),
            "serve": ("diffrl.serving.config", "ServeConfig"), "bench": ("diffrl.cli.configs", "BenchConfig"),
            "bench-train": ("diffrl.cli.configs", "BenchTrainConfig")}


def _subcommands(only: str | None = None) -> dict:
    """Each subcommand's flags' dataclass by name; `only` (a subcommand's name): that one's alone, importing only its
    module (deferred, by name: the config modules import tyro and the config tree, which `diffrl --help` need not)."""
    names = [only] if only in _CONFIGS else list(_CONFIGS)
    return {name: getattr(importlib.import_module(_CONFIGS[name][0]), _CONFIGS[name][1]) for name in names}


def quiet_third_party_loading() -> None:
    """No "Loading weights" / "Writing model shards" bars from transformers, diffusers or the hub: a command loads
    several models, and their bars buried its own output."""
    os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")
    from diffusers.utils import logging as diffusers_logging
    from transformers.utils import logging as transformers_logging

    diffusers_logging.disable_progress_bar()
    transformers_logging.disable_progress_bar()


def top_help() -> str:
    width = max(map(len, SUBCOMMAND_SUMMARIES))
    lines = ["usage: diffrl SUBCOMMAND [--flags]   (diffrl SUBCOMMAND --help: its flags)", "",
             "diffrl: RL post-training for flow-matching diffusion models", "", "subcommands:"]
    lines += [f"  {name:<{width}}  {summary}" for name, summary in SUBCOMMAND_SUMMARIES.items()]
    return "\n".join(lines)


def list_recipes() -> str:
    # deferred: the recipes build train configs (the config tree, numpy); `diffrl --help` answers without them
    from diffrl.recipes import RECIPE_SUMMARIES, recipe_names

    names = recipe_names()
    width = max(map(len, names))
    lines = [f"{name:<{width}}  {RECIPE_SUMMARIES.get(name.removesuffix('-gpu'), '')}"
             + (" (the GPU size on any device)" if name.endswith("-gpu") else "") for name in names]
    return "\n".join(["recipes (diffrl train --recipe NAME; flags after it override its values):", *lines])


def list_rewards() -> str:
    from diffrl.rewards import reward_catalogue  # deferred: the rewards load torch

    return reward_catalogue()


def _flag_value(args: list[str], flag: str) -> str | None:
    for i, arg in enumerate(args):
        if arg == flag and i + 1 < len(args):
            return args[i + 1]
        if arg.startswith(flag + "="):
            return arg.split("=", 1)[1]
    return None


def published_spellings(args: list[str]) -> list[str]:
    """Accept the published recipes' spellings: `--diffusion-sde-window-range 3,5` (for `3 5`) and
    `--eval-prompt-data NAME PATH` (a named eval set: the path is kept). miles-diffusion's own flags are
    translated before (`miles_flags.translate`)."""
    out, i = [], 0
    while i < len(args):
        flag, _, inline = args[i].partition("=")
        arg = args[i]
        if flag == "--diffusion-sde-window-range" and ("," in inline or (not inline and i + 1 < len(args)
                                                                         and "," in args[i + 1])):
            value = inline or args[i + 1]
            out += [flag, *value.split(",")]
            i += 1 if inline else 2
            continue
        if (flag == "--eval-prompt-data" and not inline and i + 2 < len(args)
                and not args[i + 1].startswith("--") and not args[i + 2].startswith("--")):
            out += [flag, args[i + 2]]
            i += 3
            continue
        out.append(arg)
        i += 1
    return out


def _size_from_flags(default: TrainConfig, args: list[str]) -> TrainConfig:
    """A size given on the command line in one kind (--resolution, or --height/--width) replaces the recipe's size
    of the other kind, as any flag after --recipe overrides it (both kinds at once stay a contradiction)."""
    square = _flag_value(args, "--resolution") is not None
    sides = _flag_value(args, "--height") is not None or _flag_value(args, "--width") is not None
    if square and not sides:
        return default.replace(height=None, width=None)
    if sides and not square:
        return default.replace(resolution=None)
    return default


# Flags only some objectives read: given on the command line to another, they would be ignored.
# (A recipe's own values for them are left alone: switching a recipe's --loss-type keeps its other settings.)
_SDE = ("flow_grpo", "grpo_guard")
_RENOISED = ("nft", "awm", "dpo", "dgpo", "crd", "sft")  # trained on clean samples re-noised at chosen timesteps


def _only_for() -> tuple:
    # deferred: the config tree; `diffrl --help`, `recipes` and `rewards` answer without it
    from diffrl.train.config import AwmConfig, CrdConfig, DgpoConfig, DpoConfig, GrpoGuardConfig

    return (
        (_SDE, "the SDE steps of Flow-GRPO and its relatives",
         ("--diffusion-sde-window-range", "--diffusion-num-sde-steps", "--diffusion-sde-type", "--diffusion-noise-level",
          "--diffusion-sde-step-strategy", "--diffusion-sde-window-shift-interval", "--diffusion-sde-window-stride")),
        ((*_SDE, "awm", "dgpo"), "the clipped policy ratio", ("--diffusion-clip-range",)),
        (_RENOISED, "the re-noised training timesteps", ("--train-timestep-range", "--train-timesteps",
                                                         "--train-timestep-sampling", "--train-timestep-shift")),
        (("dgpo", "crd"), "the guided KL reference of DGPO and CRD", ("--kl-cfg",)),
        (("nft",), "DiffusionNFT's loss and old policy", ("--diffusion-nft-beta", "--nft-adaptive-weighting",
                                                          "--no-nft-adaptive-weighting", "--nft-ema-ramp", "--nft-ema-max",
                                                          "--nft-ema-flat")),
        *(((name,), f"--loss-type {name}'s own settings", tuple(
            f"--{prefix}{f.name.replace('_', '-')}" for f in dataclasses.fields(section) for prefix in
            ("", "no-") if prefix == "" or f.type in (bool, "bool")))
          for name, section in (("grpo_guard", GrpoGuardConfig), ("awm", AwmConfig), ("dpo", DpoConfig),
                                ("dgpo", DgpoConfig), ("crd", CrdConfig))),
    )


def refuse_other_objectives_flags(args: list[str], loss_type: str) -> None:
    """A ValueError naming the first flag on the command line that only other --loss-type values read."""
    given = [a.partition("=")[0] for a in args if a.startswith("--")]
    for owners, what, flags in _only_for():
        if loss_type not in owners and (flag := next((f for f in given if f in flags), None)):
            raise ValueError(f"{flag} sets {what}; --loss-type {loss_type} does not read it (drop it, or use "
                             f"--loss-type {' or '.join(owners)})")


def flow_factory_args(path: str, rest: list[str]):
    """`--flow-factory-config FILE`: the file's keys as diffrl flags (`flow_factory_config.translate_file`); a file
    naming rewards needs `--reward` among the flags given (its rewards are hub names, diffrl's local folders)."""
    peer = translate_file(path)
    given = {arg.partition("=")[0] for arg in rest}
    if peer.names_rewards and "--reward" not in given:
        raise ValueError(f"--flow-factory-config {path} names its rewards by hub name; pass --reward with local "
                         "models (e.g. --reward pickscore@DIR; docs/rewards.md)")
    return peer


def _take_flag(args: list[str], flag: str, with_value: bool) -> tuple[list[str], str | bool | None]:
    """`args` without `flag` (and its value), and the value (True for a switch; None when absent)."""
    rest, value, i = [], None, 0
    while i < len(args):
        name, eq, inline = args[i].partition("=")
        if name == flag:
            if not with_value:
                value = True
            elif eq:
                value = inline
            elif i + 1 < len(args):
                value, i = args[i + 1], i + 1
            else:
                raise ValueError(f"{flag} needs a value")
            i += 1
            continue
        rest.append(args[i])
        i += 1
    return rest, value


def read_config_file(path: Path) -> dict:
    """The settings of a --config file: JSON (a run's config.json as written) or YAML, the same tree or flat names."""
    path = Path(path)
    try:
        text = path.read_text()
    except OSError as err:
        raise FileNotFoundError(f"--config {path}: {err.strerror}") from None
    if path.suffix.lower() in (".yaml", ".yml"):
        import yaml

        try:
            return yaml.safe_load(text) or {}
        except yaml.YAMLError as err:
            raise ValueError(f"--config {path}: not valid YAML ({str(err).splitlines()[0]})") from None
    try:
        return json.loads(text)
    except ValueError as err:
        raise ValueError(f"--config {path}: not valid JSON ({err}); YAML files end in .yaml or .yml") from None


def cuda_device_seen() -> tuple[bool, str]:
    """Whether this machine looks as if it has a CUDA device, and what says so, without importing torch (about 1.5 s
    of a 2 s `diffrl train --recipe NAME --help`). A guess for the help text alone: the driver's device files can
    exist where torch finds no usable device, so a run asks `torch.cuda.is_available()` instead."""
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    if visible is not None:
        first = visible.split(",")[0].strip()
        # CUDA reads the list up to its first invalid entry: empty, -1 or junk first hides every device
        if not (first.isdigit() or first.startswith(("GPU-", "MIG-"))):
            return False, f"CUDA_VISIBLE_DEVICES={visible!r} hides every device"
    gpus = Path("/proc/driver/nvidia/gpus")
    if gpus.is_dir() and any(gpus.iterdir()):
        return True, f"the NVIDIA driver lists a GPU in {gpus}"
    nodes = sorted(p.name for p in Path("/dev").glob("nvidia[0-9]*"))
    if nodes:
        return True, f"/dev/{nodes[0]} exists"
    return False, "neither /proc/driver/nvidia/gpus nor /dev/nvidia0 exists"


def _asks_for_help(args: list[str]) -> bool:
    return any(arg in ("-h", "--help") for arg in args)


def _recipe_for_help(name: str, device: str, prog: str) -> tuple[TrainConfig, str]:
    """The recipe's values for `--help` without torch, and a note saying which of its sizes they are and how to see
    the other. The run itself sizes the recipe with `recipe_config` (torch's answer for --device auto)."""
    # deferred: the recipes and the config tree (numpy); `diffrl --help`, `recipes` and `rewards` answer without them
    from diffrl.recipes import SIZED, recipe_config
    from diffrl.train.config import TrainConfig

    if name.endswith("-gpu") or name not in SIZED:  # one size, or an unknown name's error: neither needs torch
        return recipe_config(name, device), ""
    sizes = SIZED[name]
    if sizes["gpu"] == sizes["cpu"]:
        return TrainConfig.flat(recipe=name, **sizes["gpu"]), ""
    if device == "auto":
        cuda, evidence = cuda_device_seen()
        why = (f"--device auto, and {'a' if cuda else 'no'} CUDA device seems present: {evidence}. That check reads "
               f"the driver's files, not torch, and serves this help alone; a run asks torch.cuda.is_available()")
    else:
        cuda, why = device.startswith("cuda"), f"--device {device}"
    size, other = ("GPU", "CPU") if cuda else ("CPU", "GPU")
    gpu, cpu = sizes["gpu"], sizes["cpu"]
    differ = sorted(k for k in {*gpu, *cpu} if k not in gpu or k not in cpu or gpu[k] != cpu[k])
    note = (f"--recipe {name} has a GPU size and a CPU size. The defaults below are its {size} size: {why}. "
            f"`{prog} --recipe {name} --device {'cuda' if other == 'GPU' else 'cpu'} --help` shows its {other} size. "
            f"The two sizes differ in {', '.join('--' + k.replace('_', '-') for k in differ)}.")
    return TrainConfig.flat(recipe=name, **sizes[size.lower()]), note


def _train_defaults(args: list[str], prog: str = "diffrl train") -> tuple[TrainConfig, str]:
    """What the flags of `diffrl train` apply to: a recipe's values, then a --config file's (or, for `--resume` of a
    run folder holding a config.json, the run's own settings), so the flags given override both; and, for --help, a
    note saying which size of the recipe those values are ("" when there is nothing to say)."""
    # deferred: the recipes and the config tree (numpy); `diffrl --help`, `recipes` and `rewards` answer without them
    from diffrl.recipes import recipe_config
    from diffrl.train.config import TrainConfig

    args, config_file = _take_flag(args, "--config", with_value=True)
    recipe, device, note = _flag_value(args, "--recipe"), _flag_value(args, "--device") or "auto", ""
    if recipe is not None and _asks_for_help(args):
        default, note = _recipe_for_help(recipe, device, prog)
    else:
        default = recipe_config(recipe, device)
    output_dir = _flag_value(args, "--output-dir")
    if config_file is None and "--resume" in args and output_dir and (Path(output_dir) / "config.json").is_file():
        config_file = Path(output_dir) / "config.json"
    if config_file is not None:
        raw = read_config_file(Path(config_file))
        settings = TrainConfig.from_settings(raw, f"--config {config_file}")
        if "--resume" not in args and isinstance(raw, dict) and "flags" in raw:  # another run's: a new folder
            settings = settings.replace(output_dir=None, resume=False)
        built_in = TrainConfig().as_flat_dict()
        default = default.replace(**{k: v for k, v in settings.as_flat_dict().items() if v != built_in[k]})
    return _size_from_flags(default, args), note


def parse(argv: list[str]):
    # deferred: tyro and the configs (no torch: tests/test_cli_help.py); `diffrl --help`, `recipes` and `rewards`
    # answer without them
    import tyro

    from diffrl.cli.configs import BENCH_TRAIN_DEFAULTS, BenchTrainConfig
    from diffrl.train.config import TrainConfig

    if argv[:1] in (["train"], ["bench-train"]):
        rest, flow_factory = _take_flag(argv[1:], "--flow-factory-config", with_value=True)
        peer = flow_factory_args(flow_factory, rest) if flow_factory else None
        miles = translate([*(peer.args if peer else []), *rest])  # the flags given after the file win
        args, print_config = _take_flag(published_spellings(miles.args), "--print-config", with_value=False)
        default, size_note = _train_defaults(args, f"diffrl {argv[0]}")
        args, _ = _take_flag(args, "--config", with_value=True)
        if argv[0] == "bench-train":
            # `train`'s flags, its defaults but a short run, and the benchmark's own
            description = "\n\n".join(filter(None, [inspect.cleandoc(BenchTrainConfig.__doc__), size_note]))
            config = tyro.cli(BenchTrainConfig, default=BenchTrainConfig(train=default.replace(**BENCH_TRAIN_DEFAULTS)),
                              args=args, prog="diffrl bench-train", config=(tyro.conf.OmitArgPrefixes,),
                              description=description)
            refuse_other_objectives_flags(args, config.train.algorithm.loss_type)
            return config
        config = tyro.cli(TrainConfig, default=default, args=args, prog="diffrl train",
                          config=(tyro.conf.OmitArgPrefixes,),
                          description="\n\n".join(filter(None, [TRAIN_DESCRIPTION, size_note])))
        refuse_other_objectives_flags(args, config.algorithm.loss_type)
        if print_config:
            print(json.dumps({"tree": dataclasses.asdict(config), "flags": config.as_flat_dict()}, default=str, indent=2))
            return None  # printed, nothing to run
        if os.environ.get("RANK", "0") == "0":  # each miles-diffusion flag once, with diffrl's name for it
            for note in miles.notes:
                print(f"miles-diffusion flag {note}")
            for note in peer.notes if peer else ():
                print(f"Flow-Factory {note}")
        return config
    return tyro.extras.subcommand_cli_from_dict(  # a known subcommand's flags alone: its --help loads only its module
        _subcommands(argv[0] if argv else None), args=argv,
        description="diffrl: RL post-training for flow-matching diffusion models")


def run(config) -> None:
    """Run a parsed subcommand, importing only its module: `diffrl train` the trainer (or Ray's launcher), not the
    server's fastapi nor the benchmarks and evaluation."""
    # deferred: each subcommand's module loads only when it runs
    from diffrl.cli.configs import BenchConfig, BenchTrainConfig, CompareConfig, EvaluateConfig
    from diffrl.train.config import TrainConfig
    from diffrl.train.pretrain_config import PretrainConfig

    if isinstance(config, TrainConfig):
        if config.uses_ray():
            from diffrl.launch.ray_placement import launch  # deferred: Ray

            launch(config)
        else:
            from diffrl.train.trainer import train  # deferred: the trainer, the engine and the rewards

            train(config)
        return
    # deferred, each: the subcommand's module (torch, diffusers; fastapi for serve) loads only when it runs
    if isinstance(config, PretrainConfig):
        from diffrl.train.pretrain import pretrain  # deferred: torch

        pretrain(config)
    elif isinstance(config, CompareConfig):
        from diffrl.cli.compare import compare  # deferred: as above

        compare(config)
    elif isinstance(config, BenchConfig):
        from diffrl.cli.bench import bench  # deferred: as above

        bench(config)
    elif isinstance(config, BenchTrainConfig):
        from diffrl.cli.bench_train import bench_train  # deferred: as above

        bench_train(config)
    elif isinstance(config, EvaluateConfig):
        from diffrl.cli.evaluate import evaluate  # deferred: as above

        evaluate(config)
    else:
        from diffrl.serving.server import serve  # deferred: as above (torch and fastapi)

        serve(config)


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] in ("-h", "--help"):
        print(top_help())
        return 0
    if argv[0] in ("recipes", "rewards"):
        print(list_recipes() if argv[0] == "recipes" else list_rewards())
        return 0
    # deferred: the recipes (the config tree, numpy); `diffrl --help`, `recipes` and `rewards` answer without them
    from diffrl.recipes import another_familys_message

    try:
        config = parse(argv)
        if config is not None:
            quiet_third_party_loading()  # after parsing: --help and a refused flag need not import diffusers (seconds)
            run(config)
    except (ModelLoadError, FileExistsError, FileNotFoundError, ValueError) as err:
        # Bad configuration or a broken checkpoint: one line, no traceback.
        print(f"error: {another_familys_message(err) if isinstance(err, AnotherFamilysCheckpoint) else err}",
              file=sys.stderr)
        return 2
    except (EngineUnavailable, RewardUnavailable) as err:
        # An engine that died or cannot be reached (e.g. a --colocate engine process killed): its name and
        # the reason in one line; the run's last checkpoint is there for --resume.
        print(f"error: {err}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
