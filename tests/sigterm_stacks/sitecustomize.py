"""Test-only start-up hook (on ``PYTHONPATH`` of a job in ``test_multihost.py``): on
SIGTERM, as mpirun sends when it ends a job, print every thread's Python stack to stderr,
then die of SIGTERM as before. It shows where a rank that printed no error was waiting."""

import faulthandler
import signal

faulthandler.register(signal.SIGTERM, all_threads=True, chain=True)
