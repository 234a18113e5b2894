"""Attention speed options that the engine and the trainer share, since both run the family's one forward:

- `--attention-backend`: which scaled-dot-product-attention kernel the transformer uses. `attention_context`
  is entered by `FamilyAdapter.forward_precision()`, the context every transformer call of every family runs
  in, so rollouts and the trainer's replay use the same kernel (a different kernel rounds differently, which
  would show as first-pass log-prob drift). `auto` leaves torch's choice (and deterministic mode's limits).
- `--fuse-qkv`: SD3's joint attention computes each stream's q, k and v projections as one matmul
  (`FusedJointAttnProcessor`).
"""

from __future__ import annotations

import contextlib

import torch
import torch.nn.functional as F

ATTENTION_BACKENDS = ("auto", "flash", "cudnn", "efficient", "math")
# Kernels torch has on CUDA only (the CPU has flash and math).
_CUDA_ONLY = ("cudnn", "efficient")
# What deterministic mode allows (utils/determinism.py: efficient and math on CUDA).
_DETERMINISTIC = ("auto", "efficient", "math")


def check_attention_backend(backend: str, device: torch.device | str | None = None,
                            deterministic: bool = False) -> None:
    """Refuse, naming the flags, a backend that does not exist, that deterministic mode excludes, or that the
    device lacks (None: the device is not known yet)."""
    if backend not in ATTENTION_BACKENDS:
        raise ValueError(f"--attention-backend {backend}: expected one of {', '.join(ATTENTION_BACKENDS)}")
    if deterministic and backend not in _DETERMINISTIC:
        raise ValueError(f"--attention-backend {backend} with --deterministic-mode: deterministic mode keeps attention "
                         "on the efficient and math kernels (pick one of them, or auto)")
    if device is not None and torch.device(device).type != "cuda" and backend in _CUDA_ONLY:
        raise ValueError(f"--attention-backend {backend} needs a CUDA device (on {torch.device(device).type} torch has "
                         "the flash and math kernels)")


def attention_context(backend: str):
    """The SDPA kernel restriction for one forward: `sdpa_kernel([backend])`, or nothing for `auto`. It sets
    torch's process-wide flags until the block ends; every forward of a run enters the same one."""
    if backend == "auto":
        return contextlib.nullcontext()
    from torch.nn.attention import SDPBackend, sdpa_kernel

    kernels = {"flash": SDPBackend.FLASH_ATTENTION, "cudnn": SDPBackend.CUDNN_ATTENTION,
               "efficient": SDPBackend.EFFICIENT_ATTENTION, "math": SDPBackend.MATH}
    return sdpa_kernel([kernels[backend]])


# ---------------------------------------------------------------------------------------------- fused q/k/v
# Names of the projections a fused processor computes together (image stream, then text stream).
QKV_PROJECTIONS = ("to_q", "to_k", "to_v", "add_q_proj", "add_k_proj", "add_v_proj")


def project_qkv(x: torch.Tensor, q: torch.nn.Module, k: torch.nn.Module, v: torch.nn.Module):
    """q(x), k(x), v(x) as one matmul over the three weights concatenated at this call, when all three are
    plain linear layers with the same bias setting; otherwise (a LoRA adapter wraps one of them) one by one.
    Concatenating per call rather than once keeps no copy of the weights: gradients and weight updates reach
    the layers' own parameters, and there is nothing to go stale."""
    layers = (q, k, v)
    if not all(type(m) is torch.nn.Linear for m in layers) or len({m.bias is None for m in layers}) != 1:
        return q(x), k(x), v(x)
    weight = torch.cat([m.weight for m in layers])
    bias = None if q.bias is None else torch.cat([m.bias for m in layers])
    return F.linear(x, weight, bias).split([m.out_features for m in layers], dim=-1)


