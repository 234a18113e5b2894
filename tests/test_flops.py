import torch
from torch.utils.flop_counter import sdpa_flop_count

from diffrl.utils.flops import _attention_flops


def test_attention_formula_matches_torch_when_heads_match():
    q = k = v = (2, 8, 77, 64)
    assert _attention_flops(q, k, v) == sdpa_flop_count(q, k, v)


def test_grouped_query_attention_counts_every_query_head():
    # 8 query heads over 2 key/value heads cost what 8 full heads cost: keys and values are shared, not the work.
    assert _attention_flops((2, 8, 77, 64), (2, 2, 99, 64), (2, 2, 99, 64)) == sdpa_flop_count(
        (2, 8, 77, 64), (2, 8, 99, 64), (2, 8, 99, 64))



def test_counting_a_compiled_module_leaves_it_compiling_afterwards():
    """A compiled module first called under a dispatch mode is skipped by dynamo for good (every later call eager,
    silently): the counter counts with compilation off, so the module compiles at its next call and then runs its
    graph. This is what kept `recipe_runs.py --flags {"compile": true}` eager (BENCHMARKS.md, FLUX 3)."""
    from diffrl.utils.flops import flop_counter

    backend_calls = {"compiles": 0, "graph_runs": 0}

    def backend(graph_module, example_inputs):
        backend_calls["compiles"] += 1

        def run(*args):
            backend_calls["graph_runs"] += 1
            return graph_module.forward(*args)

        return run

    class Block(torch.nn.Module):  # a user module: dynamo skips torch.nn's own forwards as the top frame
        def __init__(self):
            super().__init__()
            self.linear = torch.nn.Linear(16, 16)

        def forward(self, x):
            return torch.nn.functional.gelu(self.linear(x))

    torch._dynamo.reset()
    block = Block()
    block.compile(backend=backend)
    x = torch.randn(4, 16)
    with torch.no_grad():
        with flop_counter() as counter:
            block(x)
        assert counter.get_total_flops() == 2 * 4 * 16 * 16 and backend_calls["compiles"] == 0
        for _ in range(2):
            block(x)
    assert backend_calls == {"compiles": 1, "graph_runs": 2}
