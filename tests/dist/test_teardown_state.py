"""A layout strategy leaves nothing behind in the objects the user or Lightning own: the precision plugin and its
scaler come back as they were (the layout's subclass copies are taken out at teardown, [Note: precision
subclasses]), and no sharding rule of ours stays in DTensor's propagator."""
import os
import subprocess
import sys
import textwrap

import pytest

from harness import TIMEOUT_S

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

# Each case runs in a fresh process: a one-device fit runs in the calling process, whose process group and
# DTensor propagator would otherwise be shared with the tests after it.
BODY = textwrap.dedent("""
    import sys
    import lightning.pytorch as pl
    import torch
    from lightning.pytorch.plugins.precision import MixedPrecision
    from torch.utils.data import DataLoader

    sys.path.insert(0, "tests")
    from harness import trainer_kwargs
    from lightning_par import HybridParallelStrategy, PipelineParallelStrategy, TensorParallelStrategy
    from lightning_par.data import SyntheticCorpus
    from lightning_par.models import GPT
    from lightning_par.tensor.rules import strategy_of

    DATA = SyntheticCorpus(vocab_size=32, seq_len=16, train_sequences=16, val_sequences=8)
    make = {"tensor": lambda: TensorParallelStrategy(tensor_parallel_size=1, timeout=60),
            "pipeline": lambda: PipelineParallelStrategy(pipeline_parallel_size=1, microbatches=2, timeout=60),
            "hybrid": lambda: HybridParallelStrategy(timeout=60)}[sys.argv[1]]
    scaler = torch.amp.GradScaler("cpu", init_scale=1024.0)""")


@pytest.mark.timeout(TIMEOUT_S)
@pytest.mark.parametrize("kind", ["tensor", "pipeline", "hybrid"])
def test_precision_plugin_and_scaler_come_back_unchanged(kind):
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""))
    res = subprocess.run([sys.executable, "-c", BODY + CHECKS, kind], cwd=ROOT, env=env, capture_output=True,
                         text=True, timeout=TIMEOUT_S - 20)
    assert res.returncode == 0 and "unchanged" in res.stdout, res.stdout[-2000:] + res.stderr[-3000:]


CHECKS = textwrap.dedent("""
    plugin = MixedPrecision("16-mixed", "cpu", scaler)
    before = (type(plugin), dict(vars(plugin)), type(scaler), set(vars(scaler)))
    rules_before = strategy_of(torch.ops.aten._scaled_dot_product_flash_attention_for_cpu.default)
    trainer = pl.Trainer(**trainer_kwargs(devices=1, strategy=make(), plugins=[plugin], max_steps=2,
                                          gradient_clip_val=0.5))
    model = GPT(vocab_size=32, block_size=16, n_layer=2, n_head=2, n_embd=16)
    trainer.fit(model, DataLoader(DATA.train_set, batch_size=4))
    assert trainer.strategy.precision_plugin is plugin
    assert (type(plugin), dict(vars(plugin)), type(scaler), set(vars(scaler))) == before
    assert plugin.scaler is scaler
    assert strategy_of(torch.ops.aten._scaled_dot_product_flash_attention_for_cpu.default) is rules_before
    print("unchanged")
""")
