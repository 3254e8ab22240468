"""How far a batch's logits are from one-row logits on a model, with llama-cpp-python alone (no
edgeinfer code): the numerical floor under "greedy speculation gives the same text".

A verification decodes the drafted tokens as one batch; plain decoding reads one token a step. The
same tokens decoded both ways give logits that differ by llama.cpp's kernels (another accumulation
order or activation quantization for a batch), so a greedy answer can part from plain wherever its
two best candidates are closer than about twice this.

    .venv/bin/python -m benchmarks.batch_logits MODEL.gguf [--batch 8] [--threads 2]
"""

from __future__ import annotations

import argparse
from pathlib import Path

import numpy as np


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("model")
    ap.add_argument("--batch", type=int, default=8, help="tokens decoded together (a verification of batch - 1 drafts)")
    ap.add_argument("--prefix", type=int, default=392, help="tokens read before them")
    ap.add_argument("--threads", type=int, default=2)
    args = ap.parse_args()
    from llama_cpp import Llama

    kw = dict(n_ctx=1024, n_batch=512, n_threads=args.threads, logits_all=True, verbose=False, flash_attn=False)
    text = (Path(__file__).parent / "bench_suffix.py").read_text()
    end = args.prefix + args.batch
    batched = Llama(args.model, **kw)
    toks = batched.tokenize(text.encode())[:end]
    batched.eval(toks[:args.prefix])
    batched.eval(toks[args.prefix:end])
    one = Llama(args.model, **kw)
    one.eval(toks[:args.prefix])
    for t in toks[args.prefix:end]:
        one.eval([t])
    diff = np.abs(np.array(batched.scores[args.prefix:end]) - np.array(one.scores[args.prefix:end])).max(axis=1)
    print(f"{Path(args.model).name}: max |logit difference| per position, a batch of {args.batch} against one "
          f"token at a time: {[round(float(x), 4) for x in diff]}")


if __name__ == "__main__":
    main()
