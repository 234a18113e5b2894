"""What `--resume` needs beyond the saved weights: trained parameters, optimizer moments, the EMAs
(by name: `ema` = NFT's old policy or GRPO's --use-ema, `eval_ema` = NFT's --use-ema) and the run's counters.

One process writes one torch file (`train_state.pt`). Several ranks (FSDP2) write a
torch.distributed.checkpoint folder (`train_state/`), each rank its own shards of the parameters,
the optimizer state and the EMA, plus `train_meta.json` for the counters; a resume must use the
same kind of launch that wrote the checkpoint (refused otherwise, by name).
"""

from __future__ import annotations

import json
from pathlib import Path

import torch

from diffrl.train.ema import ParameterEMA
from diffrl.train.parallel import Parallel

SINGLE_FILE = "train_state.pt"
SHARDED_DIR = "train_state"
META_FILE = "train_meta.json"


def save_train_state(path: Path, *, transformer: torch.nn.Module, params: list[torch.nn.Parameter],
                     names: list[str], optimizer: torch.optim.Optimizer, emas: dict[str, ParameterEMA],
                     meta: dict, parallel: Parallel) -> None:
    """Every rank calls this (the sharded save is collective)."""
    if not parallel.enabled:
        torch.save({"params": [p.detach().cpu() for p in params], "optimizer": optimizer.state_dict(),
                    "emas": {name: ema.state_dict() for name, ema in emas.items()}, **meta}, path / SINGLE_FILE)
        return
    import torch.distributed.checkpoint as dcp

    dcp.save(_sharded_state(transformer, params, names, optimizer, emas), checkpoint_id=str(path / SHARDED_DIR))
    if parallel.is_main:
        (path / META_FILE).write_text(json.dumps(meta) + "\n")


def load_train_state(path: Path, *, transformer: torch.nn.Module, params: list[torch.nn.Parameter],
                     names: list[str], optimizer: torch.optim.Optimizer, emas: dict[str, ParameterEMA],
                     device: torch.device, parallel: Parallel) -> dict:
    """Restore into the live objects; returns the counters (`meta` of the save)."""
    sharded = (path / SHARDED_DIR).is_dir()
    if sharded != parallel.enabled:
        writer = "several ranks (torchrun)" if sharded else "one process"
        raise ValueError(f"--resume: {path} was written by {writer}; resume it the same way "
                         f"(this run has {parallel.world_size} rank{'s' if parallel.world_size > 1 else ''})")
    if not sharded:
        file = path / SINGLE_FILE
        state = read_single_file(file, device)
        saved_params = state.pop("params")
        if len(saved_params) != len(params) or any(s.shape != p.shape for s, p in zip(saved_params, params)):
            raise ValueError(f"--resume: {file} holds {len(saved_params)} trained tensors that do not fit the "
                             f"{len(params)} this run trains (another model, --use-lora or --lora-rank?)")
        try:
            optimizer.load_state_dict(state.pop("optimizer"))
        except (ValueError, KeyError, TypeError, RuntimeError) as err:
            raise ValueError(f"--resume: {file}: the optimizer state does not fit this run ({_first_line(err)})") from None
        with torch.no_grad():
            for p, saved in zip(params, saved_params, strict=True):
                p.copy_(saved)
        legacy = state.pop("ema", None)  # checkpoints before named EMAs held one, under "ema"
        saved = state.pop("emas", None) or ({"ema": legacy} if legacy is not None else {})
        for name, ema in emas.items():
            if name in saved:
                ema.load_state_dict(saved[name])
        return state
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.api import CheckpointException
    from torch.distributed.checkpoint.state_dict import StateDictOptions, set_state_dict

    state = _sharded_state(transformer, params, names, optimizer, emas)
    # Partial: the fresh optimizer has state for every parameter, the saved one only for those that
    # ever had a gradient (a module this task never runs has none), and those keep their fresh zeros.
    meta_file = path / META_FILE
    try:
        meta = json.loads(meta_file.read_text())
    except FileNotFoundError:
        raise FileNotFoundError(f"--resume: {meta_file} is missing") from None
    except (OSError, ValueError) as err:
        raise ValueError(f"--resume: {meta_file} is damaged ({_first_line(err)})") from None
    try:
        dcp.load(state, checkpoint_id=str(path / SHARDED_DIR),
                 planner=dcp.DefaultLoadPlanner(allow_partial_load=True))
    except (CheckpointException, OSError, RuntimeError, ValueError) as err:
        raise ValueError(f"--resume: {path / SHARDED_DIR} does not load ({_first_line(err)})") from None
    # Not strict: the model state holds the trained parameters alone (a LoRA run's adapters, not the frozen base
    # weights, which come from the checkpoint's model folder), exactly the keys get_state_dict gave above.
    set_state_dict(transformer, optimizer, model_state_dict=state["model"], optim_state_dict=state["optimizer"],
                   options=StateDictOptions(ignore_frozen_params=True, strict=False))
    with torch.no_grad():
        for name, ema in emas.items():
            for shadow, loaded in zip(ema.shadow, (state[name][n] for n in names), strict=True):
                shadow.copy_(loaded.to_local())
    return meta


def read_single_file(file: Path, device) -> dict:
    """The dict of a one-process `train_state.pt`; a missing, empty, truncated or foreign file is a
    one-line error naming it."""
    if not file.is_file():
        raise FileNotFoundError(f"--resume: {file} is missing")
    try:
        state = torch.load(file, map_location=device, weights_only=True)
    except Exception as err:  # noqa: BLE001 - torch.load raises many types for a damaged archive
        raise ValueError(f"--resume: {file} is damaged or truncated ({_first_line(err)})") from None
    if not isinstance(state, dict) or not {"params", "optimizer"} <= state.keys():
        raise ValueError(f"--resume: {file} is not a diffrl train state (no params/optimizer)")
    return state


def _first_line(err: BaseException) -> str:
    text = str(err).strip()
    return f"{type(err).__name__}: {text.splitlines()[0] if text else ''}".rstrip(": ")


def _sharded_state(transformer, params, names, optimizer, emas) -> dict:
    """DTensor state dicts of the trained parameters, the optimizer and the EMAs (whose per-rank
    shadows are wrapped with their parameters' placements)."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict
    from torch.distributed.tensor import DTensor

    model_sd, optim_sd = get_state_dict(transformer, optimizer, options=StateDictOptions(ignore_frozen_params=True))
    state = {"model": model_sd, "optimizer": optim_sd}
    for name, ema in emas.items():
        state[name] = {n: DTensor.from_local(s, p.device_mesh, p.placements, shape=p.shape, stride=p.stride(),
                                              run_check=False)
                        for n, s, p in zip(names, ema.shadow, params, strict=True)}
    return state
