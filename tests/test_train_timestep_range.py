"""`--train-timestep-range START END`: the methods trained on re-noised clean samples (DiffusionNFT, AWM, SFT, DPO,
DGPO, CRD) draw their timesteps from the steps whose place along the denoising, k/K, lies in [START, END)."""

import pytest
import torch

from diffrl.algorithms.pairs import candidate_steps, group_pairs, nft_pairs, preference_pairs
from diffrl.train.config import TrainConfig

SIGMAS = torch.cat([torch.linspace(1.0, 0.125, 8), torch.zeros(1)])


def _inputs(n=4):
    x0 = torch.randn(n, 2, 3, generator=torch.Generator().manual_seed(1))
    return x0, [100 + i for i in range(n)], SIGMAS, torch.linspace(-1, 1, n), [torch.zeros(1)] * n


def test_the_pairs_come_from_the_steps_in_the_range_only():
    assert candidate_steps(8, (0.0, 0.5)) == [0, 1, 2, 3] and candidate_steps(8, (0.5, 1.0)) == [4, 5, 6, 7]
    assert candidate_steps(10, (0.0, 0.9)) == list(range(9))
    noisier = nft_pairs(*_inputs(), timestep_fraction=0.5, timestep_range=(0.0, 0.5))
    assert len(noisier.t) == 4 * 2 and set(noisier.t.tolist()) <= set(SIGMAS[:4].tolist())
    for build, extra in ((preference_pairs, {"group_size": 2}), (group_pairs, {"group_size": 2})):
        pairs = build(*_inputs(), timestep_fraction=1.0, timestep_range=(0.5, 1.0), **extra)
        assert set(pairs.t.tolist()) <= set(SIGMAS[4:8].tolist()) and len(pairs.t) > 0


def test_the_whole_range_draws_what_it_drew_before():
    """(0, 1), the default, keeps every step: the same timesteps and noise per seed as a plain shuffle of the
    schedule (so runs and their resumes are unchanged)."""
    pairs = nft_pairs(*_inputs(), timestep_fraction=0.99)
    for s, seed in enumerate(_inputs()[1]):
        g = torch.Generator().manual_seed(seed)
        order = torch.randperm(8, generator=g)[:7].tolist()
        noise = [torch.randn(2, 3, generator=g) for _ in order]
        rows = slice(7 * s, 7 * (s + 1))
        assert pairs.t[rows].tolist() == SIGMAS[order].tolist()
        assert torch.equal(pairs.noise[rows], torch.stack(noise))


@pytest.mark.parametrize("flags, message", [
    ({"train_timestep_range": (0.5, 0.5)}, "--train-timestep-range 0.5 0.5 must satisfy 0 <= start < end <= 1"),
    ({"train_timestep_range": (0.01, 0.05)}, "--train-timestep-range 0.01 0.05 holds no step of a 10-step schedule"),
    ({"train_timestep_range": (0.0, 0.2), "nft_timestep_fraction": 0.4},
     "--nft-timestep-fraction 0.4 keeps none of the 2 steps"),
])
def test_a_range_that_trains_nothing_is_refused(flags, message):
    with pytest.raises(ValueError, match=message):
        TrainConfig.flat(loss_type="nft", diffusion_num_steps=10, diffusion_guidance_scale=1.0, **flags).check()


def test_an_nft_run_trains_in_the_noisier_half(tiny_model_dir, tmp_path, monkeypatch):
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
                      diffusion_num_steps=4, diffusion_sde_window_range=None, train_timestep_range=(0.0, 0.5),
                      nft_timestep_fraction=1.0)
    trainer = Trainer(cfg)
    record = trainer.rollout_and_update(0)
    assert torch.isfinite(torch.tensor(record["train/loss"]))
    (t, sigmas), = seen
    assert len(t) == 6 * 2  # 2 groups × 3 samples, 2 steps each
    assert set(t.tolist()) == set(sigmas[:2].tolist())  # the noisier half of the 4 steps, and all of it
