"""Context parallelism by the numbers: compiled per-device temp memory and collective bytes per
train step for mesh.context = 1, 2, 4, 8 and each implementation, and communicated bytes per
attention FLOP. Prints a table and writes a PNG.

    python scripts/context_report.py [--seq_lens=4096,16384] [--contexts=1,2,4,8] [--out=context_report.png]

Everything is read from compiled programs (`jaxpar.analysis.program.compiled.compile_step`; nothing runs):
`memory_analysis()` for temp bytes, and the HLO's collectives (`jaxpar.analysis.program.hlo`) — each op's
per-device bytes sent (`comm.wire_bytes`, ring-algorithm counts: all-gather and all-to-all
R·(n-1)/n of the result R, all-reduce 2R·(n-1)/n, reduce-scatter R·(n-1), collective-permute R)
times the trip counts of the while loops around it. Ops in conditional branches are counted as
if taken (an upper bound; the ring's permutes are never in a branch).
"attention" collectives are those of the attention's shard_map; the rest are the gradient and loss
reductions over `context` (parameters are replicated over it, as over data replicas).

Attention FLOPs per step (model FLOPs, causal): forward 2 matmuls of 2·B·Hq·S²·D/2, backward
twice the forward, per layer; per device divided by c. c = 1 runs XLA's one-device attention
(a full [S, S] score matrix per head); c > 1 the chunked flash-style kernels
(`parallel.context_block_size` bounds their score blocks).
"""

import collections
import sys

from jaxpar import command
from jaxpar.command import Command, Flag

IMPLS = ("all_gather", "ring", "all_to_all")
FLAGS = (
    Flag("seq_lens", list, "4096,16384", "sequence lengths"),
    Flag("contexts", list, "1,2,4,8", "mesh.context sizes (c = 1: one device)"),
    Flag("impls", list, ",".join(IMPLS), "parallel.context_impl values", choices=IMPLS),
    Flag("block", int, 512, "parallel.context_block_size", at_least=1),
    Flag("layers", int, 2, "decoder layers", at_least=1),
    Flag("hidden", int, 128, "hidden size", at_least=1),
    Flag("heads", int, 8, "query heads", at_least=1),
    Flag("kv_heads", int, 2, "key/value heads (GQA)", at_least=1),
    Flag("out", str, "context_report.png", "PNG path ('' for none)"),
)


def checks(args) -> list[str]:
    return [f"--{name}={word}: not a positive integer" for name in ("seq_lens", "contexts")
            for word in getattr(args, name) if not (word.isdigit() and int(word) > 0)]


def make_config(args, seq_len: int, c: int, impl: str):
    from jaxpar.config import base_config
    from jaxpar.models.llama import model_config as llama_model_config

    config = base_config()
    config.model = llama_model_config(
        vocab_size=256, hidden_size=args.hidden, intermediate_size=2 * args.hidden,
        num_hidden_layers=args.layers, num_attention_heads=args.heads, num_key_value_heads=args.kv_heads,
        head_dim=16, max_position_embeddings=seq_len,
    )
    config.train.update(global_batch_size=1, seq_len=seq_len, warmup_steps=0)
    config.mesh.update(data=1, pipeline=1, context=c, expert=1, tensor=1)
    config.parallel.update(context_impl=impl, context_block_size=args.block)
    return config


def collective_bytes(step) -> dict:
    """Per-device bytes sent per step by the compiled step's collectives, keyed "attention"
    (inside the attention's shard_map) / "other"."""
    from jaxpar.analysis.cost.comm import wire_bytes

    n = step.num_devices
    totals = collections.Counter()
    for c in step.collectives:
        kind = "attention" if "attention/shard_map" in c.op_name else "other"
        totals[kind] += wire_bytes(c.kind, c.size_bytes(n), c.group_size(n)) * c.executions
    return totals


def attention_flops_per_device(config, c: int) -> float:
    m, s = config.model, config.train.seq_len
    forward = 2 * (2 * config.train.global_batch_size * m.num_attention_heads * s * s * 16) / 2
    return 3 * forward * m.num_hidden_layers / c


