"""A device this machine lacks is refused in one line naming the flag, before any model loads: `--device cuda` without
a usable GPU failed with torch's AssertionError traceback ("Torch not compiled with CUDA enabled"), as did
`--reward-device cuda` (in a reward worker, after the first rollout's sampling)."""

import pytest
import torch

from diffrl.cli.main import main
from diffrl.utils.device import resolve_device

NO_GPU = not torch.cuda.is_available()


def test_resolve_device_names_the_flag():
    with pytest.raises(ValueError, match=r"^--device gpu: expected auto, cpu, cuda or cuda:N$"):
        resolve_device("gpu")
    beyond = f"cuda:{torch.cuda.device_count()}"
    with pytest.raises(ValueError, match=rf"^--device {beyond}: this machine has"):
        resolve_device(beyond)
    assert resolve_device("cpu") == torch.device("cpu")


@pytest.mark.skipif(not NO_GPU, reason="a machine without a GPU refuses cuda")
@pytest.mark.parametrize("argv, message", [
    (["train", "--recipe", "shapes-nft", "--device", "cuda"], "--device cuda: this machine has no CUDA GPU"),
    (["train", "--recipe", "shapes-nft", "--device", "cpu", "--prompt-data", "P", "--reward", "jpeg_compressibility",
      "--reward-device", "cuda", "--reward-workers", "1"], "reward device 'cuda' (--reward-device): this machine has no"),
    (["evaluate", "--device", "cuda"], "--device cuda: this machine has no CUDA GPU"),
    (["evaluate", "--device", "cpu", "--prompt-data", "P", "--reward", "jpeg_compressibility", "--reward-device",
      "cuda:1"], "reward device 'cuda:1' (--reward-device): this machine has no CUDA GPU"),
    (["compare", "--trained", "diffrl/assets/demo-shapes", "--device", "cuda:0"], "--device cuda:0: this machine has no"),
    (["pretrain", "--device", "cuda"], "--device cuda: this machine has no CUDA GPU"),
])
def test_a_gpu_this_machine_lacks_is_one_line(tmp_path, capsys, argv, message):
    (tmp_path / "prompts.txt").write_text("a red cat\n")
    argv = [str(tmp_path / "prompts.txt") if a == "P" else a for a in argv]
    assert main([*argv, "--output-dir", str(tmp_path / "out")]) == 2
    assert capsys.readouterr().err.strip().splitlines()[-1].startswith(f"error: {message}")
