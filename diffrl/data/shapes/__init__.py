"""The "shapes" world: a GenEval-like synthetic text-to-image task with exact rewards.

Prompts (`grammar`) describe scenes of colored circles, squares, triangles and diamonds;
`render` draws a scene, `verify` checks any image against a prompt. `edits` is the editing
world on top: a source scene, an instruction that changes one object, the ground-truth result,
and `verify_edit` to judge any output against the source.
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
from .edits import (
    EDIT_KINDS,
    Edit,
    EditExample,
    EditVerdict,
    all_edits,
    apply_edit,
    edits_by_kind,
    make_example,
    parse_edit,
    sample_example,
    test_edits,
    train_edits,
    verify_edit,
)
from .render import PlacedObject, draw_objects, layout_scene, render_prompt, render_scene
from .verify import DetectedObject, Verdict, detect_objects, verify

__all__ = [
    "BACKGROUND",
    "CATEGORIES",
    "COLORS",
    "EDIT_KINDS",
    "NUMBERS",
    "RELATIONS",
    "SHAPES",
    "DetectedObject",
    "Edit",
    "EditExample",
    "EditVerdict",
    "ObjectSpec",
    "PlacedObject",
    "SceneSpec",
    "Verdict",
    "all_edits",
    "all_prompts",
    "apply_edit",
    "category_of",
    "detect_objects",
    "draw_objects",
    "edits_by_kind",
    "format_prompt",
    "layout_scene",
    "make_example",
    "parse_edit",
    "parse_prompt",
    "prompts_by_category",
    "render_prompt",
    "render_scene",
    "sample_example",
    "test_edits",
    "test_prompts",
    "train_edits",
    "train_prompts",
    "verify",
    "verify_edit",
]
