"""transformers + PyTorch training steps on CPU, on a model described by a transformers config.json.

    python benchmarks/peers/hf_torch/train_step.py --config_dir=DIR [--batch=8] [--seq_len=256]
        [--steps=6] [--threads=2] [--learning_rate=1e-3] [--weight_decay=0.01]

The peer of `scripts/bench.py step --peer`, which writes DIR/config.json from the jaxpar bench config
(`configs/bench_llama.py` or `configs/bench_mixtral.py`, through `jaxpar.interop.hf.hf_config`), so the
two sides train the same architecture at the same sizes; any other transformers config.json works too.
A step is what jaxpar's train step does: forward with the mean next-token loss, backward, global
gradient-norm clipping at 1.0, an AdamW update. Weights are fp32, attention is SDPA, the batch is one
fixed random [batch, seq_len] array of token ids from seed 0.

The first step is warm-up and not timed; each later one is timed alone. The last line is
`params=<N>M step_median_s=<s> tokens_per_s=<x> loss_first=<a> loss_last=<b>`, the one the jaxpar side reads.
Needs only torch and transformers (no jaxpar): see README.md beside this file.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time


def arguments(argv):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--config_dir", required=True, help="a directory holding a transformers config.json")
    parser.add_argument("--batch", type=int, default=8, help="rows per step")
    parser.add_argument("--seq_len", type=int, default=256, help="tokens per row")
    parser.add_argument("--steps", type=int, default=6, help="timed steps after one warm-up step")
    parser.add_argument("--threads", type=int, default=2, help="torch.set_num_threads")
    parser.add_argument("--learning_rate", type=float, default=1e-3)
    parser.add_argument("--weight_decay", type=float, default=0.01)
    args = parser.parse_args(argv)
    for name in ("batch", "seq_len", "steps", "threads"):
        if getattr(args, name) < 1:
            parser.error(f"--{name} must be >= 1")
    return args


def main(argv=None) -> int:
    args = arguments(argv)
    import torch
    import transformers

    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    config = transformers.AutoConfig.from_pretrained(args.config_dir)
    model = transformers.AutoModelForCausalLM.from_config(config, attn_implementation="sdpa", dtype=torch.float32)
    model.train()
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.learning_rate, weight_decay=args.weight_decay)
    tokens = torch.randint(0, config.vocab_size, (args.batch, args.seq_len), generator=torch.Generator().manual_seed(0))

    def step() -> float:
        loss = model(input_ids=tokens, labels=tokens).loss  # transformers shifts the labels by one
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        return loss.item()

    losses, times = [step()], []
    for _ in range(args.steps):
        start = time.perf_counter()
        losses.append(step())
        times.append(time.perf_counter() - start)
    median = statistics.median(times)
    params = sum(p.numel() for p in model.parameters())
    print(f"params={params / 1e6:.1f}M step_median_s={median:.3f} tokens_per_s={args.batch * args.seq_len / median:.0f} "
          f"loss_first={losses[0]:.3f} loss_last={losses[-1]:.3f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
