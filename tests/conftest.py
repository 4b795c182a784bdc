import os
import sys

# tests/util.py is imported as `util` by the test modules.
sys.path.insert(0, os.path.dirname(__file__))
# JAX on the CPU everywhere in the test session, whatever the machine has.
os.environ.setdefault("JAX_PLATFORMS", "cpu")
