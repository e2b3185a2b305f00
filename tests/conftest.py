"""Suite-wide test settings.

Torch runs on one thread in tests and in the CLI subprocesses they start: on a 2-core machine
two threads stall whenever anything else holds a core, which made single tests swing from 17 s
to 95 s. Set before torch is imported anywhere, so the environment variable reaches torch's
thread pool here and in every child process.
"""

import os

os.environ.setdefault("OMP_NUM_THREADS", "1")
os.environ.setdefault("MKL_NUM_THREADS", "1")
