"""benchmarks/float8_drift.py on a tiny random SD3 checkpoint on CPU: both forwards run on the same seeds and the
drift they report is real (non-zero, and small for FP8's rounding)."""

import json

from benchmark_scripts import load_benchmark

from diffrl.models.random_checkpoints.sd3 import save_random_checkpoint



def test_drift_of_float8_against_the_plain_forward(tmp_path, monkeypatch):
    script = load_benchmark("float8_drift", monkeypatch)
    checkpoint = save_random_checkpoint(tmp_path / "sd3-tiny", with_t5=False)
    out = tmp_path / "drift.json"
    results = script.main(["--family", "sd3", "--checkpoint", str(checkpoint), "--device", "cpu", "--dtype", "float32",
                           "--resolution", "32", "--n", "3", "--steps", "3", "--repeats", "1", "--out", str(out)])
    assert json.loads(out.read_text()) == results
    assert 0 < results["final_latent_relative_l2"] < 0.3
    assert 10 < results["image_psnr_db_min"] < float("inf")
    assert results["sde_log_prob_mean_abs_diff"] > 0
    assert results["plain_s_per_image"] > 0 and results["float8_s_per_image"] > 0
