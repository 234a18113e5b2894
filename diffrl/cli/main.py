"""Entry point: `diffrl <subcommand> [--flags]`; every flag is a field of a typed config.

`diffrl train --recipe NAME [--flags]` loads the recipe's values as defaults, then applies the flags.
"""

from __future__ import annotations

import dataclasses
import os
import sys

import tyro

from diffrl.cli.bench import BenchConfig, bench
from diffrl.cli.bench_train import BENCH_TRAIN_DEFAULTS, BenchTrainConfig, bench_train
from diffrl.cli.compare import CompareConfig, compare
from diffrl.cli.evaluate import EvaluateConfig, evaluate
from diffrl.cli.miles_flags import translate
from diffrl.engine.server import ServeConfig, serve
from diffrl.errors import ModelLoadError
from diffrl.recipes import recipe_config
from diffrl.rollout.clients import EngineUnavailable
from diffrl.train.config import AwmConfig, CrdConfig, DgpoConfig, DpoConfig, GrpoGuardConfig, TrainConfig
from diffrl.train.pretrain import PretrainConfig, pretrain

SUBCOMMANDS = {"train": TrainConfig, "pretrain": PretrainConfig, "evaluate": EvaluateConfig, "compare": CompareConfig,
               "serve": ServeConfig, "bench": BenchConfig, "bench-train": BenchTrainConfig}


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
_ONLY_FOR = (
    (_SDE, "the SDE steps of Flow-GRPO and its relatives",
     ("--diffusion-sde-window-range", "--diffusion-num-sde-steps", "--diffusion-sde-type", "--diffusion-noise-level",
      "--diffusion-sde-step-strategy", "--diffusion-sde-window-shift-interval", "--diffusion-sde-window-stride")),
    ((*_SDE, "awm"), "the clipped policy ratio", ("--diffusion-clip-range",)),
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
    for owners, what, flags in _ONLY_FOR:
        if loss_type not in owners and (flag := next((f for f in given if f in flags), None)):
            raise ValueError(f"{flag} sets {what}; --loss-type {loss_type} does not read it (drop it, or use "
                             f"--loss-type {' or '.join(owners)})")


def parse(argv: list[str]):
    if argv[:1] in (["train"], ["bench-train"]):
        miles = translate(argv[1:])
        args = published_spellings(miles.args)
        default = _size_from_flags(recipe_config(_flag_value(args, "--recipe"), _flag_value(args, "--device") or "auto"),
                                   args)
        if argv[0] == "bench-train":  # `train`'s flags, its defaults but a short run, and the benchmark's own
            config = tyro.cli(BenchTrainConfig, default=BenchTrainConfig(train=default.replace(**BENCH_TRAIN_DEFAULTS)),
                              args=args, prog="diffrl bench-train", config=(tyro.conf.OmitArgPrefixes,))
            refuse_other_objectives_flags(args, config.train.algorithm.loss_type)
            return config
        config = tyro.cli(TrainConfig, default=default, args=args, prog="diffrl train",
                          config=(tyro.conf.OmitArgPrefixes,))
        refuse_other_objectives_flags(args, config.algorithm.loss_type)
        if os.environ.get("RANK", "0") == "0":  # each miles-diffusion flag once, with diffrl's name for it
            for note in miles.notes:
                print(f"miles-diffusion flag {note}")
        return config
    return tyro.extras.subcommand_cli_from_dict(
        SUBCOMMANDS, args=argv, description="diffrl: RL post-training for flow-matching diffusion models")


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    try:
        config = parse(argv)
        if isinstance(config, TrainConfig) and config.uses_ray():
            from diffrl.launch.ray_placement import launch

            launch(config)
        elif isinstance(config, TrainConfig):
            from diffrl.train.trainer import train

            train(config)
        elif isinstance(config, PretrainConfig):
            pretrain(config)
        elif isinstance(config, ServeConfig):
            serve(config)
        elif isinstance(config, CompareConfig):
            compare(config)
        elif isinstance(config, BenchConfig):
            bench(config)
        elif isinstance(config, BenchTrainConfig):
            bench_train(config)
        else:
            evaluate(config)
    except (ModelLoadError, FileExistsError, FileNotFoundError, ValueError) as err:
        # Bad configuration or a broken checkpoint: one line, no traceback.
        print(f"error: {err}", file=sys.stderr)
        return 2
    except EngineUnavailable as err:
        # An engine that died or cannot be reached (e.g. a --colocate engine process killed): its name and
        # the reason in one line; the run's last checkpoint is there for --resume.
        print(f"error: {err}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
