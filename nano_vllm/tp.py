"""Tensor-parallel execution (vLLM, arXiv 2309.06180, §4.6), Megatron-LM style, on torch.distributed.

§4.6: the model is split across GPUs with Megatron-LM's tensor parallelism; every GPU worker holds the
K/V of *its* attention heads only, yet all workers share one block table, because a token's K/V occupies
the same block id on every GPU. So one scheduler and one block manager (on rank 0) drive all workers:
each step rank 0 broadcasts the step's inputs, every rank runs the forward on its shard (two all-reduces
per layer), and rank 0, whose logits are complete, samples.

Sharding (applied from outside, shared.model stays plain — torchtitan's rule):
* q/k/v, gate and up projections are column-parallel: rank r keeps a contiguous slice of the output rows,
  i.e. heads [r·H/N, (r+1)·H/N) and a slice of the MLP width (shared.model reads head counts off the
  projected widths, so nothing else changes);
* o_proj and down_proj are row-parallel: rank r keeps the matching input columns and all-reduces the
  partial sums;
* embeddings, norms and the LM head are replicated (simple; costs vocab·hidden memory per GPU).

Workers are processes this module spawns (NCCL on CUDA, gloo on a CPU, where CI tests it); the engine's
process is rank 0. Every rank runs a `TPModelRunner`, the paper path's ModelRunner loading a shard.
"""

from __future__ import annotations

import multiprocessing as mp
from datetime import timedelta

import torch
import torch.distributed as dist
from torch import nn

from nano_vllm.config import EngineConfig
from nano_vllm.kv_cache import load_engine_model
from nano_vllm.model_runner import ModelRunner, StepInputs
from shared.config import ModelConfig
from shared.dist import find_free_port
from shared.model import CausalLM

_CPU_GROUP: dist.ProcessGroup | None = None  # gloo group for broadcasting Python objects


class RowParallelLinear(nn.Module):
    """y = all_reduce(x_r W_rᵀ): this rank's slice of the input features, summed over ranks."""

    def __init__(self, linear: nn.Linear):
        super().__init__()
        self.linear = linear

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.linear(x)
        dist.all_reduce(y)
        return y


def _slice_linear(linear: nn.Linear, dim: int, rank: int, world: int) -> nn.Linear:
    """A new Linear holding rank's contiguous 1/world of `linear` along dim 0 (outputs) or 1 (inputs)."""
    w = linear.weight.detach()
    if w.shape[dim] % world:
        raise ValueError(f"cannot split a {tuple(w.shape)} weight {world} ways along dim {dim}")
    w = w.chunk(world, dim=dim)[rank].clone()
    bias = linear.bias is not None and dim == 0  # a row-parallel bias would be added `world` times
    out = nn.Linear(w.shape[1], w.shape[0], bias=bias, device=w.device, dtype=w.dtype)
    out.weight.data.copy_(w)
    if bias:
        out.bias.data.copy_(linear.bias.detach().chunk(world)[rank])
    return out


def shard_model(model: CausalLM, rank: int, world: int) -> CausalLM:
    """Shard `model` in place for tensor-parallel rank `rank` of `world` (Megatron-LM, §4.6)."""
    cfg = model.config
    for name, value in (("num_attention_heads", cfg.num_attention_heads),
                        ("num_key_value_heads", cfg.num_key_value_heads),
                        ("intermediate_size", cfg.intermediate_size)):
        if value % world:
            raise ValueError(f"tensor_parallel_size={world} must divide {name}={value}")
    for layer in model.model.layers:
        attn, mlp = layer.self_attn, layer.mlp
        if attn.o_proj.bias is not None:
            raise ValueError("o_proj with a bias is not supported under tensor parallelism")
        attn.q_proj, attn.k_proj, attn.v_proj = (_slice_linear(m, 0, rank, world)
                                                 for m in (attn.q_proj, attn.k_proj, attn.v_proj))
        attn.o_proj = RowParallelLinear(_slice_linear(attn.o_proj, 1, rank, world))
        mlp.gate_proj, mlp.up_proj = (_slice_linear(m, 0, rank, world) for m in (mlp.gate_proj, mlp.up_proj))
        mlp.down_proj = RowParallelLinear(_slice_linear(mlp.down_proj, 1, rank, world))
    return model


