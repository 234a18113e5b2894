"""A user's prompt dataset as a task: training prompts from `--prompt-data`, judged by a reward.

Training prompts are walked through `PromptStream` (shuffled per epoch from the run seed; its
position is checkpointed, so `--resume` continues with the very next prompt). Evaluation samples
the first `--eval-num-prompts` held-out prompts (`--eval-prompt-data`, or the test split of a
`--prompt-data` directory) at fixed seeds with ODE and reports the mean of each reward component
(`eval/reward`, `eval/reward/<name>`), writing every image with its prompt, seed and scores.
"""

from __future__ import annotations

import re
from collections import defaultdict
from collections.abc import Sequence
from pathlib import Path

import numpy as np

from diffrl.data.prompts import PromptRecord, PromptStream, check_input_key, fingerprint, load_prompts, prompt_file
from diffrl.evaluation.reward_eval import evaluate_with_reward
from diffrl.evaluation.sampling import TEST_SEED
from diffrl.rewards import check_prompts
from diffrl.tasks.base import EvalOutcome, EvalSettings

# Metadata keys that name a prompt's kind (GenEval's `tag`); rewards are also logged per kind.
KIND_KEYS = ("tag", "category")
# The rollout's own statistics beside the per-kind rewards (rollout/reward/<kind>): a kind of one of these
# names would overwrite them, so a prompt set using one is refused.
RESERVED_KINDS = ("raw_mean", "std")


def reward_identity(spec: str) -> str:
    """A --reward spec without its checkpoint and processor paths: the same reward moved to another directory
    (another machine) is the same reward."""
    return re.sub(r"@[^,=]*", "", re.sub(r",processor=[^,=]*", "", spec))


def kind_of(record: PromptRecord) -> str | None:
    return next((record.metadata[k] for k in KIND_KEYS if isinstance(record.metadata.get(k), str)), None)


def _first_row(sources, predicate) -> tuple[Path, PromptRecord] | None:
    """The first record (with its file) of `sources` (file, records) that `predicate` holds for; None when none."""
    return next(((file, r) for file, records in sources for r in records if predicate(r)), None)


def _row(file: Path, record: PromptRecord) -> str:
    """How errors name a prompt's row, as the prompt loader does: `prompt data FILE:LINE`."""
    return f"prompt data {file}" + (f":{record.line}" if record.line is not None else "")


