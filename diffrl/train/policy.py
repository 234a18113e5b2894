"""The policy: the trained transformer and everything that moves with its weights.

It owns the trained parameters (LoRA adapter or the full transformer, fp32 masters), the optimizer,
the EMAs (DiffusionNFT's old policy; `--use-ema`'s evaluation weights), the KL reference, and the
weight sync to the engines that sample from it. The training loop asks it for an optimizer step,
for the reference model inside a block, and for the engines to hold given weights inside a block.

Engines: the in-process engine of a one-process run shares the trained module (every update is live
for it; an EMA is swapped in for a block). Under torchrun the trainer's copy is sharded with FSDP2
and the engine samples from a full copy refreshed from the shards; remote engines (`--engine-urls`,
Ray actors, a `--colocate` engine process) get the trained tensors pushed. A colocated engine and the
trainer take turns on the device: the engine is woken for the sampling block and put back to sleep
after it, `--reward-colocate` model rewards likewise (`rewards/colocate.py`), and `--offload-optimizer`
keeps the optimizer state in host memory during the block.
"""

from __future__ import annotations

import contextlib
import copy
import math
import os
from pathlib import Path
from collections.abc import Sequence

import torch

from diffrl.serving.colocated import ColocatedEngineClient
from diffrl.models.checkpointing import enable_gradient_checkpointing
from diffrl.models.compile import block_kinds_at_recompile_limit, uncompiled_block_kinds
from diffrl.models.checkpoint import load_lora_weights
from diffrl.models.lora import LoraSpec, adaptable_parts, add_lora
from diffrl.train.ema import ParameterEMA, warmed_up_decay
from diffrl.train.objectives import OBJECTIVES
from diffrl.train.parallel import Parallel, full_tensor, shard_transformer
from diffrl.utils.offload import OptimizerOffload, release_cached


def bf16_forward(model_cfg, device: torch.device) -> bool:
    """Whether transformer forwards run in bf16 (--mixed-precision; auto = on CUDA). Frozen weights (a LoRA's
    base, text encoders, VAE, a KL reference) are then kept in bf16 too: they are only ever read at bf16."""
    return model_cfg.mixed_precision == "bf16" or (model_cfg.mixed_precision == "auto" and device.type == "cuda")


def twin_with_own_transformer(family, dtype: torch.dtype | None = None):
    """A second view of the family whose transformer is its own copy (the engine's full weights under FSDP2)
    while the frozen parts (text encoders, VAE, tokenizers) stay shared: one copy of them per process.
    `dtype`: the copy's floating-point dtype (None: the family's as it is)."""
    twin = copy.copy(family)
    twin.transformer = copy.deepcopy(family.transformer)
    if dtype is not None:  # tensor by tensor: what .to(dtype) casts, without diffusers' keep-in-fp32 warning
        for t in (*twin.transformer.parameters(), *twin.transformer.buffers()):
            if t.is_floating_point():
                t.data = t.data.to(dtype)
    return twin


# --engine-copy-dtype auto keeps a full finetune's engine copy in fp32 (the masters' dtype: the engine samples what
# the trainer's forward computes, bit for bit) unless that copy would take more than this share of the GPU.
ENGINE_COPY_SHARE = 0.4


def engine_copy_dtype(choice: str, full_finetune: bool, bf16: bool, transformer: torch.nn.Module,
                      device: torch.device) -> torch.dtype | None:
    """The dtype of each rank's engine copy under FSDP2 (None: as loaded, a LoRA's bf16 base and fp32 adapters).
    A full finetune: `float32` (exact), `bfloat16` (half the memory; the copy's norm and modulation weights are
    rounded to bf16, so the engine drifts from the trainer's forward by bf16 rounding), or `auto`: fp32 unless the
    copy would take more than 40% of the GPU's memory (a 20.9 B transformer: 84 GB of 141), then bf16."""
    if not full_finetune:
        return None
    if choice == "bfloat16" and not bf16:
        raise ValueError("--engine-copy-dtype bfloat16 needs a bf16 forward (--mixed-precision bf16, or auto on a GPU)")
    if choice == "float32" or (choice == "auto" and not bf16):
        return torch.float32
    if choice == "auto" and device.type == "cuda":
        fp32_bytes = 4 * sum(p.numel() for p in transformer.parameters())
        if fp32_bytes <= ENGINE_COPY_SHARE * torch.cuda.get_device_properties(device).total_memory:
            return torch.float32
    elif choice == "auto":
        return torch.float32
    return None  # bf16: the weights as loaded for a bf16 forward (modules a checkpoint keeps in fp32 stay so)


