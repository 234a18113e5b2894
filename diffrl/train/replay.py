"""Rollout records: what `--save-rollout-data DIR` writes and `--load-rollout-data DIR` trains from.

One file per rollout, `DIR/rollout-NNNNNN.safetensors` (N = the rollout index). Its tensors, per
sample `i` in group order: `samples.i.latents` / `timesteps` / `sigmas` / `latent_step_indices` (the
trajectory the engine returned: the latents at the trained steps, or NFT's final x0),
`samples.i.log_probs` (Flow-GRPO) and `samples.i.env.<key>` (the denoising env, on the first sample of
each request as the engine sends it), plus `rewards` [samples] float64. Its safetensors metadata
`diffrl_rollout` is JSON: the format, rollout index, policy weight version, config fingerprint, the
objective's request, the prompts with their metadata (and their condition images' paths and sha256, checked
on replay), the first group index, per sample its prompt,
group and sample index, seed, engine, weight version and timings, and a sha256 over every tensor's
name, dtype, shape and bytes. Nothing is pickled.

A record is written to a hidden temp file, fsynced and renamed into place, so a reader sees either no
record or a whole one; a resumed run rewrites the records of the rollouts it does again under the
same names (never a second copy). A record that is missing, damaged or made under another
configuration is refused with one line naming the file and what is wrong.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors import SafetensorError, safe_open
from safetensors.torch import save_file

from diffrl.data.condition_images import ConditionImage
from diffrl.data.prompts import PromptRecord
from diffrl.engine.protocol import DitTrajectory, RolloutOutput
from diffrl.rollout.manager import Sample
from diffrl.utils.folders import check_output_dir

RECORD_FORMAT = "diffrl-rollout/1"
METADATA_KEY = "diffrl_rollout"
_RECORD = re.compile(r"rollout-(\d{6,})\.safetensors")
_TRAJECTORY = ("latents", "timesteps", "sigmas", "latent_step_indices")

# What makes records of one configuration unusable by another, by the flag that sets it.
FINGERPRINT_FLAGS = {"loss_type": "--loss-type", "diffusion_model_family": "--diffusion-model-family",
                     "height": "--height", "width": "--width", "num_frames": "--num-frames",
                     "rollout_batch_size": "--rollout-batch-size", "n_samples_per_prompt": "--n-samples-per-prompt",
                     "rollout_seed": "--rollout-seed", "reward": "--reward", "reward_frames": "--reward-frames"}


def record_path(directory: Path, k: int) -> Path:
    return Path(directory) / f"rollout-{k:06d}.safetensors"


def fingerprint(cfg, family_name: str) -> dict:
    """The settings a record must share with the run that trains from it (see FINGERPRINT_FLAGS); the size
    as height and width, however the flags spelled it."""
    height, width = cfg.model.size() or (None, None)
    return {"loss_type": cfg.algorithm.loss_type, "diffusion_model_family": family_name,
            "height": height, "width": width, "num_frames": cfg.model.num_frames,
            "rollout_batch_size": cfg.rollout.rollout_batch_size,
            "n_samples_per_prompt": cfg.rollout.n_samples_per_prompt, "rollout_seed": cfg.rollout.rollout_seed,
            "reward": cfg.task.reward, "reward_frames": cfg.task.reward_frames}


@dataclass
class RolloutRecord:
    rollout_index: int
    weight_version: int  # the policy's when it rolled out
    fingerprint: dict
    request: dict  # the objective's request fields (steps, guidance, SDE window, …)
    prompts: list[PromptRecord]  # one per group
    first_group_index: int
    samples: list[Sample]  # group by group, each group's samples in order, rewards set


def existing_records(directory: Path) -> list[int]:
    """Rollout indices of the records under `directory`, ascending."""
    if not Path(directory).is_dir():
        return []
    return sorted(int(m.group(1)) for p in Path(directory).iterdir() if (m := _RECORD.fullmatch(p.name)))


def prepare_save_dir(directory: Path, resume: bool, fingerprint: dict | None = None) -> None:
    """Refuse a folder with another run's records (unless resuming that run: its records are rewritten
    as the rollouts are done again; records of another configuration are refused even then, or the
    folder would mix two runs); clear temp files a crash left behind."""
    directory = Path(directory)
    # The folder or a parent a file: mkdir below would fail with a NotADirectoryError traceback.
    check_output_dir(directory, "--save-rollout-data", kind="folder")
    found = existing_records(directory)
    if found and not resume:
        raise FileExistsError(f"--save-rollout-data {directory} already holds rollout records "
                              f"({record_path(directory, found[0]).name}, …); choose another folder or pass --resume")
    for k in found if fingerprint is not None else ():
        path = record_path(directory, k)
        try:
            with safe_open(str(path), framework="pt") as f:
                recorded = _metadata(path, f.metadata()).get("fingerprint") or {}
        except (SafetensorError, OSError, RuntimeError, ValueError):
            continue  # unreadable: a rollout this run does again rewrites it
        if (mismatch := _fingerprint_mismatch(recorded, fingerprint)) is not None:
            raise ValueError(f"--save-rollout-data {directory} holds another run's records: {path.name} was "
                             f"{mismatch}; choose another folder")
    directory.mkdir(parents=True, exist_ok=True)
    for stale in directory.glob(".rollout-*.tmp"):
        stale.unlink(missing_ok=True)


def check_load_dir(directory: Path) -> None:
    """Refuse, before any model is loaded, a --load-rollout-data folder that holds no record."""
    if not existing_records(directory):
        what = "holds no rollout records" if Path(directory).is_dir() else "is not a folder"
        raise FileNotFoundError(f"--load-rollout-data {directory} {what} (rollout-NNNNNN.safetensors, written by "
                                "--save-rollout-data)")


def check_records(directory: Path, rollouts: range, fingerprint: dict) -> None:
    """Before training: every record the run will read is there, intact (its sha256: one pass over its data,
    a tensor at a time) and of this configuration; a damaged one is refused now, not rollouts into the run."""
    for k in rollouts:
        path = record_path(directory, k)
        if not path.is_file():
            have = existing_records(directory)
            held = f"it holds rollouts {have[0]}–{have[-1]}" if have else "it holds no records"
            raise FileNotFoundError(f"--load-rollout-data {directory}: {path.name} is missing ({held}; this run "
                                    f"reads rollouts {rollouts.start}–{rollouts.stop - 1})")
        try:
            with safe_open(str(path), framework="pt") as f:
                meta = _metadata(path, f.metadata())
                _check_fingerprint(path, meta.get("fingerprint") or {}, fingerprint)
                _check_digest(path, meta, f.keys(), f.get_tensor)
        except (SafetensorError, OSError, RuntimeError) as err:
            raise ValueError(f"--load-rollout-data: {path} is damaged ({_first_line(err)})") from None


# ---------------------------------------------------------------------- writing
def save_rollout(directory: Path, record: RolloutRecord) -> Path:
    tensors: dict[str, torch.Tensor] = {
        "rewards": torch.tensor([s.reward for s in record.samples], dtype=torch.float64)}
    samples = []
    for i, s in enumerate(record.samples):
        out = s.output
        if out.dit_trajectory is not None:
            for name in _TRAJECTORY:
                tensors[f"samples.{i}.{name}"] = getattr(out.dit_trajectory, name)
        if out.rollout_log_probs is not None:
            tensors[f"samples.{i}.log_probs"] = out.rollout_log_probs
        for key, value in (out.denoising_env or {}).items():
            tensors[f"samples.{i}.env.{key}"] = value
        samples.append({"prompt": s.prompt, "group_index": s.group_index, "sample_index": s.sample_index,
                        "seed": s.seed, "engine": s.engine, "weight_version": out.weight_version,
                        "inference_time_s": out.inference_time_s, "peak_memory_mb": out.peak_memory_mb})
    # Own contiguous CPU copies: engine outputs are views into one batch, which safetensors refuses.
    tensors = {k: v.detach().to("cpu", copy=True).contiguous() for k, v in tensors.items()}
    meta = {"format": RECORD_FORMAT, "rollout_index": record.rollout_index, "weight_version": record.weight_version,
            "fingerprint": record.fingerprint, "request": record.request,
            "prompts": [{"prompt": p.prompt, "metadata": p.metadata,
                         **({"images": [[str(i.path), i.sha256] for i in p.images]} if p.images else {})}
                        for p in record.prompts],
            "first_group_index": record.first_group_index, "samples": samples,
            "sha256": _digest(tensors, tensors.__getitem__)}
    path = record_path(directory, record.rollout_index)
    temp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    save_file(tensors, str(temp), metadata={METADATA_KEY: json.dumps(meta)})
    with temp.open("rb") as f:
        os.fsync(f.fileno())
    os.replace(temp, path)
    fd = os.open(path.parent, os.O_RDONLY)
    try:
        os.fsync(fd)  # the rename itself survives a crash
    finally:
        os.close(fd)
    return path


def _digest(names: Iterable[str], get: Callable[[str], torch.Tensor]) -> str:
    """sha256 over names, dtypes, shapes and bytes: a flipped bit anywhere in the data is caught. Tensors
    are fetched one at a time (`get`), so a record on disk is hashed without holding it whole."""
    h = hashlib.sha256()
    for name in sorted(names):
        t = get(name).contiguous()
        h.update(f"{name}|{t.dtype}|{tuple(t.shape)}|".encode())
        h.update(t.reshape(-1).view(torch.uint8).numpy().tobytes())
    return h.hexdigest()


# ---------------------------------------------------------------------- reading
def read_rollout(path: Path) -> RolloutRecord:
    """A whole, intact record; a missing or damaged file raises with one line naming it."""
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"--load-rollout-data: {path} is missing")
    try:
        with safe_open(str(path), framework="pt") as f:
            header = f.metadata()
            tensors = {k: f.get_tensor(k) for k in f.keys()}  # noqa: SIM118 (safe_open has no iterator)
    except (SafetensorError, OSError, ValueError, RuntimeError) as err:  # truncated or garbled
        raise ValueError(f"--load-rollout-data: {path} is damaged ({_first_line(err)})") from None
    meta = _metadata(path, header)
    _check_digest(path, meta, tensors, tensors.__getitem__)
    try:
        return _record(meta, tensors)
    except (KeyError, TypeError, ValueError, IndexError) as err:
        raise ValueError(f"--load-rollout-data: {path} is damaged (field {_first_line(err)})") from None


def _metadata(path: Path, header: dict | None) -> dict:
    """The record's JSON metadata, of the format this code reads."""
    try:
        meta = json.loads((header or {})[METADATA_KEY])
        fmt = meta["format"]
    except (TypeError, ValueError, KeyError):
        raise ValueError(f"--load-rollout-data: {path} is not a diffrl rollout record (no {METADATA_KEY} "
                         "metadata)") from None
    if fmt != RECORD_FORMAT:
        raise ValueError(f"--load-rollout-data: {path} has format {fmt!r}; this diffrl reads {RECORD_FORMAT!r}")
    return meta


