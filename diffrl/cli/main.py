"""Entry point: `diffrl <subcommand> [--flags]`; every flag is a field of a typed config."""

from __future__ import annotations

import sys

import tyro

from diffrl.cli.evaluate import EvaluateConfig, evaluate
from diffrl.engine.server import ServeConfig, serve
from diffrl.models.base import ModelLoadError
from diffrl.train.pretrain import PretrainConfig, pretrain


def main(argv: list[str] | None = None) -> int:
    config = tyro.extras.subcommand_cli_from_dict(
        {"pretrain": PretrainConfig, "evaluate": EvaluateConfig, "serve": ServeConfig},
        args=argv, description="diffrl: RL post-training for flow-matching diffusion models",
    )
    try:
        if isinstance(config, PretrainConfig):
            pretrain(config)
        elif isinstance(config, ServeConfig):
            serve(config)
        else:
            evaluate(config)
    except (ModelLoadError, FileExistsError, ValueError) as err:
        # Bad configuration or a broken checkpoint: one line, no traceback.
        print(f"error: {err}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