def in_process_forward_graph(cfg, several_processes: bool) -> str:
    """The in-process engine's `EngineConfig.forward_graph` (--engine-forward-graph; auto: training when compiled
    blocks would otherwise give the rollout and its replay different graphs that the loss compares: --compile, a
    loss that replays rollout steps, one process; see the flag's help)."""
    choice = cfg.engine.engine_forward_graph
    if choice != "auto":
        return choice
    replays = OBJECTIVES[cfg.algorithm.loss_type].replays_rollout_steps
    compiled = cfg.model.speed_options().compile
    return "training" if compiled and replays and not several_processes else "inference"


def in_process_training_graph_rows(cfg, graph: str) -> int | None:
    """`EngineConfig.training_graph_rows`: a forward in the training graph keeps what the backward would need until
    its velocity is detached, so unless every block is checkpointed keeping its inputs alone, the engine runs the
    trainer's micro-batch at a time (the memory the trainer's own step needs); fully checkpointed, the batch runs
    whole."""
    m = cfg.model
    fully_checkpointed = (m.gradient_checkpointing and m.gradient_checkpointing_interval == 1
                          and m.gradient_checkpointing_keeps == "inputs")
    if graph != "training" or fully_checkpointed:
        return None
    return cfg.optim.micro_batch_size


