"""`hpsv2`: the Human Preference Score v2.1 (Wu et al., 2023) from a local checkpoint.

HPSv2.1 is an open_clip ViT-H-14 fine-tuned on human preferences; `HPS_v2.1_compressed.pt` is its
open_clip state dict (under a `state_dict` key). The score is the cosine between the image's and the
prompt's embeddings, as HPSv2's own scorer (the diagonal of image_features @ text_features.T over
unit-norm features) and DiffusionNFT's HPSv2 reward compute it: about 0.2-0.35 for real images, no ×100
(the HPSv2 leaderboard prints it ×100). Images are preprocessed as HPSv2's evaluation transform does:
the longer side resized to the model's input size (bicubic), the shorter padded with black to a square,
then normalized with OpenAI CLIP's mean and std. fp32, as both references score.

Asked for as `hpsv2@PATH[,processor=DIR]`. PATH is the weights file (`.pt`, `.pth`, `.bin`, read with
`torch.load(weights_only=True)`, which refuses pickled code; or `.safetensors`) or a directory holding
exactly one such file. Beside the weights, an optional `open_clip_config.json` (open_clip's format:
`{"model_cfg": {...}, "preprocess_cfg": {...}}`) gives the architecture; without it the architecture is
ViT-H-14's. The tokenizer is CLIP's BPE in transformers' format (vocab.json + merges.txt, or
tokenizer.json), from DIR or else from the weights' directory; the processor directory of
`laion/CLIP-ViT-H-14-laion2B-s32B-b79K` (PickScore's) holds the same BPE open_clip's tokenizer uses.

The open_clip weights are renamed onto transformers' CLIPModel, which computes the same network for this
architecture (pre-LN transformer blocks, exact GELU, class-token vision pooling, text pooled at the
end-of-text token through a causal mask): open_clip itself needs torchvision, whose PyPI build does not
load beside a CPU-only torch.
"""

from __future__ import annotations

import html
import json
import re
from pathlib import Path

import torch

from diffrl.errors import ModelLoadError
from diffrl.models.components import hub_id_hint
from diffrl.rewards.clip_scores import _first_line, load_processor

OPENAI_CLIP_MEAN = (0.48145466, 0.4578275, 0.40821073)
OPENAI_CLIP_STD = (0.26862954, 0.26130258, 0.27577711)

# open_clip's ViT-H-14 model config (the architecture HPSv2.1 fine-tunes).
VIT_H_14 = {
    "embed_dim": 1024,
    "vision_cfg": {"image_size": 224, "layers": 32, "width": 1280, "head_width": 80, "patch_size": 14},
    "text_cfg": {"context_length": 77, "vocab_size": 49408, "width": 1024, "heads": 16, "layers": 24},
}
_WEIGHT_SUFFIXES = (".pt", ".pth", ".bin", ".safetensors")
# Model-config keys this loader builds; any other key asks for an architecture it does not implement.
_KNOWN_CFG = {"embed_dim", "vision_cfg", "text_cfg", "quick_gelu", "custom_text"}
_KNOWN_VISION = {"image_size", "layers", "width", "head_width", "patch_size", "mlp_ratio"}
_KNOWN_TEXT = {"context_length", "vocab_size", "width", "heads", "layers", "mlp_ratio"}


def _weights_file(path: Path) -> Path:
    if path.is_file():
        return path
    if not path.is_dir():
        raise ModelLoadError(f"hpsv2: no checkpoint at {path}{hub_id_hint(path)}")
    found = sorted(p for p in path.iterdir() if p.suffix in _WEIGHT_SUFFIXES and p.is_file())
    if len(found) != 1:
        which = ", ".join(p.name for p in found) if found else "none"
        raise ModelLoadError(f"hpsv2: {path} must hold exactly one weights file ({'/'.join(_WEIGHT_SUFFIXES)}); "
                             f"found {which}: give the file as hpsv2@FILE")
    return found[0]


def read_state_dict(file: Path) -> dict[str, torch.Tensor]:
    """An open_clip state dict from `file`, unwrapped from a `state_dict` key if it has one."""
    try:
        if file.suffix == ".safetensors":
            from safetensors.torch import load_file

            state = load_file(str(file))
        else:
            state = torch.load(file, map_location="cpu", weights_only=True)
    except Exception as err:  # noqa: BLE001 - any unreadable file is the same error to the user
        raise ModelLoadError(f"corrupt file: {file} ({_first_line(err)})") from None
    if isinstance(state, dict) and isinstance(state.get("state_dict"), dict):
        state = state["state_dict"]
    if not isinstance(state, dict) or not all(isinstance(v, torch.Tensor) for v in state.values()):
        raise ModelLoadError(f"corrupt file: {file} (not a state dict of tensors)")
    return state


