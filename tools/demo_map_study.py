"""Which 4-bit (or 8-bit) code maps train the demo's transformer like fp32 AdamW?

The demo's small model (``shardadam.demo``: same data, seed, learning-rate schedule,
betas, weight decay groups), trained in one process for ``--steps`` steps by torch's
AdamW and by ``tools/state_map_study.py``'s emulated AdamW whose moments are stored in
the maps a spec names (``m=MAP:B,v=MAP:B``, its syntax), or by torchao's low-bit
AdamW (``torchao:AdamW4bit``). 1-D parameters (norms, biases)
take ``--small`` instead, as FusedAdam's block4 gives them block8's formats (S2.12).
Prints the mean loss of the last 10 steps of each run beside torch AdamW's (the
README's accuracy measure) and appends JSON lines to --out.

    python tools/demo_map_study.py --runs "ref;m=fe2m1:128,v=ufe3m1:128"
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import state_map_study as study  # noqa: E402

from shardadam._arguments import whole_number_at_least  # noqa: E402
from shardadam.demo.config import SIZES  # noqa: E402
from shardadam.demo.corpus import build_corpus  # noqa: E402
from shardadam.demo.data import VOCAB_SIZE, Batches  # noqa: E402
from shardadam.demo.model import Transformer  # noqa: E402
from shardadam.demo.worker import BETAS, EPS, WEIGHT_DECAY, lr_at  # noqa: E402


def train(spec_text: str, small_text: str, steps: int, seed: int, corpus: str) -> list:
    size = SIZES["small"]
    torch.manual_seed(seed)
    model = Transformer(VOCAB_SIZE, size)
    decay = [p for p in model.parameters() if p.dim() >= 2]
    no_decay = [p for p in model.parameters() if p.dim() < 2]
    groups = [{"params": decay, "weight_decay": WEIGHT_DECAY},
              {"params": no_decay, "weight_decay": 0.0}]
    if spec_text == "ref":
        optimizers = [torch.optim.AdamW(groups, lr=0.0, betas=BETAS, eps=EPS, foreach=True)]
    elif spec_text.startswith("torchao:"):
        make = study.torchao_factory(spec_text[len("torchao:"):])
        optimizers = [make(groups, lr=0.0, betas=BETAS, eps=EPS)]
    else:
        optimizers = [study.BlockAdamW(decay, 0.0, BETAS, EPS, WEIGHT_DECAY,
                                       **study.parse_spec(spec_text)),
                      study.BlockAdamW(no_decay, 0.0, BETAS, EPS, 0.0,
                                       **study.parse_spec(small_text))]
    batches = Batches(corpus, size.seq_len, size.rows, seed)
    losses = []
    for step in range(1, steps + 1):
        rows = batches.global_batch(step)
        logits = model(rows[:, :-1])
        loss = F.cross_entropy(logits.reshape(-1, VOCAB_SIZE), rows[:, 1:].reshape(-1))
        loss.backward()
        for opt in optimizers:
            for group in opt.param_groups:
                if isinstance(group["lr"], torch.Tensor):  # torchao keeps lr a tensor
                    group["lr"].fill_(lr_at(step, steps, size.lr))
                else:
                    group["lr"] = lr_at(step, steps, size.lr)
            opt.step()
            opt.zero_grad(set_to_none=True)
        losses.append(loss.item())
    return losses


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--runs", default="ref", help="specs separated by ';'")
    parser.add_argument("--small", default="m=e4m3s29:128,v=ufe4m4:128",
                        help="spec for the 1-D parameters (default: block8's maps)")
    parser.add_argument("--steps", type=whole_number_at_least(1), default=100)
    parser.add_argument("--seed", type=whole_number_at_least(0), default=0)
    parser.add_argument("--threads", type=whole_number_at_least(1), default=2)
    parser.add_argument("--out", default="runs/demo_map_study.jsonl")
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    corpus = os.path.join(os.path.dirname(os.path.abspath(args.out)), "demo-corpus.bin")
    if not os.path.exists(corpus):
        build_corpus(corpus, SIZES["small"].corpus_bytes)
    for text in args.runs.split(";"):
        began = time.time()
        losses = train(text, args.small, args.steps, args.seed, corpus)
        last10 = statistics.fmean(losses[-10:])  # as the demo's report (fewer if fewer)
        with open(args.out, "a") as f:
            f.write(json.dumps({"spec": text, "small": args.small, "steps": args.steps,
                                "seed": args.seed, "last10": last10,
                                "losses": losses}) + "\n")
        print(f"{text}: mean loss of the last 10 steps {last10:.4f} "
              f"({time.time() - began:.0f} s)", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
