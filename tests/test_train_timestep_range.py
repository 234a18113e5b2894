"""`--train-timestep-range START END`, `--train-timesteps N` and `--train-timestep-sampling`: the methods trained on re-noised clean samples
(DiffusionNFT, AWM, SFT, DPO, DGPO, CRD) draw their timesteps from the schedule steps whose σ lies in [1 − END,
1 − START] (a fraction of the way from noise to image, as Flow-Factory's timestep_range), N of them or
--nft-timestep-fraction of them."""

import pytest
import torch

from diffrl.algorithms.pairs import TimestepChoice, candidate_steps, group_pairs, nft_pairs, preference_pairs
from diffrl.train.config import TrainConfig

SIGMAS = torch.cat([torch.linspace(1.0, 0.125, 8), torch.zeros(1)])


def _inputs(n=4):
    x0 = torch.randn(n, 2, 3, generator=torch.Generator().manual_seed(1))
    return x0, [100 + i for i in range(n)], SIGMAS, torch.linspace(-1, 1, n), [torch.zeros(1)] * n


def test_the_pairs_come_from_the_steps_in_the_range_only():
    schedule = SIGMAS[:-1]  # 1, 0.875, …, 0.125
    assert candidate_steps(schedule, (0.0, 0.5)) == [0, 1, 2, 3, 4] and candidate_steps(schedule, (0.5, 1.0)) == [4, 5, 6, 7]
    shifted = torch.tensor([1.0, 0.95, 0.9, 0.8, 0.6, 0.3])  # a shifted schedule: most steps are noisy
    assert candidate_steps(shifted, (0.0, 0.5)) == [0, 1, 2, 3, 4] and candidate_steps(shifted, (0.5, 0.9)) == [5]
    noisier = nft_pairs(*_inputs(), timesteps=TimestepChoice(count=2, range=(0.0, 0.5)))
    assert len(noisier.t) == 4 * 2 and set(noisier.t.tolist()) <= set(SIGMAS[:5].tolist())
    for build, extra in ((preference_pairs, {"group_size": 2}), (group_pairs, {"group_size": 2})):
        pairs = build(*_inputs(), timesteps=TimestepChoice(fraction=1.0, range=(0.5, 1.0)), **extra)
        assert set(pairs.t.tolist()) <= set(SIGMAS[4:8].tolist()) and len(pairs.t) > 0


def test_the_whole_range_draws_what_it_drew_before():
    """(0, 1), the default, keeps every step: the same timesteps and noise per seed as a plain shuffle of the
    schedule (so runs and their resumes are unchanged)."""
    pairs = nft_pairs(*_inputs())
    for s, seed in enumerate(_inputs()[1]):
        g = torch.Generator().manual_seed(seed)
        order = torch.randperm(8, generator=g)[:7].tolist()
        noise = [torch.randn(2, 3, generator=g) for _ in order]
        rows = slice(7 * s, 7 * (s + 1))
        assert pairs.t[rows].tolist() == SIGMAS[order].tolist()
        assert torch.equal(pairs.noise[rows], torch.stack(noise))


@pytest.mark.parametrize("flags, message", [
    ({"train_timestep_range": (0.5, 0.5)}, "--train-timestep-range 0.5 0.5 must satisfy 0 <= start < end <= 1"),
    ({"train_timesteps": 0}, "--train-timesteps must be >= 1"),
])
def test_a_bad_range_or_count_is_refused(flags, message):
    with pytest.raises(ValueError, match=message):
        TrainConfig.flat(loss_type="nft", diffusion_num_steps=10, diffusion_guidance_scale=1.0, **flags).check()


def test_a_range_that_trains_nothing_on_the_familys_schedule_is_refused_at_start(tiny_model_dir, tmp_path):
    from diffrl.train.trainer import Trainer
    from test_trainer import tiny_config

    flags = dict(loss_type="nft", diffusion_guidance_scale=1.0, diffusion_num_steps=4, diffusion_sde_window_range=None)
    with pytest.raises(ValueError, match=r"--train-timestep-range 0.99 1 \(σ from 0 to 0.01\) holds no step"):
        Trainer(tiny_config(tiny_model_dir, tmp_path / "a", train_timestep_range=(0.99, 1.0), **flags))
    with pytest.raises(ValueError, match="--nft-timestep-fraction 0.3 keeps none of the 1 steps"):
        Trainer(tiny_config(tiny_model_dir, tmp_path / "b", train_timestep_range=(0.0, 0.01), nft_timestep_fraction=0.3,
                            **flags))


