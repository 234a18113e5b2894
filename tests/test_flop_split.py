"""benchmarks/flop_split.py: the FLOP split of a real-size transformer, counted on meta tensors."""

import pytest
from benchmark_scripts import load_benchmark


def test_sd35m_attention_flops_are_the_attention_formula(monkeypatch):
    report = load_benchmark("flop_split", monkeypatch).split("sd3", 512)
    # Attention is 4·L²·width per layer and sample (QKᵀ and the weighted sum, 2 FLOPs per multiply-add): 24 joint
    # layers over 1,024 image + 333 text tokens and 13 image-only second attentions, at width 1,536.
    width, joint, image = 1536, 1024 + 333, 1024
    attention = 24 * 4 * joint**2 * width + 13 * 4 * image**2 * width
    assert report["gflop_by_op"]["bmm"] * 1e9 == pytest.approx(attention, rel=1e-9)
    assert report["gflop_per_forward"] == pytest.approx(2442.6, abs=0.1)  # SD3.5-M's transformer forward at 512²
    assert sum(report["share"].values()) == pytest.approx(1.0)
    assert report["share"]["linear"] == pytest.approx(0.854, abs=1e-3)


def test_flux3_klein_at_1024_counts_what_the_recipe_run_counted_on_the_gpu(monkeypatch):
    report = load_benchmark("flop_split", monkeypatch).split("flux3_image", 1024)
    # recipe_runs.py counted the family's own forward (text window of 80 tokens) at 41,488.9 GFLOP on the H200
    # (benchmarks/results/recipe_flux3-klein-grpo-hps_h200_2026-12-02.json).
    assert report["gflop_per_forward"] == pytest.approx(41488.9, abs=0.1)
    assert report["share"]["attention"] == pytest.approx(0.169, abs=1e-3)
