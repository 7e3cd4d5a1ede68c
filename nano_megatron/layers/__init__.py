"""nano_megatron's performance layers: MegatronEngine subclasses that make a step faster without changing
what it computes. `nano_megatron.build.REGISTRY` lists them and loads each inside a guard (a deleted one
is skipped); `build_engine` stacks those a configuration asks for or that apply (see build.py)."""