def _model_config(folder: Path) -> tuple[dict, dict]:
    """(model_cfg, preprocess_cfg) from `open_clip_config.json` in `folder`, else ViT-H-14's."""
    file = folder / "open_clip_config.json"
    if not file.is_file():
        return VIT_H_14, {}
    try:
        config = json.loads(file.read_text())
        model_cfg, preprocess_cfg = config["model_cfg"], config.get("preprocess_cfg", {})
    except (ValueError, KeyError, TypeError) as err:
        raise ModelLoadError(f"corrupt file: {file} ({_first_line(err)})") from None
    for key, known, cfg in (("model_cfg", _KNOWN_CFG, model_cfg),
                            ("vision_cfg", _KNOWN_VISION, model_cfg.get("vision_cfg", {})),
                            ("text_cfg", _KNOWN_TEXT, model_cfg.get("text_cfg", {}))):
        unknown = sorted(set(cfg) - known)
        if unknown:
            raise ModelLoadError(f"{file}: {key} {', '.join(unknown)} is not supported by the hpsv2 loader")
    return model_cfg, preprocess_cfg


def _clip_config(model_cfg: dict, tokenizer):
    from transformers import CLIPConfig

    vision, text = model_cfg["vision_cfg"], model_cfg["text_cfg"]
    act = "quick_gelu" if model_cfg.get("quick_gelu") else "gelu"
    # open_clip's defaults where the config leaves a field out.
    v_width, t_width = vision.get("width", 768), text.get("width", 512)
    return CLIPConfig(
        projection_dim=model_cfg["embed_dim"],
        vision_config=dict(hidden_size=v_width, intermediate_size=int(v_width * vision.get("mlp_ratio", 4.0)),
                           num_hidden_layers=vision.get("layers", 12),
                           num_attention_heads=v_width // vision.get("head_width", 64),
                           image_size=vision.get("image_size", 224), patch_size=vision.get("patch_size", 16),
                           hidden_act=act, layer_norm_eps=1e-5),
        text_config=dict(vocab_size=text.get("vocab_size", 49408), hidden_size=t_width,
                         intermediate_size=int(t_width * text.get("mlp_ratio", 4.0)),
                         num_hidden_layers=text.get("layers", 12), num_attention_heads=text.get("heads", 8),
                         max_position_embeddings=text.get("context_length", 77), hidden_act=act,
                         layer_norm_eps=1e-5, bos_token_id=tokenizer.bos_token_id,
                         eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id))


_BLOCK = re.compile(r"(visual\.)?transformer\.resblocks\.(\d+)\.(.+)")
_BLOCK_PARTS = {"ln_1": "layer_norm1", "ln_2": "layer_norm2", "attn.out_proj": "self_attn.out_proj",
                "mlp.c_fc": "mlp.fc1", "mlp.c_proj": "mlp.fc2"}
_NAMES = {
    "visual.conv1.weight": "vision_model.embeddings.patch_embedding.weight",
    "visual.class_embedding": "vision_model.embeddings.class_embedding",
    "visual.positional_embedding": "vision_model.embeddings.position_embedding.weight",
    "visual.ln_pre.weight": "vision_model.pre_layrnorm.weight",
    "visual.ln_pre.bias": "vision_model.pre_layrnorm.bias",
    "visual.ln_post.weight": "vision_model.post_layernorm.weight",
    "visual.ln_post.bias": "vision_model.post_layernorm.bias",
    "token_embedding.weight": "text_model.embeddings.token_embedding.weight",
    "positional_embedding": "text_model.embeddings.position_embedding.weight",
    "ln_final.weight": "text_model.final_layer_norm.weight",
    "ln_final.bias": "text_model.final_layer_norm.bias",
    "logit_scale": "logit_scale",
}


def to_transformers(state: dict[str, torch.Tensor], file: Path) -> dict[str, torch.Tensor]:
    """open_clip CLIP parameter names → transformers CLIPModel's (projections transposed: open_clip
    multiplies `x @ proj`, a Linear computes `x @ W.T`; fused q/k/v projections split in three)."""
    out = {}
    for key, value in state.items():
        if key == "attn_mask" or key.endswith(".attn_mask"):
            continue  # the causal mask, a constant that older open_clip versions saved
        if key in _NAMES:
            out[_NAMES[key]] = value
        elif key == "visual.proj":
            out["visual_projection.weight"] = value.t().contiguous()
        elif key == "text_projection":
            out["text_projection.weight"] = value.t().contiguous()
        elif match := _BLOCK.fullmatch(key):
            tower = "vision_model" if match[1] else "text_model"
            prefix, rest = f"{tower}.encoder.layers.{match[2]}.", match[3]
            if rest in ("attn.in_proj_weight", "attn.in_proj_bias"):
                kind = rest.rpartition("_")[2]
                for name, part in zip(("q_proj", "k_proj", "v_proj"), value.chunk(3, dim=0), strict=True):
                    out[f"{prefix}self_attn.{name}.{kind}"] = part
            else:
                module, _, param = rest.rpartition(".")
                if module not in _BLOCK_PARTS:
                    raise ModelLoadError(f"{file}: unexpected parameter {key} for an open_clip CLIP")
                out[f"{prefix}{_BLOCK_PARTS[module]}.{param}"] = value
        else:
            raise ModelLoadError(f"{file}: unexpected parameter {key} for an open_clip CLIP")
    return out


