import os
import signal
import sys

# The worker functions live in tests/workers.py; spawned children import it by name.
sys.path.insert(0, os.path.dirname(__file__))

# The Ctrl-C tests send SIGINT to programs and children this session starts. A session started
# with SIGINT ignored (a background job of a non-interactive shell, as some CI runners start
# it) would pass the ignoring on across exec, and Python then installs no KeyboardInterrupt
# handler: with a handler here, the children start with SIGINT at its default again.
signal.signal(signal.SIGINT, signal.default_int_handler)
