"""A server's exit (jaxserve/process_exit.py) abandons compiles under way but not a persistent-cache write."""

import subprocess
import sys
from pathlib import Path

WRITE_UNDER_WAY_AT_EXIT = '''
import sys, threading, time
from jax._src import compilation_cache

def slow_put(*args, **kwargs):  # an entry's write, slowed down: the exit comes while it runs
    time.sleep(1.0)
    with open(sys.argv[1], "w") as f:
        f.write("complete")

compilation_cache.put_executable_and_time = slow_put
from jaxserve.process_exit import exit_now, guard_cache_writes

guard_cache_writes()
guard_cache_writes()  # idempotent: one lock, not two
threading.Thread(target=compilation_cache.put_executable_and_time).start()
threading.Thread(target=time.sleep, args=(3600,)).start()  # a compile that never ends: not waited for
time.sleep(0.2)
exit_now(3)
'''


def test_the_exit_waits_for_a_cache_write_and_for_nothing_else(tmp_path: Path):
    entry = tmp_path / "entry"
    done = subprocess.run([sys.executable, "-c", WRITE_UNDER_WAY_AT_EXIT, str(entry)], capture_output=True,
                          text=True, timeout=60)
    assert done.returncode == 3, done.stderr[-2000:]
    assert entry.read_text() == "complete"  # not cut off mid-write