class FusedJointAttnProcessor:
    """diffusers' `JointAttnProcessor2_0` (SD3 and SD3.5: the joint image + text attention, q/k RMSNorm, the
    image-only second attention of dual-attention blocks) with the projections of each stream through
    `project_qkv`. diffusers' own `fuse_qkv_projections()` is not used: its processor skips the q/k norms
    SD3.5 has, fails on the image-only attention, and copies the weights once (stale after an update)."""

    def __call__(self, attn, hidden_states: torch.Tensor, encoder_hidden_states: torch.Tensor | None = None,
                 attention_mask: torch.Tensor | None = None, *args, **kwargs) -> torch.Tensor:
        residual = hidden_states
        batch_size = hidden_states.shape[0]
        query, key, value = project_qkv(hidden_states, attn.to_q, attn.to_k, attn.to_v)
        head_dim = key.shape[-1] // attn.heads
        query, key, value = (t.view(batch_size, -1, attn.heads, head_dim).transpose(1, 2) for t in (query, key, value))
        if attn.norm_q is not None:
            query = attn.norm_q(query)
        if attn.norm_k is not None:
            key = attn.norm_k(key)
        if encoder_hidden_states is not None:
            text = project_qkv(encoder_hidden_states, attn.add_q_proj, attn.add_k_proj, attn.add_v_proj)
            text_q, text_k, text_v = (t.view(batch_size, -1, attn.heads, head_dim).transpose(1, 2) for t in text)
            if attn.norm_added_q is not None:
                text_q = attn.norm_added_q(text_q)
            if attn.norm_added_k is not None:
                text_k = attn.norm_added_k(text_k)
            query = torch.cat([query, text_q], dim=2)
            key = torch.cat([key, text_k], dim=2)
            value = torch.cat([value, text_v], dim=2)
        hidden_states = F.scaled_dot_product_attention(query, key, value, dropout_p=0.0, is_causal=False)
        hidden_states = hidden_states.transpose(1, 2).reshape(batch_size, -1, attn.heads * head_dim)
        hidden_states = hidden_states.to(query.dtype)
        if encoder_hidden_states is not None:
            hidden_states, encoder_hidden_states = (hidden_states[:, : residual.shape[1]],
                                                    hidden_states[:, residual.shape[1]:])
            if not attn.context_pre_only:
                encoder_hidden_states = attn.to_add_out(encoder_hidden_states)
        hidden_states = attn.to_out[0](hidden_states)
        hidden_states = attn.to_out[1](hidden_states)
        if encoder_hidden_states is not None:
            return hidden_states, encoder_hidden_states
        return hidden_states


def fuse_qkv_projections(transformer: torch.nn.Module) -> int:
    """Give every joint (SD3) attention of `transformer` the fused processor; returns how many. A transformer
    without one is refused: the option would do nothing."""
    from diffusers.models.attention_processor import Attention, JointAttnProcessor2_0

    count = 0
    for module in transformer.modules():
        if isinstance(module, Attention) and isinstance(module.processor, JointAttnProcessor2_0 | FusedJointAttnProcessor):
            module.set_processor(FusedJointAttnProcessor())
            count += 1
    if not count:
        raise ValueError(f"--fuse-qkv: {type(transformer).__name__} has no joint (SD3) attention to fuse")
    return count


def fused_qkv_streams(transformer: torch.nn.Module) -> dict[str, bool]:
    """Each attention stream under a fused processor (`<attention>.to_qkv` for the image stream,
    `<attention>.add_qkv` for the text stream) → whether it runs as one matmul: False where a LoRA adapter
    wraps one of its projections (peft layers run one by one, adapter included)."""
    streams = {}
    for name, module in transformer.named_modules():
        if isinstance(getattr(module, "processor", None), FusedJointAttnProcessor):
            for stream, projections in (("to_qkv", QKV_PROJECTIONS[:3]), ("add_qkv", QKV_PROJECTIONS[3:])):
                layers = [getattr(module, p, None) for p in projections]
                if all(layer is not None for layer in layers):
                    streams[f"{name}.{stream}"] = all(type(layer) is torch.nn.Linear for layer in layers)
    return streams