def clean_text(text: str) -> str:
    """The text cleaning open_clip's tokenizer applies before BPE that transformers' CLIP tokenizer does
    not: HTML entities decoded (twice, for doubly escaped text) and runs of whitespace made one space.
    (open_clip also runs ftfy's mojibake repair, which leaves ordinary text unchanged.)"""
    return " ".join(html.unescape(html.unescape(text)).split())


class HPSv2:
    """The HPSv2 network (open_clip weights in a transformers CLIPModel) and its tokenizer."""

    def __init__(self, path: str | Path, device: torch.device, processor: str | Path | None = None):
        from transformers import CLIPModel

        file = _weights_file(Path(path))
        model_cfg, preprocess_cfg = _model_config(file.parent)
        loaded = load_processor(file.parent if processor is None else processor, what="hpsv2 tokenizer")
        self.tokenizer = getattr(loaded, "tokenizer", loaded)
        if not callable(self.tokenizer) or self.tokenizer.eos_token_id is None:
            raise ModelLoadError(f"hpsv2: no CLIP tokenizer in {processor or file.parent}")
        state = to_transformers(read_state_dict(file), file)
        with torch.device("meta"):  # the weights come from the file: no random init first
            model = CLIPModel(_clip_config(model_cfg, self.tokenizer))
        try:
            missing, unexpected = model.load_state_dict(state, strict=False, assign=True)
        except RuntimeError as err:
            raise ModelLoadError(f"{file}: the weights do not fit the configured architecture "
                                 f"({_first_line(err)})") from None
        missing = [k for k in missing if not k.endswith("position_ids")]
        if missing or unexpected:
            name, more = (missing or unexpected)[0], len(missing) + len(unexpected) - 1
            raise ModelLoadError(f"{file}: the weights do not fit the configured architecture "
                                 f"({'missing' if missing else 'unexpected'} parameter {name}, {more} more mismatched)")
        # The position ids are buffers built at init, on the meta device here: build them on the CPU.
        for module in model.modules():
            for name, buffer in list(module.named_buffers(recurse=False)):
                if buffer.is_meta and name == "position_ids":
                    module.register_buffer(name, torch.arange(buffer.shape[-1]).expand(buffer.shape).clone(),
                                           persistent=False)
        self.model = model.float()
        self.device = torch.device(device)
        self.model.to(self.device).eval().requires_grad_(False)
        self.image_size = self.model.config.vision_config.image_size
        self.context_length = self.model.config.text_config.max_position_embeddings
        mean = preprocess_cfg.get("mean", OPENAI_CLIP_MEAN)
        std = preprocess_cfg.get("std", OPENAI_CLIP_STD)
        self.mean = torch.tensor(mean, device=self.device).view(1, 3, 1, 1)
        self.std = torch.tensor(std, device=self.device).view(1, 3, 1, 1)

    def preprocess(self, images: torch.Tensor) -> torch.Tensor:
        """[B, 3, H, W] in [0, 1] → the model's input: longer side to image_size, black padding, normalized."""
        images = images.to(self.device, torch.float32)
        h, w = images.shape[-2:]
        scale = self.image_size / max(h, w)
        size = (round(h * scale), round(w * scale))
        if size != (h, w):
            images = torch.nn.functional.interpolate(images, size=size, mode="bicubic", align_corners=False,
                                                     antialias=True)
        pad_h, pad_w = self.image_size - size[0], self.image_size - size[1]
        images = torch.nn.functional.pad(images, (pad_w // 2, pad_w - pad_w // 2, pad_h // 2, pad_h - pad_h // 2))
        return (images - self.mean) / self.std

    @torch.no_grad()
    def cosine(self, images: torch.Tensor, prompts: list[str]) -> torch.Tensor:
        pixels = self.preprocess(images)
        tokens = self.tokenizer([clean_text(p) for p in prompts], return_tensors="pt", padding=True, truncation=True,
                                max_length=self.context_length)
        image = self.model.get_image_features(pixel_values=pixels)
        text = self.model.get_text_features(input_ids=tokens["input_ids"].to(self.device),
                                            attention_mask=tokens["attention_mask"].to(self.device))
        image, text = (getattr(e, "pooler_output", e).float() for e in (image, text))
        normalize = torch.nn.functional.normalize
        return (normalize(image, dim=-1) * normalize(text, dim=-1)).sum(-1)


def hpsv2(path: str, device: torch.device, processor: str | None = None):
    model = HPSv2(path, device, processor)

    def score(images, prompts, metadata=None) -> list[float]:
        return model.cosine(images, list(prompts)).tolist()

    score.modules = (model.model,)  # what --reward-colocate moves (the normalization constants are 24 bytes)
    return score
