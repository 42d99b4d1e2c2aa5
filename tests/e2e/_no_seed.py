"""Run by test_torchrun: no seed call anywhere; every rank prints what it drew."""

import torch

import spmdgt as gt

lin = torch.nn.Linear(3, 2)  # built before any spmdgt call: only import-time seeding helps
a = gt.randn(4)
print(f"rank {gt.rank()}: {lin.weight.sum().item():.8f} {a.sum().item():.8f}", flush=True)
