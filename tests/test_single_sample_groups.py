"""One sample per prompt: with per-prompt advantages every advantage is 0, so such a run is refused at start-up
instead of training nothing."""

import pytest

from diffrl.train.config import TrainConfig

ONE = dict(rollout_batch_size=2, n_samples_per_prompt=1, rollout_microgroup_size=1, global_batch_size=2,
           num_steps_per_rollout=1, micro_batch_size=2)


@pytest.mark.parametrize("loss_type", ["flow_grpo", "nft"])
def test_one_sample_per_prompt_is_refused_naming_the_flag(loss_type):
    with pytest.raises(ValueError, match=r"--n-samples-per-prompt 1: .*every advantage is 0.*--globalize-reward-mean"):
        TrainConfig.flat(loss_type=loss_type, **ONE).check()


def test_one_sample_per_prompt_is_fine_with_a_batch_wide_mean_or_without_training():
    TrainConfig.flat(globalize_reward_mean=True, **ONE).check()
    TrainConfig.flat(debug_rollout_only=True, **ONE).check()
    TrainConfig.flat(**{**ONE, "n_samples_per_prompt": 2, "global_batch_size": 4, "micro_batch_size": 4}).check()
