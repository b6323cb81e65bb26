"""Imported first in multiprocessing's forkserver (dist/start.py's preload): the server outlives stop signals.

A stop signal sent to a whole process group (`timeout`, Slurm's `scancel`, Kubernetes, a closed
terminal) reaches the forkserver the launcher started, not only the launcher and its ranks. The
server ignores SIGINT itself but not SIGTERM or SIGHUP, whose default action ended it: its ranks,
whose parent it is, were then killed by PR_SET_PDEATHSIG, and the launcher, reading the server's
pipe closed, saw every rank "exit 255" in the middle of the graceful stop the signal asked for. So
the server ignores them too: it still exits when the launcher does (its "alive" pipe closes). A
rank forked from it inherits the ignored dispositions and sets its own first thing (dist/launch.py,
dist/pool.py).

The server also blocks the three stop signals (SIGINT, SIGTERM, SIGHUP), and a fork inherits the
mask: a stop signal sent to a rank before it has set its handlers (importing shardlab, a second or
more) stays pending instead of being discarded as ignored, and arrives when the rank unblocks it
after setting them (dist/signals.py `install`). Before, a SIGTERM in those seconds was lost: the
run trained to its last step.

At the package's root, not in shardlab.dist, so that preloading it imports nothing else of
shardlab into the server (dist/start.py: shardlab's modules read settings from the environment
when imported, which must happen in each rank).
"""

import signal

for _signum in (signal.SIGTERM, signal.SIGHUP):
    signal.signal(_signum, signal.SIG_IGN)
signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGINT, signal.SIGTERM, signal.SIGHUP})