class PromptSetTask:
    name = "prompt_set"
    selection_metric = None  # the only evaluation is on held-out prompts, which must not pick checkpoints

    def __init__(self, task_cfg, eval_cfg, settings: EvalSettings, seed: int = 0):
        path = task_cfg.prompt_data
        records = load_prompts(path, "train", task_cfg.input_key)[: task_cfg.train_num_prompts]  # None: all
        self.train = PromptStream(records, seed=seed, source=f"--prompt-data {path}")
        if clash := next((kind_of(r) for r in self.train.records if kind_of(r) in RESERVED_KINDS), None):
            raise ValueError(f"prompt data {path}: the prompt kind {clash!r} (metadata {'/'.join(KIND_KEYS)}) would "
                             f"overwrite the metric rollout/reward/{clash} that diffrl logs; rename it in the file")
        self.eval_cfg, self.settings = eval_cfg, settings
        self.reward, self.reward_device = task_cfg.reward, task_cfg.reward_device
        self.judge = task_cfg.eval_reward  # --eval-reward: scores the held-out images beside the trained reward
        self.judge_baseline: dict | None = None  # the first evaluation's mean and spread of both, for the gains
        held_out = task_cfg.eval_prompt_data
        self.eval_source = f"--eval-prompt-data {held_out}" if held_out else f"--prompt-data {path} (its test split)"
        self.eval_fingerprint = None  # of the whole held-out split: an edit to it is refused by --resume
        if (held_out is None and not path.is_dir()) or eval_cfg.eval_num_prompts == 0:
            self.eval_records = []  # a single training file has no held-out split; 0 prompts: no evaluation
        else:
            try:
                records = load_prompts(held_out or path, "test", task_cfg.input_key)
            except FileNotFoundError as err:
                if held_out is not None:
                    raise
                raise FileNotFoundError(f"{err}: pass the held-out prompts as --eval-prompt-data FILE, or "
                                        "--eval-num-prompts 0 to train without held-out evaluation") from None
            self.eval_records = records[: eval_cfg.eval_num_prompts]
            self.eval_fingerprint = fingerprint(records)
        files = {f"--prompt-data {path}": prompt_file(path, "train")}
        # Each file read with the records taken from it: what the condition-image checks walk, naming file and row.
        self.sources = [(files[f"--prompt-data {path}"], self.train.records)]
        if self.eval_records:
            files[self.eval_source] = prompt_file(held_out or path, "test")
            self.sources.append((files[self.eval_source], self.eval_records))
        check_input_key(task_cfg.input_key, files)
        if task_cfg.condition_images == "required":  # known from the flags: refused before the model loads
            self._require_condition_images("the run needs one in every row (--condition-images required, as the "
                                           "image-to-video recipes set)", "its condition image")
        self.evaluates = bool(self.eval_records)
        # Said once at the start of a run: a single file trains without a held-out evaluation, which a user
        # asking for --eval-interval would otherwise only notice by its absence.
        self.no_eval_note = None if self.evaluates or eval_cfg.eval_num_prompts == 0 else (
            f"no held-out evaluation: --prompt-data {path} is a single file, without a test split; pass "
            "--eval-prompt-data FILE (or a directory with train and test files) to evaluate on held-out prompts")
        check_prompts(self.reward, [r.prompt for r in self.train.records], f"prompt data {path} (training prompts)")
        check_prompts(self.reward, [r.prompt for r in self.eval_records],
                      f"prompt data {held_out or path} (held-out prompts)")
        if self.judge is not None:
            check_prompts(self.judge, [r.prompt for r in self.eval_records],
                          f"--eval-reward {self.judge}: prompt data {held_out or path} (held-out prompts)")

    def check_family(self, family) -> None:
        """Rows whose condition images the checkpoint cannot take, refused before anything is written: the engine
        would refuse them only at the first rollout, and a checkpoint that takes a first frame without needing one
        (LTX-2) would train text to video on a row without (`--condition-images required` guards that). Rewards
        score video as the mean over its frames, so nothing else is refused."""
        checkpoint = f"the {family.name} checkpoint at --model-path"
        if family.requires_image_conditioning:
            need = "image to video" if family.generates_video else "image editing"
            self._require_condition_images(f"{checkpoint} is {need} and cannot run without one",
                                           "its first frame" if family.generates_video else "its source image")
        found = _first_row(self.sources, lambda r: len(r.images) > family.max_condition_images)
        if found is None:
            return
        count = len(found[1].images)
        if not family.accepts_image_conditioning:
            media = "video" if family.generates_video else "image"
            raise ValueError(f"{_row(*found)}: this row names a condition image ({found[1].images[0].path.name}), "
                             f"but {checkpoint} is text-to-{media} only and takes none; drop the row's image/images "
                             "key, or train a checkpoint that takes condition images")
        raise ValueError(f"{_row(*found)}: this row names {count} condition images; {checkpoint} takes at most "
                         f"{family.max_condition_images}")

    def _require_condition_images(self, why: str, what: str) -> None:
        """A ValueError naming the first row (of the training file, then of the held-out one) without a condition
        image: `why` says what needs one, `what` what to name under `image`."""
        found = _first_row(self.sources, lambda r: not r.images)
        if found is None:
            return
        file = found[0]
        if file.suffix == ".txt":
            fix = ("a .txt prompt file holds text only: write the prompts as a .jsonl file, one "
                   '{"prompt": ..., "image": PATH} object per line, each PATH relative to the file\'s folder')
        else:
            fix = f'add an "image" key naming {what}, a path relative to {file.parent} (or to its images/ folder)'
        raise ValueError(f"{_row(*found)}: this row has no condition image, and {why}; {fix}")

    def draw(self, k: int, batch: int) -> list[PromptRecord]:
        return self.train.take(batch)

    def observe(self, prompts: Sequence[PromptRecord], group_rewards) -> dict[str, float]:
        by_kind: dict[str, list[float]] = defaultdict(list)
        for record, rewards in zip(prompts, group_rewards, strict=True):
            kind = kind_of(record)
            if kind is not None:
                by_kind[kind].extend(float(r) for r in rewards)
        return {f"rollout/reward/{kind}": float(np.mean(rs)) for kind, rs in by_kind.items()}

    def evaluate(self, family, k: int, out_dir) -> EvalOutcome:
        s = self.settings
        result = evaluate_with_reward(
            family, self.eval_records, self.reward, seeds_per_prompt=self.eval_cfg.n_samples_per_eval_prompt,
            seed=TEST_SEED, num_steps=s.num_steps, guidance_scale=s.guidance_scale,
            guidance_scale_2=s.guidance_scale_2, **s.size(),
            num_frames=s.num_frames, negative_prompt=s.negative_prompt, out_dir=out_dir / f"rollout-{k:05d}",
            reward_device=self.reward_device, reward_frames=s.reward_frames, judge=self.judge,
            batch_size=self.eval_cfg.eval_batch_size)
        shown = min(self.eval_cfg.eval_log_images, len(result.rows))
        metrics = dict(result.summary)
        if self.judge is not None:
            metrics.update(self._gains(result.rows))
        return EvalOutcome(metrics=metrics, images=result.images[:shown],
                           captions=[f"{row['reward']:.3f} {row['prompt']}" for row in result.rows[:shown]])

    def _gains(self, rows: list[dict]) -> dict[str, float]:
        """How far the trained reward and the judge moved since the first evaluation, each in units of its
        per-image spread there (a standardized gain: comparable across rewards of any scale), and the gap."""
        now = {key: (float(np.mean([r[key] for r in rows])), float(np.std([r[key] for r in rows])))
               for key in ("reward", "judge")}
        if self.judge_baseline is None:
            self.judge_baseline = now
        base = self.judge_baseline
        if min(base["reward"][1], base["judge"][1]) <= 0:  # no spread at the first evaluation: no unit to count in
            return {}
        gain = {key: (now[key][0] - base[key][0]) / base[key][1] for key in now}
        return {"eval/reward_gain_sd": gain["reward"], "eval/judge_gain_sd": gain["judge"],
                "eval/hacking_gap_sd": gain["reward"] - gain["judge"]}

    def state_dict(self) -> dict:
        return {"prompt_stream": self.train.state_dict(), "eval_prompts_sha256": self.eval_fingerprint,
                "reward": reward_identity(self.reward), "judge_baseline": self.judge_baseline}

    def load_state_dict(self, state: dict) -> None:
        # Another reward would put other numbers into the same training and held-out series (checkpoints written
        # before the reward was kept have nothing to compare).
        saved, now = state.get("reward"), reward_identity(self.reward)
        if saved is not None and saved != now:
            raise ValueError(f"--resume: the checkpoint was trained with --reward {saved} (paths aside), this run "
                             f"asks for {now}: their rewards and held-out scores would not compare; resume with the "
                             "same reward, or start a new run in another --output-dir")
        if "prompt_stream" in state:
            self.train.load_state_dict(state["prompt_stream"])
        if state.get("judge_baseline") is not None:
            self.judge_baseline = {k: tuple(v) for k, v in state["judge_baseline"].items()}
        # Checked only when both runs evaluate: a run that stopped or started evaluating has nothing to compare.
        saved = state.get("eval_prompts_sha256")
        if saved is not None and self.eval_fingerprint is not None and saved != self.eval_fingerprint:
            raise ValueError(f"--resume: {self.eval_source} is not the held-out prompt set the checkpoint was "
                             "evaluated on (other text, metadata or order); resume with the original file, or "
                             "start a new run in another --output-dir")
