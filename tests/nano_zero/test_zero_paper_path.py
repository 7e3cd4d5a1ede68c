"""nano_zero's paper path stands alone: in a copy of the repository without `ledger.py` (the counted
collectives and the memory ledger) and `bench.py`, `nano_zero.zero` imports and a ZeRO step on one gloo
rank gives the loss the full repository gives. nano_zero has no performance layer; the ledger measures a
ZeroDataParallel from outside (`count_communication`, `memory_report`)."""

from __future__ import annotations

import json
import textwrap

import pytest
import torch
import torch.distributed as dist

from nano_zero.ledger import count_communication
from shared.dist import destroy_distributed, init_distributed

# Two stages x two steps of the tiny model, one micro-batch each, on a 1-rank gloo group.
STEPS = textwrap.dedent('''
    import torch
    from nano_zero.zero import ZeroDataParallel
    from shared.config import ModelConfig
    from shared.dist import init_distributed
    from shared.model import build_model
    from shared.train import next_token_loss

    def zero_losses():
        init_distributed()
        mc = ModelConfig.from_name("tiny").replace(num_hidden_layers=1, hidden_size=32,
                                                   intermediate_size=64, head_dim=8, vocab_size=97)
        x = torch.randint(0, 97, (2, 9), generator=torch.Generator().manual_seed(0))
        out = {}
        for stage in (2, 3):
            model = ZeroDataParallel(build_model(mc, seed=0), stage, weight_decay=0.1)
            losses = []
            for _ in range(2):
                loss = next_token_loss(model(x[:, :-1]), x[:, 1:], x[:, 1:].numel())
                loss.backward()
                model.step(1e-2, max_norm=1.0)
                losses.append(loss.item())
            out[stage] = losses
        return out
''')
SCRIPT = STEPS + textwrap.dedent('''
    import json, os
    import nano_zero

    assert nano_zero.__file__.startswith(os.getcwd()), nano_zero.__file__
    try:
        import nano_zero.ledger
    except ModuleNotFoundError:
        pass
    else:
        raise AssertionError("nano_zero/ledger.py is still there")
    print("RESULT", json.dumps(zero_losses()))
''')


@pytest.fixture(scope="module")
def full_tree_losses():
    created = not dist.is_initialized()
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # as in the copy (OMP_NUM_THREADS=1)
    try:
        namespace: dict = {}
        exec(STEPS, namespace)
        return {str(k): v for k, v in namespace["zero_losses"]().items()}
    finally:
        torch.set_num_threads(threads)
        if created:
            destroy_distributed()


@pytest.mark.slow
def test_zero_runs_with_the_ledger_and_bench_deleted(run_in_copy, full_tree_losses):
    proc = run_in_copy(["nano_zero", "shared", "nano_flashattn"],
                       ["nano_zero/ledger.py", "nano_zero/bench.py"], SCRIPT, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    losses = json.loads(proc.stdout.split("RESULT ", 1)[1])
    assert losses.keys() == full_tree_losses.keys() == {"2", "3"}
    for stage, ref in full_tree_losses.items():
        assert losses[stage] == pytest.approx(ref, rel=1e-6), stage
        assert ref[1] < ref[0]  # it trains


def test_the_ledger_counts_from_outside():
    """The paper path's collectives are plain; the ledger's wrapper counts them, once wrapped."""
    from nano_zero.collectives import Collectives
    from nano_zero.ledger import CountedCollectives
    from nano_zero.zero import ZeroDataParallel

    created = not dist.is_initialized()
    init_distributed()
    try:
        model = ZeroDataParallel(torch.nn.Sequential(torch.nn.ModuleList([torch.nn.Linear(3, 3)])), 1)
        assert type(model.comm) is Collectives and not hasattr(model, "counter")
        counter = count_communication(model)
        assert isinstance(model.comm, CountedCollectives) and count_communication(model) is counter
        model.step(1e-3)  # stage 1: reduce-scatter the gradients, all-gather the parameters
        psi = sum(u.padded for u in model.units)
        assert counter.elements == {"reduce_scatter": psi, "all_gather": psi}
    finally:
        if created:
            destroy_distributed()
