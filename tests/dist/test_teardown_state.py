"""A layout strategy leaves nothing behind in the objects the user or Lightning own: the precision plugin and its
scaler come back as they were (the layout's subclass copies are taken out at teardown, [Note: precision
subclasses]), and no global state stays behind: DTensor's sharding tables and dispatcher flag, torch's global
module hooks, the trainer's flags and the module's attributes are as before the fit (its blocks' forward the
class's again after ``compile=``), no patch of
lightning_par.patches is still installed, the optimizer keeps its own ``step`` and no step hook, and nothing of
the package (a cache, a registry) holds the module: a second Trainer of the same module finds out from the
module itself that it is parallelized already."""
import multiprocessing
import os
import sys
import textwrap

import pytest

from harness import TIMEOUT_S, output_to

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

# Each case runs in a process forked from pytest's: a one-device fit runs in the calling process, whose process
# group and DTensor propagator would otherwise be shared with the tests after it. The child compares the state
# before its fit with the state after it, both its own (a fork, not a new interpreter: the imports are done).
BODY = textwrap.dedent("""
    import sys
    import lightning.pytorch as pl
    import torch
    from lightning.pytorch.plugins.precision import MixedPrecision
    from torch.utils.data import DataLoader

    sys.path.insert(0, "tests")
    from harness import trainer_kwargs
    from lightning_par import DataParallelStrategy, HybridParallelStrategy, PipelineParallelStrategy, TensorParallelStrategy
    from lightning_par.data import SyntheticCorpus
    from lightning_par.models import GPT
    from lightning_par.tensor.rules import strategy_of

    DATA = SyntheticCorpus(vocab_size=32, seq_len=16, train_sequences=16, val_sequences=8)
    make = {"tensor": lambda: TensorParallelStrategy(tensor_parallel_size=1, timeout=60),
            "pipeline": lambda: PipelineParallelStrategy(pipeline_parallel_size=1, microbatches=2, timeout=60),
            "hybrid": lambda: HybridParallelStrategy(timeout=60),
            "data": lambda: DataParallelStrategy(timeout=60),
            "data_compiled": lambda: DataParallelStrategy(compile="aot_eager", timeout=60),
            "tensor_compiled": lambda: TensorParallelStrategy(tensor_parallel_size=1, compile="aot_eager", timeout=60),
            }[sys.argv[1]]
    scaler = torch.amp.GradScaler("cpu", init_scale=1024.0)""")


@pytest.mark.timeout(TIMEOUT_S)
@pytest.mark.parametrize("kind", ["tensor", "pipeline", "hybrid", "data", "data_compiled", "tensor_compiled"])
def test_precision_plugin_and_scaler_come_back_unchanged(kind, tmp_path):
    log = tmp_path / "child.log"
    child = multiprocessing.get_context("fork").Process(target=_run_checks, args=(kind, str(log)))
    child.start()
    child.join(TIMEOUT_S - 20)
    if child.is_alive():
        child.kill()
        child.join()
    out = log.read_text() if log.exists() else ""
    assert child.exitcode == 0 and "unchanged" in out, out[-5000:]


def _run_checks(kind: str, log_path: str) -> None:
    """The child: BODY + CHECKS as a script run with ``kind`` as its argument, its output in ``log_path``."""
    import torch

    torch.set_num_threads(1)
    os.chdir(ROOT)
    output_to(log_path, "w")
    sys.argv = ["-c", kind]
    exec(compile(BODY + CHECKS, "<teardown checks>", "exec"), {"__name__": "__main__"})


CHECKS = textwrap.dedent("""
    import weakref
    from torch.nn.modules import module as nn_module
    from lightning_par import patches
    from lightning_par._compat import op_dispatcher, sharding_propagator
    from lightning_par.tensor import attention, fused
    from lightning_par.tensor.rules import _TABLES

    def global_state():
        prop = sharding_propagator()
        tables = {name: dict(getattr(prop, name)) for name in (*_TABLES, "op_to_scalar_shape_adjuster")
                  if hasattr(prop, name)}
        hooks = {name: dict(getattr(nn_module, name)) for name in dir(nn_module) if name.startswith("_global_")
                 and isinstance(getattr(nn_module, name), dict)}
        return {**tables, **hooks, "implicit replication": op_dispatcher()._allow_implicit_replication,
                "patches": patches.pending(), "registered": (attention._registered, fused._registered)}

    def held_by_package(objects):  # module-level names of lightning_par whose container holds one of objects
        ids, found = {id(o) for o in objects}, []
        for name, mod in list(sys.modules.items()):
            if name.split(".")[0] != "lightning_par":
                continue
            for attr, value in list(vars(mod).items()):
                if isinstance(value, (dict, weakref.WeakKeyDictionary, weakref.WeakValueDictionary)):
                    items = [*value.keys(), *value.values()]
                elif isinstance(value, (list, set, frozenset, tuple, weakref.WeakSet)):
                    items = list(value)
                else:
                    continue
                found += [f"{name}.{attr}"] if any(id(i) in ids for i in items) else []
        return found

    plugin = MixedPrecision("16-mixed", "cpu", scaler)
    before = (type(plugin), dict(vars(plugin)), type(scaler), set(vars(scaler)))
    rules_before = strategy_of(torch.ops.aten._scaled_dot_product_flash_attention_for_cpu.default)
    trainer = pl.Trainer(**trainer_kwargs(devices=1, strategy=make(), plugins=[plugin], max_steps=2,
                                          gradient_clip_val=0.5))
    model = GPT(vocab_size=32, block_size=16, n_layer=2, n_head=2, n_embd=16)
    global_before, connector_before = global_state(), vars(trainer._accelerator_connector).copy()
    trainer.fit(model, DataLoader(DATA.train_set, batch_size=4))
    after = global_state()
    assert after == global_before, {k: (global_before[k], v) for k, v in after.items() if v != global_before[k]}
    assert vars(trainer._accelerator_connector) == connector_before
    assert not {"log", "_ddp_params_and_buffers_to_ignore"} & set(vars(model))
    # Lightning's forward redirection (DDP's) puts the class's own forward back as an instance attribute
    rebound = [name for name, m in model.named_modules()
               if getattr(vars(m).get("forward", m.forward), "__func__", None) is not type(m).forward]
    assert not rebound, rebound
    assert trainer.strategy.precision_plugin is plugin
    assert (type(plugin), dict(vars(plugin)), type(scaler), set(vars(scaler))) == before
    assert plugin.scaler is scaler
    assert strategy_of(torch.ops.aten._scaled_dot_product_flash_attention_for_cpu.default) is rules_before
    # the optimizer's step is its class's (under the wrapper torch's LR scheduler puts on it), and no step hook
    # of the run is left on it
    for opt in trainer.optimizers:
        step = vars(opt).get("step")
        assert step is None or getattr(step, "__wrapped__", None) is type(opt).step, step
        assert not opt._optimizer_step_pre_hooks and not opt._optimizer_step_post_hooks
    # no container of the package's modules (a cache, a registry) holds the module, its parts or its optimizer
    assert not held_by_package([model, *model.modules(), *trainer.optimizers])
    # a later Trainer of the same module (parallelized in place by the first) finds that out from the module
    again = pl.Trainer(**trainer_kwargs(devices=1, strategy=make(), max_steps=1))
    again.fit(model, DataLoader(DATA.train_set, batch_size=4))
    assert global_state() == global_before and not held_by_package([model, *model.modules(), *again.optimizers])
    print("unchanged")
""")
