"""Run by test_torchrun: no seed call anywhere; every rank prints what it drew."""

import os

import torch

import spmdgt as gt

lin = torch.nn.Linear(3, 2)  # built before any spmdgt call: only import-time seeding helps
a = gt.randn(4)
# one write of under PIPE_BUF bytes: the two ranks' lines cannot interleave in the shared pipe
os.write(1, f"rank {gt.rank()}: {lin.weight.sum().item():.8f} {a.sum().item():.8f}\n".encode())