def measure(args, seq_len: int, c: int, impl: str):
    import jax

    from jaxpar.analysis.program.compiled import compile_step

    config = make_config(args, seq_len, c, impl)
    step = compile_step(config, jax.devices()[:c], checked=True)
    comm = collective_bytes(step)
    flops = attention_flops_per_device(config, c)
    return dict(seq=seq_len, c=c, impl=impl if c > 1 else "one device", temp=step.memory.temp,
                attn_bytes=comm["attention"], other_bytes=comm["other"], flops=flops,
                ratio=comm["attention"] / flops, compile_s=step.compile_seconds)


HEADER = (f"{'seq':>6}{'c':>3}  {'impl':<11}{'temp MiB/dev':>13}{'attn comm MiB':>14}{'other comm MiB':>15}"
          f"{'attn GFLOP/dev':>15}{'attn B/FLOP':>12}{'compile s':>10}")


def row_text(r) -> str:
    return (f"{r['seq']:>6}{r['c']:>3}  {r['impl']:<11}{r['temp'] / 2**20:>13.1f}{r['attn_bytes'] / 2**20:>14.2f}"
            f"{r['other_bytes'] / 2**20:>15.2f}{r['flops'] / 1e9:>15.2f}{r['ratio']:>12.5f}{r['compile_s']:>10.1f}")


def plot(rows, impls, path):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    seqs = sorted({r["seq"] for r in rows})
    sizes = sorted({r["c"] for r in rows if r["c"] > 1})
    fig, axes = plt.subplots(2, len(seqs), figsize=(5.5 * len(seqs), 8), squeeze=False)
    for j, seq in enumerate(seqs):
        mem, ratio = axes[0][j], axes[1][j]
        one = [r for r in rows if r["seq"] == seq and r["c"] == 1]
        if one:
            mem.axhline(one[0]["temp"] / 2**20, color="gray", linestyle="--", label="c=1 (XLA attention)")
        for impl in impls:
            sel = sorted((r for r in rows if r["seq"] == seq and r["impl"] == impl), key=lambda r: r["c"])
            cs = [r["c"] for r in sel]
            mem.plot(cs, [r["temp"] / 2**20 for r in sel], marker="o", label=impl)
            ratio.plot(cs, [r["ratio"] for r in sel], marker="o", label=impl)
        mem.set(title=f"seq {seq}: compiled temp memory per device", xlabel="mesh.context", ylabel="MiB", yscale="log")
        ratio.set(title=f"seq {seq}: attention bytes sent / attention FLOP", xlabel="mesh.context", ylabel="bytes per FLOP")
        for ax in (mem, ratio):
            ax.set_xscale("log", base=2)
            ax.set_xticks(sizes, [str(c) for c in sizes])
            ax.legend()
            ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def run(args, _) -> None:
    import jax

    contexts = [int(c) for c in args.contexts]
    jax.config.update("jax_num_cpu_devices", max(contexts))
    print(f"Llama {args.layers} layers, hidden {args.hidden}, {args.heads} query / {args.kv_heads} KV heads "
          f"of 16, batch 1, fp32, block {args.block}; per-device numbers from compiled train steps")
    print(HEADER + "\n" + "-" * len(HEADER))
    rows = []
    for seq in (int(s) for s in args.seq_lens):
        for c in contexts:
            for impl in args.impls if c > 1 else args.impls[:1]:
                rows.append(measure(args, seq, c, impl))
                print(row_text(rows[-1]), flush=True)
    if args.out:
        plot(rows, args.impls, args.out)
        print(f"wrote {args.out}")


COMMANDS = (Command(None, "context parallelism's compiled memory and traffic per context size and implementation", run,
                    flags=FLAGS, devices=False, checks=checks),)


def main(argv: list[str] | None = None) -> int:
    return command.main(__doc__, COMMANDS, argv)


if __name__ == "__main__":
    sys.exit(main())
