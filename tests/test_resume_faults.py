"""Faults around checkpoints and resume: a crash inside a checkpoint write, a damaged or truncated
train state, a torn metrics line, kill -9 at a random moment, and NaN weights in a model directory."""

import json
import os
import random
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file
from test_trainer import tiny_config

import diffrl.train.checkpointer as checkpointer_module
from diffrl.cli.main import main as cli_main
from diffrl.errors import ModelLoadError
from diffrl.models.demo import DemoFamily
from diffrl.train.checkpointer import MANIFEST, verify_checkpoint
from diffrl.train.metrics import read_metrics
from diffrl.train.train_state import read_single_file
from diffrl.train.trainer import Trainer

FAST = dict(eval_images_per_category=0)  # no held-out sampling: these tests are about the run folder
COMPARED = ("rollout/reward/raw_mean", "rollout/reward/std", "train/loss", "train/grad_norm")


def _strict_records(out: Path) -> list[dict]:
    """Every line of metrics.jsonl parsed, none skipped: the file must be whole."""
    return [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]


def _params(checkpoint: Path) -> list[torch.Tensor]:
    return torch.load(checkpoint / "train_state.pt", weights_only=True)["params"]


def _same_run(a: Path, b: Path, last: int) -> None:
    """Run folders `a` and `b` logged the same rollouts 0..last once each, with the same values, and
    their final checkpoints hold the same weights."""
    ra, rb = _strict_records(a), _strict_records(b)
    assert [r["rollout"] for r in rb] == list(range(last + 1))
    assert [r["rollout"] for r in ra] == list(range(last + 1))
    for x, y in zip(ra, rb, strict=True):
        for key in COMPARED:
            assert (key in x) == (key in y) and x.get(key) == y.get(key), (x["rollout"], key)
    final = f"checkpoints/rollout-{last:05d}"
    assert verify_checkpoint(a / final) is None and verify_checkpoint(b / final) is None
    assert all(torch.equal(x, y) for x, y in zip(_params(a / final), _params(b / final), strict=True))


@pytest.fixture
def two_rollout_run(module_tiny_model_dir, restorable_runs) -> Path:
    """A run of the module's tiny model done to rollout 2 (no held-out sampling), trained once for the module:
    each test gets its own copy to damage and resume."""
    return restorable_runs("run", lambda out: Trainer(tiny_config(module_tiny_model_dir, out, num_rollout=2,
                                                                  **FAST)).train())


@pytest.fixture
def one_rollout_run(module_tiny_model_dir, restorable_runs) -> Path:
    """The same to rollout 1, trained once for the module; each test gets its own copy."""
    return restorable_runs("run-1", lambda out: Trainer(tiny_config(module_tiny_model_dir, out, num_rollout=1,
                                                                    **FAST)).train())


def test_resume_at_or_past_num_rollout_says_so_and_leaves_the_run_as_it_was(module_tiny_model_dir, two_rollout_run,
                                                                           capsys):
    """A run done to rollout 2 resumed with --num-rollout 1 (or 2) trains nothing, says so in one line and
    rewrites no file: the report said "2 of 1 rollouts" from the rewritten config.json."""
    tiny_model_dir, out = module_tiny_model_dir, two_rollout_run
    files = ("config.json", "metrics.jsonl", "report.md")
    before = {name: (out / name).read_bytes() for name in files}
    assert "2 of 2 rollouts" in before["report.md"].decode()
    for num_rollout in (1, 2):
        capsys.readouterr()
        assert Trainer(tiny_config(tiny_model_dir, out, num_rollout=num_rollout, resume=True, **FAST)).train() == {}
        lines = [line for line in capsys.readouterr().out.splitlines() if line.startswith("--resume")]
        assert lines == [f"--resume: {out} is at rollout 2 already, --num-rollout is {num_rollout}: nothing to "
                         "train (pass a larger --num-rollout to continue it)"]
        assert {name: (out / name).read_bytes() for name in files} == before


