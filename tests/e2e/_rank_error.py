"""A program whose op fails on rank 0 only (``tests/e2e/test_rank_error.py`` runs it under
torchrun): the first of 7 ids is out of range and lies in rank 0's shard of the embedding's
input. Every rank must exit with spmdgt's RankFailedError naming rank 0 and the op."""

import time

import torch
import torch.nn.functional as F

import spmdgt as gt

gt.register_config("data", gt.SignalConfig(shard=gt.ShardConfig(axis=0)))
with gt.signal.context("data"):
    ids = gt.tensor(torch.tensor([9, 1, 2, 3, 4, 0, 1]))
start = time.monotonic()
try:
    print("VALUE", F.embedding(ids, torch.ones(5, 3)).cumsum(0).numpy(), flush=True)
finally:
    print(f"ELAPSED {gt.rank()} {time.monotonic() - start:.1f}", flush=True)
