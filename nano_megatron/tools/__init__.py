"""Tools beside nano_megatron's paper path: the bench's DTensor peers (`bench_peers`) and measurements
(`bench_profile`), and the pipeline simulator (`python -m nano_megatron.tools.simulator`)."""