def test_a_crash_inside_a_checkpoint_write_leaves_the_previous_one_to_resume(tiny_model_dir, tmp_path, monkeypatch,
                                                                            capsys):
    straight = tmp_path / "straight"
    Trainer(tiny_config(tiny_model_dir, straight, num_rollout=3, **FAST)).train()

    out = tmp_path / "crashed"
    real_save = checkpointer_module.save_train_state

    def crash_at_rollout_2(path, **kwargs):
        if kwargs["meta"]["rollout_index"] == 2:  # the model is written, the train state half of it
            (path / "train_state.pt").write_bytes(b"PK\x03\x04 cut short")
            raise OSError("No space left on device")
        real_save(path, **kwargs)

    monkeypatch.setattr(checkpointer_module, "save_train_state", crash_at_rollout_2)
    with pytest.raises(OSError, match="No space left"):
        Trainer(tiny_config(tiny_model_dir, out, num_rollout=3, **FAST)).train()
    monkeypatch.undo()
    checkpoints = out / "checkpoints"
    assert [p.name for p in checkpoints.glob("rollout-*")] == ["rollout-00001"]  # the torn one never took the name
    assert verify_checkpoint(checkpoints / "rollout-00001") is None
    assert [r["rollout"] for r in _strict_records(out)] == [0, 1, 2]  # rollout 2 was logged before the crash

    resumed = Trainer(tiny_config(tiny_model_dir, out, num_rollout=3, resume=True, **FAST))
    assert resumed.rollout_index == 1
    assert "dropped 1 record(s) after rollout 1" in capsys.readouterr().out
    resumed.train()
    assert not list(checkpoints.glob(".*"))  # the interrupted write was cleared
    _same_run(straight, out, last=3)


def _flip_byte(path: Path) -> None:
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0x01  # inside the stored tensors: torch.load would read it without complaint
    path.write_bytes(bytes(data))


