"""The peers of nano_megatron's bench: torch's own tensor parallelism (DTensor `parallelize_module`) on the
same shared.model, with the recipe our engine uses (bf16 model, fp32 master weights, AdamW, clipping).

    dtensor_tp              ColwiseParallel / RowwiseParallel on q,k,v,o and the MLP, vocabulary-sharded
                            embedding and LM head, `loss_parallel`
    dtensor_tp_sp           the same with sequence parallelism (torchtitan's plan): the residual stream and
                            the norms sharded along the sequence, all-gather before and reduce-scatter after
                            each block
    dtensor_tp_sp_compile   dtensor_tp_sp under `torch.compile` (each decoder layer, as torchtitan does)
"""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from shared.config import ModelConfig
from shared.model import build_model
from shared.train import MixedPrecisionAdamW, StepResult, TrainConfig

DTENSOR_SYSTEMS = ("dtensor_tp", "dtensor_tp_sp", "dtensor_tp_sp_compile")


def _replicate_params(name: str, module: nn.Module, mesh) -> None:
    """distribute_module's partition function for norms under SP: each parameter a Replicate DTensor, so
    its gradient (partial over the sequence shards) is summed over tp in backward (2205.05198 §4.2.2)."""
    from torch.distributed.tensor import DTensor, Replicate

    for pname, p in list(module.named_parameters(recurse=False)):
        module.register_parameter(pname, nn.Parameter(DTensor.from_local(p, mesh, [Replicate()], run_check=False)))


class DTensorTP:
    """torch's tensor parallelism behind `train_step`, with our recipe (bf16 model, fp32 masters)."""

    def __init__(self, mcfg: ModelConfig, cfg: TrainConfig, device: torch.device, sequence_parallel: bool = False,
                 compile: bool = False) -> None:
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.tensor import Replicate, Shard, distribute_module
        from torch.distributed.tensor.parallel import (
            ColwiseParallel,
            PrepareModuleInput,
            RowwiseParallel,
            parallelize_module,
        )

        self.cfg, self.device = cfg, device
        model = build_model(mcfg, device, seed=cfg.seed)
        sp = sequence_parallel
        residual = Shard(1) if sp else Replicate()  # the layout of the residual stream between blocks
        plan = {"model.embed_tokens": RowwiseParallel(input_layouts=Replicate(), output_layouts=residual,
                                                      use_local_output=not sp),
                "lm_head": ColwiseParallel(input_layouts=residual, output_layouts=Shard(-1), use_local_output=False)}
        for i in range(mcfg.num_hidden_layers):
            p = f"model.layers.{i}."
            for name in ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "mlp.gate_proj", "mlp.up_proj"):
                plan[p + name] = ColwiseParallel()
            for name in ("self_attn.o_proj", "mlp.down_proj"):
                plan[p + name] = RowwiseParallel(output_layouts=residual, use_local_output=not sp)
            if sp:  # all-gather the sequence at each block's entry (args: x, cos, sin, ctx / x)
                plan[p + "self_attn"] = PrepareModuleInput(input_layouts=(Shard(1), None, None, None),
                                                           desired_input_layouts=(Replicate(), None, None, None),
                                                           use_local_output=True)
                plan[p + "mlp"] = PrepareModuleInput(input_layouts=(Shard(1),), desired_input_layouts=(Replicate(),),
                                                     use_local_output=True)
        mesh = init_device_mesh(device.type, (dist.get_world_size(),))
        self.model = parallelize_module(model, mesh, plan)
        if sp:  # the block norms and the final norm see sequence-sharded DTensors
            for layer in model.model.layers:
                for norm in (layer.input_layernorm, layer.post_attention_layernorm):
                    distribute_module(norm, mesh, _replicate_params)
            distribute_module(model.model.norm, mesh, _replicate_params)
        else:
            # A Replicate output with use_local_output is an AsyncCollectiveTensor: a wrapper around the
            # all-reduce still in flight, with no storage of its own. torch ops wait on it transparently, but
            # a Triton kernel (our RMSNorm, next) reads raw pointers: an illegal memory access on the GPU. One
            # clone per all-reduced output makes it a plain tensor (the b·s·h copy is charged to this peer).
            for name, style in plan.items():
                if isinstance(style, RowwiseParallel):
                    self.model.get_submodule(name).register_forward_hook(lambda mod, args, out: out.clone())
        self.opt = MixedPrecisionAdamW(list(self.model.parameters()), cfg)
        self.model.to(cfg.torch_dtype)
        if compile:
            for layer in model.model.layers:
                layer.compile()

    def train_step(self, micro_batches: list[tuple[torch.Tensor, torch.Tensor]], lr: float) -> StepResult:
        from torch.distributed.tensor import DTensor
        from torch.distributed.tensor.parallel import loss_parallel

        num_tokens = sum(y.numel() for _, y in micro_batches)
        for x, y in micro_batches:
            with loss_parallel():
                logits = self.model(x.to(self.device))
                loss = F.cross_entropy(logits.flatten(0, 1).float(), y.to(self.device).flatten(),
                                       reduction="sum") / num_tokens
                loss.backward()
        grads = self.opt.master_grads()
        # torch.nn.utils.clip_grad_norm_ refuses a mix of DTensor and plain (norm) gradients: the norm per
        # kind, sharded ones reduced as a scalar; the clipping itself is MixedPrecisionAdamW's
        sharded = [g for g in grads if isinstance(g, DTensor)]
        plain = [g for g in grads if not isinstance(g, DTensor)]
        sq = torch.zeros((), device=self.device)
        if sharded:
            sq = sq + torch.nn.utils.get_total_norm(sharded).full_tensor().pow(2)
        if plain:
            sq = sq + torch.nn.utils.get_total_norm(plain).pow(2)
        norm = sq.sqrt()
        self.opt.step(norm, self.cfg.grad_clip, lr)
        return StepResult(loss=0.0, grad_norm=float(norm))

    def close(self) -> None:
        pass
