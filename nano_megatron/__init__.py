"""nano_megatron: Megatron-LM's tensor, sequence, pipeline and data parallelism for shared.model.

Papers: Shoeybi et al. 2019 (arXiv 1909.08053, tensor parallelism), Narayanan et al. 2021 (2104.04473,
pipeline schedules and the 3-D grid), Korthikanti et al. 2022 (2205.05198, sequence parallelism).
One file per parallelism; `engine.MegatronEngine` combines them behind shared.train's loop, and
`build_engine` adds the performance layers (`layers/`: overlap, cudagraph, micro_batch_pairs) that apply.

    torchrun --nproc-per-node 4 -m nano_megatron.train parallel.tp=2 parallel.pp=2 model=tiny
"""

from nano_megatron.build import LayerConfig, build_engine
from nano_megatron.data_parallel import BucketedGradReducer
from nano_megatron.engine import MegatronEngine, ParallelConfig, validate
from nano_megatron.grid import GridShape, ParallelGrid
from nano_megatron.pipeline_parallel import PipelineSchedule, split_into_stage, stage_forward
from nano_megatron.schedules import bubble_fraction_formula, gpipe, one_f_one_b
from nano_megatron.sequence_parallel import (
    gather_from_sequence_parallel,
    reduce_scatter_to_sequence_parallel,
)
from nano_megatron.tensor_parallel import (
    ColumnParallelLinear,
    RowParallelLinear,
    TPShard,
    VocabParallelEmbedding,
    apply_tensor_parallel,
    copy_to_tp,
    reduce_from_tp,
    vocab_parallel_cross_entropy,
)

__all__ = [
    "BucketedGradReducer",
    "ColumnParallelLinear",
    "GridShape",
    "LayerConfig",
    "MegatronEngine",
    "ParallelConfig",
    "ParallelGrid",
    "PipelineSchedule",
    "RowParallelLinear",
    "TPShard",
    "VocabParallelEmbedding",
    "apply_tensor_parallel",
    "bubble_fraction_formula",
    "build_engine",
    "copy_to_tp",
    "gather_from_sequence_parallel",
    "gpipe",
    "one_f_one_b",
    "reduce_from_tp",
    "reduce_scatter_to_sequence_parallel",
    "split_into_stage",
    "stage_forward",
    "validate",
    "vocab_parallel_cross_entropy",
]
