"""Suite-wide settings.

One intra-op thread: the tiny model's ops are too small to gain from a second
one, and on a busy 2-core machine OpenMP's spinning workers slow small ops
down twenty-fold (measured: index_add_ 0.008 ms with one thread, 20-185 ms
with two while another process held a core).

The same holds for every process a test starts (servers, engine cores, gloo
ranks, bench scripts): they inherit ``OMP_NUM_THREADS=1`` (and MKL's) unless a
test sets its own. Two pytest workers each driving a two-thread server on two
cores oversubscribe them; one thread each was 15 % faster on the forced-call
tests run alone beside one busy core.
"""

from __future__ import annotations

import os

os.environ.setdefault("OMP_NUM_THREADS", "1")
os.environ.setdefault("MKL_NUM_THREADS", "1")

import torch  # after the thread variables, which torch reads at import

torch.set_num_threads(1)
