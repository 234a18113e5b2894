from torch.utils.flop_counter import sdpa_flop_count

from diffrl.utils.flops import _attention_flops


def test_attention_formula_matches_torch_when_heads_match():
    q = k = v = (2, 8, 77, 64)
    assert _attention_flops(q, k, v) == sdpa_flop_count(q, k, v)


def test_grouped_query_attention_counts_every_query_head():
    # 8 query heads over 2 key/value heads cost what 8 full heads cost: keys and values are shared, not the work.
    assert _attention_flops((2, 8, 77, 64), (2, 2, 99, 64), (2, 2, 99, 64)) == sdpa_flop_count(
        (2, 8, 77, 64), (2, 8, 99, 64), (2, 8, 99, 64))

