"""benchmarks/text_encoder_sizes.py: the published text encoders rebuilt from their shapes on the meta device come
out at their published parameter counts, so what it says a real checkpoint adds to a measured peak rests on them."""

import pytest
from benchmark_scripts import load_benchmark

# Published totals (billions of parameters): Qwen2.5-VL-7B, Qwen3-VL-4B, CLIP-L's text model + T5-XXL's encoder,
# UMT5-XXL's encoder, Gemma 3 12B.
PUBLISHED = {"qwen_image": 8.29, "flux3_image": 4.44, "flux1": 0.123 + 4.762, "wan2_2": 5.68, "ltx2": 12.19}


def test_published_encoders_have_their_published_sizes_and_the_random_ones_are_small(monkeypatch, tmp_path):
    rows = load_benchmark("text_encoder_sizes", monkeypatch).main(["--json", str(tmp_path / "sizes.json")])
    assert set(rows) == set(PUBLISHED)
    for name, row in rows.items():
        assert row["published_params_b"] == pytest.approx(PUBLISHED[name], abs=0.02), name
        assert 0.1 < row["random_params_b"] < 0.5, name  # what the GPU rows' peaks held
        assert row["adds_gib_bf16"] == pytest.approx(2 * (row["published_params_b"] - row["random_params_b"])
                                                     * 1e9 / 2**30)
    assert (tmp_path / "sizes.json").exists()
