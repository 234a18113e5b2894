"""A reward that varies even on a random model's images (tests reach it as `rewards_for_tests:darkness`)."""


def darkness(images, prompts, metadata=None):
    return [1.0 - float(image.mean()) for image in images]


def torch_threads(images, prompts, metadata=None):
    """How many threads torch runs with where the reward is scored (a pool worker checks its setting)."""
    import torch

    return [float(torch.get_num_threads())] * len(images)
