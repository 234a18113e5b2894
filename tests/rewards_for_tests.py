"""A reward that varies even on a random model's images (tests reach it as `rewards_for_tests:darkness`)."""


def darkness(images, prompts, metadata=None):
    return [1.0 - float(image.mean()) for image in images]


def torch_threads(images, prompts, metadata=None):
    """How many threads torch runs with where the reward is scored (a pool worker checks its setting)."""
    import torch

    return [float(torch.get_num_threads())] * len(images)


def from_metadata(images, prompts, metadata=None):
    """The `value` each prompt's metadata carries (checks that jsonl metadata reaches the reward)."""
    return [float(m["value"]) for m in metadata]


def seed_of(images, prompts, metadata=None):
    """The seed the evaluation passes with each image's metadata."""
    return [float(m["seed"]) for m in metadata]


def signed_darkness(images, prompts, metadata=None):
    """Darkness above 0.5 times each prompt's metadata `sign`: prompts can favour dark or bright images, or
    neither (sign 0), so one comparison can hold wins, ties and losses."""
    return [float(m["sign"]) * (0.5 - float(image.mean())) for image, m in zip(images, metadata, strict=True)]


def frame_count(images, prompts, metadata=None):
    """How many frames of each video the reward is shown (1 for images)."""
    return [float(images.shape[2]) if images.dim() == 5 else 1.0] * len(images)


FRAMES_SEEN: list[int] = []


def darkness_noting_frames(images, prompts, metadata=None):
    """`darkness`, noting in FRAMES_SEEN how many frames each call was shown (an inline reward's caller reads it)."""
    FRAMES_SEEN.append(images.shape[2] if images.dim() == 5 else 1)
    return darkness(images, prompts, metadata)


def not_a_number(images, prompts, metadata=None):
    """NaN for every image (a reward broken on these images)."""
    return [float("nan")] * len(images)


def one_value(images, prompts, metadata=None):
    """One value whatever the number of images."""
    return [0.5]


def redness(images, prompts, metadata=None):
    """How much redder than green and blue each image is, ×100: a term whose spread dwarfs darkness's in a sum."""
    return [100.0 * float(image[0].mean() - image[1:].mean()) for image in images]


def constant(images, prompts, metadata=None):
    """The same reward for every image: a run with no learning signal."""
    return [0.0] * len(images)


def by_index(images, prompts, metadata=None):
    """The value planted in each image's first pixel (group-reward tests)."""
    return [float(image[0, 0, 0]) for image in images]