DAMAGE = {
    "flipped-byte": _flip_byte,
    "truncated": lambda p: p.write_bytes(p.read_bytes()[: p.stat().st_size // 2]),
    "empty": lambda p: p.write_bytes(b""),
    "no-manifest": lambda p: (p.parent / MANIFEST).unlink(),  # a folder whose write never finished
}


@pytest.mark.parametrize("damage", list(DAMAGE))
def test_a_damaged_newest_checkpoint_is_skipped_for_the_older_complete_one(module_tiny_model_dir, two_rollout_run,
                                                                           capsys, damage):
    tiny_model_dir, out = module_tiny_model_dir, two_rollout_run
    newest = out / "checkpoints" / "rollout-00002"
    expected = _params(newest)
    records = _strict_records(out)
    DAMAGE[damage](newest / "train_state.pt")
    assert verify_checkpoint(newest) is not None
    capsys.readouterr()

    resumed = Trainer(tiny_config(tiny_model_dir, out, num_rollout=2, resume=True, **FAST))
    printed = capsys.readouterr().out
    skipped = [line for line in printed.splitlines() if "skipping" in line]
    assert len(skipped) == 1 and str(newest) in skipped[0]
    assert resumed.rollout_index == 1
    resumed.train()  # rollout 2 again: its folder is replaced by a complete one
    assert verify_checkpoint(newest) is None
    assert all(torch.equal(a, b) for a, b in zip(_params(newest), expected, strict=True))
    again = _strict_records(out)
    assert [r["rollout"] for r in again] == [0, 1, 2]
    assert again[2]["rollout/reward/raw_mean"] == records[2]["rollout/reward/raw_mean"]


def _cli_flags(model_dir: Path, out: Path, num_rollout: int) -> list[str]:
    return ["train", "--model-path", str(model_dir), "--output-dir", str(out), "--num-rollout", str(num_rollout),
            "--rollout-batch-size", "2", "--n-samples-per-prompt", "3", "--rollout-microgroup-size", "2",
            "--global-batch-size", "3", "--num-steps-per-rollout", "2", "--micro-batch-size", "2",
            "--diffusion-num-steps", "3", "--diffusion-sde-window-range", "0", "3", "--diffusion-num-sde-steps", "2",
            "--diffusion-guidance-scale", "2.0", "--lr", "1e-3", "--no-use-lora", "--eval-images-per-category", "0",
            "--checkpoint-interval", "1", "--device", "cpu", "--reward", "rewards_for_tests:darkness"]


@pytest.mark.parametrize("damage", ["flipped-byte", "truncated"])
def test_the_only_checkpoint_damaged_is_a_one_line_error_naming_it(module_tiny_model_dir, restorable_runs, capsys,
                                                                   damage):
    def first_rollout(out):
        assert cli_main(_cli_flags(module_tiny_model_dir, out, 1)) == 0

    tiny_model_dir, out = module_tiny_model_dir, restorable_runs("cli-run", first_rollout)
    only = out / "checkpoints" / "rollout-00001"
    DAMAGE[damage](only / "train_state.pt")
    capsys.readouterr()
    assert cli_main(_cli_flags(tiny_model_dir, out, 2) + ["--resume"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err[-1].startswith("error: --resume: no complete checkpoint under") and str(out / "checkpoints") in err[-1]
    assert "rollout-00001: train_state.pt" in err[-1]
    assert not any("Traceback" in line for line in err)


@pytest.mark.parametrize("content", [b"", b"PK\x03\x04 cut", b"not a torch file at all"], ids=["empty", "truncated", "junk"])
def test_an_unreadable_train_state_is_a_one_line_error_naming_the_file(tmp_path, content):
    """What a checkpoint without a manifest (from an older diffrl) meets on load."""
    path = tmp_path / "train_state.pt"
    path.write_bytes(content)
    with pytest.raises(ValueError, match="damaged or truncated") as caught:
        read_single_file(path, "cpu")
    assert str(path) in str(caught.value) and "\n" not in str(caught.value)
    with pytest.raises(FileNotFoundError, match="train_state.pt is missing"):
        read_single_file(tmp_path / "nothing" / "train_state.pt", "cpu")


def test_a_torn_last_metrics_line_is_dropped_on_resume(module_tiny_model_dir, two_rollout_run, capsys):
    """Killed while writing rollout 2's record (before its checkpoint): the half line goes, rollout 2 is
    done again and logged once, and the file reads whole at the end of the run."""
    tiny_model_dir, out = module_tiny_model_dir, two_rollout_run
    expected = _strict_records(out)
    metrics = out / "metrics.jsonl"
    text = metrics.read_text()
    last_start = text.rstrip("\n").rfind("\n") + 1
    metrics.write_text(text[: last_start + (len(text) - last_start) // 2])  # half of rollout 2's line
    checkpoint = out / "checkpoints" / "rollout-00002"
    checkpoint.rename(checkpoint.with_name(".rollout-00002.partial"))  # its checkpoint was never published
    with pytest.raises(ValueError, match=r"metrics.jsonl, line 3"):  # another reader would meet it mid-file
        _append_and_read(metrics)

    metrics.write_text(text[: last_start + (len(text) - last_start) // 2])
    capsys.readouterr()
    resumed = Trainer(tiny_config(tiny_model_dir, out, num_rollout=2, resume=True, **FAST))
    assert "dropped its last line" in capsys.readouterr().out and resumed.rollout_index == 1
    resumed.train()
    again = _strict_records(out)
    assert [r["rollout"] for r in again] == [0, 1, 2]
    assert again[2]["rollout/reward/raw_mean"] == expected[2]["rollout/reward/raw_mean"]


def _append_and_read(metrics: Path):
    """A torn line followed by more records (what appending after it did: the first joins the half
    line) is an error naming the line."""
    with metrics.open("a") as f:
        f.write(json.dumps({"rollout": 2}) + "\n" + json.dumps({"rollout": 3}) + "\n")
    return read_metrics(metrics)


def test_reading_metrics_names_the_file_and_line(tmp_path):
    path = tmp_path / "metrics.jsonl"
    path.write_text('{"rollout": 0}\n{"rollout": 1}\n{"rollout": 2, "x": 1')
    records, torn = read_metrics(path)
    assert [r["rollout"] for r in records] == [0, 1] and torn
    path.write_text('{"rollout": 0}\n[1, 2]\n{"rollout": 2}\n')
    with pytest.raises(ValueError, match=rf"{path}, line 2: not a metrics record"):
        read_metrics(path)


def test_kill_9_at_a_random_moment_then_resume_matches_the_uninterrupted_run(tiny_model_dir, tmp_path):
    """`diffrl train` killed with SIGKILL at a random moment after its first checkpoint (mid rollout,
    mid metrics write or mid checkpoint write), then `--resume`d: the same metrics, each rollout once,
    and the same final weights as the run never killed. The seed of the moment is in the failure message."""
    seed = int.from_bytes(os.urandom(4), "little")
    rng = random.Random(seed)
    num_rollout = 8  # the kill lands anywhere in rollouts 2-6: mid rollout, metrics write or checkpoint write
    env = {**os.environ, "OMP_NUM_THREADS": "1",
           "PYTHONPATH": os.pathsep.join([str(Path(__file__).parent), os.environ.get("PYTHONPATH", "")])}
    cli = [sys.executable, "-m", "diffrl.cli.main"]

    def start(out: Path, *extra: str) -> subprocess.Popen:
        log = (tmp_path / f"{out.name}{len(extra)}.log").open("w")
        return subprocess.Popen(cli + _cli_flags(tiny_model_dir, out, num_rollout) + list(extra), env=env,
                                stdout=log, stderr=subprocess.STDOUT)

    def log_of(out: Path, n_extra: int) -> str:
        return (tmp_path / f"{out.name}{n_extra}.log").read_text()

    def wait_for(path: Path, proc: subprocess.Popen, timeout: float = 120) -> float:
        deadline = time.monotonic() + timeout
        while not path.exists():
            assert proc.poll() is None and time.monotonic() < deadline, f"seed {seed}: {path} never appeared"
            time.sleep(0.01)
        return time.monotonic()

    straight, split = tmp_path / "straight", tmp_path / "split"
    reference = start(straight)  # alongside: each process has one thread
    victim = start(split)
    first = wait_for(split / "checkpoints" / "rollout-00001" / MANIFEST, victim)
    pace = wait_for(split / "checkpoints" / "rollout-00002" / MANIFEST, victim) - first
    time.sleep(rng.uniform(0, pace * (num_rollout - 4)))
    assert victim.poll() is None, f"seed {seed}: the run ended before the kill"
    victim.send_signal(signal.SIGKILL)
    victim.wait()

    resumed = start(split, "--resume")
    assert resumed.wait(timeout=300) == 0, f"seed {seed}: {log_of(split, 1)[-3000:]}"
    assert reference.wait(timeout=300) == 0, log_of(straight, 0)[-3000:]
    assert "resumed from" in log_of(split, 1), f"seed {seed}"
    try:
        _same_run(straight, split, last=num_rollout)
    except AssertionError as err:
        raise AssertionError(f"seed {seed}: {err}") from None


# ---------------------------------------------------------------------- NaN weights in a model directory
@pytest.mark.parametrize("value", [float("nan"), float("inf")])
def test_non_finite_transformer_weights_are_refused_naming_file_and_tensor(tiny_model_dir, value):
    weights = tiny_model_dir / "transformer" / "diffusion_pytorch_model.safetensors"
    state = load_file(str(weights))
    name = sorted(state)[len(state) // 2]
    state[name].view(-1)[3] = value
    save_file(state, str(weights))
    with pytest.raises(ModelLoadError) as caught:
        DemoFamily.load(tiny_model_dir)
    message = str(caught.value)
    assert str(weights) in message and repr(name) in message and "\n" not in message
    assert cli_main(["evaluate", "--model-path", str(tiny_model_dir), "--device", "cpu"]) == 2


def test_non_finite_text_encoder_and_lora_weights_are_refused(tiny_model_dir, tmp_path):
    from diffrl.models.checkpoint import load_model

    encoder = tiny_model_dir / "text_encoder" / "model.safetensors"
    clean = load_file(str(encoder))
    state = {k: v.clone() for k, v in clean.items()}
    name = sorted(state)[0]
    state[name].view(-1)[0] = float("nan")
    save_file(state, str(encoder))
    with pytest.raises(ModelLoadError, match=rf"{encoder} holds NaN or inf in tensor '{name}'"):
        DemoFamily.load(tiny_model_dir)
    save_file(clean, str(encoder))

    out = tmp_path / "run"
    Trainer(tiny_config(tiny_model_dir, out, use_lora=True, **FAST)).train()
    adapter = out / "checkpoints" / "rollout-00001" / "lora" / "adapter_model.safetensors"
    lora = load_file(str(adapter))
    lora_name = sorted(lora)[-1]
    lora[lora_name].view(-1)[-1] = float("-inf")
    save_file(lora, str(adapter))
    with pytest.raises(ModelLoadError, match=rf"{adapter} holds NaN or inf in tensor '{lora_name}'"):
        load_model(tiny_model_dir, adapter.parent)  # the adapter folder alone: no manifest to catch it first


def test_from_pretrained_components_name_the_shard_holding_the_bad_tensor(tmp_path):
    """The diffusers families check their loaded modules on the device; a sharded folder's index
    says which file holds the tensor."""
    from diffrl.models.weights import require_finite_modules

    module = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.LayerNorm(4))
    folder = tmp_path / "transformer"
    folder.mkdir()
    index = {"weight_map": {"0.weight": "model-00001-of-00002.safetensors", "0.bias": "model-00001-of-00002.safetensors",
                            "1.weight": "model-00002-of-00002.safetensors", "1.bias": "model-00002-of-00002.safetensors"}}
    (folder / "diffusion_pytorch_model.safetensors.index.json").write_text(json.dumps(index))
    require_finite_modules(tmp_path, {"transformer": module, "vae": None})  # finite: nothing to say
    with torch.no_grad():
        module[1].bias[2] = float("nan")
    with pytest.raises(ModelLoadError, match=r"model-00002-of-00002.safetensors holds NaN or inf in tensor '1.bias'"):
        require_finite_modules(tmp_path, {"transformer": module})


def test_evaluating_a_damaged_run_checkpoint_names_it(module_tiny_model_dir, one_rollout_run):
    """`diffrl evaluate` / `compare` load run checkpoints through load_model, which checks the manifest:
    a flipped byte in the saved weights would otherwise score other weights without a word."""
    from diffrl.models.checkpoint import load_model

    tiny_model_dir, out = module_tiny_model_dir, one_rollout_run
    checkpoint = out / "checkpoints" / "rollout-00001"
    assert load_model(tiny_model_dir, checkpoint).transformer is not None
    _flip_byte(checkpoint / "model" / "transformer" / "diffusion_pytorch_model.safetensors")
    with pytest.raises(ModelLoadError, match=r"damaged checkpoint: .*rollout-00001 \(model/transformer/"
                                             r"diffusion_pytorch_model.safetensors does not match its sha256"):
        load_model(tiny_model_dir, checkpoint)


def test_a_from_pretrained_family_refuses_nan_weights_naming_file_and_tensor(tmp_path):
    """The diffusers `from_pretrained` path (SD3 here; every such family makes the same call)."""
    from diffrl.models.random_checkpoints.sd3 import save_random_checkpoint
    from diffrl.models.sd3 import SD3Family

    root = save_random_checkpoint(tmp_path / "sd3-tiny", with_t5=False)
    weights = next((root / "transformer").glob("*.safetensors"))
    state = load_file(str(weights))
    name = sorted(state)[-1]
    state[name].view(-1)[0] = float("nan")
    save_file(state, str(weights), metadata={"format": "pt"})
    with pytest.raises(ModelLoadError, match=rf"{weights} holds NaN or inf in tensor '{name}'"):
        SD3Family.load(root)


def test_resume_with_another_loss_type_is_refused_naming_both(module_tiny_model_dir, one_rollout_run):
    """A Flow-GRPO run resumed with --loss-type nft went on as DiffusionNFT in the same metrics series and report."""
    tiny_model_dir, out = module_tiny_model_dir, one_rollout_run
    config = (out / "config.json").read_bytes()
    with pytest.raises(ValueError, match=r"^--resume: the checkpoint was trained with --loss-type flow_grpo, this run "
                                         r"asks for nft; resume with the same --loss-type"):
        Trainer(tiny_config(tiny_model_dir, out, num_rollout=2, resume=True, loss_type="nft", **FAST))
    assert (out / "config.json").read_bytes() == config


def test_resume_of_a_run_stopped_before_its_first_checkpoint_starts_it_again(tiny_model_dir, tmp_path, capsys):
    """A run killed before its first checkpoint left a folder that a plain run refuses as not empty and that --resume
    refused too ('no checkpoint under …'): nothing could retry it there. --resume now starts it from rollout 0 in
    that folder, its records replaced (none doubled)."""
    out = tmp_path / "run"
    out.mkdir()
    (out / "config.json").write_text("{}\n")  # what the failed start wrote before dying
    (out / "metrics.jsonl").write_text(json.dumps({"rollout": 0, "eval/strict": 0.5}) + "\n")
    with pytest.raises(FileExistsError, match="not empty; pass --resume"):
        Trainer(tiny_config(tiny_model_dir, out, **FAST))
    trainer = Trainer(tiny_config(tiny_model_dir, out, resume=True, num_rollout=1, **FAST))
    assert "holds no checkpoint yet; the run starts from rollout 0" in capsys.readouterr().out
    trainer.train()
    records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert [r["rollout"] for r in records] == [0, 1] and records[0].get("eval/strict") != 0.5
    assert (out / "checkpoints" / "rollout-00001").is_dir()