def _check_digest(path: Path, meta: dict, names: Iterable[str], get: Callable[[str], torch.Tensor]) -> None:
    if meta.get("sha256") != _digest(names, get):
        raise ValueError(f"--load-rollout-data: {path} is damaged (its tensors do not match their sha256)")


def _check_fingerprint(path: Path, recorded: dict, ours: dict) -> None:
    if (mismatch := _fingerprint_mismatch(recorded, ours)) is not None:
        raise ValueError(f"--load-rollout-data: {path} was {mismatch}")


def _fingerprint_mismatch(recorded: dict, ours: dict) -> str | None:
    """"recorded with FLAG X; this run has Y" for the first setting that differs, else None."""
    if "resolution" in recorded:  # records from before --height/--width held the square side
        side = recorded["resolution"]
        recorded = {**recorded, "height": side, "width": side}
    for field, flag in FINGERPRINT_FLAGS.items():
        if recorded.get(field) != ours.get(field):
            return f"recorded with {flag} {_shown(recorded.get(field))}; this run has {_shown(ours.get(field))}"
    return None


def _shown(value) -> str:
    return "(the default)" if value is None else str(value)


def _record(meta: dict, tensors: dict[str, torch.Tensor]) -> RolloutRecord:
    rewards = tensors["rewards"]
    samples = []
    for i, s in enumerate(meta["samples"]):
        own = f"samples.{i}."
        trajectory = (DitTrajectory(**{name: tensors[own + name] for name in _TRAJECTORY})
                      if own + "latents" in tensors else None)
        env = {k[len(own) + 4:]: v for k, v in tensors.items() if k.startswith(own + "env.")} or None
        output = RolloutOutput(seed=s["seed"], generated_output=torch.empty(0),  # images are not kept
                               rollout_log_probs=tensors.get(own + "log_probs"), dit_trajectory=trajectory,
                               denoising_env=env, weight_version=s["weight_version"],
                               inference_time_s=s["inference_time_s"], peak_memory_mb=s["peak_memory_mb"])
        samples.append(Sample(s["prompt"], s["group_index"], s["sample_index"], s["seed"], output, s["engine"],
                              float(rewards[i])))
    if len(rewards) != len(samples):
        raise ValueError(f"rewards: {len(rewards)} values for {len(samples)} samples")
    prompts = [PromptRecord(p["prompt"], p["metadata"], tuple(ConditionImage(Path(path), sha256)
                                                              for path, sha256 in p.get("images", ())))
               for p in meta["prompts"]]
    return RolloutRecord(meta["rollout_index"], meta["weight_version"], meta["fingerprint"], meta["request"],
                         prompts, meta["first_group_index"], samples)