def _device(config: EngineConfig, rank: int) -> torch.device:
    return torch.device("cuda", rank) if config.torch_device.type == "cuda" else torch.device("cpu")


def _init_group(rank: int, world: int, port: int, device: torch.device) -> None:
    global _CPU_GROUP
    backend = "nccl" if device.type == "cuda" else "gloo"
    kwargs = {"device_id": device} if device.type == "cuda" else {}
    if device.type == "cuda":
        torch.cuda.set_device(device)
    dist.init_process_group(backend, init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world,
                            timeout=timedelta(seconds=300), **kwargs)
    _CPU_GROUP = dist.new_group(backend="gloo") if backend == "nccl" else dist.group.WORLD


def _worker(rank: int, world: int, port: int, config: EngineConfig, model_config: ModelConfig,
            max_model_len: int) -> None:
    """Ranks 1..N-1: build the shard, then run every step rank 0 broadcasts until it sends None."""
    device = _device(config, rank)
    if device.type == "cpu":
        torch.set_num_threads(1)  # N ranks on one CPU: do not oversubscribe the cores
    _init_group(rank, world, port, device)
    try:
        runner = TPModelRunner(config, model_config, max_model_len, rank, device)
        while True:
            box = [None]
            dist.broadcast_object_list(box, src=0, group=_CPU_GROUP)
            if box[0] is None:
                break
            runner.run(box[0])
    finally:
        dist.destroy_process_group()


class TPModelRunner(ModelRunner):
    """The ModelRunner of one tensor-parallel rank: it loads its shard of the model (§4.6). Rank 0 is the
    engine's runner: it starts the other ranks and broadcasts each step's inputs before running it; its
    logits are complete after the all-reduces, so it alone samples."""

    def __init__(self, config: EngineConfig, model_config: ModelConfig, max_model_len: int, rank: int = 0,
                 device: torch.device | None = None):
        world = config.tensor_parallel_size
        self.procs: list[mp.Process] = []
        if rank == 0:
            if dist.is_initialized():
                raise RuntimeError("tensor_parallel_size > 1 starts its own process group; one already "
                                   "exists")
            if config.torch_device.type == "cuda" and torch.cuda.device_count() < world:
                raise ValueError(f"tensor_parallel_size={world} needs {world} GPUs, found "
                                 f"{torch.cuda.device_count()}")
            port = find_free_port()
            ctx = mp.get_context("spawn")  # a forked child would inherit CUDA state and threads
            args = (world, port, config, model_config, max_model_len)
            self.procs = [ctx.Process(target=_worker, args=(r, *args), daemon=True) for r in range(1, world)]
            for p in self.procs:
                p.start()
            device = _device(config, 0)
            _init_group(0, world, port, device)
        super().__init__(config, model_config, max_model_len, tp_rank=rank, tp_size=world, device=device)

    def load_model(self) -> CausalLM:
        model = load_engine_model(self.config, self.model_config, torch.device("cpu"))
        return shard_model(model, self.tp_rank, self.tp_size).to(self.device)

    def run(self, inputs: StepInputs) -> torch.Tensor | None:
        if self.tp_rank == 0:
            dist.broadcast_object_list([inputs], src=0, group=_CPU_GROUP)
        return super().run(inputs)

    def shutdown(self) -> None:
        if self.tp_rank != 0 or not dist.is_initialized():
            return
        dist.broadcast_object_list([None], src=0, group=_CPU_GROUP)
        for p in self.procs:
            p.join(timeout=30)
        dist.destroy_process_group()
