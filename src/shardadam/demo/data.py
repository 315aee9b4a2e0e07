"""Byte-level batches over the corpus file (see ``corpus``).

The batch of a step depends only on the seed and the step number: a fixed global batch
of ``rows`` windows, split into contiguous, possibly uneven, slices per rank. Any number
of ranks therefore trains on exactly the same tokens at every step.
"""

import torch

VOCAB_SIZE = 256  # byte-level tokens


class Batches:
    """The global batch of every step, and each rank's slice of it."""

    def __init__(self, corpus_path, seq_len, rows, seed):
        with open(corpus_path, "rb") as f:
            self.tokens = torch.frombuffer(bytearray(f.read()), dtype=torch.uint8)
        self.seq_len, self.rows, self.seed = seq_len, rows, seed

    def global_batch(self, step):
        """``rows`` windows of ``seq_len + 1`` tokens, chosen by (seed, step) alone."""
        generator = torch.Generator().manual_seed(self.seed * 1_000_003 + step)
        starts = torch.randint(0, self.tokens.numel() - self.seq_len - 1, (self.rows,),
                               generator=generator)
        offsets = starts[:, None] + torch.arange(self.seq_len + 1)
        return self.tokens[offsets].long()

    def local_batch(self, step, rank, world_size):
        """This rank's contiguous slice of the step's rows (slices may differ by one)."""
        return torch.tensor_split(self.global_batch(step), world_size)[rank]

    @property
    def tokens_per_step(self):
        return self.rows * self.seq_len
