"""A reward that varies even on a random model's images (tests reach it as `rewards_for_tests:darkness`)."""


def darkness(images, prompts, metadata=None):
    return [1.0 - float(image.mean()) for image in images]
