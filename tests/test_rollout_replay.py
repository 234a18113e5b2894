"""Rollout records: a run trained from saved rollouts equals the live run that saved them, to the bit;
damaged, missing or foreign records are refused by name; the debug modes; resume never duplicates."""

import json
import shutil

import pytest
import torch
from safetensors import safe_open

from diffrl.cli.main import main as cli_main
from diffrl.cli.main import parse
from diffrl.models.demo import DemoFamily
from diffrl.train.config import TrainConfig
from diffrl.train.replay import METADATA_KEY, existing_records, record_path
from diffrl.train.trainer import Trainer, validate_config

# Trainer-side numbers that must agree between the live run and the replay (timings differ).
COMPARED = ("rollout/reward/raw_mean", "rollout/reward/std", "rollout/zero_std_ratio", "train/loss",
            "train/grad_norm", "train/lr", "train/pairs", "train/log_prob_mean_abs_diff", "train/approx_kl",
            "train/clipfrac", "train/ratio_mean", "train/policy_loss", "train/nft_positive_loss",
            "train/nft_negative_loss", "train/kl_loss")


def config(model_dir, out, **overrides) -> TrainConfig:
    base = {"model_path": model_dir, "output_dir": out, "num_rollout": 2, "rollout_batch_size": 2,
            "n_samples_per_prompt": 3, "rollout_microgroup_size": 2, "global_batch_size": 3,
            "num_steps_per_rollout": 2, "micro_batch_size": 2, "diffusion_num_steps": 3,
            "diffusion_sde_window_range": (0, 3), "diffusion_num_sde_steps": 2, "diffusion_guidance_scale": 2.0,
            "lr": 1e-3, "checkpoint_interval": 10, "use_lora": False, "eval_images_per_category": 0,
            "reward": "rewards_for_tests:darkness"}
    base.update(overrides)
    return TrainConfig.flat(**base)


def _records(out):
    return [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]


def _state(trainer):
    state = [p.detach().clone() for p in trainer.policy.params]
    if trainer.policy.ema is not None:  # NFT's old policy samples the next rollout: it must agree too
        state += [s.clone() for s in trainer.policy.ema.shadow]
    return state


_LIVE = {}  # loss type → the live run's results, made once and shared by the tests below


@pytest.fixture(params=["flow_grpo", "nft"])
def live(request, tiny_model_dir, tmp_path_factory):
    """A live run that saves its two rollouts: (loss type, records folder, metrics, final state). Every
    `tiny_model_dir` holds the same weights, so the records fit any test's model."""
    if request.param not in _LIVE:
        root = tmp_path_factory.mktemp(f"live-{request.param}")
        trainer = Trainer(config(tiny_model_dir, root / "run", loss_type=request.param,
                                 save_rollout_data=root / "records"))
        start = _state(trainer)
        trainer.train()
        assert any(not torch.equal(a, b) for a, b in zip(start, _state(trainer), strict=True))  # it trained
        _LIVE[request.param] = (request.param, root / "records", _records(root / "run"), _state(trainer))
    return _LIVE[request.param]


def _no_sampling(monkeypatch):
    """Replaying builds no engine, encodes, samples, decodes or scores nothing."""
    def refuse(*args, **kwargs):
        raise AssertionError("replaying must not sample or score")

    import diffrl.engine.engine
    import diffrl.train.trainer

    monkeypatch.setattr(diffrl.engine.engine.Engine, "__init__", refuse)
    monkeypatch.setattr(diffrl.engine.engine, "denoise", refuse)
    monkeypatch.setattr(diffrl.train.trainer, "build_reward", refuse)
    monkeypatch.setattr(diffrl.train.trainer.RolloutManager, "rollout", refuse)
    for name in ("encode_prompts", "prepare_latents", "decode"):
        monkeypatch.setattr(DemoFamily, name, refuse)


def test_training_from_records_equals_the_live_run(live, tiny_model_dir, tmp_path, monkeypatch):
    loss_type, records, live_metrics, live_state = live
    assert existing_records(records) == [0, 1]
    _no_sampling(monkeypatch)
    trainer = Trainer(config(tiny_model_dir, tmp_path / "replay", loss_type=loss_type, load_rollout_data=records))
    assert trainer.engine is None and trainer.manager is None
    trainer.train()
    for a, b in zip(_state(trainer), live_state, strict=True):
        assert torch.equal(a, b)  # bit-identical trained weights (and NFT's old policy)
    replayed = _records(tmp_path / "replay")
    assert [r["rollout"] for r in replayed] == [r["rollout"] for r in live_metrics] == [0, 1, 2]
    for a, b in zip(live_metrics[1:], replayed[1:], strict=True):
        shared = [key for key in COMPARED if key in a]
        assert "train/loss" in shared and all(key in b for key in shared)
        assert {key: a[key] for key in shared} == {key: b[key] for key in shared}


