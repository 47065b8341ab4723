"""decision: the advisor's choice across model sizes × device memory (see recipes/decision/README.md)."""
from __future__ import annotations

import dataclasses
from pathlib import Path

import torch

from lightning_par.advisor import Layout, advise, estimate, profile_lightning_module
from lightning_par.advisor.profile import ModuleProfile
from lightning_par.models import GPT
from lightning_par.recipes.common import figure, Report, savefig

GiB = 1024**3
KINDS = ("data parallel", "DP + ZeRO-1", "pipeline (+DP)", "tensor (+PP/DP)", "nothing fits")


def scaled_profile(probe: ModuleProfile, probe_vocab: int, n_layer: int, n_embd: int, n_head: int,
                   vocab: int, seq_len: int) -> ModuleProfile:
    """The profile of a full-size GPT: exact parameter counts (built on the meta device), activations
    scaled from the narrow probe by width (blocks, embeddings) and vocabulary (logits)."""
    with torch.device("meta"):
        model = GPT(vocab_size=vocab, block_size=seq_len, n_layer=n_layer, n_head=n_head, n_embd=n_embd)
    block = sum(p.numel() for p in model.blocks[0].parameters())
    linear = sum(p.numel() for m in model.blocks[0].modules() if isinstance(m, torch.nn.Linear)
                 for p in m.parameters())
    width = n_embd / probe.hidden_size
    return dataclasses.replace(
        probe,
        total_params=sum(p.numel() for p in model.parameters()),
        block_params=(block,) * n_layer,
        first_params=model.tok_emb.weight.numel() + model.pos_emb.weight.numel(),
        last_params=sum(p.numel() for p in model.ln_f.parameters()),
        tied_params=model.tok_emb.weight.numel(),
        shardable_block_params=linear * n_layer,
        block_activation_bytes=(int(probe.block_activation_bytes[0] * width),) * n_layer,
        block_input_bytes=int(probe.block_input_bytes * width),
        selective_bytes=(int(probe.selective_bytes[0] * width),) * n_layer if probe.selective_bytes else (),
        block_kv_bytes=(int(probe.block_kv_bytes[0] * width),) * n_layer if probe.block_kv_bytes else (),
        block_attention_bytes=((int(probe.block_attention_bytes[0] * width),) * n_layer
                               if probe.block_attention_bytes else ()),
        block_attention_io_bytes=((int(probe.block_attention_io_bytes[0] * width),) * n_layer
                                  if probe.block_attention_io_bytes else ()),
        block_interface_calls=probe.block_interface_calls[:1] * n_layer,
        block_whole_bytes=(int(probe.block_whole_bytes[0] * width),) * n_layer if probe.block_whole_bytes else (),
        block_whole_sp_bytes=((int(probe.block_whole_sp_bytes[0] * width),) * n_layer
                              if probe.block_whole_sp_bytes else ()),
        first_activation_bytes=int(probe.first_activation_bytes * width),
        last_activation_bytes=int(probe.last_activation_bytes * vocab / probe_vocab),
        head_largest_bytes=int(probe.head_largest_bytes * vocab / probe_vocab),
        hidden_size=n_embd,
        num_heads=n_head,
    )


def kind(layout: Layout | None) -> int:
    if layout is None:
        return 4
    if layout.tensor_parallel_size > 1:
        return 3
    if layout.pipeline_parallel_size > 1:
        return 2
    return 1 if layout.zero_stage else 0


def run(cfg, out_dir: Path, command: str) -> Report:
    probe_vocab = 256
    torch.manual_seed(0)
    probe_model = GPT(vocab_size=probe_vocab, block_size=cfg.seq_len, n_layer=2, n_head=1, n_embd=cfg.probe_width)
    tokens = torch.randint(0, probe_vocab, (1, cfg.seq_len + 1))
    probe = profile_lightning_module(probe_model, (tokens[:, :-1], tokens[:, 1:]), precision=cfg.precision)

    names = list(cfg.models)
    memories = list(cfg.memory_gib)
    grid, rows, states = [], [], []
    for name in names:
        n_layer, n_embd, n_head = cfg.models[name]
        prof = scaled_profile(probe, probe_vocab, n_layer, n_embd, n_head, cfg.vocab_size, cfg.seq_len)
        single = estimate(prof, Layout(), cfg.batch_size // cfg.devices, cfg.precision, cfg.optimizer)
        model_states = single.param_bytes + single.grad_bytes + single.optimizer_bytes
        states.append([name, f"{prof.total_params / 1e9:.3f}", f"{model_states / 1e9:.1f}",
                       f"{16 * prof.total_params / 1e9:.1f}", f"{model_states / (16 * prof.total_params):.3f}"])
        line = []
        for mem in memories:
            adv = advise(prof, cfg.devices, int(mem * GiB), cfg.batch_size, precision=cfg.precision,
                         optimizer=cfg.optimizer, zero_stages=(0, 1), checkpointing=(None,),
                         context=False)  # the seeds' table: data, pipeline and tensor parallel
            layout = adv.choice.layout if adv.choice else None
            line.append(kind(layout))
            total = adv.choice.estimate.total_bytes / GiB if adv.choice else float("nan")
            rows.append([name, f"{prof.total_params / 1e9:.2f}B", mem, layout.name if layout else "none fits",
                         f"{total:.1f}", adv.why])
        grid.append(line)

    fig = _picture(names, memories, grid, cfg)
    report = Report(
        title="decision: the advisor's layout across model sizes × device memory",
        command=command,
        published=("mixed-precision Adam holds 16 bytes of model state per parameter — 24 GB for GPT-2 1.5B "
                   "(Rajbhandari et al., ZeRO, SC 2020, §3.1); the seeds' choosing rule (fits → data parallel; "
                   "else pipeline first, tensor parallel when a layer does not fit, data parallel over the rest)"),
        data={"grid": grid, "models": names, "memory_gib": memories, "choices": rows, "model_states": states},
    )
    report.tables.append(("Model states on one device (params + grads + Adam), measured by the advisor vs 16Ψ",
                          ["model", "params (B)", "advisor GB", "16Ψ GB", "ratio"], states))
    report.tables.append((f"Choice on {cfg.devices} devices, global batch {cfg.batch_size} × {cfg.seq_len} tokens, "
                          f"{cfg.precision} {cfg.optimizer}",
                          ["model", "params", "GiB/device", "layout", "GiB used", "why"], rows))
    report.figures.append(("The choice per model and device memory", savefig(fig, out_dir, "decision.png")))
    report.notes.append("Activations are scaled from a narrow probe (see README); model states are exact counts.")
    return report


def _picture(names, memories, grid, cfg):
    from matplotlib.colors import ListedColormap

    colors = ["#4c9f70", "#9fd28c", "#4a7fb5", "#e0a03a", "#c0504d"]
    fig, ax = figure(1.6 * len(memories) + 3, 0.55 * len(names) + 1.8)
    ax.imshow(grid, cmap=ListedColormap(colors), vmin=0, vmax=4, aspect="auto")
    ax.set_xticks(range(len(memories)), [f"{m} GiB" for m in memories])
    ax.set_yticks(range(len(names)), names)
    for i, line in enumerate(grid):
        for j, k in enumerate(line):
            ax.text(j, i, KINDS[k], ha="center", va="center", fontsize=8)
    ax.set_xlabel("memory per device")
    ax.set_title(f"advisor's choice on {cfg.devices} devices ({cfg.precision}, {cfg.optimizer})")
    return fig
