"""--reward-schedule: a multi: term's weight ramps over rollouts, and the trainer sums the terms with each rollout's
weights before its advantages."""

import pytest

from diffrl.rewards.schedule import WeightRamp, parse_schedule, weights_at

TERMS = {"shapes": 1.0, "white_background": 0.5, "rewards_for_tests:darkness": 0.0}


def test_a_ramp_by_hand():
    ramp = WeightRamp("white_background", 0.0, 1.0, 10, 30)
    assert [ramp.at(k) for k in (0, 10, 15, 20, 30, 99)] == [0.0, 0.0, 0.25, 0.5, 1.0, 1.0]
    ramps = parse_schedule(["white_background:0:1:10:30", "rewards_for_tests:darkness:2:0:0:4"], TERMS)
    assert weights_at(TERMS, ramps, 20) == {"shapes": 1.0, "white_background": 0.5, "rewards_for_tests:darkness": 0.0}
    assert weights_at(TERMS, ramps, 1) == {"shapes": 1.0, "white_background": 0.0, "rewards_for_tests:darkness": 1.5}


@pytest.mark.parametrize("entry, message", [
    ("ocr:0:1:0:10", "'ocr' is not a term of the multi: reward"),
    ("shapes:0:1:10", "expected NAME:START:END:FIRST:LAST"),
    ("shapes:a:1:0:10", "START and END are numbers"),
    ("shapes:0:1:10:10", "needs 0 <= FIRST < LAST"),
])
def test_bad_entries_are_named(entry, message):
    with pytest.raises(ValueError, match=message):
        parse_schedule([entry], TERMS)


def test_the_trainer_sums_the_terms_with_the_rollouts_weights(tiny_model_dir, tmp_path):
    """Rollout 0 of a ramp 0.5 → 1 weighs the term 0.5, over the multi: weight of 0: the same reward as a fixed
    weight of 0.5 on the same samples, and the weights are logged (the ramp's values: test_a_ramp_by_hand)."""
    from diffrl.cli.main import parse
    from diffrl.train.trainer import Trainer

    def first_rollout(reward, schedule, k, name):
        cfg = parse(["train", "--reward", reward, *schedule, "--rollout-batch-size", "2", "--n-samples-per-prompt", "2",
                     "--rollout-microgroup-size", "2", "--global-batch-size", "4", "--num-steps-per-rollout", "1",
                     "--diffusion-num-steps", "2", "--eval-images-per-category", "0", "--val-images-per-category", "0",
                     "--device", "cpu", "--model-path", str(tiny_model_dir), "--output-dir", str(tmp_path / name),
                     "--loss-type", "nft"])
        return Trainer(cfg).rollout_and_update(k)

    ramped = first_rollout("multi:rewards_for_tests:darkness=1,jpeg_compressibility=0",
                           ["--reward-schedule", "jpeg_compressibility:0.5:1:0:2"], 0, "ramped")
    fixed = first_rollout("multi:rewards_for_tests:darkness=1,jpeg_compressibility=0.5", [], 0, "fixed")
    assert ramped["rollout/reward_weight/jpeg_compressibility"] == 0.5
    assert ramped["rollout/reward_weight/rewards_for_tests:darkness"] == 1.0
    assert ramped["rollout/reward/raw_mean"] == pytest.approx(fixed["rollout/reward/raw_mean"], rel=1e-12)
    with pytest.raises(ValueError, match="none: --reward is not a multi: sum"):
        parse(["train", "--reward", "shapes", "--reward-schedule", "shapes:0:1:0:9", "--device", "cpu"]).check()
