"""The Python examples of the docs run as written (the rollout example passed `request=` to the rollout settings, which has
no such field: a TypeError), at a smaller size where the example's size is a choice, not the point."""

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]


def _python_blocks() -> list[tuple[Path, str]]:
    return [(page, block) for page in PAGES for block in re.findall(r"```python\n(.*?)```", page.read_text(), flags=re.S)]


def test_the_rollout_example_runs_as_written():
    ((page, block),) = [(p, b) for p, b in _python_blocks() if "RolloutManager(" in b]
    small = block.replace("n_samples_per_prompt=16", "n_samples_per_prompt=2").replace(
        "rollout_microgroup_size=8", "rollout_microgroup_size=2").replace("num_inference_steps=10", "num_inference_steps=4")
    assert small != block  # the sizes shrunk are still the example's
    namespace = {}
    exec(compile(small, str(page), "exec"), namespace)
    groups = namespace["groups"]
    assert len(groups) == 2 and all(len(g) == 2 for g in groups)
    sample = groups[0][0]
    assert isinstance(sample.seed, int) and 0.0 <= sample.reward <= 1.0
    assert sample.output.rollout_log_probs.shape[-1] == 2  # the two SDE steps asked for
