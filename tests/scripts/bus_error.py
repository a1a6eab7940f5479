"""Rank 1 dies of SIGBUS (as a rank touching an unbacked page of a full /dev/shm does)."""

import os
import signal
import time

if os.environ["RANK"] == "1":
    os.kill(os.getpid(), signal.SIGBUS)
time.sleep(30)