def load_rollout(directory: Path, k: int, *, fingerprint: dict, request: dict, prompts: list[PromptRecord],
                 first_group_index: int) -> RolloutRecord:
    """Rollout k's record, checked against what this run would have rolled out: its configuration
    fingerprint, the objective's request, the task's prompts and the group indices (hence seeds)."""
    path = record_path(directory, k)
    record = read_rollout(path)
    where = f"--load-rollout-data: {path}"
    _check_fingerprint(path, record.fingerprint, fingerprint)
    if record.rollout_index != k:
        raise ValueError(f"{where} holds rollout {record.rollout_index}, not {k}")
    ours = json.loads(json.dumps(request))  # as the record stores it
    for field in sorted(set(ours) | set(record.request)):
        if ours.get(field) != record.request.get(field):
            raise ValueError(f"{where}: its request has {field} = {record.request.get(field)!r}, this run's "
                             f"{ours.get(field)!r} (another --diffusion-* setting, --seed or objective)")
    expected = len(prompts) * fingerprint["n_samples_per_prompt"]
    if len(record.prompts) != len(prompts) or len(record.samples) != expected:
        raise ValueError(f"{where} holds {len(record.prompts)} groups and {len(record.samples)} samples; this run "
                         f"rolls out {len(prompts)} groups and {expected} samples")
    for j, (theirs, mine) in enumerate(zip(record.prompts, prompts, strict=True)):
        if (theirs.prompt, theirs.metadata) != (mine.prompt, json.loads(json.dumps(mine.metadata))):
            raise ValueError(f"{where}: group {j} has prompt {theirs.prompt!r}, this run draws {mine.prompt!r} "
                             "(another --prompt-data, --seed or task setting)")
        if [i.sha256 for i in theirs.images] != [i.sha256 for i in mine.images]:
            raise ValueError(f"{where}: group {j} ({mine.prompt!r}) was rolled out from other condition images "
                             f"than this run's {', '.join(str(i.path) for i in mine.images) or '(none)'}")
    if record.first_group_index != first_group_index:
        raise ValueError(f"{where} starts at group {record.first_group_index}; this run is at group "
                         f"{first_group_index}")
    return record


def _first_line(err: BaseException) -> str:
    text = str(err).strip()
    return text.splitlines()[0] if text else type(err).__name__