class Policy:
    def __init__(self, cfg, family, parallel: Parallel, device: torch.device, init_lora: Path | None = None):
        m, a, o = cfg.model, cfg.algorithm, cfg.optim
        self.family, self.parallel, self.device = family, parallel, device
        self.use_lora, self.kl_reference = m.use_lora, a.kl_reference
        transformer = family.transformer
        bf16 = bf16_forward(m, device)
        family.autocast_dtype = torch.bfloat16 if bf16 else None  # the engine shares the family
        family.detach_uncond = a.detach_uncond  # likewise: rollouts run CFG's halves as the replay does
        if m.flow_shift is not None:  # likewise: the schedule rollouts sample and the trainer replays
            family.set_flow_shift(m.flow_shift)
        if m.condition_image_size is not None:  # the in-process engine encodes the run's sources with it
            family.set_condition_image_area(m.condition_image_size ** 2)
        if cfg.eval.eval_condition_image_size is not None:  # refused now, not at the first evaluation
            family.check_condition_image_area()
        if not m.use_lora and not parallel.enabled:
            transformer.float()  # a full finetune trains fp32 masters (the family may load in bf16)
        if m.gradient_checkpointing:  # active only when gradients are (training)
            enable_gradient_checkpointing(transformer, family.block_lists, m.gradient_checkpointing_interval,
                                          keep=m.gradient_checkpointing_keeps)
        targets = list(m.lora_target_modules or family.lora_target_modules)
        self.lora = (LoraSpec(rank=m.lora_rank, alpha=m.lora_alpha, target_modules=targets,
                              components=list(m.lora_components), fold_without_grad=m.folds_lora(a.loss_type))
                     if m.use_lora else None)
        if self.lora is not None:
            parts = adaptable_parts(transformer)
            if unknown := [c for c in m.lora_components if c not in parts]:
                raise ValueError(f"--lora-components {unknown[0]}: the {family.name} model's parts are "
                                 f"{', '.join(parts) or 'none (it is one model: leave the flag out)'}")
            try:
                add_lora(transformer, self.lora)
            except ValueError as err:  # PEFT's own refusal when no module matches names neither flag nor family
                if "not found in the base model" not in str(err):
                    raise
            if not any("lora_" in n for n, _ in transformer.named_parameters()):
                raise ValueError(f"--lora-target-modules {', '.join(targets)}: no module of the {family.name} "
                                 "transformer matches")
            if init_lora is not None:  # --init-from: the run's adapter starts as the saved one (before any copy)
                load_lora_weights(family, init_lora, self.lora.rank, self.lora.alpha, self.lora.target_modules)
        # Attention kernel, fused projections, decode batch: after LoRA (whose targets --fuse-qkv checks),
        # before the engine's copy is made, so that both run the same forward.
        speed = m.speed_options()
        streams = speed.apply(family, deterministic=cfg.deterministic_mode)
        if streams and parallel.is_main:
            print(f"--fuse-qkv: {sum(streams.values())} of {len(streams)} attention streams fused (the others carry "
                  "LoRA on their q/k/v projections)")
        # The engine's family: the trained one itself in one process; under torchrun a full copy whose
        # weights are synced from the shards before each rollout and evaluation.
        # Under FSDP2 a full finetune's masters are cast to fp32 block by block as they are sharded (below), after
        # the copy is made from the weights as loaded: a rank never holds the whole transformer in fp32 twice.
        self.engine_family = family
        if parallel.enabled:
            dtype = engine_copy_dtype(cfg.engine.engine_copy_dtype, not m.use_lora, bf16, transformer, device)
            self.engine_family = twin_with_own_transformer(family, dtype)
            if parallel.is_main and not m.use_lora:
                kind = "float32" if dtype == torch.float32 else "bfloat16, as loaded"
                print(f"engine copy of the transformer on each rank: {kind} (--engine-copy-dtype "
                      f"{cfg.engine.engine_copy_dtype})")
        # Compiled after LoRA (it replaces layers inside the blocks), before FSDP2 shards them. An engine sampling in
        # the trainer's graph gets it for every batch size from the start: the rollout's batch and the replay's
        # micro-batch then share one graph, the first rollout included.
        self.engine_forward_graph = in_process_forward_graph(cfg, parallel.enabled)
        for f in self.families():
            speed.compile_family(f, dynamic=self.engine_forward_graph == "training")
        if parallel.enabled:
            shard_transformer(transformer, family.block_lists, parallel.mesh,
                              dtype=None if m.use_lora else torch.float32)
        # Trained, and what other engines receive after each update (LoRA: only the adapter's tensors).
        trainable = {n: p for n, p in transformer.named_parameters() if not m.use_lora or "lora_" in n}
        self.trainable_names, self.params = list(trainable), list(trainable.values())
        for p in self.params:
            p.requires_grad_(True)
        self.optimizer = torch.optim.AdamW(self.params, lr=o.lr, weight_decay=o.weight_decay,
                                           betas=(o.adam_beta1, o.adam_beta2))
        # self.ema: the objective's own EMA (DiffusionNFT's old policy θ_old, CRD's sampling snapshot, AWM's KL
        # anchor), or GRPO's --use-ema. self.eval_ema: what evaluation, checkpoints/best and the saved model use
        # with --use-ema (beside an objective's own EMA a second one, updated per optimizer step with --ema-decay:
        # the objective's follows its own schedule).
        objective = OBJECTIVES[a.loss_type]
        own_ema = objective.needs_ema(cfg)
        self.ema = ParameterEMA(self.params) if (a.use_ema or own_ema) else None
        self.eval_ema = (ParameterEMA(self.params) if own_ema else self.ema) if a.use_ema else None
        self.ema_update_interval, self.ema_warmup = a.ema_update_interval, a.ema_warmup
        self.extra_emas: dict[str, ParameterEMA] = {}  # snapshots an objective keeps (saved with the checkpoint)
        # The base model of a full finetune (a KL anchor, a preference method's reference): the starting weights,
        # taken before any resume loads later ones (an EMA that is never updated). LoRA gets it by disabling the
        # adapter.
        wants_base = (a.diffusion_kl_beta > 0 and a.kl_reference == "base") or objective.needs_base_model(cfg)
        self.base_weights = (ParameterEMA(self.params, dtype=torch.bfloat16 if bf16 else None,
                                          on_host=o.offload_reference)
                             if wants_base and not m.use_lora else None)
        self.optimizer_offload = OptimizerOffload(self.optimizer) if o.offload_optimizer else None
        self.local_engine = None  # the in-process engine, whose outputs carry the weight version
        self.remote_engines: list = []
        self.colocated: list[ColocatedEngineClient] = []  # engines that sleep while the trainer trains
        self.colocated_rewards: list = []  # reward models (in this process, in workers) that do too
        self.engine_sleep_level = cfg.engine.engine_sleep_level
        self.engine_released_gib: float | None = None  # what the colocated engines' last sleep gave the device
        self.engine_token = cfg.engine.engine_token or os.environ.get("DIFFRL_ENGINE_TOKEN")
        self.weight_version = 0

    @property
    def transformer(self) -> torch.nn.Module:
        return self.family.transformer

    def families(self) -> list:
        """The trained family and this process's engine family when it is a copy (under FSDP2), each once."""
        return list({id(f): f for f in (self.family, self.engine_family)}.values())

    def uncompiled_block_kinds(self) -> list[str]:
        """With --compile, after every block has run: the kinds of block that run eager anyway
        (`models.compile.uncompiled_block_kinds`), in the trained transformer and this process's engine copy."""
        return sorted({k for f in self.families() for k in uncompiled_block_kinds(f)})

    def block_kinds_at_recompile_limit(self) -> list[str]:
        """The kinds of compiled block whose dynamo cache is full (`models.compile.block_kinds_at_recompile_limit`),
        in the trained transformer and this process's engine copy."""
        return sorted({k for f in self.families() for k in block_kinds_at_recompile_limit(f)})

    # ------------------------------------------------------------------ engines
    def attach_remote_engines(self, clients: Sequence) -> None:
        """Engines elsewhere join the sync; with LoRA they host the adapter unmerged and get only its tensors."""
        self.remote_engines = list(clients)
        self.colocated = [c for c in self.remote_engines if isinstance(c, ColocatedEngineClient)]
        if self.lora is not None:
            for client in self.remote_engines:
                client.add_lora_adapter(self.lora, self.engine_token)

    @contextlib.contextmanager
    def engine_weights(self, ema: ParameterEMA | None):
        """The engines sample with an EMA (NFT's old policy; evaluation with --use-ema) or, given None,
        the current weights, inside the block. Every rank calls this."""
        with self._sampling_memory():
            with ema.swapped_in() if ema is not None else contextlib.nullcontext():
                self._send_weights_to_engines()
                if self.engine_family is self.family:
                    yield  # the shared module holds the EMA only while swapped in
                    return
            yield

    @contextlib.contextmanager
    def _sampling_memory(self):
        """The device's memory goes to the engines and rewards inside the block: the optimizer state on the
        host (--offload-optimizer), the trainer's cached blocks released, colocated engines and reward models
        awake; after it, the engines asleep again (--engine-sleep-level), the reward models on the host and
        the state back. `self.engine_released_gib`: the device memory the colocated engines' sleep after the
        block gave back (GiB, summed over them; 0.0 on a CPU), None when no engine was put to sleep."""
        self.engine_released_gib = None
        if self.optimizer_offload is not None:
            self.optimizer_offload.offload()  # returns with the host copies complete, holding no device tensor
        if self.colocated or self.colocated_rewards:
            release_cached(self.device)  # what training left cached is the other processes' to use now
        for sleeper in (*self.colocated, *self.colocated_rewards):
            sleeper.wake()
        try:
            yield
        finally:
            try:
                if self.engine_sleep_level and self.colocated:
                    replies = [engine.sleep(self.engine_sleep_level) for engine in self.colocated]
                    self.engine_released_gib = sum(r.get("released_bytes") or 0 for r in replies) / 2**30
                for reward in self.colocated_rewards:
                    reward.sleep()
            finally:  # the state comes back even when an engine cannot be put to sleep
                if self.optimizer_offload is not None:
                    self.optimizer_offload.restore()

    @torch.no_grad()
    def _send_weights_to_engines(self) -> None:
        if self.local_engine is not None:
            self.local_engine.weight_version = self.weight_version
        if self.parallel.enabled:  # the rank's engine copy: full tensors gathered from the shards
            # Only what trains: a LoRA's frozen base is the copy's since it was made (gathering it would move the
            # whole transformer over the network before every rollout).
            engine_params = dict(self.engine_family.transformer.named_parameters())
            for name, p in zip(self.trainable_names, self.params, strict=True):
                engine_params[name].copy_(full_tensor(p.detach()))
        if self.remote_engines:
            tensors = {name: p.detach() for name, p in zip(self.trainable_names, self.params, strict=True)}
            for client in self.remote_engines:
                client.push_weights(tensors, self.weight_version, self.engine_token)

    # ------------------------------------------------------------------ optimization
    def set_lr(self, lr: float) -> None:
        for group in self.optimizer.param_groups:
            group["lr"] = lr

    def step(self, grad_clip: float, ema_decay: float, nonfinite_loss: torch.Tensor | None = None) -> float | None:
        """Clip, step and bump the weight version; None (and no step) when the gradient is not finite, or when
        `nonfinite_loss` (a device flag: a loss of the accumulated micro-batches was not finite) is set; the
        caller clears the gradient. The norm and the flag come back to the host together: the one wait for
        the device of an optimizer step."""
        grad_norm = full_tensor(torch.nn.utils.clip_grad_norm_(self.params, grad_clip))
        if nonfinite_loss is None:
            norm, bad = grad_norm.item(), False
        else:
            norm, bad = torch.stack([grad_norm.double(), nonfinite_loss.double()]).tolist()
        if bad or not math.isfinite(norm):
            return None
        self.optimizer.step()
        self.weight_version += 1
        if self.eval_ema is not None and self.weight_version % self.ema_update_interval == 0:
            update = self.weight_version // self.ema_update_interval  # (the count survives a resume with it)
            self.eval_ema.update(warmed_up_decay(ema_decay, update, self.ema_warmup))
        return norm

    @contextlib.contextmanager
    def reference(self):
        """The KL reference (--kl-reference) in place of the trained weights inside the block: the base
        model or the EMA."""
        with self.ema.swapped_in() if self.kl_reference == "ema" else self.base_model():
            yield

    @contextlib.contextmanager
    def base_model(self):
        """The starting weights in place of the trained ones inside the block: LoRA disabled, or the starting
        weights swapped in."""
        if self.use_lora:
            self.transformer.disable_adapters()
            try:
                yield
            finally:
                self.transformer.enable_adapters()
        else:
            with self.base_weights.swapped_in():
                yield

    def emas(self) -> dict[str, ParameterEMA]:
        """The EMAs a checkpoint saves and a resume restores, by name."""
        emas = {"ema": self.ema, "eval_ema": self.eval_ema if self.eval_ema is not self.ema else None,
                **self.extra_emas}
        return {name: ema for name, ema in emas.items() if ema is not None}
