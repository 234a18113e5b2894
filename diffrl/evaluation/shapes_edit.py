"""The editing world's held-out evaluation (`evaluate_held_out`: `per_kind` held-out examples of each edit kind, the
test split's instructions in turn with scenes from fixed seeds, ODE at fixed seeds, scored by the strict edit
verifier and its partial credit). The `--world shapes-edit` task, `diffrl evaluate`/`compare` and pretraining's
checkpoints all call it, so a pretrained editing model's numbers are the ones RL runs log as `eval/strict`.

`python -m diffrl.evaluation.shapes_edit --model-path DIR --guidance-scale 1 3` prints one JSON line per scale
(what scripts/device/pretrain_edit.sh records for each checkpoint); each scale's images, records and grid (every
output after its source) go under `--output-dir/cfg<scale>/rollout-00000/`.
"""

from __future__ import annotations

import argparse
import json
import shutil
from collections.abc import Sequence
from pathlib import Path

import numpy as np

from diffrl.data.condition_images import ConditionImage, encode_png
from diffrl.data.prompts import PromptRecord
from diffrl.data.shapes import EDIT_KINDS, EditExample, edits_by_kind, make_example
from diffrl.evaluation.reward_eval import RewardComponent, RewardEval, evaluate_with_reward
from diffrl.evaluation.sampling import TEST_SEED
from diffrl.models.base import FamilyAdapter
from diffrl.models.demo import DemoFamily
from diffrl.rewards.shapes_edit import shapes_edit_reward, shapes_edit_strict_reward
from diffrl.utils.device import resolve_device

DEFAULT_SIZE = 64  # the shapes world's canvas
_EVAL_COMPONENTS = [RewardComponent("strict", "shapes_edit_strict", 1.0, shapes_edit_strict_reward),
                    RewardComponent("score", "shapes_edit", 0.0, shapes_edit_reward)]


def edit_record(example: EditExample, name: str) -> PromptRecord:
    """An example as a prompt: the instruction, its kind as metadata, the rendered source as its condition image."""
    source = ConditionImage.in_memory(encode_png(example.source_image()), name)
    return PromptRecord(example.instruction, {"edit_kind": example.edit.kind}, (source,))


def held_out_records(per_kind: int, size: int) -> list[PromptRecord]:
    """`per_kind` examples of each edit kind: its test instructions in turn, scene j drawn from seed TEST_SEED + j."""
    records = []
    for kind, instructions in edits_by_kind("test").items():
        for j in range(per_kind):
            example = make_example(instructions[j % len(instructions)], TEST_SEED + j, size)
            records.append(edit_record(example, f"shapes-edit test {kind} {j}"))
    return records


def edit_metrics(rows: Sequence[dict]) -> dict[str, float]:
    """{"eval/strict", "eval/score", "eval/strict/<kind>"} of scored held-out rows (`evaluate_with_reward`'s)."""
    metrics = {"eval/strict": float(np.mean([r["rewards"]["strict"] for r in rows])),
               "eval/score": float(np.mean([r["rewards"]["score"] for r in rows]))}
    for kind in EDIT_KINDS:
        mine = [r["rewards"]["strict"] for r in rows if r["metadata"]["edit_kind"] == kind]
        if mine:
            metrics[f"eval/strict/{kind}"] = float(np.mean(mine))
    return metrics


def evaluate_held_out(family, per_kind: int, size: int, *, num_steps: int, guidance_scale: float,
                      negative_prompt: str = "", out_dir=None, batch_size: int = 16,
                      progress: bool = False) -> tuple[dict[str, float], RewardEval]:
    """The world's held-out evaluation (`held_out_records`, ODE at seeds TEST_SEED + k, scored strictly and by
    partial credit): its metrics and the scored rows and images; files under `out_dir` when given. One function
    for the trainer's evaluation and `diffrl evaluate`/`compare`, so their figures are the same."""
    result = evaluate_with_reward(family, held_out_records(per_kind, size), _EVAL_COMPONENTS, seeds_per_prompt=1,
                                  seed=TEST_SEED, num_steps=num_steps, guidance_scale=guidance_scale, height=size,
                                  width=size, negative_prompt=negative_prompt, out_dir=out_dir,
                                  batch_size=batch_size, progress=progress)
    return edit_metrics(result.rows), result


def evaluate_edits(family: FamilyAdapter, out_dir: str | Path, *, per_kind: int = 16, num_steps: int = 10,
                   guidance_scale: float = 3.0, size: int = DEFAULT_SIZE) -> dict[str, float]:
    """`evaluate_held_out` in eval mode, as a training run's evaluation at rollout 0 lays it out: {"eval/strict",
    "eval/strict/<kind>", "eval/score"}; files under `out_dir/rollout-00000/` (images, records.jsonl, grid.png,
    report.json)."""
    was_training = family.transformer.training
    family.transformer.eval()
    try:
        metrics, _ = evaluate_held_out(family, per_kind, size, num_steps=num_steps, guidance_scale=guidance_scale,
                                       out_dir=Path(out_dir) / "rollout-00000")
        return metrics
    finally:
        family.transformer.train(was_training)


def sample_grid(family: FamilyAdapter, path: str | Path, *, per_kind: int = 6, num_steps: int = 10,
                guidance_scale: float = 3.0) -> dict[str, float]:
    """Pretraining's sample grid of an editing model: held-out edits of each kind, each output after its source,
    captioned with the instruction and its strict verdict, at `path`; the evaluation's files beside it (`path`
    without its suffix). Returns the evaluation's metrics."""
    path = Path(path)
    folder = path.with_suffix("")
    metrics = evaluate_edits(family, folder, per_kind=per_kind, num_steps=num_steps, guidance_scale=guidance_scale,
                             size=family.default_size()[0])
    shutil.copyfile(folder / "rollout-00000" / "grid.png", path)
    return metrics


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model-path", type=Path, required=True)
    parser.add_argument("--guidance-scale", type=float, nargs="+", default=[1.0, 3.0])
    parser.add_argument("--per-kind", type=int, default=64, help="held-out examples per edit kind")
    parser.add_argument("--num-steps", type=int, default=10)
    parser.add_argument("--output-dir", type=Path, required=True)
    parser.add_argument("--device", default="auto")
    args = parser.parse_args(argv)
    family = DemoFamily.load(args.model_path, device=resolve_device(args.device))
    for g in args.guidance_scale:
        metrics = evaluate_edits(family, args.output_dir / f"cfg{g:g}", per_kind=args.per_kind,
                                 num_steps=args.num_steps, guidance_scale=g, size=family.default_size()[0])
        print(json.dumps({"model": str(args.model_path), "guidance_scale": g, **metrics}), flush=True)


if __name__ == "__main__":
    main()
