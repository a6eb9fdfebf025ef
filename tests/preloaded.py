"""What the test workers' fork server imports once (see tests/workers.py): torch, its
process groups, and what building a first optimizer imports lazily (about 800 modules)."""

import torch
import torch.distributed

torch.optim.SGD([torch.zeros(1, requires_grad=True)], lr=0.1)
