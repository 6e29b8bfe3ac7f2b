"""Suite-wide settings.

One intra-op thread: the tiny model's ops are too small to gain from a second
one, and on a busy 2-core machine OpenMP's spinning workers slow small ops
down twenty-fold (measured: index_add_ 0.008 ms with one thread, 20-185 ms
with two while another process held a core).
"""

from __future__ import annotations

import torch

torch.set_num_threads(1)
