import os
import sys

# The worker functions live in tests/workers.py; spawned children import it by name.
sys.path.insert(0, os.path.dirname(__file__))