def test_record_contents(live):
    loss_type, records, _, _ = live
    with safe_open(str(record_path(records, 1)), framework="pt") as f:
        meta = json.loads(f.metadata()[METADATA_KEY])
        keys = set(f.keys())
    assert meta["rollout_index"] == 1 and meta["first_group_index"] == 2
    assert meta["fingerprint"]["loss_type"] == loss_type and meta["fingerprint"]["n_samples_per_prompt"] == 3
    assert [s["seed"] for s in meta["samples"]] == [6, 7, 8, 9, 10, 11]  # groups 2 and 3, n = 3
    assert len(meta["prompts"]) == 2 and "category" in meta["prompts"][0]["metadata"]
    assert {"rewards", "samples.0.latents", "samples.0.env.prompt_embeds"} <= keys
    assert "samples.1.env.prompt_embeds" not in keys  # conditioning once per request, as the engine sends it
    assert ("samples.0.log_probs" in keys) == (loss_type == "flow_grpo")
    assert not list(records.glob(".*"))  # no temp file left behind


def _copy(records, tmp_path):
    return shutil.copytree(records, tmp_path / "records")


@pytest.mark.parametrize("live", ["flow_grpo"], indirect=True)
def test_missing_and_damaged_records_are_refused_by_name(live, tiny_model_dir, tmp_path):
    loss_type, records, _, _ = live
    records = _copy(records, tmp_path)
    cfg = config(tiny_model_dir, tmp_path / "a", loss_type=loss_type, load_rollout_data=records)

    record_path(records, 1).unlink()
    with pytest.raises(FileNotFoundError, match=r"rollout-000001\.safetensors is missing"):
        Trainer(cfg)
    assert not (tmp_path / "a").exists()  # refused before the run folder is made

    shutil.copy(record_path(live[1], 1), record_path(records, 1))
    data = bytearray(record_path(records, 1).read_bytes())
    data[-3] ^= 0xFF  # a flipped byte in the tensor data
    record_path(records, 1).write_bytes(bytes(data))
    with pytest.raises(ValueError, match=r"rollout-000001\.safetensors is damaged \(its tensors do not match"):
        Trainer(config(tiny_model_dir, tmp_path / "b", loss_type=loss_type, load_rollout_data=records))
    assert not (tmp_path / "b").exists()  # at start-up, not when rollout 1 is read

    record_path(records, 1).write_bytes(bytes(data[: len(data) // 2]))  # cut short
    with pytest.raises(ValueError, match=r"rollout-000001\.safetensors is damaged"):
        Trainer(config(tiny_model_dir, tmp_path / "c", loss_type=loss_type, load_rollout_data=records))

    with pytest.raises(FileNotFoundError, match="empty is not a folder"):
        Trainer(config(tiny_model_dir, tmp_path / "d", loss_type=loss_type, load_rollout_data=tmp_path / "empty"))
    (tmp_path / "empty").mkdir()
    with pytest.raises(FileNotFoundError, match="empty holds no rollout records"):
        Trainer(config(tiny_model_dir, tmp_path / "d", loss_type=loss_type, load_rollout_data=tmp_path / "empty"))


@pytest.mark.parametrize("live", ["flow_grpo"], indirect=True)
def test_records_of_another_configuration_are_refused(live, tiny_model_dir, tmp_path):
    loss_type, records, _, _ = live
    other = "nft" if loss_type == "flow_grpo" else "flow_grpo"
    with pytest.raises(ValueError, match=f"--loss-type {loss_type}; this run has {other}"):
        Trainer(config(tiny_model_dir, tmp_path / "a", loss_type=other, load_rollout_data=records))
    with pytest.raises(ValueError, match="--n-samples-per-prompt 3; this run has 2"):
        Trainer(config(tiny_model_dir, tmp_path / "b", loss_type=loss_type, load_rollout_data=records,
                       n_samples_per_prompt=2, global_batch_size=2))
    # A sampling setting outside the fingerprint shows in the recorded request, named by its field.
    trainer = Trainer(config(tiny_model_dir, tmp_path / "c", loss_type=loss_type, load_rollout_data=records,
                             diffusion_num_steps=4, diffusion_sde_window_range=(0, 4)))
    with pytest.raises(ValueError, match="num_inference_steps = 3, this run's 4"):
        trainer.train()


def test_debug_rollout_only_saves_records_and_leaves_the_weights(tiny_model_dir, tmp_path):
    trainer = Trainer(config(tiny_model_dir, tmp_path / "run", loss_type="nft", debug_rollout_only=True,
                             save_rollout_data=tmp_path / "records"))
    start = _state(trainer)
    trainer.train()
    assert all(torch.equal(a, b) for a, b in zip(start, _state(trainer), strict=True))
    assert trainer.policy.weight_version == 0
    assert existing_records(tmp_path / "records") == [0, 1]
    rollouts = _records(tmp_path / "run")[1:]
    assert all("rollout/reward/raw_mean" in r and "train/loss" not in r for r in rollouts)


def test_debug_train_only_needs_records(tiny_model_dir, tmp_path, capsys):
    with pytest.raises(ValueError, match="--debug-train-only trains from saved rollouts: pass --load-rollout-data"):
        validate_config(config(tiny_model_dir, tmp_path / "a", debug_train_only=True))
    assert cli_main(["train", "--model-path", str(tiny_model_dir), "--output-dir", str(tmp_path / "b"),
                     "--debug-train-only"]) == 2
    assert "--load-rollout-data" in capsys.readouterr().err
    for bad in ({"debug_rollout_only": True}, {"save_rollout_data": tmp_path / "x"},
                {"engine_urls": ("http://h:1",)}):
        with pytest.raises(ValueError, match="--load-rollout-data"):
            validate_config(config(tiny_model_dir, tmp_path / "c", load_rollout_data=tmp_path, **bad))
    cfg = parse(["train", "--load-rollout-data", str(tmp_path), "--debug-train-only", "--output-dir", str(tmp_path)])
    assert cfg.replay.load_rollout_data == tmp_path and cfg.replay.debug_train_only
    cfg = parse(["train", "--save-rollout-data", str(tmp_path), "--debug-rollout-only"])
    assert cfg.replay.save_rollout_data == tmp_path and cfg.replay.debug_rollout_only


def _without_timings(path):
    """A record's metadata (its tensors' sha256 included) without the engine's timings."""
    with safe_open(str(path), framework="pt") as f:
        meta = json.loads(f.metadata()[METADATA_KEY])
    for sample in meta["samples"]:
        del sample["inference_time_s"], sample["peak_memory_mb"]
    return meta


def test_resume_rewrites_records_without_duplicates(tiny_model_dir, tmp_path):
    records, out = tmp_path / "records", tmp_path / "run"
    Trainer(config(tiny_model_dir, out, checkpoint_interval=1, save_rollout_data=records)).train()
    before = {k: _without_timings(record_path(records, k)) for k in (0, 1)}
    # Killed after rollout 1's record was written but before its checkpoint, mid-write of another record.
    shutil.rmtree(out / "checkpoints" / "rollout-00002")
    (records / ".rollout-000002.safetensors.999.tmp").write_bytes(b"half a record")
    with pytest.raises(FileExistsError, match="already holds rollout records"):
        Trainer(config(tiny_model_dir, tmp_path / "fresh", save_rollout_data=records))  # another run may not mix in
    resumed = Trainer(config(tiny_model_dir, out, checkpoint_interval=1, save_rollout_data=records, resume=True))
    assert resumed.rollout_index == 1
    resumed.train()
    assert sorted(p.name for p in records.iterdir()) == ["rollout-000000.safetensors", "rollout-000001.safetensors"]
    assert {k: _without_timings(record_path(records, k)) for k in (0, 1)} == before  # the same rollout, rewritten


def test_the_fingerprint_holds_the_size_however_it_was_spelled(tmp_path):
    """--resolution N and --height N --width N make the same records; records from before --height/--width
    (which held the square side as `resolution`) still load; a size or --reward-frames that differs is named."""
    from diffrl.train.replay import _check_fingerprint, fingerprint

    square = fingerprint(TrainConfig.flat(resolution=16), "demo")
    assert square == fingerprint(TrainConfig.flat(height=16, width=16), "demo")
    assert (square["height"], square["width"]) == (16, 16) and "resolution" not in square
    older = {k: v for k, v in square.items() if k not in ("height", "width", "reward_frames")} | {"resolution": 16}
    _check_fingerprint(tmp_path / "r", older, square)
    with pytest.raises(ValueError, match="recorded with --width 16; this run has 24"):
        _check_fingerprint(tmp_path / "r", square, fingerprint(TrainConfig.flat(height=16, width=24), "demo"))
    with pytest.raises(ValueError, match=r"recorded with --reward-frames \(the default\); this run has 3"):
        _check_fingerprint(tmp_path / "r", square, fingerprint(TrainConfig.flat(resolution=16, reward_frames=3), "demo"))