def test_an_nft_run_trains_the_noisiest_steps_only(tiny_model_dir, tmp_path, monkeypatch):
    import diffrl.train.objectives.base as objectives

    seen, real = [], objectives.ForwardProcessObjective.re_noised_pairs

    def spy(self, build, samples, *args, **kwargs):
        pairs = real(self, build, samples, *args, **kwargs)
        seen.append((pairs.t.clone(), samples[0].output.dit_trajectory.sigmas))
        return pairs

    monkeypatch.setattr(objectives.ForwardProcessObjective, "re_noised_pairs", spy)
    from diffrl.train.trainer import Trainer
    from test_trainer import tiny_config

    cfg = tiny_config(tiny_model_dir, tmp_path / "run", loss_type="nft", diffusion_guidance_scale=1.0,
                      diffusion_num_steps=4, diffusion_sde_window_range=None, train_timestep_range=(0.0, 0.2),
                      train_timesteps=2)
    trainer = Trainer(cfg)
    record = trainer.rollout_and_update(0)
    assert torch.isfinite(torch.tensor(record["train/loss"]))
    (t, sigmas), = seen
    assert len(t) == 6 * 2  # 2 groups × 3 samples, 2 steps each
    noisy = {x for x in sigmas[:-1].tolist() if x >= 0.8 - 1e-6}
    assert set(t.tolist()) == noisy and len(noisy) == 2  # the 2 steps of σ ≥ 0.8 of the demo's 4 (1, 0.9, 0.75, 0.5)


@pytest.mark.parametrize("sampling", ["uniform", "logit_normal"])
def test_continuous_timesteps_lie_in_the_range_and_follow_the_seed(sampling):
    choice = TimestepChoice(count=64, range=(0.2, 0.6), sampling=sampling)
    g, ts = choice.draw(7, SIGMAS[:-1])
    t = torch.stack(ts)
    assert len(t) == 64 and float(t.min()) >= 0.4 - 1e-6 and float(t.max()) <= 0.8 + 1e-6
    assert torch.equal(t, torch.stack(choice.draw(7, SIGMAS[:-1])[1]))  # the seed fixes them
    assert not torch.equal(t, torch.stack(choice.draw(8, SIGMAS[:-1])[1]))
    if sampling == "uniform":  # stratified: one value in each 64th of the range
        fractions = ((1 - t) - 0.2) / 0.4
        assert sorted(int(f * 64) for f in fractions.clamp(0, 1 - 1e-9)) == list(range(64))


def test_a_shift_above_one_moves_the_timesteps_toward_the_image():
    plain = torch.stack(TimestepChoice(count=256, sampling="logit_normal").draw(0, SIGMAS[:-1])[1])
    shifted = torch.stack(TimestepChoice(count=256, sampling="logit_normal", shift=3.0).draw(0, SIGMAS[:-1])[1])
    assert abs(float(plain.mean()) - 0.5) < 0.03 and float(shifted.mean()) < float(plain.mean()) - 0.1
    # u ← 3u / (1 + 2u) then σ = 1 − u: the same draws, warped
    u = 1 - plain
    torch.testing.assert_close(shifted, (1 - (3 * u / (1 + 2 * u)).clamp(0.01, 1.0)).to(shifted.dtype))


def test_an_nft_run_trains_at_continuous_timesteps(tiny_model_dir, tmp_path):
    from diffrl.train.trainer import Trainer
    from test_trainer import tiny_config

    cfg = tiny_config(tiny_model_dir, tmp_path / "run", loss_type="nft", diffusion_guidance_scale=1.0,
                      diffusion_num_steps=4, diffusion_sde_window_range=None, train_timestep_sampling="logit_normal",
                      train_timestep_shift=3.0, train_timesteps=3)
    record = Trainer(cfg).rollout_and_update(0)
    assert torch.isfinite(torch.tensor(record["train/loss"])) and record["train/grad_norm"] > 0


def test_the_timestep_flags_are_refused_for_a_method_that_trains_sde_steps():
    from diffrl.cli.main import parse

    with pytest.raises(ValueError, match="--train-timesteps sets the re-noised training timesteps; --loss-type "
                                         "flow_grpo does not read it"):
        parse(["train", "--loss-type", "flow_grpo", "--train-timesteps", "2"])


def test_the_noisiest_candidate_can_be_always_or_never_trained():
    """Flow-Factory's discrete_with_init / discrete_wo_init: the first (noisiest) step of the range always among a
    sample's timesteps, or never."""
    schedule = SIGMAS[:-1]  # candidates in (0, 0.5): steps 0…4, σ 1 … 0.5
    for seed in range(20):
        always = TimestepChoice(count=2, range=(0.0, 0.5), sampling="schedule_with_first").draw(seed, schedule)[1]
        never = TimestepChoice(count=2, range=(0.0, 0.5), sampling="schedule_without_first").draw(seed, schedule)[1]
        assert float(always[0]) == 1.0 and len(always) == 2 and float(always[1]) < 1.0
        assert all(0.5 <= float(s) < 1.0 for s in never) and len(never) == 2
    assert TimestepChoice(range=(0.0, 0.5), fraction=1.0, sampling="schedule_without_first").per_sample(schedule) == 4
    with pytest.raises(ValueError, match="schedule_without_first leaves no step"):
        TimestepChoice(range=(0.8, 0.9), sampling="schedule_without_first").per_sample(SIGMAS[:-1])  # σ 0.125 alone
