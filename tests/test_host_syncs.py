"""Host synchronizations (diffrl.utils.host_syncs) of the denoising loop and the training loop stay at what they
were brought down to: a regression (an `.item()` per step or per micro-batch, a boolean mask, a read of a device
tensor) fails here, naming its source line. The counter itself must see a deliberate sync."""

import math

import pytest
import torch
from benchmark_scripts import load_benchmark

from diffrl.utils.host_syncs import HostSyncCounter



@pytest.fixture(scope="module")
def script():
    return load_benchmark("host_syncs")


def test_counter_sees_each_kind_of_sync_and_where_it_comes_from():
    x = torch.randn(8)
    with HostSyncCounter() as counter:
        y = (x * 2).sum()  # device work only
        torch.isfinite(x).all()  # a reduction, not read
    assert counter.total == 0
    with HostSyncCounter() as counter:
        x.sum().item()
    assert counter.count("item") == 1
    ((where, kind, op), n), = counter.by_site().items()
    assert (kind, op, n) == ("item", "_local_scalar_dense", 1) and where == "?"  # this file is not diffrl's
    with HostSyncCounter() as counter:
        if torch.isfinite(y):  # bool(tensor)
            pass
        float(y)
        x[x > 0]  # boolean mask: its size depends on the data
        torch.nonzero(x)
        x.tolist()
        x.cpu()
    assert counter.count("item") == 2 and counter.count("shape") == 2 and counter.count("read") == 2
    assert counter.total == 6


def test_counter_names_the_diffrl_line():
    from diffrl.algorithms.advantages import compute_advantages

    with HostSyncCounter() as counter:
        compute_advantages(torch.tensor([1.0, 2.0, 3.0, 3.0]), ["a", "a", "b", "b"])
    assert counter.total > 0
    assert all(where.startswith("diffrl/algorithms/advantages.py:") for where, _, _ in counter.by_site())


def test_optimizer_step_counters_are_host_tensors():
    p = torch.nn.Parameter(torch.randn(4))
    optimizer = torch.optim.AdamW([p])
    p.sum().backward()
    with HostSyncCounter() as counter:
        optimizer.step()  # reads its CPU step counter: no sync on any device
    assert counter.total == 0


def test_denoising_steps_do_not_sync(script, tiny_family, tmp_path):
    from diffrl.models.random_checkpoints.sd3 import save_random_checkpoint

    sd3 = script.load_as_on_a_gpu(save_random_checkpoint(tmp_path / "sd3", with_t5=False), torch.device("cpu"))
    for family in (tiny_family, sd3):
        result = script.engine_syncs(family, steps=(3, 5))
        report = result["long"].report()
        assert result["per_step"] == 0, report
        # Per request: the prompts' position ids compared once (CFG in one forward), the response read back
        # (finite flags, images, schedule, trajectory, log-probs, the denoising env) and host-side bookkeeping.
        assert result["per_request"] <= 17, report
        assert not [site for site in result["long"].by_site() if site[0].startswith("diffrl/engine/denoise.py")
                    or site[0].startswith("diffrl/sampling/")], report


@pytest.mark.parametrize(("loss_type", "forward_syncs"), [("flow_grpo", 0), ("nft", 4)])
def test_training_micro_batches_do_not_sync(script, tiny_model_dir, tmp_path, loss_type, forward_syncs):
    result = script.trainer_syncs(tiny_model_dir, tmp_path / "run", loss_type=loss_type)
    counter = result["counter"]
    report = counter.report()
    # What is left per micro-batch: for NFT, the demo family's timestep MLP finding its distinct rows (torch.unique,
    # a batch-invariance layer the demo family keeps on every device) once per transformer forward. Flow-GRPO's
    # micro-batches hold one trained step, whose σ reaches the MLP as one value: no search.
    unique = sum(n for (where, _, op), n in counter.by_site().items() if op == "unique_dim")
    assert unique == forward_syncs * result["micro_batches"], report
    # Besides: CFG's check that both halves share the text position ids, once per update (remembered after).
    assert round(result["per_loss"] * result["micro_batches"]) - unique <= (1 if loss_type == "flow_grpo" else 0), report
    # One read of the statistics per update (float64 on the device until then), spread over its micro-batches.
    assert result["per_micro_batch"] <= forward_syncs + 2 / result["micro_batches"], report
    assert result["per_optimizer_step"] <= 1, report  # the gradient norm and the finite-loss flag, read together


def test_a_nonfinite_loss_still_skips_its_optimizer_step(script, tiny_model_dir, tmp_path):
    """The finite check of the losses is read with the gradient norm, at the optimizer step: a step with a
    non-finite micro-batch loss is still skipped whole, and the next one still runs."""
    from diffrl.train.trainer import Trainer

    trainer = Trainer(script.tiny_train_config(tiny_model_dir, tmp_path / "run"))
    original, calls = trainer.objective.loss, []

    def loss(batch, env, step):
        value, stats = original(batch, env, step)
        calls.append(step)
        return (value * float("nan") if len(calls) == 1 else value), stats

    trainer.objective.loss = loss
    record = trainer.rollout_and_update(0)
    assert calls.count(0) > 1  # the step's other micro-batches ran too
    assert record["train/skipped_steps"] == 1 and trainer.policy.weight_version == 1
    assert math.isfinite(record["train/grad_norm"]) and math.isfinite(record["train/loss"])


def test_sd3_flow_grpo_micro_batches_do_not_sync(script, tmp_path):
    """SD3's Flow-GRPO settings in small (LoRA, CFG 4.5), as a GPU runs the forward: nothing per micro-batch but
    the CFG check of the position ids, once per update (remembered after), and the update's one read."""
    from diffrl.models.random_checkpoints.sd3 import save_random_checkpoint

    path = save_random_checkpoint(tmp_path / "sd3", with_t5=False)
    with script.as_on_a_gpu():
        result = script.trainer_syncs(path, tmp_path / "run", loss_type="flow_grpo", use_lora=True,
                                      diffusion_guidance_scale=4.5)
    report = result["counter"].report()
    assert round(result["per_loss"] * result["micro_batches"]) <= 1, report
    assert round(result["per_micro_batch"] * result["micro_batches"]) <= 2, report
    assert result["per_optimizer_step"] <= 1, report
