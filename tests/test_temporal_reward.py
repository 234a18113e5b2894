"""Temporal-consistency rewards on video tensors `[B, C, F, H, W]`."""

import pytest
import torch
from test_model_rewards import _save_tiny_clip

from diffrl.rewards import get_reward

G = torch.Generator().manual_seed(0)
STILL = torch.rand(1, 3, 1, 32, 32, generator=G).expand(1, 3, 6, 32, 32).clone()
NOISE = torch.rand(1, 3, 6, 32, 32, generator=G)


def _panning(n_frames: int = 6, step: int = 1) -> torch.Tensor:
    """A smooth scene moving `step` pixels per frame."""
    x = torch.linspace(0, 6.28, 96)
    scene = (0.5 + 0.5 * torch.sin(x[None, :] + x[:, None] * 0.5)).expand(3, 96, 96)
    return torch.stack([scene[:, 16:48, k * step:32 + k * step] for k in range(n_frames)], dim=1)[None]


@pytest.mark.parametrize("name", ["temporal_consistency", "clip"])
def test_still_beats_smooth_motion_beats_jumbled_frames(name, tmp_path):
    if name == "clip":
        _save_tiny_clip(tmp_path / "clip")
        name = f"temporal_clip@{tmp_path / 'clip'}"
    score = get_reward(name, device="cpu")
    smooth = _panning()
    shuffled = _panning(step=5)[:, :, [0, 5, 1, 4, 2, 3]]  # the same frames, far apart in a jumbled order
    values = score(torch.cat([STILL, smooth, shuffled]), ["a"] * 3)
    assert values[0] == pytest.approx(1.0, abs=1e-5)
    assert values[0] > values[1] > values[2], values


def test_temporal_clip_of_still_videos_is_at_most_one(tmp_path):
    """A cosine similarity never exceeds 1, even where identical frames' embeddings round above it."""
    _save_tiny_clip(tmp_path / "clip")
    score = get_reward(f"temporal_clip@{tmp_path / 'clip'}", device="cpu")
    g = torch.Generator().manual_seed(0)
    still = torch.rand(40, 3, 1, 32, 32, generator=g).expand(40, 3, 5, 32, 32).clone()
    values = score(still, ["a"] * 40)
    assert max(values) <= 1.0 and min(values) == pytest.approx(1.0, abs=1e-5)


def test_flicker_scores_below_smooth_motion():
    score = get_reward("temporal_consistency")
    smooth, flicker = _panning(), _panning().clone()
    flicker[:, :, 1::2] = 1 - flicker[:, :, 1::2]  # every other frame inverted
    values = score(torch.cat([smooth, flicker, NOISE]), ["a"] * 3)
    assert values[0] > 0.95 and values[1] < 0.7 and values[2] < 0.7, values


def test_images_and_one_frame_videos_score_one_and_bad_shapes_are_named():
    score = get_reward("temporal_consistency")
    assert score(torch.rand(2, 3, 16, 16), ["a", "b"]) == [1.0, 1.0]
    assert score(torch.rand(2, 3, 1, 16, 16), ["a", "b"]) == [1.0, 1.0]
    with pytest.raises(ValueError, match=r"\[B, C, F, H, W\].*\(3, 16, 16\)"):
        score(torch.rand(3, 16, 16), ["a"])
    with pytest.raises(ValueError, match="2 videos but 1 prompts"):
        score(torch.rand(2, 3, 4, 16, 16), ["a"])


def test_a_weighted_sum_with_a_frame_reward_scores_each_video_once():
    videos = torch.cat([STILL, NOISE])
    total = get_reward("multi:temporal_consistency=1,jpeg_compressibility=0.5")
    import asyncio

    values = asyncio.run(total(videos, ["a", "b"]))
    parts = [get_reward(n)(videos, ["a", "b"]) for n in ("temporal_consistency", "jpeg_compressibility")]
    assert values == pytest.approx([a + 0.5 * b for a, b in zip(*parts)])


def test_a_reward_shown_evenly_spaced_frames():
    from diffrl.rewards.frames import on_frames

    seen = []

    def score(images, prompts, metadata=None):
        seen.append(images)
        return [float(v) for v in images.mean(dim=tuple(range(1, images.dim())))]

    video = torch.arange(7.0).view(1, 1, 7, 1, 1).expand(1, 3, 7, 2, 2)  # frame k holds the value k
    assert on_frames(score, 3)(video, ["a"]) == [pytest.approx((0 + 3 + 6) / 3)]
    assert seen[-1][0, 0, :, 0, 0].tolist() == [0.0, 3.0, 6.0]
    assert on_frames(score, 9)(video, ["a"]) == [pytest.approx(3.0)]  # fewer frames than asked: all of them
    assert on_frames(score, None) is score
    image = torch.rand(2, 3, 4, 4)
    assert on_frames(score, 3)(image, ["a", "b"]) == score(image, ["a", "b"])
    with pytest.raises(ValueError, match="frames"):
        on_frames(score, 0)


def test_reward_frames_leave_a_temporal_reward_its_consecutive_frames():
    """--reward-frames K shows image rewards K frames; a temporal reward compares consecutive frames, so it
    keeps them all, alone or inside a multi: sum whose image parts still see K frames."""
    import asyncio

    from diffrl.rewards.frames import on_frames

    video = _panning(n_frames=9, step=2)
    temporal = get_reward("temporal_consistency")
    assert on_frames(temporal, 3)(video, ["a"]) == temporal(video, ["a"])
    jpeg = get_reward("jpeg_compressibility")
    total = on_frames(get_reward("multi:temporal_consistency=1,jpeg_compressibility=0.5"), 3)
    expected = temporal(video, ["a"])[0] + 0.5 * on_frames(jpeg, 3)(video, ["a"])[0]
    assert asyncio.run(total(video, ["a"])) == [pytest.approx(expected)]


def test_a_reward_worker_pool_scores_a_video_as_in_process_scoring(tmp_path):
    """--reward-workers with --reward-frames K: the pool was shown K frames, temporal parts included, so its
    workers scored temporal rewards on K frames where in-process scoring compares them all. Both now give the
    same scores; the frame-scoring part still sees K frames."""
    import asyncio

    from diffrl.rewards.frames import on_frames
    from diffrl.rewards.workers import ProcessRewardPool

    _save_tiny_clip(tmp_path / "clip")
    spec = f"multi:temporal_consistency=1,temporal_clip@{tmp_path / 'clip'}=1,rewards_for_tests:frame_count=1"
    videos = torch.cat([_panning(n_frames=9, step=2), _panning(n_frames=9, step=5)])
    inline = asyncio.run(on_frames(get_reward(spec, device="cpu"), 3)(videos, ["a", "b"]))
    whole = asyncio.run(get_reward(spec, device="cpu")(videos, ["a", "b"]))
    assert [w - 9 for w in whole] == pytest.approx([i - 3 for i in inline])  # temporal parts: every frame
    pool = ProcessRewardPool(spec, workers=1, device="cpu", frames=3)
    frame_pool = ProcessRewardPool("rewards_for_tests:frame_count", workers=1, frames=3)
    try:
        assert asyncio.run(on_frames(pool, 3)(videos, ["a", "b"])) == pytest.approx(inline, abs=1e-6)
        assert asyncio.run(on_frames(frame_pool, 3)(videos, ["a", "b"])) == [3.0, 3.0]
        assert frame_pool._whole_videos is False  # shipped 3 frames, not 9
    finally:
        pool.close()
        frame_pool.close()
