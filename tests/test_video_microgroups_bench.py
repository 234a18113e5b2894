"""benchmarks/video_microgroups_http.py at minimal size on CPU: the tiny random LTX-2.3 behind one HTTP server (a
thread), microgroups 1 and 2 with streaming on and off; every configuration makes the same videos, streamed
scoring takes one video at a time; the response-size formula behind its real-size table matches what the
engine's outputs encode to."""

import pytest
from benchmark_scripts import load_benchmark

from diffrl.serving import sglang
from diffrl.engine.engine import Engine
from diffrl.engine.protocol import RolloutRequest
from diffrl.serving.wire import encode_outputs
from diffrl.models.ltx2 import Ltx2Family



@pytest.fixture(scope="module")
def bench():
    return load_benchmark("video_microgroups_http")


@pytest.fixture(scope="module")
def run(bench, tmp_path_factory):
    folder = tmp_path_factory.mktemp("bench")
    report = bench.main(["--tiny", "--device", "cpu", "--checkpoint", str(folder / "ltx-2.3-tiny"), "--server", "thread",
                         "--num-frames", "9", "--steps", "2", "--sde-steps", "0", "--n-samples", "2",
                         "--microgroups", "1", "2", "--scorer", "sleep:0.05", "--out", str(folder / "out.json")])
    return report, folder


def test_every_microgroup_size_runs_streamed_and_not(run):
    report, _ = run
    rows = report["rollouts"]
    assert [(r["microgroup"], r["streaming"]) for r in rows] == [(1, True), (1, False), (2, True), (2, False)]
    for row in rows:
        assert row["samples"] == 2 and row["requests"] == 2 // row["microgroup"]
        assert 0 < row["first_scored_s"] <= row["wall_s"] and row["scoring_s"] >= 2 * 0.05 - 1e-3
        assert 0 <= row["overlap"] <= 1 and row["engine_batches"] == row["requests"]
        # Streamed, each video alone; built, one batch per microgroup.
        assert row["scorer_batches"] == ([1] if row["streaming"] else [row["microgroup"]])
    assert report["same_samples_in_every_configuration"] and report["stopped"] is None
    real = report["real_size_bytes"]["ltx23 121x512x768 M=8"]
    assert real["video_per_output"] == 4 * 3 * 121 * 512 * 768 and real["compact"] > 4.5e9


def test_the_size_formula_matches_the_encoded_responses(bench, run):
    _, folder = run
    family = Ltx2Family.load(folder / "ltx-2.3-tiny")
    engine = Engine(family)
    req = RolloutRequest(prompt="a red cat", seed=1, num_outputs_per_prompt=2, num_frames=17, num_inference_steps=3,
                         guidance_scale=1.0, rollout=True, rollout_sde_type="cps", rollout_sde_step_indices=[0, 1],
                         rollout_return_dit_trajectory=True, rollout_return_denoising_env=True)
    geometry = family.geometry(64, 96, 17)
    expected = bench.response_bytes(
        pixels=3 * 17 * 64 * 96, latent_tokens=geometry.video_tokens + geometry.audio_frames,
        latent_width=family.transformer.config.in_channels, text_tokens=family.settings.max_sequence_length,
        text_width=engine.generate(req)[0].denoising_env["prompt_embeds"].shape[-1],
        id_values=6 * geometry.video_tokens, steps=3, sde_steps=[0, 1], m=2)
    compact = len(encode_outputs(engine.generate(req)))
    json_body = len(sglang.encode_response(engine.generate(sglang.engine_request(req)), req, family, "id"))
    # Within the headers, keys and small tensors the formula leaves out (< 2 KB per output).
    assert 0 <= compact - expected["compact"] < 2 * 2048
    assert 0 <= json_body - expected["sglang_json"] < 2 * 2048
