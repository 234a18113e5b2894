"""The "shapes" world: a GenEval-like synthetic text-to-image task with exact rewards.

Prompts (`grammar`) describe scenes of colored circles, squares, triangles and diamonds;
`render` draws a scene, `verify` checks any image against a prompt.
"""

from .grammar import (
    BACKGROUND,
    CATEGORIES,
    COLORS,
    NUMBERS,
    RELATIONS,
    SHAPES,
    ObjectSpec,
    SceneSpec,
    all_prompts,
    category_of,
    format_prompt,
    parse_prompt,
    prompts_by_category,
    test_prompts,
    train_prompts,
)
from .render import render_prompt, render_scene
from .verify import DetectedObject, Verdict, detect_objects, verify

__all__ = [
    "BACKGROUND",
    "CATEGORIES",
    "COLORS",
    "NUMBERS",
    "RELATIONS",
    "SHAPES",
    "DetectedObject",
    "ObjectSpec",
    "SceneSpec",
    "Verdict",
    "all_prompts",
    "category_of",
    "detect_objects",
    "format_prompt",
    "parse_prompt",
    "prompts_by_category",
    "render_prompt",
    "render_scene",
    "test_prompts",
    "train_prompts",
    "verify",
]
